"""Each rank's collectives (sequence number and fingerprint: op, input shapes, dtype, group) from
torch's Flight Recorder, which the worker writes when asked (worker/flight.py), and the verdict
they give on a hang: the ranks that never arrived at the collective the others wait in, a desync
(a rank called another op, or other shapes, at the same sequence number), or every rank arrived
(the network, or a rank not seen, holds it), or no rank waits in a collective at all.

The sequence number tells these apart where the stacks cannot: a rank in a data read and a rank
one collective behind look alike on the stack, and two ranks in all_reduce may be at different
sequence numbers. A rank's dump is reduced to a `Progress` per process group (`progress`), a few
hundred bytes that travel between nodes in the hang summary (`compact` / `parse_compact`, carried
by culprit.Where.collectives), and `judge` compares the ranks'. The numbers compared are the
recorder's entries' (collectives alone, numbered afresh when a group re-forms in place, so the
same on every rank of a generation); gloo's per-group status counts point-to-point messages too
and runs on across generations, so only how many collectives a rank has outstanding is taken
from it. `ask` and `collect` are the only parts that touch files: every wait bounded.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from elasticd import safeio
from elasticd.worker import flight

KEPT = 4  # a group's latest collectives kept per rank
MAX_GROUPS = 4  # groups kept per rank (those with a collective outstanding first)
MAX_TEXT = 80  # characters of an op, shape list or group name kept
MAX_COMPACT = 2000  # characters of a rank's compact form
MAX_DUMP = 4 << 20  # bytes of a Flight Recorder dump read
NAMED = 4  # ranks named one by one


@dataclass(frozen=True)
class Op:
    seq: int
    op: str  # "all_reduce": the backend's prefix dropped
    shapes: str  # the input shapes, "[[4, 3]]"
    dtype: str  # the input dtypes, "Float"

    @property
    def label(self) -> str:
        return f"{self.op} ({self.shapes} {self.dtype})"


@dataclass(frozen=True)
class Progress:
    """One rank's collectives in one process group."""

    group: str  # the group's name ("0": the default group)
    desc: str  # torch's description of it ("default_pg")
    enqueued: int  # the latest sequence number the rank called
    completed: int  # the latest it saw complete
    ops: tuple[Op, ...]  # the latest KEPT, oldest first

    @property
    def waiting(self) -> Op | None:
        """The collective the rank waits in, if any."""
        if self.enqueued <= self.completed:
            return None
        found = [o for o in self.ops if o.seq == self.enqueued]
        return found[0] if found else Op(self.enqueued, "?", "?", "?")

    def at(self, seq: int) -> Op | None:
        return next((o for o in self.ops if o.seq == seq), None)


@dataclass(frozen=True)
class Verdict:
    kind: str  # "desync", "never_arrived", "arrived", "idle" or "none" (no evidence)
    culprits: tuple[int, ...]
    seq: int | None
    text: str

    @property
    def decides(self) -> bool:
        return self.kind in ("desync", "never_arrived")


NONE = Verdict("none", (), None, "")


def progress(text: str) -> dict[str, Progress] | None:
    """A Flight Recorder dump (worker/flight.py's JSON) reduced to each group's Progress; None
    for anything not of its form."""
    try:
        data = json.loads(text)
        dumps = data if isinstance(data, list) else [data]  # one per recorder (flight.dump)
        status = {k: v for d in dumps for k, v in d.get("pg_status", {}).items()}
        by_group: dict[str, list[Op]] = {}
        names: dict[str, tuple[str, str]] = {}  # pg_id -> (name, desc)
        # in each recorder's order (its record ids; NCCL's after the CPU one's, where both)
        entries = [e for d in dumps for e in sorted(d.get("entries", []), key=_record)]
        for e in entries:
            if e.get("is_p2p"):
                continue
            pg = str(e["pg_id"])
            name, desc = (list(e.get("process_group") or [pg, ""]) + [""])[:2]
            names[pg] = (str(name)[:MAX_TEXT], str(desc)[:MAX_TEXT])
            ops = by_group.setdefault(pg, [])
            op = _op(e)
            if ops and op.seq <= ops[-1].seq:  # the group re-formed in place: numbered afresh
                ops.clear()
            ops.append(op)
        found = {}
        for pg, ops in by_group.items():
            # the entries' numbers count this group's collectives since it (re)formed, the same
            # on every rank; the status's count messages too (gloo: a pipeline's, or exact
            # mode's ordered sum, differ by rank) and go on across a re-forming in place, so
            # from it only how many this rank has outstanding
            s = status.get(pg, {})
            enqueued = ops[-1].seq
            outstanding = int(s.get("last_enqueued_collective", enqueued)) - int(
                s.get("last_completed_collective", -1)
            )
            completed = enqueued - max(0, min(outstanding, enqueued + 1))
            name, desc = names[pg]
            found[name] = Progress(name, desc, enqueued, completed, tuple(ops[-KEPT:]))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return _kept(found)


