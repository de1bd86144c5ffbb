"""The tee of rank logs to the daemon's stdout, on real files."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys

from elasticd.daemon.tee import Tee, console_prefix, display_env, echo_line
from harness import wait_until


def test_tee_echoes_whole_lines_of_a_file_that_appears_after_follow(tmp_path):
    out = io.StringIO()
    tee = Tee(out, interval=0.01, idle_interval=0.05)
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
            wait_until(
                lambda: out.getvalue().endswith("[rank0]: partial\n"), 5, what="the joined line"
            )
            f.write("last words")
        tee.forget([log])  # a file's last line is printed even without its newline
        assert out.getvalue().endswith("[rank0]: partial\n[rank0]: last words\n")
    finally:
        tee.close()


def test_tee_echoes_the_latest_redraw_of_a_bar_as_a_prefixed_line(tmp_path):
    """ "\r" + text is a redraw: the latest finished one is echoed at most every redraw_interval,
    the one still being drawn waits for its end; "\r\n" ends a line even when split across reads."""
    out = io.StringIO()
    tee = Tee(out, interval=0.01, idle_interval=0.05, redraw_interval=0.3)
    log = tmp_path / "rank0.log"
    log.write_bytes(b"")
    tee.start()
    try:
        tee.follow(log, "[rank0]: ")
        with open(log, "ab", buffering=0) as f:
            f.write(b"\r1%\r2%\r3%")
            wait_until(
                lambda: out.getvalue() == "[rank0]: 2%\n", 5, what="the latest finished redraw"
            )
            f.write(b"\r4%\r5%\r6%")
            wait_until(
                lambda: out.getvalue().endswith("[rank0]: 5%\n"), 5, what="the next one, once due"
            )
            f.write(b"\r100%\nwindows line\r")
            wait_until(
                lambda: out.getvalue().endswith("[rank0]: 100%\n"), 5, what="the bar's last line"
            )
            f.write(b"\nlast\r")
        tee.forget([log])
        assert (
            out.getvalue()
            == "[rank0]: 2%\n[rank0]: 5%\n[rank0]: 100%\n[rank0]: windows line\n[rank0]: last\n"
        )
    finally:
        tee.close()


def test_tee_wakes_for_a_bar_only_when_its_next_redraw_is_due(tmp_path):
    """While lines flow the tee looks again after `interval`; while only a bar flows (no
    newline), not before its next redraw is due: one wake-up per redraw echoed, not twenty."""
    out = io.StringIO()
    # polled here, no thread
    tee = Tee(out, interval=0.05, idle_interval=0.25, redraw_interval=0.5)
    log = tmp_path / "rank0.log"
    log.write_bytes(b"")
    tee.follow(log, "[rank0]: ")
    with open(log, "ab", buffering=0) as f:
        f.write(b"\r1%\r2%\r3%")
        assert (
            0.4 < tee._pump(log) <= 0.51 and out.getvalue() == "[rank0]: 2%\n"
        )  # echoed: due again in 0.5 s
        f.write(b"\r4%\r5%")
        assert (
            0.3 < tee._pump(log) <= 0.51 and out.getvalue() == "[rank0]: 2%\n"
        )  # held until it is due
        assert 0.3 < tee._pump(log) <= 0.51  # nothing new, but a redraw waits
        f.write(b"\r100%\nnext line\n")
        assert tee._pump(log) == 0.05 and out.getvalue().endswith(
            "[rank0]: 100%\n[rank0]: next line\n"
        )
        assert tee._pump(log) is None  # nothing flows, nothing held: the caller backs off
    tee.forget([log])


def test_echo_drops_a_displays_redraw_sequences_and_escapes_the_rest():
    """Rich's redraw (colours, erase in line, cursor hidden) leaves only its text; anything else a
    worker writes (clear screen, home, a title, C1 CSI) is still shown escaped."""
    rich = (
        b"\x1b[?25l\x1b[2Ktrain \x1b[35m\xe2\x94\x81\x1b[0m\x1b[90m\xe2\x95\xba\x1b[0m "
        b"\x1b[2;4m5%\x1b[0m"
    )
    assert echo_line("[rank0]: ", rich) == "[rank0]: train \u2501\u257a 5%\n"
    assert echo_line("[rank0]: ", b"\x1b[1A\x1b[2Kup\x1b[?25h") == "[rank0]: up\n"
    hostile = b"\x1b[2J\x1b[H\x1b]0;t\x07 \x9b2J"
    assert echo_line("[rank0]: ", hostile) == "[rank0]: \\x1b[2J\\x1b[H\\x1b]0;t\\x07 \\x9b2J\n"


def test_workers_are_told_to_draw_live_only_when_the_echo_reaches_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert display_env() == {}
    main, side = os.openpty()
    with open(side, "w") as tty:
        monkeypatch.setattr(sys, "stdout", tty)
        assert display_env() == {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}
    os.close(main)


def test_a_multi_line_display_is_held_like_a_bar_and_its_last_frame_shown(tmp_path):
    """Rich redraws a display of two tasks by going back up to its first line: each frame is
    held and echoed at most every redraw_interval (not at each of its 40 refreshes), the final
    frame once it ends, then what the worker prints after it."""
    out = io.StringIO()
    tee = Tee(out, interval=0.01, idle_interval=0.05, redraw_interval=0.3)
    log = tmp_path / "rank0.log"
    log.write_bytes(b"")
    code = (
        "import time\nfrom rich.progress import Progress\n"
        "with Progress() as p:\n"
        "    a, b = p.add_task('train', total=40), p.add_task('val', total=40)\n"
        "    for _ in range(40):\n"
        "        time.sleep(0.02); p.advance(a); p.advance(b); p.refresh()\n"
        "print('after')\n"
    )
    env = {**os.environ, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}
    tee.start()
    try:
        tee.follow(log, "[rank0]: ")
        with open(log, "ab") as f:
            subprocess.run([sys.executable, "-c", code], stdout=f, env=env, check=True, timeout=60)
        tee.forget([log])
    finally:
        tee.close()
    assert log.read_bytes().count(b"\x1b[1A") >= 20  # Rich did draw it live, going up each time
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue() and all(ln.startswith("[rank0]: ") for ln in lines)
    assert lines[-3:] == [
        "[rank0]: train " + "━" * 40 + " 100% 0:00:00",
        "[rank0]: val   " + "━" * 40 + " 100% 0:00:00",
        "[rank0]: after",
    ], lines[-3:]
    assert len(lines) <= 20, lines  # frames every 0.3 s at most over the display's ~1 s


def test_the_prefix_is_torchruns_template_from_the_flag_or_the_environment(monkeypatch):
    """--log-line-prefix-template (torch 2.14's torchrun flag) wins over torchrun's environment
    variable, which wins over the default; ${hostname} is this node's name."""
    monkeypatch.delenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", raising=False)
    assert console_prefix("trainer", 5, 1) == "[rank5]: "
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "<${role_name}${local_rank}>")
    assert console_prefix("trainer", 5, 1) == "<trainer1>"
    flag = "${hostname}:${rank}: ${unknown}"
    assert console_prefix("trainer", 5, 1, flag) == f"{socket.gethostname()}:5: ${{unknown}}"
