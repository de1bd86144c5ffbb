"""The tee of rank logs to the daemon's stdout, on real files."""

from __future__ import annotations

import io

from elasticd import workers
from harness import wait_until


def test_tee_echoes_whole_lines_of_a_file_that_appears_after_follow(tmp_path):
    out = io.StringIO()
    tee = workers.Tee(out, interval=0.01, idle_interval=0.05)
    log = tmp_path / "rank0.log"
    tee.start()
    try:
        tee.follow(log, "[rank0]: ")  # a warm spare creates its log itself, after follow()
        with open(log, "a") as f:
            f.write("one\ntwo\npart")
            f.flush()
            wait_until(lambda: out.getvalue() == "[rank0]: one\n[rank0]: two\n", 5, what="the echo")
            f.write("ial\n")
            f.flush()
            wait_until(lambda: out.getvalue().endswith("[rank0]: partial\n"), 5, what="the joined line")
            f.write("last words")
        tee.forget([log])  # a file's last line is printed even without its newline
        assert out.getvalue().endswith("[rank0]: partial\n[rank0]: last words\n")
    finally:
        tee.close()