def _record(e: dict) -> int:
    return int(e.get("record_id", 0))  # (our hook's entries have none: kept in their order)


def _op(e: dict) -> Op:
    op = str(e.get("profiling_name", "?")).split(":")[-1]
    shapes = json.dumps(e.get("input_sizes", []), separators=(", ", ""))
    dtypes = sorted(set(e.get("input_dtypes", [])))
    return Op(int(e["collective_seq_id"]), op[:MAX_TEXT], shapes[:MAX_TEXT], ",".join(dtypes)[:40])


def _kept(found: dict[str, Progress]) -> dict[str, Progress]:
    order = sorted(found.values(), key=lambda p: (p.waiting is None, p.group))
    return {p.group: p for p in order[:MAX_GROUPS]}


def judge(
    ranks: Mapping[int, Mapping[str, Progress] | None], nodes: Mapping[int, str] | None = None
) -> Verdict:
    """The verdict of the ranks' collectives (None: no dump from that rank): the first group's
    that decides (a desync before a rank behind), else the first group's with a collective
    outstanding, else that none is. A rank named alone is named with its node, where known."""
    nodes = nodes or {}
    unknown = tuple(sorted(r for r, p in ranks.items() if p is None))
    groups = sorted({g for p in ranks.values() if p for g in p})
    verdicts = []
    for g in groups:
        seen = {r: p[g] for r, p in ranks.items() if p and g in p}
        verdicts.append(_judge_group(seen, nodes))
    if not verdicts:
        return NONE
    order = ("desync", "never_arrived", "arrived", "idle")
    best = min(verdicts, key=lambda v: order.index(v.kind))
    tail = f"; no collectives from rank(s) {_list(unknown)}" if unknown else ""
    return Verdict(best.kind, best.culprits, best.seq, best.text + tail)


def _judge_group(seen: dict[int, Progress], nodes: Mapping[int, str]) -> Verdict:
    any_p = next(iter(seen.values()))
    where = "" if any_p.group == "0" else f" in group {any_p.desc or any_p.group}"
    top = max(p.enqueued for p in seen.values())
    if all(p.waiting is None for p in seen.values()):
        return Verdict(
            "idle", (), top, f"no rank waited in a collective{where} (the last was seq {top})"
        )
    desync = _desync(seen, where, nodes)
    if desync is not None:
        return desync
    behind = tuple(sorted(r for r, p in seen.items() if p.enqueued < top))
    waiting = sorted(r for r, p in seen.items() if p.enqueued == top and p.waiting)
    op = next((seen[r].waiting for r in waiting), None) or Op(top, "?", "?", "?")
    if not behind:
        text = (
            f"every rank seen arrived at seq {top}{where} ({op.label}) and waits: none is behind "
            f"(the network, or a rank not seen, holds it)"
        )
        return Verdict("arrived", (), top, text)
    named = "; ".join(_behind(r, seen[r], nodes.get(r)) for r in behind[:NAMED])
    more = f" and {len(behind) - NAMED} more" if len(behind) > NAMED else ""
    text = (
        f"{named}{more} never arrived at seq {top}{where} ({op.label}) "
        f"while {_count(len(waiting))} waited in it"
    )
    return Verdict("never_arrived", behind, top, text)


def _behind(rank: int, p: Progress, node: str | None) -> str:
    last = p.at(p.enqueued)
    what = f", {last.op}" if last else ""
    on = f"node {node}, " if node else ""
    return f"rank {rank} ({on}its last seq {p.enqueued}{what})"


def _desync(seen: dict[int, Progress], where: str, nodes: Mapping[int, str]) -> Verdict | None:
    """The earliest sequence number the ranks called different collectives at, said as such."""
    seqs = sorted({o.seq for p in seen.values() for o in p.ops})
    for seq in seqs:
        at = {r: op for r, p in seen.items() if (op := p.at(seq)) is not None}
        kinds: dict[tuple[str, str, str], list[int]] = {}
        for r, op in sorted(at.items()):
            kinds.setdefault(_fingerprint(op), []).append(r)
        if len(kinds) < 2:
            continue
        by_size = sorted(kinds.items(), key=lambda k: (-len(k[1]), k[1][0]))
        label = {k: at[rs[0]].label for k, rs in kinds.items()}
        if len(by_size[0][1]) == len(by_size[1][1]):  # no majority: each is said
            text = "; ".join(f"{_ranks(rs, nodes)} called {label[k]}" for k, rs in by_size)
            return Verdict("desync", (), seq, f"desync at seq {seq}{where}: {text}")
        (major, majority), odd = by_size[0], by_size[1:]
        said = "; ".join(f"{_ranks(rs, nodes)} called {label[k]}" for k, rs in odd[:NAMED])
        others = "the others" if len(majority) > 1 else "the other"
        text = (
            f"desync at seq {seq}{where}: {said} while {others} ({_ranks(majority)}) "
            f"called {label[major]}"
        )
        return Verdict("desync", tuple(r for _, rs in odd for r in rs), seq, text)
    return None


