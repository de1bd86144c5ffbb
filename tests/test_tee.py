"""The tee of rank logs to the daemon's stdout, on real files."""

from __future__ import annotations

import io
import re
import time

import psutil

from elasticd import workers
from harness import script, wait_until


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


def test_tee_echoes_the_latest_redraw_of_a_bar_as_a_prefixed_line(tmp_path):
    """"\r" + text is a redraw: the latest finished one is echoed at most every redraw_interval,
    the one still being drawn waits for its end; "\r\n" ends a line even when split across reads."""
    out = io.StringIO()
    tee = workers.Tee(out, interval=0.01, idle_interval=0.05, redraw_interval=0.3)
    log = tmp_path / "rank0.log"
    log.write_bytes(b"")
    tee.start()
    try:
        tee.follow(log, "[rank0]: ")
        with open(log, "ab", buffering=0) as f:
            f.write(b"\r1%\r2%\r3%")
            wait_until(lambda: out.getvalue() == "[rank0]: 2%\n", 5, what="the latest finished redraw")
            f.write(b"\r4%\r5%\r6%")
            wait_until(lambda: out.getvalue().endswith("[rank0]: 5%\n"), 5, what="the next one, once due")
            f.write(b"\r100%\nwindows line\r")
            wait_until(lambda: out.getvalue().endswith("[rank0]: 100%\n"), 5, what="the bar's last line")
            f.write(b"\nlast\r")
        tee.forget([log])
        assert out.getvalue() == "[rank0]: 2%\n[rank0]: 5%\n[rank0]: 100%\n[rank0]: windows line\n[rank0]: last\n"
    finally:
        tee.close()


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def test_a_tqdm_bar_in_a_real_job_is_cheap_to_echo_and_kept_whole_in_the_log(daemons):
    """Thousands of tqdm redraws (no newline until the end): the daemon echoes a few prefixed
    lines a second, holds no more memory and spends little CPU on it (over its own cost while the
    job is quiet: its loop's, which a loaded host makes vary; measured 0.25-1.3% of a core on the
    2-core VM, so the bound here is 3%, against the saturated core a held bar once cost); the log
    keeps every byte."""
    updates = 20000
    d = daemons(script("progress.py"), "--nproc-per-node", "1", "--no-warm-spawn", args=[str(updates), "3", "2.5"])
    daemon = psutil.Process(d.pid)
    wait_until(lambda: "quiet" in d.log_text(0), 60, what="the quiet phase")
    time.sleep(0.5)  # the echo of "quiet" and the tee's back-off
    cpu0, t0 = cpu_seconds(daemon), time.monotonic()
    wait_until(lambda: "train:" in d.log_text(0), 10, what="the bar")
    quiet = (cpu_seconds(daemon) - cpu0) / (time.monotonic() - t0)
    rss0, cpu0, t0 = daemon.memory_info().rss, cpu_seconds(daemon), time.monotonic()
    rss = rss0
    while "done" not in d.log_text(0) and time.monotonic() - t0 < 60:
        rss = max(rss, daemon.memory_info().rss)
        time.sleep(0.1)
    busy, seconds = cpu_seconds(daemon) - cpu0, time.monotonic() - t0
    assert d.wait(60) == 0, d.stderr()[-3000:]
    log = (d.run_dir() / "attempt1" / "rank0.log").read_bytes()
    assert {int(n) for n in re.findall(rb"\| (\d+)/%d " % updates, log)} == set(range(updates + 1))
    lines = d.stdout().splitlines()
    assert lines and all(ln.startswith("[rank0]: ") for ln in lines), lines[:3]
    bars = [ln for ln in lines if "train:" in ln]
    assert all("\\r" not in ln for ln in bars) and f"{updates}/{updates}" in bars[-1], bars[-3:]
    assert len(bars) <= seconds / workers.REDRAW_INTERVAL + 3, len(bars)
    assert rss - rss0 < 4 << 20, (rss0, rss)
    assert seconds > 2 and busy / seconds < quiet + 0.03, (seconds, busy / seconds, quiet)
