"""In-place recovery on the worker's side: whether this torch can re-form a process group in
place (`support`: `init_process_group(enable_reconfigure=True)`, `dist._get_reconfigure_handle`,
`dist._reconfigure`, from torch 2.14; `backend_support`: gloo, NCCL where torch's
ProcessGroupNCCL has `reconfigure`), and the group's membership in this process (`Member`):
formed at init, re-formed at each generation the daemon announces in the workers' store (a
survivor aborts its connections of the failed generation first, so that a peer blocked on it
fails and unwinds too).

Feature-detected, never version-compared: the API is experimental, a build may lack it or
change it, and what matters is what this interpreter's torch has. Each answer carries a reason,
which the daemon's start line (daemon/inplace.py) and a worker's fallback line show.

The protocol, on the round's workers' store (MASTER_ADDR:MASTER_PORT; keys: names.in_place_key):
every rank of generation G sets its reconfigure handle under g<G>/h<rank>, waits for all of them,
and calls `dist._reconfigure` with them in rank order and a uuid of the run, round and G. G is 0
at an attempt's start (the bootstrap's init_process_group, `init`), the daemon's number for a
spare that replaces a failed rank (names.IN_PLACE_GEN), and for a survivor whose script unwound
from a failed collective the next G the daemon sets with the ranks that start for it (`reenter`,
called by the bootstrap): a starting rank's handle may take a process start
(init_process_group's timeout), a running rank's comes within REFORM_TIMEOUT. A
handle is a way into the group: every value is signed with the job's state key (names.STATE_KEY,
HMAC-SHA256 bound to the generation and rank: `sign`), and one that does not verify ends the
re-forming; the rank then falls back to the whole-group restart, as for every other doubt.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import hmac
import inspect
import multiprocessing
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import structlog

from elasticd import names, peer_errors
from elasticd.worker import collective_hook, heartbeat

log = structlog.get_logger("elasticd.in_place")

# seconds for the handles of the ranks already running to arrive, and for the reconfigure; a
# rank whose process starts for the generation has init_process_group's timeout (Member)
REFORM_TIMEOUT = 10.0
GENERATION_WAIT = 15.0  # seconds a survivor waits for the daemon to announce the next generation
THREADS_WAIT = 2.0  # seconds a survivor waits for the script's own threads to end before re-entry

NEEDED = ("_reconfigure", "_get_reconfigure_handle")  # torch.distributed's private API


@dataclass(frozen=True)
class Support:
    """An answer: whether in-place re-forming is there, and why (one line for people)."""

    ok: bool
    why: str


def support(dist=None) -> Support:
    """Whether `dist` (torch.distributed, imported here when not given) can re-form a group in
    place."""
    import torch

    if dist is None:
        import torch.distributed as dist
    version = torch.__version__
    if not dist.is_available():
        return Support(False, f"torch {version} was built without torch.distributed")
    missing = [name for name in NEEDED if not hasattr(dist, name)]
    try:
        takes = "enable_reconfigure" in inspect.signature(dist.init_process_group).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        missing.append("init_process_group(enable_reconfigure=...)")
    if missing:
        return Support(
            False,
            f"torch {version} lacks {', '.join(missing)} (in-place recovery needs torch>=2.14)",
        )
    return Support(True, f"torch {version} has dist._reconfigure")


def backend_support(backend: str, dist=None) -> Support:
    """Whether a group of `backend` (as init_process_group names it: gloo, nccl, or a
    device:backend list such as "cpu:gloo,cuda:nccl") can be re-formed in place."""
    base = support(dist)
    if not base.ok:
        return base
    if dist is None:
        import torch.distributed as dist
    names = [part.split(":")[-1].strip().lower() for part in backend.split(",") if part.strip()]
    for name in names or ["gloo"]:
        if name == "gloo":
            continue
        if name == "nccl":
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None or not hasattr(nccl, "reconfigure"):
                return Support(False, "this torch's NCCL group has no reconfigure")
            continue
        return Support(False, f"backend {name} has no reconfigure in elasticd (gloo, nccl do)")
    return Support(True, f"{base.why}; backend {backend or 'gloo'} re-forms in place")


# --- the membership of this process -------------------------------------------------------------


class Refused(Exception):
    """The group cannot re-form in place here; the message is the fallback line's reason."""


