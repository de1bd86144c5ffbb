"""The forms of the values the daemons write to the store: one parser each, which returns None
for whatever is not of its form (the caller then treats the value as garbage: never a decision,
never a crash). Pure and torch-free: a value has already been opened (signing.py) when a parser
sees its text, and a parser may raise ValueError, UnicodeDecodeError or RecursionError (json),
which the caller counts as "not of its form" too. Parsers: the run, a round number, the
members, an arrival record, a restart reason, the budget, the worker store's address, the job's
end, and the protocol's smaller values.
"""

from __future__ import annotations

import json
import math

from elasticd.cluster import signing
from elasticd.cluster.rounds import Member

MAX_REASON = 8 * 1024  # bytes of a restart reason's JSON
MAX_COUNT = 1 << 62


def run(text: str) -> str | None:
    """The run's record: its nonce (16 hex digits) and when it began."""
    nonce, _, created = text.partition(" ")
    return nonce if _nonce(nonce) and when(created) else None


MAX_CHALLENGES = 64  # nonces the hello key keeps (and the host's beat echoes)


def _nonce(text: str) -> bool:
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


def challenges(text: str) -> list[str] | None:
    """The challenges of the nodes that would follow the run: nonces, the newest last."""
    found = text.split(" ") if text else []
    return found if len(found) <= MAX_CHALLENGES and all(map(_nonce, found)) else None


def host_beat(text: str) -> tuple[int, list[str]] | None:
    """The store's host's beat in its run: a counter, and the challenges it read there."""
    number, _, rest = text.partition(" ")
    n, found = count(number), challenges(rest)
    return (n, found) if n is not None and found is not None else None


def when(text: str) -> float | None:
    """A wall-clock time in seconds."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value < 1e11 else None  # finite, after 1970, before year 5000


def closed(text: str) -> tuple[float, str] | None:
    """The job's end: when it was issued, and why."""
    issued, _, why = text.partition(" ")
    at = when(issued)
    return (at, why) if at is not None and len(why) <= MAX_REASON else None


def count(text: str) -> int | None:
    return (
        int(text)
        if text.isascii() and text.isdigit() and len(text) < 20 and int(text) < MAX_COUNT
        else None
    )


def budget(text: str) -> tuple[int, int] | None:
    """The job's restart budget: restarts used, and the round that last spent one."""
    used, _, number = text.partition(" ")
    a, b = count(used), count(number)
    return (a, b) if a is not None and b is not None else None


def done(text: str) -> bool | None:
    return True if text == "1" else None


def safe_name(text: object, limit: int = 255) -> bool:
    return (
        isinstance(text, str)
        and 0 < len(text) <= limit
        and all(c.isalnum() or c in ".-:_%" for c in text)
    )


def master(text: str) -> tuple[str, int, tuple[int, int] | None] | None:
    """The round's worker store: address and port, and where group rank 0 goes on hosting the
    store of a group carried into the round in place (daemon/grow.py), that group's round and
    generation."""
    fields = text.split(" ")
    if len(fields) not in (2, 4):
        return None
    addr, port, *carried = fields
    n = count(port)
    if n is None or not 0 < n < 65536 or not safe_name(addr):
        return None
    group = tuple(count(v) for v in carried)
    if None in group:
        return None
    return addr, n, group or None


def record(text: str) -> dict | None:
    """A node's arrival record: id, nproc, addr, its group rank in the previous round, the
    port its daemon's links listen on (links.py; 0 or absent: none), the group its workers
    carry into the round in place (daemon/grow.py; absent: none), and whether its ranks can only
    start afresh ("fresh": true; absent: they can start into a group in place)."""
    if len(text) > 1024:
        return None
    r = json.loads(text)
    if not isinstance(r, dict) or not safe_name(r.get("id"), 128) or not safe_name(r.get("addr")):
        return None
    nproc, prev = r.get("nproc"), r.get("prev")
    link = r.setdefault("link", 0)
    if "carries" in r and not _carries(r["carries"]):
        return None
    if type(r.get("fresh", False)) is not bool:
        return None
    if (
        type(nproc) is not int
        or not 1 <= nproc <= 1 << 20
        or type(prev) is not int
        or not -1 <= prev < 1 << 20
        or type(link) is not int
        or not 0 <= link < 65536
    ):
        return None
    return r


def _carries(value: object) -> bool:
    """(round, generation) of a group carried into a round in place (daemon/grow.py)."""
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(type(v) is int and 0 <= v <= MAX_COUNT for v in value)
    )


def _member(m: object) -> Member | None:
    if (
        isinstance(m, list)
        and len(m) in (3, 4, 5, 6)
        and safe_name(m[0], 128)
        and type(m[1]) is int
        and 1 <= m[1] <= 1 << 20
        and safe_name(m[2])
        and (len(m) == 3 or (type(m[3]) is int and 0 <= m[3] < 65536))
        and (len(m) < 5 or _carries(m[4]) or (len(m) == 6 and m[4] is None))
        and (len(m) < 6 or m[5] is True)
    ):
        carries = tuple(m[4]) if len(m) >= 5 and m[4] is not None else None
        return Member(*m[:4], carries=carries, fresh=len(m) == 6)
    return None