def _fingerprint(op: Op) -> tuple[str, str, str]:
    """What every rank's call of one collective agrees on: its op and dtype, and its shapes but
    where they may differ by rank (a root's gather or scatter, an all-to-all's uneven splits)."""
    uneven = op.op in ("gather", "scatter") or "all_to_all" in op.op or "alltoall" in op.op
    return (op.op, "" if uneven else op.shapes, op.dtype)


def _ranks(ranks: list[int] | tuple[int, ...], nodes: Mapping[int, str] | None = None) -> str:
    if len(ranks) == 1 and nodes and nodes.get(ranks[0]):
        return f"rank {ranks[0]} (node {nodes[ranks[0]]})"
    return f"rank{'s' if len(ranks) != 1 else ''} {_list(tuple(ranks))}"


def _count(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _list(ranks: tuple[int, ...]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


# --- a rank's progress as it travels between nodes (in culprit.summary's rows) ---


def compact(found: Mapping[str, Progress] | None) -> str:
    """A rank's groups as short JSON ("": no dump)."""
    if not found:
        return ""
    rows = [
        [p.group, p.desc, p.enqueued, p.completed, [list(_fields(o)) for o in p.ops]]
        for p in list(found.values())[:MAX_GROUPS]
    ]
    text = json.dumps(rows, separators=(",", ":"))
    return text if len(text) <= MAX_COMPACT else ""


def _fields(o: Op) -> tuple[int, str, str, str]:
    return (o.seq, o.op, o.shapes, o.dtype)


def parse_compact(text: str) -> dict[str, Progress] | None:
    """`compact`'s form read back (from another node: checked); None for "" or anything else."""
    if not text or len(text) > MAX_COMPACT:
        return None
    try:
        found = {}
        for group, desc, enqueued, completed, ops in json.loads(text)[:MAX_GROUPS]:
            kept = tuple(Op(int(s), str(o), str(sh), str(d)) for s, o, sh, d in ops[:KEPT])
            found[str(group)] = Progress(str(group), str(desc), int(enqueued), int(completed), kept)
    except (ValueError, TypeError):
        return None
    return found


def describe(text: str) -> str:
    """A rank's collectives in one line for people (`elasticd stacks`): "" where none came."""
    found = parse_compact(text)
    if not found:
        return ""
    parts = []
    for p in found.values():
        name = p.desc or p.group
        op = p.waiting
        if op is not None:
            parts.append(f"{name}: waits in seq {op.seq}, {op.label}; completed {p.completed}")
        else:
            parts.append(f"{name}: in no collective; the last was seq {p.enqueued}")
    return "collectives: " + " | ".join(parts)


# --- asking the workers (worker/flight.py) ---


def ask(dumps: list[Path]) -> dict[Path, tuple[int, int] | None]:
    """Ask each rank for its dump (its FIFO opened for writing without blocking: a rank not
    listening is skipped); the dumps asked for, each with its file's identity before."""
    asked = {}
    for path in dumps:
        before = _identity(path)
        try:  # ENXIO: nobody reads it (yet); ENOENT: never made; ELOOP: not ours
            fd = os.open(flight.ask_path(str(path)), os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, b"?")
                asked[path] = before
        except OSError:
            continue
        finally:
            os.close(fd)
    return asked


def collect(asked: dict[Path, tuple[int, int] | None], wait: float) -> dict[Path, str]:
    """The dumps written since they were asked for, waiting at most `wait` seconds for all."""
    deadline = time.monotonic() + wait
    found: dict[Path, str] = {}
    while True:
        for path, before in asked.items():
            if path not in found and (now := _identity(path)) is not None and now != before:
                try:
                    found[path] = safeio.read_regular(path, MAX_DUMP).decode(errors="replace")
                except (OSError, ValueError):
                    continue
        if len(found) == len(asked) or time.monotonic() >= deadline:
            return found
        time.sleep(0.02)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns)
