"""Worker output is the workers' to choose, the operator's terminal is not: a real job whose
worker prints terminal escape sequences and fake daemon events, and raises an exception that
carries them. Nothing of it reaches the daemon's stdout/stderr, `elasticd status` or the final
failure line unescaped, and every echoed line carries its rank prefix."""

from __future__ import annotations

from harness import script, wait_until

FAKE = '{"event": "job_succeeded", "log_level": "info", "state": "SUCCEEDED"}'


# What a terminal would act on: ESC, BEL, CR, DEL, a raw C1 byte, U+009B (C1 CSI) in UTF-8.
RAW = (b"\x1b", b"\x07", b"\r", b"\x7f", b"\x9b", "\u009b".encode())


def _assert_inert(data: bytes, where: str) -> None:
    for seq in RAW:
        assert seq not in data, f"{where} carries raw {seq!r}: {data[:3000]!r}"


def test_worker_escape_sequences_and_fake_events_are_shown_escaped(daemons, tmp_path):
    go = tmp_path / "go"
    d = daemons(
        script("hostile_output.py"),
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "1",
        "--deterministic-retries",
        "0",  # both attempts fail alike: the budget ends it, exit 1
        "--no-warm-spawn",
        "--restart-grace",
        "1",
        args=[str(go)],
        log_format="console",
    )
    # attempt 0 failed; attempt 1 waits for `go`: the daemon runs with that failure as its last
    wait_until(lambda: "boom" in d.status().stdout, 60, what="status with the failure")
    status = d.status()
    assert status.returncode == 0, status.stderr
    _assert_inert(status.stdout.encode(), "elasticd status")
    failure = next(ln for ln in status.stdout.splitlines() if "last failure" in ln)
    assert "RuntimeError: \\x1b]0;owned\\x07boom\\x1b[2J\\r\\n{" in failure, failure
    go.touch()
    assert d.wait(60) == 1, d.stderr()[-3000:]

    out, err = d.stdout_path.read_bytes(), d.stderr_path.read_bytes()
    _assert_inert(out, "the daemon's stdout")
    _assert_inert(err, "the daemon's stderr")
    lines = out.decode().splitlines()
    assert lines and all(ln.startswith("[rank0]: ") for ln in lines), [
        ln[:80] for ln in lines if not ln.startswith("[rank0]: ")
    ]
    for text in (out.decode(), err.decode()):  # the fake event never starts a line of its own
        assert not [ln for ln in text.splitlines() if ln.lstrip().startswith('{"event"')]
    assert "[rank0]: \\x1b[2J\\x1b[H\\x1b]0;pwned title\\x07clear screen and title" in lines
    # after a carriage return: what a terminal would show of that line, with the prefix (tee.Tee)
    assert f"[rank0]: progress 50%\\r{FAKE}" not in lines and f"[rank0]: {FAKE}" in lines
    assert f"[rank0]: {FAKE}" in lines  # after the long line's first piece: a prefix of its own
    # a colour (SGR) is one of the sequences a progress bar redraws with: dropped (tee.echo_line)
    assert "[rank0]: raw bytes \\x9b31m  red" in lines
    final = [ln for ln in err.decode().splitlines() if ln.startswith("elasticd: job failed")]
    assert (
        len(final) == 1 and f"RuntimeError: \\x1b]0;owned\\x07boom\\x1b[2J\\r\\n{FAKE}" in final[0]
    ), final
