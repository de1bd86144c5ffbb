"""Which rank a hang is the fault of (or that it is a desync: ranks in different collectives), from
the stack dumps taken when it was declared. Pure: dump text in, verdict out
(tests/unit/daemon/test_culprit.py is its table).

In a collective hang every rank stops beating at once, so the heartbeat names whichever rank's
silence was read first. The stacks tell them apart: the ranks waiting in a torch.distributed
collective (or in backward, where DDP's gradient all_reduce waits) are the victims; a rank
elsewhere (a data read, a sleep, a lock, a different collective) is the culprit. Each node
reduces its ranks' dumps to a `Where` (a few short strings) and, across nodes, publishes only
those (daemon/hangs.py), so the verdict is the same wherever it is judged.

`where` reduces a faulthandler dump to where the training thread waits: the torch.distributed
collective (`COLLECTIVES`), or `backward`, else the innermost frame outside Python's library.
`judge_hang` names the ranks elsewhere than the collective most ranks waited in (where every one
of them waits in another collective, a desync, said as one). A node's summary
travels between daemons as `summary` writes it and `parse_summary` reads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# torch.distributed calls a rank blocks in (c10d's Python API; their object forms included)
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_coalesced",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "monitored_barrier",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "all_to_all",
        "all_to_all_single",
        "send",
        "recv",
        "send_object_list",
        "recv_object_list",
        "batch_isend_irecv",
    }
)
BACKWARD = "backward"  # DDP's gradient all_reduce waits inside autograd's engine
# elasticd's own waits on the other ranks where no torch.distributed frame shows (a Work's wait
# is C++): exact mode's ordered sum waits on its isend/irecv, as its other ranks wait in `recv`
_OWN_WAITS = {"_wait": ("elasticd/exact.py", "recv")}
_BACKWARD_FUNCS = frozenset({"backward", "_engine_run_backward", "run_backward"})
MAX_NAME = 120  # characters of a function name or site kept
MAX_RANKS = 256  # ranks one node's summary may carry
NAMED = 4  # culprits named one by one in the verdict's text
MAX_COLLECTIVES = 2000  # characters of a rank's collectives (collective_seq.MAX_COMPACT)

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ ")
# Python's own library, on any node's layout (not its site- or dist-packages)
_STDLIB = re.compile(r"/lib/python\d+\.\d+/(?!.*-packages/)")


@dataclass(frozen=True)
class Where:
    """Where one rank's main thread was: the collective it waited in (None: elsewhere), and its
    innermost frame outside Python's standard library (time.sleep, a lock's wait and a socket
    read are C: that frame is the code that called them)."""

    collective: str | None
    func: str
    site: str  # file name:line
    node: str = ""
    stacks: str = ""  # the rank's stack file on its node
    # its collectives' sequence numbers and ops (daemon/collective_seq.py's compact form; "": none)
    collectives: str = ""
    # its process asleep and off the CPU (suspicion.py: True), using it (False), or not known
    # (None): a hang's culprit that computes is a straggler, not a hang (daemon/hangs.py)
    idle: bool | None = None

    @property
    def label(self) -> str:
        return self.collective or f"`{self.func}` ({self.site})"


@dataclass(frozen=True)
class Verdict:
    culprits: tuple[int, ...]  # ranks elsewhere than the collective most ranks waited in
    waited_in: str | None  # that collective, if any
    waiting: tuple[int, ...]
    text: str
    # the ranks waited in different collectives, nobody elsewhere: a desync (the culprits, where
    # named, those outside the collective most ranks waited in)
    desync: bool = False


def threads(dump: str) -> list[tuple[bool, list[tuple[str, int, str]]]]:
    """A faulthandler dump's threads: (is the current thread, frames innermost first)."""
    found: list[tuple[bool, list[tuple[str, int, str]]]] = []
    for line in dump.splitlines():
        if _THREAD.match(line):
            found.append((line.startswith("Current"), []))
        elif found and (m := _FRAME.match(line)):
            found[-1][1].append((m["file"], int(m["line"]), m["func"]))
    return found


def main_frames(dump: str) -> list[tuple[str, int, str]]:
    """The training thread's frames: the one that runs the entrypoint (bootstrap.py below it),
    else the thread the signal found, else the first."""
    found = threads(dump)
    for _, frames in found:
        if any(f.endswith("elasticd/worker/bootstrap.py") for f, _, _ in frames):
            return frames
    current = [frames for cur, frames in found if cur]
    return current[0] if current else (found[0][1] if found else [])


def where(dump: str, node: str = "", stacks: str = "", collectives: str = "") -> Where | None:
    """One rank's dump reduced to where it waits; None when the dump holds no frame (the worker
    did not answer in time)."""
    frames = main_frames(dump)
    if not frames:
        return None
    collective = _collective(frames)
    file, line, func = next(
        (f for f in frames if not _stdlib(f[0])), frames[0]
    )  # all stdlib: its innermost
    site = f"{file.rsplit('/', 1)[-1]}:{line}"
    return Where(collective, func[:MAX_NAME], site[:MAX_NAME], node, stacks, collectives)


def _collective(frames: list[tuple[str, int, str]]) -> str | None:
    """The collective the frames wait in: a torch.distributed call of COLLECTIVES, else backward
    (DDP), else the innermost function of torch.distributed's own code (FSDP's waits and the
    like: a main thread inside it waits on the other ranks)."""
    for file, _, func in frames:
        if "torch/distributed/" in file and func in COLLECTIVES:
            return func
        if "torch/autograd/" in file and func in _BACKWARD_FUNCS:
            return BACKWARD
        own = _OWN_WAITS.get(func)
        if own and file.endswith(own[0]):
            return own[1]
    inside = [func for file, _, func in frames if "torch/distributed/" in file]
    return f"torch.distributed's `{inside[0]}`" if inside else None


