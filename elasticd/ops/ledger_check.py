"""`elasticd ledger check DIR...`: prove from the ledger (elasticd/ledger.py) that a run trained
every sample of each finished epoch exactly once.

The run's history is rebuilt backwards. Every rank file belongs to an attempt (all the ranks of
one round share its key) and says after which step the attempt resumed. The attempts are ordered
by when they started; the last one's records count from its resume point on; the steps up to it
are the ones of the latest earlier attempt that recorded that step (the state it resumed from was
made there: elasticd resumes from the newest state, in memory or on disk), and so on back to
step 0. Whatever else was recorded was rolled back and trained again. An epoch counts as
finished once a later epoch has samples or all its samples were seen.

The proof is only as good as the files: a ledger carries no signature, so whoever can write its
files or a directory above them can make it say anything. The check refuses (one line, exit 2)
a ledger file or a directory on its path that another user could change: owned by someone other
than the caller or root, or writable by its group or others (a sticky directory such as /tmp is
fine above the run: its entries are still only their owners' to change: `trusted`).

It says, per epoch, the samples seen once, twice or more, and never, and the per-step global batch
sizes; exit 0 when every finished epoch was trained exactly once, 1 when not.
"""

from __future__ import annotations

import os
import stat
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elasticd.ledger import LedgerError, LedgerFile, find, read

SHOWN = 10  # samples named per line at most


@dataclass
class Attempt:
    key: str
    files: list[LedgerFile] = field(default_factory=list)

    @property
    def start(self) -> float:
        return min(f.time for f in self.files)

    @property
    def resumed(self) -> int:
        return min((f.resumed for f in self.files if f.resumed is not None), default=0)

    def steps(self) -> set[int]:
        return {s for f in self.files for s in f.steps}

    def batch(self, step: int) -> list[tuple[int, int, int]]:
        """(rank, epoch, index) of every sample of `step` in this attempt."""
        return [
            (f.rank, e, i)
            for f in self.files
            for indices, epochs in f.steps.get(step, ())
            for i, e in zip(indices, epochs)
        ]


@dataclass
class Proof:
    attempts: int
    files: int
    steps: dict[int, list[tuple[int, int, int]]]  # the surviving step -> (rank, epoch, index)
    rolled_back: int  # steps recorded again by a later attempt (rolled back)
    dataset_size: int | None
    problems: list[str] = field(default_factory=list)  # history that cannot be rebuilt


def history(files: Sequence[LedgerFile]) -> Proof:
    """The surviving record of every optimizer step, walking back from the last attempt."""
    by_key: dict[str, Attempt] = {}
    for f in files:
        by_key.setdefault(f.attempt, Attempt(f.attempt)).files.append(f)
    attempts = sorted(by_key.values(), key=lambda a: a.start)
    sizes = [f.dataset_size for f in files if f.dataset_size is not None]
    proof = Proof(len(attempts), len(files), {}, 0, max(sizes) if sizes else None)
    upto, i = None, len(attempts) - 1
    while i >= 0:
        cur = attempts[i]
        for s in cur.steps():
            if s > cur.resumed and (upto is None or s <= upto):
                proof.steps.setdefault(s, cur.batch(s))
        if cur.resumed <= 0:
            break
        upto = cur.resumed
        parent = next((j for j in range(i - 1, -1, -1) if upto in attempts[j].steps()), None)
        if parent is None:
            proof.problems.append(
                f"attempt {cur.key} resumed after step {upto}, which no earlier attempt recorded "
                "(give every node's log directory)"
            )
            break
        i = parent
    recorded = sum(len(a.steps()) for a in attempts)
    proof.rolled_back = recorded - len(proof.steps)
    if proof.steps:
        gaps = sorted(set(range(1, max(proof.steps) + 1)) - set(proof.steps))
        if gaps:
            proof.problems.append(f"no record of step(s) {_some(gaps)}")
    return proof


