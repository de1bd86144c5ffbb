"""The tee: new lines of the rank logs echoed to the daemon's stdout, prefixed (torchrun's prefix
template), escaped, and a progress bar's redraws rate-limited (see Tee).

A multi-line display's frames are held like a bar's redraws (`_frames`), and a display's redraw
sequences (colours, erase line, cursor up, cursor shown) are dropped. `display_env` is what makes
Rich draw live into the log when the echo reaches a terminal. The thread wakes only when
something can be echoed (`Tee`).

A worker's stdout and stderr are two files (rankR.log, rankR.stderr.log), echoed to the daemon's
stdout and stderr respectively, as torchrun's workers write to its terminal: `2>/dev/null` hides
the workers' warnings and tracebacks too. A line that already starts with the rank's prefix
(torch's excepthook prefixes every line of an uncaught exception's traceback with `[rankR]: `
once the process group exists) is not given it twice.
"""

from __future__ import annotations

import os
import re
import socket
import string
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from elasticd import logs
from elasticd.lifecycle import supervise

MAX_ECHO_LINE = 64 * 1024  # bytes; a longer line is echoed in pieces, each with the prefix
REDRAW_INTERVAL = 0.5  # seconds; a progress bar's redraws are echoed at most this often per rank
READ_CHUNK = 1 << 20  # bytes the Tee reads of a file at once, into the one buffer it reuses
_LATE = 0.005  # seconds the Tee wakes after a redraw comes due (a timed wait may end a hair early)


# What a progress display redraws a line with, once each redraw is a line of its own: colours
# (SGR), erase in line, cursor up/down and to a column, cursor hidden/shown. The echo drops them;
# every other escape sequence is shown escaped (logs.printable).
_DISPLAY = re.compile(r"\x1b\[(?:[0-9;]*[mKABG]|\?25[hl])")
# A display of several lines goes back up to its first line before each redraw (Rich: erase
# line, cursor up): a finished line holding that is the first line of a redrawn frame.
_CURSOR_UP = re.compile(rb"\x1b\[[0-9]*A")


def display_env() -> dict[str, str]:
    """What a worker is given so that Rich (Lightning's default progress bar) draws live into its
    rank log, as it would on the terminal torchrun's workers share, where the daemon echoes to a
    terminal: Rich treats the log as one (TTY_COMPATIBLE) and redraws it (TTY_INTERACTIVE), and
    the tee turns each redraw into one prefixed line with the display's sequences dropped. A
    value the user set wins (the caller only sets what is missing); off a terminal, nothing."""
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):
        tty = False
    return {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"} if tty else {}


def console_prefix(role: str, rank: int, local_rank: int, template: str = "") -> str:
    """What a worker's echoed lines start with: `[rankR]: `, or torchrun's template
    (--log-line-prefix-template, else TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE where it is set) with
    its macros ${role_name}, ${rank}, ${local_rank} and ${hostname}."""
    template = template or os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "")
    if not template:
        return f"[rank{rank}]: "
    return string.Template(template).safe_substitute(
        role_name=role, rank=rank, local_rank=local_rank, hostname=socket.gethostname()
    )


def echo_line(prefix: str, raw: bytes) -> str:
    """One line of a worker's output as the console shows it: the rank prefix, then the text with
    a progress display's sequences dropped (_DISPLAY) and every other control character escaped
    (logs.printable), so a worker can neither drive the operator's terminal nor print a line
    without its prefix. The Tee has already split the output at carriage returns (see Tee): one
    that is left here is escaped like the rest. A line that starts with this very prefix (torch's
    excepthook writes `[rankR]: ` before each line of a traceback) keeps that one: a rank can only
    drop its own prefix, never show another's without it."""
    text = raw.decode(errors="backslashreplace")
    text = text.removeprefix(prefix)
    return prefix + logs.printable(_DISPLAY.sub("", text) if "\x1b" in text else text) + "\n"


def _cut(line: bytes, size: int = MAX_ECHO_LINE) -> list[bytes]:
    """`line` in pieces of at most `size` bytes, cut between UTF-8 characters."""
    pieces = []
    while len(line) > size:
        at = size
        while at > size - 4 and line[at] & 0xC0 == 0x80:  # a continuation byte: step back
            at -= 1
        pieces.append(line[:at])
        line = line[at:]
    pieces.append(line)
    return pieces