def _stdlib(file: str) -> bool:
    return file.startswith("<frozen ") or _STDLIB.search(file) is not None


def judge_hang(stacks_by_rank: Mapping[int, Where | str | None]) -> Verdict:
    """The ranks waiting in the collective most ranks waited in, and the others: the culprits.
    A value may be a dump's text (reduced here) or None (no dump: left out, and said)."""
    ranks = {r: (where(w) if isinstance(w, str) else w) for r, w in sorted(stacks_by_rank.items())}
    known = {r: w for r, w in ranks.items() if w is not None}
    unknown = tuple(r for r, w in ranks.items() if w is None)
    groups: dict[str, list[int]] = {}
    for r, w in known.items():
        if w.collective:
            groups.setdefault(w.collective, []).append(r)
    tail = f"; no stack from rank(s) {_list(unknown)}" if unknown else ""
    if not groups:
        places: dict[str, list[int]] = {}
        for r, w in known.items():
            places.setdefault(w.label, []).append(r)
        text = "no rank waited in a collective: " + "; ".join(
            f"{_count(len(rs))} in {label} ({_list(tuple(rs))})"
            for label, rs in sorted(places.items(), key=lambda p: -len(p[1]))[:NAMED]
        )
        return Verdict((), None, (), (text if known else "no stacks to compare") + tail)
    size = max(len(g) for g in groups.values())
    top = sorted(c for c, g in groups.items() if len(g) == size)
    elsewhere = [r for r, w in known.items() if not w.collective]
    if len(top) > 1 and not elsewhere:  # as many ranks in one collective as in another
        text = "desync: ranks waited in different collectives, none is the odd one: " + "; ".join(
            f"{_count(len(groups[c]))} waited in {c} ({_list(tuple(groups[c]))})" for c in top
        )
        return Verdict((), None, (), text + tail, desync=True)
    waited_in = top[0]
    waiting = tuple(groups[waited_in])
    others = [r for r in known if r not in waiting]
    culprits = tuple(elsewhere) if len(top) > 1 else roots_first(others, known)
    if not culprits:
        text = (
            f"every rank waited in {waited_in}: none was elsewhere (a rank outside these "
            "stacks, or the network, holds it up)"
        )
        return Verdict((), waited_in, waiting, text + tail)
    named = "; ".join(placed(r, known[r]) for r in culprits[:NAMED])
    more = f" and {len(culprits) - NAMED} more" if len(culprits) > NAMED else ""
    desync = all(known[r].collective for r in culprits)  # in another collective, every one
    text = f"{named}{more} while {_count(len(waiting))} waited in {waited_in}{tail}"
    return Verdict(culprits, waited_in, waiting, ("desync: " if desync else "") + text, desync)


def roots_first(ranks: Iterable[int], wheres: Mapping[int, Where | None]) -> tuple[int, ...]:
    """`ranks` (each a culprit by some evidence) with those seen in no collective first: a rank
    that waits in one (a `recv` from the hung rank, a collective the others left) waits on
    someone, where one in a data read or a spin holds the others up (exact mode's ordered sum:
    the rank receiving from the hung one is behind on the collectives too)."""
    return tuple(sorted(ranks, key=lambda r: bool((w := wheres.get(r)) and w.collective)))


def _who(rank: int, w: Where) -> str:
    return f"rank {rank} (node {w.node})" if w.node else f"rank {rank}"


def placed(rank: int, w: Where) -> str:
    """Where a culprit was, as the verdict says it: "rank 1 was in `read_batch` (hang.py:24)"."""
    stacks = f" [stacks {w.stacks}]" if w.stacks else ""
    return f"{_who(rank, w)} {'waited' if w.collective else 'was'} in {w.label}{stacks}"


def _count(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _list(ranks: tuple[int, ...]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


# --- one node's summary, as it travels between the daemons (daemon/hangs.py) ---


_IDLE = {True: "idle", False: "busy", None: ""}
_IDLE_READ = {v: k for k, v in _IDLE.items()}


def summary(ranks: Mapping[int, Where]) -> str:
    """JSON of a node's ranks' `Where`s: a few short strings per rank, at most MAX_RANKS."""
    rows = [
        [
            r,
            w.collective or "",
            w.func,
            w.site,
            w.node,
            w.stacks[:300],
            w.collectives,
            _IDLE[w.idle],
        ]
        for r, w in sorted(ranks.items())[:MAX_RANKS]
    ]
    return json.dumps(rows)


def parse_summary(text: str) -> dict[int, Where] | None:
    """A summary read back; None for anything not of its form (a value from the store)."""
    if len(text) > 1024 * 1024:
        return None
    rows = json.loads(text)
    if not isinstance(rows, list) or len(rows) > MAX_RANKS:
        return None
    found: dict[int, Where] = {}
    for row in rows:
        if (
            not isinstance(row, list)
            # 6: a daemon before the collectives' evidence; 7: before the ranks' idleness
            or len(row) not in (6, 7, 8)
            or not isinstance(row[0], int)
            or isinstance(row[0], bool)
            or not 0 <= row[0] < 1 << 24
            or not all(isinstance(x, str) and len(x) <= 300 for x in row[1:6])
            or not all(isinstance(x, str) and len(x) <= MAX_COLLECTIVES for x in row[6:7])
            or not all(x in _IDLE_READ for x in row[7:])
        ):
            return None
        rank, collective, func, site, node, stacks, *rest = row
        seqs, idle = (rest + ["", ""])[:2]
        found[rank] = Where(collective or None, func, site, node, stacks, seqs, _IDLE_READ[idle])
    return found
