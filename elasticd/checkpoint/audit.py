"""The replicas' audit against silent data corruption: under DDP every rank holds the same bits of
the parameters and the optimizer state after each optimizer step, so a digest of those bits,
compared across the ranks, finds a rank whose state a fault changed (a flipped bit in memory or
a miscomputed update) without re-running anything.

It runs inside the calls a script already makes: before CheckpointManager keeps a state (an
in-memory refresh or a disk checkpoint), the state is audited, and it is kept only when every
replica agrees. So every state kept is certified: a resume, from memory or disk, never takes a
state the audit has not passed. Its cost is part of the refresh's, which the in-memory cadence
keeps under its budget of step time (memory.cadence), so it needs no setting of its own
(`CheckpointManager(audit=False)` turns it off).

The digest (`digest`) reads the raw bits: each tensor viewed as 64-bit integers (or integers of
its element's size, where its bytes do not divide by 8) and summed with wrap-around (integer sums
are exact and associative, so identical bits give an identical digest on any device and in any
reduction order; one flipped bit always changes the sum, by 2^k mod 2^64), and the sums hashed
with BLAKE2b. The verdict (`verdict`) is pure: with three
replicas or more a strict majority names the odd ones out; with two, or no majority, it is
undecided between them (with two, each rank leaves a bundle of the step for the daemon's referee
to replay, checkpoint/bundle.py `on_sdc`, daemon/referee.py). A disagreement ends every rank
with `names.SDC_EXIT`
(`SilentDataCorruption`), which the daemon restarts from the newest certified state and judges
(a rank blamed again quarantines its node, daemon/sdc.py); its verdict goes to the daemon as
heartbeat figures (sdc_*), the library's numbers, and as the rank's error file, the text people
read.

A sharded (FSDP2) state has no replica in the same step, so it is audited in time instead of
across ranks (`Auditor.arm`, `Auditor.verify`): each rank digests its own shards at a boundary
and again when the optimizer's next step begins (a step pre-hook); between
the two the parameters and optimizer state are only read (forward, backward), so a difference is
a change at rest, and the rank that saw it is named, no majority needed. The windows have a
cadence of their own (every step where two digests of a rank's shards cost at most
WINDOW_BUDGET of a step, the rest of the 1% the refresh's 0.75% leaves), agreed on the same
all-reduce; a flip in a window left out is trained into the state unseen.

What it does not see: a fault in a step's computation that the gradients' all-reduce spread to
every replica alike (all replicas then agree on wrong bits), or, sharded, one in the optimizer's
update itself; both need the step replayed elsewhere.
"""

from __future__ import annotations

import contextvars
import ctypes
import dataclasses
import hashlib
import math
import statistics
import time
from collections import deque
from typing import Any

import structlog
import torch
import torch.distributed as dist

from elasticd import names
from elasticd.checkpoint.collectives import cpu_group, dist_on, rank, world
from elasticd.worker import bootstrap, heartbeat

log = structlog.get_logger()

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# a sharded audit's share of step time: with the refresh's 0.75% (memory.cadence), the 1% a job
# may pay elasticd
WINDOW_BUDGET = 0.0025


@dataclasses.dataclass
class Seen:
    """What capture() saw of the live training objects while an audit was wanted (SEEN)."""

    model: Any = None  # the unwrapped module
    optimizer: Any = None
    sharded: bool = False


SEEN: contextvars.ContextVar[Seen | None] = contextvars.ContextVar("elasticd_audit", default=None)


class SilentDataCorruption(SystemExit):
    """The replicas disagreed: every rank ends with names.SDC_EXIT (a SystemExit, so that no
    `except Exception` of the script keeps training on a state that is not certified)."""

    def __init__(self, message: str) -> None:
        super().__init__(names.SDC_EXIT)
        self.message = message

    def __str__(self) -> str:
        return self.message