def _split(
    data: bytes | bytearray, final: bool, end: int | None = None
) -> tuple[list[bytes], bytes | None, bytes]:
    """Output (`data[:end]`) as the console echoes it: (finished lines, the latest finished
    redraw or None, the unfinished rest). A line is what a terminal would show of it, the text
    after its last carriage return ("\r\n" ends a line). A redraw is a segment ended by "\r"
    after the last newline: a progress bar draws each state as "\r" + text, so the text after
    the last "\r" is still being drawn and waits for the next "\r" or "\n" (or the file's end).

    Scanned from the end by index: of a bar's thousands of redraws only the last two carriage
    returns are looked for, and nothing is copied but what is returned (and the lines)."""
    view = memoryview(data)
    end = len(data) if end is None else end
    nl = data.rfind(b"\n", 0, end)
    lines = (
        [
            piece
            for ln in bytes(view[:nl]).split(b"\n")
            for piece in _cut(ln.removesuffix(b"\r").rpartition(b"\r")[2])
        ]
        if nl >= 0
        else []
    )
    start = nl + 1
    held = b""
    if not final and end > start and data[end - 1] == 0x0D:  # maybe the first half of "\r\n"
        end, held = end - 1, b"\r"
    redraw = None
    cr = data.rfind(b"\r", start, end)
    if cr >= 0:
        begin = max(start, data.rfind(b"\r", start, cr) + 1)
        redraw = _cut(bytes(view[begin : min(cr, begin + MAX_ECHO_LINE + 1)]))[0]
        start = cr + 1
    *long, rest = _cut(bytes(view[start:end]) + held)
    return lines + long, redraw or None, rest


def _frames(done: list[bytes]) -> tuple[list[bytes], list[bytes] | None]:
    """Finished lines as (those to echo now, the latest frame of a multi-line display or None):
    a frame starts at a line that moves the cursor up (_CURSOR_UP) and runs to the end of what
    was read, so a display redrawn ten times a second is held like a one-line bar's redraw, not
    echoed whole each time. Lines before its first frame are echoed; older frames dropped."""
    starts = [i for i, ln in enumerate(done) if b"\x1b[" in ln and _CURSOR_UP.search(ln)]
    if not starts:
        return done, None
    return done[: starts[0]], done[starts[-1] :]


@dataclass
class _Followed:
    """A rank log the Tee follows: where it read up to, what it holds back (an unfinished line,
    a redraw not yet due), and the file, open from the moment it exists."""

    prefix: str
    offset: int
    stderr: bool = False  # echoed to the daemon's stderr (the worker's stderr file)
    partial: bytes = b""
    redraw: bytes | None = None
    frame: list[bytes] | None = None  # a multi-line display's lines above its redraw (_frames)

    def take(self, done: list[bytes], redraw: bytes | None) -> list[bytes]:
        """What to echo now of the lines and redraw just read; the rest is held until due."""
        done, frame = _frames(done)
        if frame is not None:  # held, shown with the next redraw
            self.frame = frame
        elif done and self.frame:  # the display ended: its last frame, then what follows
            done, self.frame = self.frame + done, None
        if done or redraw:
            self.redraw = redraw  # a later line or redraw replaces one not yet shown
        return done

    next_redraw: float = 0.0
    fd: int | None = None


