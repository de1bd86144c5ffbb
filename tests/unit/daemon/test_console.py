"""The console as torchrun's: a worker's stderr file echoed to the daemon's stderr, its stdout to
stdout, stream by stream as -r/-t say, and a line torch already prefixed not prefixed twice."""

from __future__ import annotations

import io

from elasticd import config
from elasticd.daemon.tee import Tee, echo_line
from harness import wait_until


def test_a_line_with_its_own_prefix_is_not_prefixed_twice():
    # torch's excepthook (after init_process_group) writes "[rankR]: " before each line
    assert echo_line("[rank1]: ", b"[rank1]: Traceback (most recent call last):") == (
        "[rank1]: Traceback (most recent call last):\n"
    )
    assert echo_line("[rank1]: ", b"[rank1]:") == "[rank1]: [rank1]:\n"  # not the whole prefix
    # a rank never shows another's prefix bare, nor a line without its own
    assert echo_line("[rank0]: ", b"[rank1]: forged") == "[rank0]: [rank1]: forged\n"
    assert echo_line("[rank0]: ", b"\x1b[2K[rank0]: x").startswith("[rank0]: ")


def test_stderr_files_go_to_the_daemons_stderr(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    tee = Tee(out, err, interval=0.01, idle_interval=0.05)
    tee.start()
    try:
        stdout_log, stderr_log = tmp_path / "rank0.log", tmp_path / "rank0.stderr.log"
        tee.follow(stdout_log, "[rank0]: ")
        tee.follow(stderr_log, "[rank0]: ", stderr=True)
        stdout_log.write_text("printed\n")
        stderr_log.write_text("[rank0]: Traceback\nwarned\n")
        wait_until(lambda: out.getvalue() and err.getvalue().count("\n") == 2, 5, what="echo")
        tee.forget([stdout_log, stderr_log])
    finally:
        tee.close()
    assert out.getvalue() == "[rank0]: printed\n"
    assert err.getvalue() == "[rank0]: Traceback\n[rank0]: warned\n"


def test_redirects_and_tee_apply_stream_by_stream():
    """torchrun's -r/-t: a stream redirected and not teed stays off the console; 1 stdout, 2
    stderr, 3 both."""
    cfg = config.build(
        {"nproc_per_node": "4", "redirects": "0:3,1:3,2:1", "tee_streams": "1:2"}, environ={}
    )
    assert cfg.echoed(0, 1) is False and cfg.echoed(0, 2) is False and cfg.echoed(0) is False
    assert cfg.echoed(1, 1) is False and cfg.echoed(1, 2) is True and cfg.echoed(1) is True
    assert cfg.echoed(2, 1) is False and cfg.echoed(2, 2) is True
    assert cfg.echoed(3, 1) is True and cfg.echoed(3, 2) is True
    assert config.build({"nproc_per_node": "1", "tee_streams": "0"}, environ={}).echoed(0, 2)
    assert not config.build({"nproc_per_node": "1", "tee": False}, environ={}).echoed(0)