def tensors(model: Any, optimizer: Any) -> list[torch.Tensor]:
    """The replicated state: the model's parameters (not its buffers: BatchNorm's running
    statistics are each rank's own until DDP broadcasts them at the next forward) and the
    optimizer's state, in parameter order; of a DTensor, this rank's own shard (a view)."""
    params = list(model.parameters()) if model is not None else []
    out = list(params)
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                for _, t in sorted(optimizer.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                    if isinstance(t, torch.Tensor):
                        out.append(t)
    return [t.to_local() if hasattr(t, "to_local") else t for t in out]


def owned(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What `optimizer` updates (its parameters, each rank's own shards, and their state): the
    state a sharded audit in time digests. A parameter another optimizer updates is not in it,
    so its step is never taken for a change at rest."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return local + tensors(None, optimizer)


def digest(ts: list[torch.Tensor]) -> int:
    """A 63-bit digest of the tensors' raw bits, the same for the same bits (see the module's
    docstring)."""
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for t in ts:
        if t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)  # a view where it can be: no copy of a contiguous tensor
        if flat.is_contiguous() and flat.nbytes % 8 == 0:
            ints = flat.view(torch.int64)  # 8 bytes at a time: several times an int32 view's speed
        elif flat.element_size() in _INTS:
            ints = flat.view(_INTS[flat.element_size()])
        else:
            ints = flat.contiguous().view(torch.uint8)
        sums.setdefault(t.device, []).append(ints.sum(dtype=torch.int64))
    h = hashlib.blake2b(digest_size=8)
    for device in sorted(sums, key=str):
        stacked = torch.stack(sums[device]).cpu()
        h.update(ctypes.string_at(stacked.data_ptr(), stacked.nbytes))
    return int.from_bytes(h.digest(), "little") >> 1


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the gathered digests say: `odd`, the ranks a strict majority outvoted (empty when
    undecided); `suspects`, every rank outside the majority (all ranks when undecided)."""

    agreed: bool
    odd: tuple[int, ...] = ()
    suspects: tuple[int, ...] = ()

    @property
    def undecided(self) -> bool:
        return not self.agreed and not self.odd


def verdict(digests: list[int]) -> Verdict:
    """Pure: the verdict on each rank's digest (index: rank)."""
    groups: dict[int, list[int]] = {}
    for r, d in enumerate(digests):
        groups.setdefault(d, []).append(r)
    if len(groups) <= 1:
        return Verdict(True)
    largest = max(groups.values(), key=len)
    if 2 * len(largest) > len(digests):
        odd = tuple(r for r in range(len(digests)) if r not in largest)
        return Verdict(False, odd, odd)
    return Verdict(False, (), tuple(range(len(digests))))


class Auditor:
    """One CheckpointManager's audits, before a state is kept. In band where it can be: from the
    second keep on, the live model and optimizer are known, so the digest of a step where a keep
    is due rides on the small all-reduce the manager makes at every boundary anyway (`ballot`,
    `tally`: its MAX of [d, -d] is the largest and the smallest digest), at no extra collective;
    a disagreement then gathers every rank's digest to name the odd one out. Otherwise (the first
    keep, a keep that was not foreseen) `check` gathers the digests at the keep. A sharded
    model is audited in time (the module's docstring): its verdict, whether any rank's shards
    changed at rest, is the ballot's fifth int. Off outside torch.distributed and at world
    size 1."""

    # ints of the ballot: [has, -has, digest, -digest, a shard changed at rest, windows' every]
    BALLOT = 6

    def __init__(self, on: bool = True) -> None:
        self.on = bool(on)
        self.audits = 0
        self.last_step: int | None = None  # the step last audited (and passed)
        self.seconds = 0.0  # audits' time, summed
        self.last_seconds = 0.0
        self._live: Seen | None = None  # the model and optimizer capture() last saw
        self._mine: tuple[int, int, float] | None = None  # (step, digest, seconds) of a ballot
        self._told: set[str] = set()  # why audits are off, said once each
        self._ballot_spent: tuple[int, float] = (-1, 0.0)  # the last passed ballot's step, cost
        # sharded: the digest armed at a boundary, (step, digest, seconds), until verified; then
        # the window's verdict (changed at rest?) and its seconds, until the ballot carries it
        self._armed: tuple[int, int, float] | None = None
        self._window: tuple[int, bool, float] | None = None  # (step, changed, seconds)
        self._hooked: Any = None  # the optimizer whose step pre-hook verifies
        self._hook: Any = None
        self.window_every = 1  # sharded: a window before every N-th step's update, agreed
        self._window_costs: deque = deque(maxlen=25)  # seconds of the windows audited

    def wanted(self) -> Seen | None:
        """A Seen for capture() to fill, or None when no audit can run here."""
        if not self.on or not dist_on() or world() < 2:
            return None
        return Seen()

    def ballot(self, step: int, due: bool, step_time: float = 0.0) -> list[int]:
        """This rank's part of the boundary's MAX all-reduce: its digest of the live state at
        `step` when a keep is due there and the live objects are known, else zeros; sharded,
        whether its shards changed at rest and its windows' cadence for `step_time` steps."""
        self._mine = None
        live = self._live
        if live is not None and live.sharded:
            if self._armed is not None:
                self.verify()  # no optimizer step since the boundary: the state is as armed
            changed = int(bool(self._window and self._window[1]))
            return [0, 0, 0, 0, changed, self._proposal(step_time)]
        if not (due and live is not None and self.on and step != self.last_step):
            return [0] * self.BALLOT
        t0 = time.perf_counter()
        mine = digest(tensors(live.model, live.optimizer))
        self._mine = (step, mine, time.perf_counter() - t0)
        return [1, -1, mine, -mine, 0, 0]

    def _proposal(self, step_time: float) -> int:
        """Sharded: the smallest N whose windows, one before every N-th update, cost at most
        WINDOW_BUDGET of step time (every step until five windows were measured)."""
        if len(self._window_costs) < 5 or step_time <= 0:
            return self.window_every
        allowed = WINDOW_BUDGET * step_time
        return max(1, math.ceil(statistics.median(self._window_costs) / allowed))

    def tally(self, reduced: list[int]) -> None:
        """The all-reduced ballots: passed when every rank had a digest and the largest is the
        smallest; a disagreement gathers the digests to name the odd one out, and raises."""
        has, neg_least_has, largest, neg_least, changed, every = reduced
        if every and every != self.window_every:
            self.window_every = int(every)
            if rank() == 0:
                log.info("sdc_audit_cadence", every=self.window_every, budget=WINDOW_BUDGET)
        if self._window is not None or changed:
            self._windowed(bool(changed))
            return
        if self._mine is None or not has or -neg_least_has != 1:
            return  # not every rank had one: the keep gathers them (check)
        step, mine, seconds = self._mine
        self._mine = None
        if largest == -neg_least:
            self._counted(seconds)
            self.last_step = step
            self._ballot_spent = (step, seconds)
            return
        self._gathered(step, mine, time.perf_counter() - seconds)

    def spent(self, step: int) -> float:
        """Seconds the ballot that passed at `step` took (its digest, made before the keep, is
        part of the keep's cost: the refresh's cadence counts it); 0 where none did."""
        at, seconds = self._ballot_spent
        return seconds if at == step else 0.0

    def check(self, step: int, seen: Seen | None) -> None:
        """Audit the state capture() saw at `step` unless its ballot passed (a collective: every
        rank calls it at the same keeps); raise SilentDataCorruption when the replicas disagree.
        Passes at once where there is nothing to audit (no model given to capture(), a sharded
        model)."""
        if seen is None:
            return
        if seen.model is None:
            self.off("no model given to capture()")
            return
        if seen.sharded:
            self._watch(seen)
            if self._window is not None:  # the boundary's all-reduce did not carry it
                flag = torch.tensor([int(self._window[1])], dtype=torch.int64)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cpu_group())
                self._windowed(bool(flag.item()))
            return
        self._live = seen  # the next keeps' ballots digest these live objects
        if step == self.last_step:
            return
        t0 = time.perf_counter()
        self._gathered(step, digest(tensors(seen.model, seen.optimizer)), t0)

    def _watch(self, seen: Seen) -> None:
        """Audit these sharded objects from now on: the optimizer's step pre-hook verifies."""
        if not isinstance(seen.optimizer, torch.optim.Optimizer):
            self.off("sharded: no torch.optim.Optimizer given to capture() marks the updates")
            return
        self._live = seen
        if self._hooked is not seen.optimizer:
            if self._hook is not None:
                self._hook.remove()
            self._hooked = seen.optimizer
            self._hook = seen.optimizer.register_step_pre_hook(lambda *_: self.verify())

    def arm(self, step: int) -> None:
        """At the boundary of `step`, sharded, when the next update's window is due (every
        `window_every`-th): digest this rank's shards, to be verified when that update begins."""
        live = self._live
        self._armed = None
        due = (step + 1) % self.window_every == 0
        if not (due and self.on and live is not None and live.sharded):
            return
        t0 = time.perf_counter()
        armed = digest(owned(live.optimizer))
        self._armed = (step, armed, time.perf_counter() - t0)

    def verify(self) -> None:
        """Sharded: whether this rank's shards still have the bits armed at the boundary (the
        optimizer's step pre-hook: only forward and backward read them in between)."""
        if self._armed is None or self._live is None:
            return
        at, armed, seconds = self._armed
        self._armed = None
        t0 = time.perf_counter()
        now = digest(owned(self._live.optimizer))
        self._window = (at + 1, now != armed, seconds + time.perf_counter() - t0)

    def _windowed(self, changed: bool) -> None:
        """The window's verdict, agreed: every rank learns whether any rank's shards changed at
        rest before the update of `step`; those that did are gathered and named."""
        step, mine, seconds = self._window if self._window is not None else (-1, False, 0.0)
        if self._window is not None:
            self._window_costs.append(seconds)
        self._window = None
        if not changed:
            self._counted(seconds)
            self.last_step = step
            return
        out = [torch.zeros(2, dtype=torch.int64) for _ in range(world())]
        dist.all_gather(out, torch.tensor([int(mine), step], dtype=torch.int64), group=cpu_group())
        odd = tuple(r for r, t in enumerate(out) if t[0].item())
        step = max(int(t[1].item()) for t in out)  # the window the ranks that saw it audited
        self._diverged(step, Verdict(False, odd, odd), self._counted(seconds), sharded=True)

    def _gathered(self, step: int, mine: int, t0: float) -> None:
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(world())]
        dist.all_gather(out, torch.tensor([mine], dtype=torch.int64), group=cpu_group())
        digests = [int(t.item()) for t in out]
        found = verdict(digests)
        figures = self._counted(time.perf_counter() - t0)
        if found.agreed:
            self.last_step = step
            return
        self._diverged(step, found, figures, digests)

    def _counted(self, seconds: float) -> Any:
        self.audits += 1
        self.last_seconds = seconds
        self.seconds += seconds
        figures = heartbeat.writer()
        if figures is not None:
            figures.add("sdc_audits", 1)
            figures.add("audit_total", seconds)
        return figures

    def _diverged(
        self,
        step: int,
        found: Verdict,
        figures: Any,
        digests: list[int] | None = None,
        sharded: bool = False,
    ) -> None:
        me = rank()
        if sharded:
            what = (
                f"silent data corruption: rank(s) {', '.join(map(str, found.odd))}'s shards of "
                f"the parameters and optimizer state changed at rest before step {step}'s "
                f"update (their digest differs from the one made at step {step - 1}'s boundary)"
            )
        elif found.odd:
            what = (
                f"silent data corruption: rank(s) {', '.join(map(str, found.odd))} disagreed "
                f"with the other {world() - len(found.odd)} replicas of the parameters and "
                f"optimizer state at step {step}"
            )
        else:
            what = (
                f"silent data corruption suspected: the {world()} replicas of the parameters and "
                f"optimizer state disagree at step {step} with no majority (undecided between "
                f"ranks {', '.join(map(str, found.suspects))})"
            )
        # None: no audit passed in this process yet (it began with this run's resume), so the
        # newest certified state is one kept before it, whose step this process does not know
        known = f" (step {self.last_step})" if self.last_step is not None else ""
        action = f"rolling back to the newest certified state{known}"
        if figures is not None:
            figures.note("sdc_step", step)
            figures.note("sdc_rank", found.odd[0] + 1 if len(found.odd) == 1 else 0)
            figures.add("sdc_found", 1)
        log.error(
            "sdc_detected",
            rank=me,
            step=step,
            odd=list(found.odd),
            suspects=list(found.suspects),
            certified=self.last_step,
            action=action,
        )
        exc = SilentDataCorruption(f"{what}; {action}")
        bootstrap.write_error_file(exc)  # what status and the final line show of it
        if found.undecided and world() == 2 and digests is not None:
            from elasticd.checkpoint import bundle  # bundle imports this module

            bundle.on_sdc(exc, step, digests)  # the referee's evidence (daemon/referee.py)
        raise exc

    def off(self, why: str) -> None:
        """Say once per reason, on rank 0, why states are kept unaudited."""
        if why not in self._told:
            self._told.add(why)
            if rank() == 0 and self.wanted() is not None:
                log.info("sdc_audit_off", reason=why, action="states are kept unaudited")
