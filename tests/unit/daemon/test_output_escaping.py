"""Worker output is the workers' to choose, the operator's terminal is not: a real job whose
worker prints terminal escape sequences and fake daemon events, and raises an exception that
carries them. Nothing of it reaches the daemon's stdout/stderr, `elasticd status` or the final
failure line unescaped, and every echoed line carries its rank prefix."""

from __future__ import annotations

import io
import os

from elasticd import logs
from elasticd.daemon import spawn
from elasticd.daemon.tee import MAX_ECHO_LINE, Tee


def test_printable_escapes_what_a_terminal_would_interpret():
    assert logs.printable("a\x1b[31mb\x9b\x7f\r\n\x00\tc") == "a\\x1b[31mb\\x9b\\x7f\\r\\n\\x00\tc"
    assert logs.printable("one\ntwo\x1b", keep="\n") == "one\ntwo\\x1b"
    text = "x\x1b]0;t\x07 \\x1b already escaped"
    assert logs.printable(logs.printable(text)) == logs.printable(text)  # idempotent


def test_tee_prefixes_every_piece_of_a_long_line_and_cuts_between_characters(tmp_path):
    out = io.StringIO()
    tee = Tee(out)
    log = tmp_path / "rank0.log"
    tee.follow(log, "[rank0]: ")
    # a line that never ends grows no buffer beyond MAX_ECHO_LINE, and each piece has the prefix
    log.write_bytes(("é" * MAX_ECHO_LINE).encode() + b"\x1b[2J")
    tee.forget([log])
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all(ln.startswith("[rank0]: ") for ln in lines)
    assert "".join(ln[len("[rank0]: ") :] for ln in lines) == "é" * MAX_ECHO_LINE + "\\x1b[2J"


def test_error_file_text_is_escaped_cut_short_and_never_breaks_the_daemon(tmp_path):
    path = tmp_path / "rank0.error.json"
    path.write_text('{"message": {"message": "ValueError: \\u001b[2Jx\\ny", "extraInfo": {}}}')
    assert spawn.read_error_file(path) == "ValueError: \\x1b[2Jx\\ny"
    path.write_text(
        '{"message": {"message": "", "extraInfo": {"py_callstack": "a\\nKeyError: \\u009b"}}}'
    )
    assert spawn.read_error_file(path) == "KeyError: \\x9b"
    path.write_text('{"message": "%s"}' % ("z" * 10000))
    assert len(spawn.read_error_file(path)) == spawn.MAX_EXCEPTION_TEXT + 3
    for hostile in (
        "[" * 100000,
        "[1, 2]",
        '{"message": {"extraInfo": "str"}}',
        '{"message": [1]}',
        '{"message": {"message": 5, "extraInfo": {"py_callstack": 7}}}',
        "\udcff",
    ):
        path.write_text(hostile, errors="surrogateescape")
        assert spawn.read_error_file(path) is None, hostile
    path.unlink()
    os.mkfifo(path)  # a FIFO nobody writes to: reading must not block the daemon's loop
    assert spawn.read_error_file(path) is None
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text('{"message": "secret"}')
    assert spawn.read_error_file(path) is None