class Regroup(Exception):
    """Raised on every rank at one step boundary (the checkpoint library's agreement) where the
    daemon asked the group to re-form as a larger one (a node joins: daemon/grow.py): the script
    unwinds to the bootstrap, which re-forms the group and runs it again, no step lost."""


def regroup_asked() -> bool:
    """Whether the daemon asked this rank to re-form at its next step boundary as a generation
    past the one its group stands at (heartbeat.regroup_asked); False off the in-place path."""
    found = member()
    if found is None:
        return False
    return heartbeat.regroup_asked(os.environ.get(names.HEARTBEAT_FILE)) > found.generation


def _key() -> bytes:
    try:
        return bytes.fromhex(os.environ.get(names.STATE_KEY, ""))
    except ValueError:
        return b""


def sign(key: bytes, generation: int, rank: int, text: str) -> bytes:
    """`text` (a handle, rank -1: the daemon's generation) as stored: its MAC in hex, a space,
    the text."""
    tag = hmac.new(key, f"elasticd/in-place/1\0{generation}\0{rank}\0{text}".encode(), "sha256")
    return f"{tag.hexdigest()} {text}".encode()


def opened(key: bytes, generation: int, rank: int, value: bytes) -> str | None:
    """The text of a value `sign` made for this generation and rank; None if it does not
    verify."""
    try:
        _, text = value.decode().split(" ", 1)
    except (UnicodeDecodeError, ValueError):
        return None
    return text if hmac.compare_digest(sign(key, generation, rank, text), value) else None