class Tee:
    """Echo new lines of the rank logs to the daemon's stdout (a worker's stderr file to its
    stderr), prefixed with the rank, escaped
    (echo_line), a line longer than MAX_ECHO_LINE in pieces.

    A progress bar (tqdm: "\r" + the bar, again and again, one newline at the end) is echoed as
    a prefixed line per redraw, the latest one at most every REDRAW_INTERVAL, the rest dropped
    (the log file keeps every byte). Never "\r" + prefix on a terminal: worker bytes must not
    move the operator's cursor, and a line without the prefix must never show. The bar is held
    as at most one unfinished segment, so memory stays bounded: each file is read into one
    buffer the Tee reuses (READ_CHUNK, behind the segment held back), scanned from its end.

    One thread polls the files, so workers write straight to disk and are never slowed by us.
    Each file stays open while followed: a poll with nothing new is one pread per file. Each
    wake-up costs the daemon CPU (on a VM, more than the reading), so the thread wakes only when
    there can be something to echo: every `interval` while lines flow; while only a bar flows
    (output with no newline), when its next redraw comes due (a redraw_interval apart); backing
    off to `idle_interval` while nothing flows. A quiet job, and one drawing a bar, cost next to
    nothing to watch (a tqdm bar: 0.04% of a core, 0.24% when polled every `interval`)."""

    def __init__(
        self,
        out=None,
        err=None,
        interval: float = 0.05,
        idle_interval: float = 0.25,
        redraw_interval: float = REDRAW_INTERVAL,
    ):
        self._out = out or sys.stdout
        self._err = err or sys.stderr
        self._interval = interval
        self._idle_interval = idle_interval
        self._redraw_interval = redraw_interval
        self._files: dict[Path, _Followed] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._buf = bytearray(
            MAX_ECHO_LINE + READ_CHUNK
        )  # the segment held back, then what is read
        self._thread = supervise.thread("tee", self._run)

    def start(self) -> None:
        self._thread.start()

    def follow(self, path: Path, prefix: str, stderr: bool = False) -> None:
        """Echo what `path` gains, to the daemon's stdout, or its stderr where `stderr` (the
        worker's stderr file)."""
        with self._lock:
            self._files[path] = _Followed(
                prefix, path.stat().st_size if path.exists() else 0, stderr
            )

    def forget(self, paths: list[Path]) -> None:
        """Print what is left of these files (their last lines) and stop following them."""
        with self._lock:
            for p in paths:
                self._pump(p, final=True)
                entry = self._files.pop(p, None)
                if entry is not None and entry.fd is not None:
                    os.close(entry.fd)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self.forget(list(self._files))

    def _run(self) -> None:
        wait = self._interval
        while not self._stop.wait(wait):
            with self._lock:
                due = [d for d in [self._pump(p) for p in list(self._files)] if d is not None]
            wait = min(due) if due else min(2 * wait, self._idle_interval)

    def _pump(self, path: Path, final: bool = False) -> float | None:
        """Echo what the file gained since the last call, and a redraw that has come due; how
        soon the file wants looking at again (None: it gained nothing and holds nothing due)."""
        entry = self._files.get(path)
        if entry is None:
            return None
        lines: list[bytes] = []
        gained = full = False
        while True:  # once, or until the file's end when it is the last call
            held = len(entry.partial)
            self._buf[:held] = entry.partial  # the unfinished segment, then what follows it
            try:
                if (
                    entry.fd is None
                ):  # a warm spare opens its rank's log itself, maybe after follow()
                    entry.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                n = os.preadv(
                    entry.fd, [memoryview(self._buf)[held : held + READ_CHUNK]], entry.offset
                )
            except OSError:
                n = 0
            full = n == READ_CHUNK
            if not (n or final):
                break
            entry.offset += n
            gained = gained or n > 0
            done, redraw, entry.partial = _split(self._buf, final and not full, held + n)
            lines += entry.take(done, redraw)
            if not (final and full):
                break
        flowing = bool(lines)  # lines came (before any redraw is added below)
        now = time.monotonic()
        held = entry.redraw is not None or bool(entry.frame)
        if final:
            lines += entry.frame or []
            lines += [entry.partial] if entry.partial else [entry.redraw] if entry.redraw else []
            entry.partial, entry.redraw, entry.frame = b"", None, None
        elif held and now >= entry.next_redraw:
            lines += (entry.frame or []) + ([entry.redraw] if entry.redraw is not None else [])
            entry.redraw, entry.frame = None, None
            entry.next_redraw = now + self._redraw_interval
        if lines:
            text = "".join(echo_line(entry.prefix, ln) for ln in lines)
            out = self._err if entry.stderr else self._out
            try:  # whole lines in one write: never glued to another rank's or the daemon's
                out.write(text)
                out.flush()
            except (OSError, ValueError):
                pass
        if flowing or full:
            return self._interval
        if (
            gained or entry.redraw is not None or entry.frame
        ):  # a bar: nothing to echo before its next redraw is due
            left = entry.next_redraw - now
            return left + _LATE if left > 0 else self._redraw_interval
        return None
