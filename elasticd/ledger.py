"""The per-sample ledger: which sample went into which optimizer step, on which rank, in which
attempt, so that `elasticd ledger check` can prove a finished run trained each sample of each
epoch exactly once.

On when `ELASTICD_LEDGER_DIR` names a directory: `elasticd run --ledger` sets it to each attempt's
directory (beside the ranks' logs); under another launcher set it yourself. Each process then
appends to one file of its own there, `rank<RANK>.ledger` (`rank<RANK>.g<G>.ledger` from a
generation G of the group in place on: the script run again in place is an attempt of its own,
`attempt_key`), with one `os.write` per call: nothing
is buffered, so a SIGKILL loses no record of a step the in-memory state may hold. The sampler
(elasticd.sampler) calls this module; code that deals its own batches calls it the same way:

    ledger.dataset_size(len(dataset))   # once: lets the checker name samples never seen
    ledger.resumed(step)                # after loading a state of `step` optimizer steps
    ledger.record(epoch, step, indices) # the samples this rank put into optimizer step `step`

`record` may be called several times for one step (micro-batches); `epoch` is one epoch or one
per index. Every call is a no-op when the ledger is off. Torch-free: the CLI reads it, through
`find` (the ledger files under given paths) and `read` (a regular file only, never through a
link, at most `MAX_FILE`, 1 GiB).

File format (little-endian): MAGIC, a u32 length and a JSON header (rank, world, attempt, pid,
time), then records, each a kind byte: b"R" + i64 step + f64 time (this attempt resumed after
that step); b"N" + i64 dataset size; b"S" + i64 step + u32 count + count i64 indices + count i32
epochs. A record cut short at the end (a process killed mid-write) is ignored by the reader.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elasticd import names, safeio

__all__ = ["dataset_size", "enabled", "record", "resumed", "read", "LedgerFile"]

MAGIC = b"ELDLEDG1"
SUFFIX = ".ledger"
_STEP = struct.Struct("<cqI")
_RESUMED = struct.Struct("<cqd")
_SIZE = struct.Struct("<cq")
MAX_FILE = 1 << 30  # bytes of one ledger file read at most (about 89 million sample records)


def attempt_key(env: dict[str, str] | os._Environ = os.environ) -> str:
    """What every rank of one attempt shares and no other attempt has: the job, the round (a
    restart count under torchrun), the round's worker store and, recovered in place, the group's
    generation: a survivor's script run again, its replacement and a joining node's ranks all
    start one (names.IN_PLACE_GEN), which resumed from a state of its own (what the generation
    before it recorded past that state was rolled back)."""
    round_ = env.get(names.ROUND_NUMBER) or f"restart{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    gen = _generation(env)
    return f"{env.get('TORCHELASTIC_RUN_ID', 'none')}/{round_}/{store}" + (gen and f"/g{gen}")


def _generation(env: dict[str, str] | os._Environ = os.environ) -> str:
    """The group's generation in place (names.IN_PLACE_GEN); "" for the first (0) or none."""
    gen = env.get(names.IN_PLACE_GEN, "0")
    return "" if gen in ("", "0") else gen


class Writer:
    """One process's ledger file, created at the first call (O_EXCL, never through a symlink)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.fd: int | None = None
        self.path: Path | None = None  # the file, once created (a repro bundle reads it back)
        self.started = False  # a resumed record written (the first step record writes one)
        self.gen = ""  # the generation in place the open file is of ("": the first)

    def _open(self) -> int:
        gen = _generation()
        if self.fd is not None and gen != self.gen:  # re-entered in place: an attempt of its own
            os.close(self.fd)
            self.fd, self.path, self.started = None, None, False
        if self.fd is None:
            rank = os.environ.get("RANK", "0")
            path = Path(self.directory) / f"rank{rank}{gen and f'.g{gen}'}{SUFFIX}"
            try:
                self.fd = safeio.create(path, os.O_WRONLY | os.O_APPEND)
            except FileExistsError:  # a second process of this rank in one directory
                path = path.with_name(f"rank{rank}-{os.getpid()}{SUFFIX}")
                self.fd = safeio.create(path, os.O_WRONLY | os.O_APPEND)
            self.path = path
            header = json.dumps(
                {
                    "rank": int(rank),
                    "world": int(os.environ.get("WORLD_SIZE", "1")),
                    "attempt": attempt_key(),
                    "pid": os.getpid(),
                    "time": time.time(),
                }
            ).encode()
            os.write(self.fd, MAGIC + struct.pack("<I", len(header)) + header)
            self.gen = gen
        return self.fd

    def resumed(self, step: int) -> None:
        os.write(self._open(), _RESUMED.pack(b"R", step, time.time()))
        self.started = True

    def dataset_size(self, n: int) -> None:
        os.write(self._open(), _SIZE.pack(b"N", n))

    def record(self, epoch: int | Sequence[int], step: int, indices: Sequence[int]) -> None:
        if not self.started:
            self.resumed(step - 1)  # a fresh start: this attempt begins after the step before
        count = len(indices)
        epochs = array("i", [epoch] * count if isinstance(epoch, int) else epoch)
        if len(epochs) != count:
            raise ValueError(f"ledger.record: {len(epochs)} epochs for {count} indices")
        os.write(
            self._open(),
            _STEP.pack(b"S", step, count) + array("q", indices).tobytes() + epochs.tobytes(),
        )


_writer: Writer | None = None
_checked = False


def _get() -> Writer | None:
    global _writer, _checked
    if not _checked:
        directory = os.environ.get(names.LEDGER_DIR, "")
        _writer, _checked = (Writer(directory) if directory else None), True
    return _writer


def enabled() -> bool:
    return _get() is not None


def own_file() -> Path | None:
    """This process's ledger file, once it wrote one (elasticd.checkpoint.bundle reads it)."""
    w = _get()
    return w.path if w is not None else None