def uuid_of(generation: int) -> int:
    """A communicator's uuid, fresh for every (run, round, generation), the same on every rank."""
    run, rnd = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get(names.ROUND_NUMBER, "")
    digest = hashlib.blake2b(f"{run}/{rnd}/{generation}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


@dataclass
class Member:
    """This rank in a group made to re-form in place."""

    dist: object  # torch.distributed
    store: object  # a client of the workers' store
    rank: int
    world: int
    start_timeout: float  # seconds a rank's process may take to start: init_process_group's
    generation: int = -1
    marks: dict[str, float] = field(default_factory=dict)  # the latest form's: wall times
    # fd -> inode: the connected sockets the latest reconfigure made (gloo's pairs; `abort`)
    pairs: dict[int, int] = field(default_factory=dict)
    restarts: int | None = None  # the job's restart count the latest generation announced

    def form(self, generation: int, starting: frozenset[int] | None = None) -> float:
        """Re-form the group as generation `generation`: seconds it took. `starting`: the ranks
        whose processes start for it (all of them where None: this rank is one), whose handles
        may take a process start (`start_timeout`); the others' come within REFORM_TIMEOUT."""
        dist, store, key = self.dist, self.store, _key()
        t0 = time.monotonic()
        self.marks = {}
        store.set(
            names.in_place_key(generation, self.rank),
            sign(key, generation, self.rank, dist._get_reconfigure_handle()),
        )
        keys = [names.in_place_key(generation, r) for r in range(self.world)]
        new = set(range(self.world)) if starting is None else starting
        for ranks, seconds in (
            ([r for r in range(self.world) if r not in new], REFORM_TIMEOUT),
            (sorted(new), self.start_timeout),
        ):
            try:
                store.wait([keys[r] for r in ranks], timedelta(seconds=seconds))
            except Exception as e:
                raise Refused(self._missing(generation, keys, ranks, seconds)) from e
        self.marks["handles"] = time.time()
        handles = []
        for r, k in enumerate(keys):
            handle = opened(key, generation, r, store.get(k))
            if handle is None:
                raise Refused(f"rank {r}'s handle for generation {generation} does not verify")
            handles.append(handle)
        before = _sockets()
        try:
            dist._reconfigure(
                uuid=uuid_of(generation), handles=handles, timeout=timedelta(seconds=REFORM_TIMEOUT)
            ).wait()
        except Exception as e:
            raise Refused(f"reconfigure of generation {generation} failed: {e}") from e
        self.pairs = {fd: ino for fd, ino in _sockets().items() if before.get(fd) != ino}
        _publish(generation, self.pairs)
        self.marks["reformed"] = time.time()
        self.generation = generation
        if generation > 0:
            fresh_subgroups(dist, generation)
            collective_hook.reset()
        return time.monotonic() - t0

    def _missing(self, generation: int, keys: list[str], ranks: list[int], seconds: float) -> str:
        """Who gave no handle in time: a rank whose script caught the collective's error and
        went on never comes to re-form."""
        try:
            missing = [r for r in ranks if not self.store.check([keys[r]])]
        except Exception:  # noqa: BLE001 - the store itself is gone
            return f"the workers' store went away while generation {generation} formed"
        return (
            f"rank(s) {', '.join(map(str, missing))} gave no handle for generation {generation} "
            f"in {seconds:g} s (dead, or a script that caught the collective's error)"
        )

    def abort(self) -> None:
        """Close this rank's connections of the failed generation: a survivor still blocked in a
        collective on this rank (not on the dead one) then fails too, and unwinds, instead of
        waiting out gloo's timeout while this rank waits for its handle. The group re-forms
        after an abort (torch's recovery-after-abort case).

        The group's abort alone does not reach the peers (gloo, torch 2.14.1: a survivor two
        hops from the dead rank in the ring, rank 1 of 4 when rank 3 died, stayed blocked in
        every multi-node trial, the rare stuck survivor of one node too): the sockets the last
        reconfigure made are shut down first, so each peer's pending receive sees its
        connection closed at once. Then the default group and the groups made on it abort."""
        _shut(self.pairs)
        c10d = self.dist.distributed_c10d
        default = c10d._get_default_group()
        for group in [default, *subgroups(self.dist)]:
            try:
                group.abort()
            except Exception as e:  # noqa: BLE001 - a group that cannot abort re-forms or times out
                log.warning("in_place_abort_failed", error=str(e), rank=self.rank)

    def announced(self, deadline: float) -> tuple[int, frozenset[int]] | None:
        """The next generation and the ranks that start for it, once the daemon has set them
        (signed: "G R,R... C", C the job's restart count with this recovery; a smaller world
        adds its size and the ranks' new numbers) before `deadline`."""
        gen = self.generation + 1
        key = names.in_place_key(gen)
        try:
            self.store.wait([key], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            text = opened(_key(), gen, -1, self.store.get(key))
            fields = text.split(" ") if text else []
            if len(fields) not in (3, 5) or fields[0] != str(gen):
                return None
            self.restarts = int(fields[2])
            if len(fields) == 5:  # a smaller world: this rank's new number in it
                mapping = dict(tuple(map(int, p.split(":"))) for p in fields[4].split(",") if p)
                self.renumber(mapping[self.rank], int(fields[3]))
            return gen, frozenset(int(r) for r in fields[1].split(",") if r)
        except Exception:  # noqa: BLE001 - a timeout, the store gone with the daemon, a bad value
            return None

    def renumber(self, rank: int, world: int) -> None:
        """This rank's number and the world after a node was lost: the script, run again, reads
        them where torchrun puts them (the group node's own numbers stay: GROUP_RANK is the
        daemon's to say at the next round)."""
        log.info("in_place_renumbered", rank=self.rank, new_rank=rank, world=world)
        self.rank, self.world = rank, world
        os.environ.update(
            RANK=str(rank), ROLE_RANK=str(rank), WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world)
        )


def _sockets() -> dict[int, int]:
    """This process's sockets: fd -> inode (/proc/self/fd)."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    found[int(name)] = int(target[8:-1])
    return found


def _publish(generation: int, pairs: dict[int, int]) -> None:
    """Say which sockets are this generation's (names.pairs_file), so that the daemon can shut
    them down from outside when the next generation is announced (daemon/outside_abort.py): a
    survivor blocked on a peer that went silent without closing its connection (a partition)
    then fails and unwinds, instead of being killed as stuck."""
    beat_file = os.environ.get(names.HEARTBEAT_FILE)
    if not beat_file:
        return
    path = names.pairs_file(beat_file)
    text = " ".join([str(generation), *(f"{fd}:{ino}" for fd, ino in sorted(pairs.items()))])
    with contextlib.suppress(OSError):
        with open(f"{path}.tmp", "w") as f:
            f.write(text + "\n")
        os.replace(f"{path}.tmp", path)


def _shut(pairs: dict[int, int]) -> None:
    """Shut down the connected sockets of `pairs` still open as the same socket (an fd closed
    and reused since is left alone); a listening one has no peer and is kept."""
    now = _sockets()
    for fd, inode in pairs.items():
        if now.get(fd) != inode:
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.getpeername()
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()  # the duplicate only


# new_group's names (and so its store keys) count up from the default group's; a generation
# starts its count here, the same on a survivor and its replacement, fresh in the store
GROUPS_PER_GENERATION = 1_000_000


def subgroups(dist) -> list:
    """This process's groups other than the default one (new_group's, init_device_mesh's)."""
    c10d = dist.distributed_c10d
    return [g for g in list(c10d._world.pg_map) if g is not c10d.GroupMember.WORLD]


def fresh_subgroups(dist, generation: int) -> None:
    """After the default group re-formed as `generation`: drop the groups made on the failed
    generation (a dead rank was in them, and torch 2.14 re-forms only a group made with
    enable_reconfigure, which new_group cannot ask for), and start new_group's count where
    every rank of `generation` starts it. The script, entered again, makes its groups again on
    the re-formed default group (init_device_mesh, new_group, the checkpoint writer's), in the
    same order on a survivor and on its replacement, so they agree on names and store keys
    (torch resets the count so itself when its default group is destroyed)."""
    c10d = dist.distributed_c10d
    for group in subgroups(dist):
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001 - dropped from torch's maps all the same below
            log.warning("in_place_subgroup_destroy_failed", error=str(e))
            for table in (c10d._world.pg_map, c10d._world.pg_names, c10d._world.pg_group_ranks):
                table.pop(group, None)
    c10d._world.group_count = 1 + generation * GROUPS_PER_GENERATION


_member: Member | None = None


def member() -> Member | None:
    """This process's membership, once its group formed in place (and while it stands)."""
    return _member if _member is not None and _member.dist.is_initialized() else None


def _fallback(why: str) -> None:
    log.warning(
        "in_place_fallback",
        why=why,
        rank=os.environ.get("RANK"),
        run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
    )


def _backend(dist, args, kwargs) -> str:
    backend = kwargs.get("backend", args[0] if args else None)
    if backend is None:
        import torch

        return "cuda:nccl" if torch.cuda.is_available() else "gloo"
    return str(backend)


def init(init_process_group, dist, args, kwargs):
    """The bootstrap's init_process_group: on the in-place path (names.IN_PLACE_GEN set) a gloo
    group is made in the reconfigure regime and formed at the generation given; a group that
    already stands (a survivor's script entered again) is returned as it is."""
    global _member
    if member() is not None:
        return None  # re-entry: the group re-formed before the script ran again
    gen = os.environ.get(names.IN_PLACE_GEN)
    if gen is None:
        return init_process_group(*args, **kwargs)
    backend = _backend(dist, args, kwargs)
    found = backend_support(backend, dist)
    why = None if found.ok else found.why
    if why is None and backend != "gloo":
        why = f"in-place recovery of a {backend} group is not built yet (gloo only)"
    if why is None and kwargs.get("init_method") not in (None, "env://"):
        why = "init_method other than env:// (the workers' store is elasticd's)"
    if why is not None:
        _fallback(why)
        return init_process_group(*args, **kwargs)
    at = {"init": time.time()}
    result = init_process_group(*args, **{**kwargs, "enable_reconfigure": True})
    at["initialized"] = time.time()
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=REFORM_TIMEOUT),
    )
    timeout = kwargs.get("timeout") or dist.default_pg_timeout
    joining = Member(dist, store, dist.get_rank(), dist.get_world_size(), timeout.total_seconds())
    joining.form(int(gen))  # Refused: the script fails here, and this rank falls back
    _member = joining
    if int(gen) > 0:  # a replacement, joined late
        log.info(
            "joined_in_place",
            generation=int(gen),
            rank=joining.rank,
            **timeline({**at, **joining.marks}),
        )
    return result