def members(text: str) -> dict | None:
    """A closed round: its members in group-rank order, the nodes found lost, and the budget's
    verdict ("failed": why the job cannot go on), as the closer wrote them."""
    if len(text) > signing.MAX_VALUE:
        return None
    value = json.loads(text)
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("members"), list)
        or not value["members"]
    ):
        return None
    found = [_member(m) for m in value["members"]]
    if None in found:
        return None
    lost = value.get("lost", [])
    if not isinstance(lost, list) or not all(safe_name(x, 128) for x in lost):
        return None
    if len({m.node_id for m in found}) != len(found):
        return None
    failed, sig, repeats = value.get("failed"), value.get("sig", ""), value.get("repeats", 0)
    if failed is not None and not isinstance(failed, str):
        return None
    if not (isinstance(sig, str) and type(repeats) is int and 0 <= repeats <= MAX_COUNT):
        return None
    deterministic = value.get("deterministic", False)
    if not isinstance(deterministic, bool):
        return None
    # the repeat rule's record (lifecycle/triage.py): the failure this closing followed, and how
    # many consecutive attempts ended in it
    return {
        "members": found,
        "lost": lost,
        "failed": failed,
        "sig": sig,
        "repeats": repeats,
        "deterministic": deterministic,
    }


def _first_fields(value: dict) -> bool:
    """A failure's time, rank and whether it is a consequence (triage.comes_first), if given."""
    at, rank = value.get("at", 0.0), value.get("rank")
    if not (isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at)):
        return False
    if not (rank is None or (isinstance(rank, int) and not isinstance(rank, bool))):
        return False
    return isinstance(value.get("consequence", False), bool)


# a replay's verdict as a restart request carries it (daemon/replay_verdict.py)
REPLAYED = ("", "reproduced", "transient", "hardware")


def _bundle_path(path: object) -> bool:
    """Where a failed rank's bundle is copied for another node's replay: an absolute path."""
    return isinstance(path, str) and path.startswith("/") and 0 < len(path) <= 4096


def replay_ask(text: str) -> dict | None:
    """Where a failed node copied its rank's bundle for another node's replay: the path and the
    file's SHA-256 (hex); or, where it could not, why ("none")."""
    if len(text) > 8192:
        return None
    value = json.loads(text)
    if isinstance(value, dict) and isinstance(value.get("none"), str):
        return value
    if not isinstance(value, dict) or not _bundle_path(value.get("path")):
        return None
    sha = value.get("sha256")
    ok = isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)
    return value if ok else None


def replay_answer(text: str) -> dict | None:
    """Another node's replay of a failed rank's bundle (daemon/replay_elsewhere.py): the node
    that ran it, `elasticd replay`'s exit code (0 reproduced, 1 not, 2 refused, 3 undecided) and
    its line."""
    if len(text) > 2048:
        return None
    value = json.loads(text)
    if not isinstance(value, dict) or not safe_name(value.get("node"), 255):
        return None
    code, said = value.get("code"), value.get("said")
    if type(code) is not int or not 0 <= code <= 3 or not isinstance(said, str):
        return None
    return value


def refereed(text: str) -> dict | None:
    """The referee's verdict on two replicas of two nodes (daemon/replay_elsewhere.py): the odd
    rank (None: undecided), its words, the replays that ran warm."""
    if len(text) > 2048:
        return None
    value = json.loads(text)
    if not isinstance(value, dict) or value.get("odd") not in (None, 0, 1):
        return None
    said, warm = value.get("said"), value.get("warm")
    if type(value.get("odd")) is bool or not isinstance(said, str) or warm not in (0, 1, 2):
        return None
    return value if type(warm) is int else None


def reason(text: str) -> dict | None:
    """A restart request: summary, node, whether it spends the budget or scales, the lost and the
    waiting nodes it names."""
    if len(text) > MAX_REASON:
        return None
    value = json.loads(text)
    if not isinstance(value, dict) or not isinstance(value.get("summary"), str):
        return None
    if not all(isinstance(value.get(k, ""), str) for k in ("node", "class", "sig")) or not all(
        isinstance(value.get(k, False), bool) for k in ("scale", "spends")
    ):
        return None
    if not _first_fields(value) or value.get("replayed", "") not in REPLAYED:
        return None
    if "replay_on" in value and not safe_name(value["replay_on"], 128):
        return None  # the node that replays the failed step too (daemon/replay_elsewhere.py)
    for name in ("lost", "waiting"):
        ids = value.get(name, [])
        if (
            not isinstance(ids, list)
            or len(ids) > 1 << 16
            or not all(safe_name(x, 128) for x in ids)
        ):
            return None
    return value