def resumed(step: int) -> None:
    """This attempt continues from a state saved after optimizer step `step`: the checker drops
    what earlier attempts recorded past it (rolled back)."""
    if (w := _get()) is not None:
        w.resumed(int(step))


def dataset_size(n: int) -> None:
    if (w := _get()) is not None:
        w.dataset_size(int(n))


def record(epoch: int | Sequence[int], step: int, indices: Sequence[int]) -> None:
    """This rank put `indices` (of `epoch`, or of one epoch each) into optimizer step `step`."""
    if (w := _get()) is not None:
        w.record(epoch, int(step), indices)


# --- reading -------------------------------------------------------------------------------


class LedgerError(ValueError):
    """A file that is not a ledger, or cannot be read: the message names it."""


@dataclass
class LedgerFile:
    path: Path
    rank: int
    world: int
    attempt: str
    time: float
    resumed: int | None = None  # the first resumed record's step
    dataset_size: int | None = None
    # step -> [(indices, epochs), ...] in the order written
    steps: dict[int, list[tuple[list[int], list[int]]]] = field(default_factory=dict)
    torn: bool = False  # a record cut short at the end


def read(path: Path) -> LedgerFile:
    """A ledger file: a regular file (never through a symlink, never a FIFO or a device) of at
    most MAX_FILE bytes, else LedgerError."""
    try:
        data = safeio.read_regular(path, MAX_FILE)
    except OSError as e:
        why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise LedgerError(
            f"{path}: cannot read it ({why}): a ledger is a regular file elasticd wrote"
        ) from None
    except ValueError:
        raise LedgerError(
            f"{path}: larger than {MAX_FILE >> 20} MiB, more than elasticd reads of one ledger "
            "file: give the ledger files of one run"
        ) from None
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise LedgerError(f"{path}: not an elasticd ledger file (no {MAGIC.decode()} header)")
    (size,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        head = json.loads(data[start : start + size])
        out = LedgerFile(
            path, int(head["rank"]), int(head["world"]), str(head["attempt"]), float(head["time"])
        )
    except (ValueError, KeyError, TypeError):
        raise LedgerError(f"{path}: its ledger header is damaged") from None
    out.torn = not _records(data, start + size, out)
    return out


def _records(data: bytes, at: int, out: LedgerFile) -> bool:
    """Parse the records into `out`; False when the last one is cut short."""
    while at < len(data):
        kind = data[at : at + 1]
        if kind == b"R" and at + _RESUMED.size <= len(data):
            _, step, _ = _RESUMED.unpack_from(data, at)
            out.resumed = step if out.resumed is None else out.resumed
            at += _RESUMED.size
        elif kind == b"N" and at + _SIZE.size <= len(data):
            out.dataset_size = _SIZE.unpack_from(data, at)[1]
            at += _SIZE.size
        elif kind == b"S" and at + _STEP.size <= len(data):
            _, step, count = _STEP.unpack_from(data, at)
            body = at + _STEP.size
            end = body + 12 * count
            if end > len(data):
                return False
            indices = array("q", data[body : body + 8 * count]).tolist()
            epochs = array("i", data[body + 8 * count : end]).tolist()
            out.steps.setdefault(step, []).append((indices, epochs))
            at = end
        elif kind in (b"R", b"N", b"S"):
            return False
        else:
            raise LedgerError(f"{out.path}: damaged at byte {at} (unknown record {kind!r})")
    return True


def find(paths: Sequence[str | Path]) -> Iterator[Path]:
    """Every ledger file at or below each path (a run's or a log directory, or a file)."""
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(p.rglob(f"*{SUFFIX}"))
        elif p.exists():
            yield p
        else:
            raise LedgerError(f"{p}: no such file or directory")