def timeline(at: dict[str, float]) -> dict[str, object]:
    """A re-forming's phases for its log line: the first one's wall time (`at`, to line up
    with the daemon's and the other ranks'), the others' seconds after it (bench/recovery.py
    reads them)."""
    start = min(at.values())
    return {"at": round(start, 4), "phases": {k: round(v - start, 4) for k, v in at.items()}}


def _stray_threads() -> list[str]:
    """The script's own threads that still run (not daemon threads), after waiting a moment."""
    deadline = time.monotonic() + THREADS_WAIT
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    alive = threading.enumerate()
    return [t.name for t in alive if t is not threading.main_thread() and not t.daemon]


def from_elsewhere(exc: BaseException) -> bool:
    """Whether the script unwound from a fault elsewhere, which re-entry answers: its collective
    failed of a peer's going (peer_errors.py's texts, a consequence to the daemon too: a connection
    closed or reset, gloo's or NCCL's), or the daemon has already announced the next generation.
    Anything else is the script's own error (a bug, bad data, a check of its own): the rank exits
    with it as under torchrun, so that the daemon sees it and its restart judges it (the replay,
    the repeat rule), rather than the rank waiting for a generation nobody will announce.

    Only a collective's errors count (torch's are RuntimeErrors: gloo's, NCCL's, the Dist*Error
    family): an OSError in the chain is a Python socket's, which says nothing of a peer rank.
    torch's DataLoader raises its "worker ... is killed by signal" while handling the
    ConnectionResetError of multiprocessing's resource sharer (the batch's fd, from the dead
    worker): taken for a peer's going, the rank waited for a generation nobody announced, its
    abort closed the others' connections, and the daemon named another rank hung."""
    texts, seen, e = [], set(), exc
    while e is not None and id(e) not in seen:
        if isinstance(e, Regroup):
            return True
        seen.add(id(e))
        if not isinstance(e, OSError):
            texts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    if peer_errors.consequence("\n".join(texts)):
        return True
    found = member()
    if found is None:
        return True  # `reenter` says why it cannot
    with contextlib.suppress(Exception):
        return bool(found.store.check([names.in_place_key(found.generation + 1)]))
    return False