def _some(items: Sequence[int]) -> str:
    shown = ", ".join(map(str, items[:SHOWN]))
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def epochs(proof: Proof) -> tuple[list[str], bool]:
    """One line per epoch (seen once / twice or more / never) and whether all is exactly once."""
    counts: dict[int, Counter] = {}
    for batch in proof.steps.values():
        for _, e, i in batch:
            counts.setdefault(e, Counter())[i] += 1
    n = proof.dataset_size
    lines, ok = [], True
    last = max(counts, default=-1)
    for e in sorted(counts):
        c = counts[e]
        twice = sorted(i for i, k in c.items() if k > 1)
        never = sorted(set(range(n)) - set(c)) if n is not None else []
        finished = e < last or not never
        head = f"epoch {e}: {len(c)} samples seen, {sum(k == 1 for k in c.values())} once"
        if not finished:
            lines.append(f"{head}, {len(twice)} twice or more; in progress ({len(never)} to come)")
        else:
            lines.append(f"{head}, {len(twice)} twice or more, {len(never)} never")
        if twice:
            lines.append(f"  twice or more: {_some(twice)}")
        if never and finished:
            lines.append(f"  never: {_some(never)}")
        ok = ok and not twice and (not finished or not never)
    return lines, ok


def batches(proof: Proof) -> str:
    """The per-step global batch sizes, with the ranks that made them."""
    sizes = Counter((len(b), len({r for r, _, _ in b})) for b in proof.steps.values())
    parts = [
        f"{size} samples x {k} steps ({w} rank{'s' * (w != 1)})"
        for (size, w), k in sorted(sizes.items())
    ]
    return "global batch per step: " + ("; ".join(parts) or "none")


def _changeable(path: Path, st: os.stat_result) -> str | None:
    """Why a user other than the caller or root could change `path`, or None."""
    me = os.geteuid()
    if st.st_uid not in (0, me):
        return f"{path} belongs to uid {st.st_uid}"
    if stat.S_ISLNK(st.st_mode):
        return None  # read() refuses it: a ledger is never read through a link
    if st.st_mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by {'other users' if st.st_mode & 0o002 else 'its group'}"
    return None


def trusted(found: Sequence[Path]) -> None:
    """LedgerError unless only the caller or root could have written each file, and each
    directory above it (resolved): the ledger proves nothing of files someone else can forge."""
    seen: set[Path] = set()
    for f in found:
        parent = Path(os.path.realpath(f.parent))
        for p in (parent / f.name, parent, *parent.parents):
            if p in seen:
                break  # its parents are checked too
            seen.add(p)
            try:
                why = _changeable(p, os.lstat(p))
            except OSError as e:
                raise LedgerError(f"{p}: cannot read it ({e.strerror})") from None
            if why:
                mine = "root" if os.geteuid() == 0 else "you or root"
                raise LedgerError(
                    f"{why}, who could forge its records: the check proves exactly-once only for "
                    f"ledgers that only {mine} can write (chown / chmod go-w it, or copy the "
                    "run's directory somewhere private)"
                )


def check(paths: Sequence[str]) -> int:
    """Print the proof for the ledger files at or below `paths`; 0 when every sample of every
    finished epoch was trained once, 1 when not, 2 for input that is not a run's ledger."""
    try:
        found = list(find(paths))
        if not found:
            raise LedgerError(
                f"no ledger files (*.ledger) under {', '.join(paths)}: run the job with "
                "`elasticd run --ledger` (or ELASTICD_LEDGER=1), and give its log directories"
            )
        trusted(found)
        files = [read(Path(p)) for p in found]
    except LedgerError as e:
        sys.stderr.write(f"elasticd: error: {e}\n")
        return 2
    proof = history(files)
    top = max(proof.steps, default=0)
    torn = sum(f.torn for f in files)
    print(
        f"ledger: {proof.files} files, {proof.attempts} attempts, steps 1-{top} "
        f"({proof.rolled_back} steps rolled back and trained again"
        + (f"; {torn} files end in a record cut short" if torn else "")
        + ")"
    )
    lines, ok = epochs(proof)
    print("\n".join(lines))
    print(batches(proof))
    for problem in proof.problems:
        print(f"problem: {problem}")
    ok = ok and not proof.problems
    print("exactly once: " + ("yes" if ok else "NO"))
    return 0 if ok else 1