def reenter(exc: BaseException) -> str | None:
    """After the script unwound with `exc`: wait for the daemon's next generation, make sure
    this process can vouch for itself, and re-form the group. None when the script may run
    again; else the reason it may not (the caller ends the process as today)."""
    found = member()
    if found is None:
        return "not on the in-place path" if _member is None else "the group was destroyed"
    at = {"unwound": time.time()}
    found.abort()
    at["aborted"] = time.time()
    with contextlib.suppress(Exception):  # the daemons' evidence that a silent node is gone
        found.store.add(names.in_place_waiting_key(found.generation + 1), 1)
    announced = found.announced(time.monotonic() + GENERATION_WAIT)
    if announced is None:
        _fallback(f"no generation announced in {GENERATION_WAIT:g} s after: {exc}")
        return "no new generation"
    at["announced"] = time.time()
    with contextlib.suppress(Exception):  # only spares this rank the daemon's kill (unstick)
        found.store.set(names.in_place_unwound_key(announced[0], found.rank), b"1")
    # the unwound script's frames hold its model, loaders and managers: let them go
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    at["collected"] = time.time()
    why = None
    if threads := _stray_threads():
        why = f"the script's threads still run: {', '.join(threads)}"
    elif children := multiprocessing.active_children():
        why = f"child processes still run (DataLoader workers?): {len(children)}"
    if why is None:
        try:
            seconds = found.form(*announced)
        except Refused as e:
            why = str(e)
        else:
            # the script, run again, sees its generation as a replacement of it does (a fault a
            # script arms for its first process only, `== "0"`, stays disarmed)
            os.environ[names.IN_PLACE_GEN] = str(announced[0])
            # as its replacement sees it: each recovery in place spends one of the budget, as
            # a restart does (a script's `if restart_count > 0: resume` holds on both paths)
            os.environ["TORCHELASTIC_RESTART_COUNT"] = str(found.restarts)
            log.info(
                "re_entered",
                generation=announced[0],
                reform_s=round(seconds, 4),
                rank=found.rank,
                # what the script, run again, will read: the re-formed group's and torchrun's
                torch_rank=found.dist.get_rank(),
                env_rank=os.environ.get("RANK"),
                **timeline({**at, **found.marks}),
            )
            return None
    _fallback(why)
    return why
