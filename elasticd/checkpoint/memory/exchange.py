"""A sharded resume from memory at another world size: each rank receives only the parts of the
old shards that overlap its own new ones, not every old rank's whole slot.

Where each rank's new shards lie is known only once the model and optimizer are built, so the
exchange runs in restore() (Exchange.place), after load() agreed on the step:

1. load() (memory.shards.fetch): each rank reads the slots it was chosen to serve (its own, a
   replica) from its node's memory, and the holder of old rank 0's slot broadcasts the rest of
   the state, the skeleton: the sampler, scheduler, user values and the replicated (non-DTensor)
   entries, with every DTensor's chunk replaced by a marker (global shape, dtype).
2. restore(): every rank works out its needs (each marker's box in the live DTensor: offsets and
   local shape) and one all_gather of small JSON tells every rank everyone's needs, the boxes of
   the chunks each holder serves and any failure so far. The plan is then the same arithmetic on
   every rank: for each distinct old chunk (replicated mesh dims repeat them: the lowest old
   rank's is sent) and each rank whose new box it overlaps, the holder sends the intersection.
3. One all_to_all_single of raw bytes over the library's gloo group carries every holder's
   slices to every rank, each message followed by its MAC (memory.seal: 32 bytes, bound to the
   step, lineage, sender and receiver): the bytes a rank receives are its new shards' size plus
   32 per sender, whatever the world was; a message whose MAC does not verify fails the resume.

Every rank takes part in every step whatever failed here (a failure is carried as a reason, the
bytes as zeros), so a failure never leaves a peer waiting; memory.shards agrees on the outcome.
Every wait is bounded (WAIT plus a size term): a peer that died fails the attempt instead.
"""

from __future__ import annotations

import ctypes
import json
import math
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elasticd.checkpoint import sharded
from elasticd.checkpoint.collectives import _tensor_bytes, cpu_group, rank, world
from elasticd.checkpoint.memory import seal
from elasticd.checkpoint.memory.description import Chunk
from elasticd.checkpoint.walk import keys, root, where

MARK = "\x00elasticd.chunk"  # a skeleton's stand-in for a chunk: {MARK: [global shape, dtype]}
WAIT = 60.0  # seconds any step of the exchange waits for its peers, plus the bytes at SPEED
SPEED = 20e6  # bytes/s assumed of the slowest link when bounding the all_to_all's wait
ALIGN = 8  # each slice starts at a multiple of 8 bytes, so the bytes view as any dtype in place
# Tests only: called on each outgoing message (rank to, bytes) after its MAC was taken, as a bad
# link or someone on it would change it (tests/unit/checkpoint/test_sharded_exchange.py).
TAMPER: Callable[[int, torch.Tensor], None] | None = None


def skeleton(state: Any) -> Any:
    """`state` with each Chunk replaced by its marker: what travels to every rank."""
    if isinstance(state, Chunk):
        return {MARK: [list(state.shape), str(state.tensor.dtype).removeprefix("torch.")]}
    if isinstance(state, Mapping):
        return type(state)((k, skeleton(v)) for k, v in state.items())
    if isinstance(state, list):
        return [skeleton(v) for v in state]
    return state


def _is_mark(obj: Any) -> bool:
    return type(obj) is dict and len(obj) == 1 and MARK in obj


def _leaves(obj: Any, at: Any, found: list, test: Callable[[Any], bool]) -> None:
    """Locations (at, value) of the values `test` picks, in walk order: a skeleton's markers and a
    slot's chunks are met in the same order (the same structure, the same keys)."""
    if test(obj):
        found.append((at, obj))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _leaves(v, (at, k), found, test)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _leaves(v, (at, i), found, test)


def _targets(model, optimizer, saved: Any, marks: list) -> dict[str, Any]:
    """The live values the shards are placed in ({"model", "optimizer"}: state_dicts()'s). A fresh
    optimizer whose saved state's names are its parameters' (sharded.fresh_by_name) has no state
    to look in yet: each of its entries is placed in its parameter's spec instead (the same), and
    Pieces.restore seeds the optimizer with what was placed, so torch's get_state_dict does not
    make a state by a step of zero gradients first. Where any marker would find no DTensor that
    way, state_dicts() as before."""
    state = saved.get("state") if isinstance(saved, Mapping) else None
    named = sharded.fresh_by_name(model, optimizer, state)
    if named is not None:
        msd, _ = sharded.state_dicts(model, None)
        stand_in = {
            n: dict.fromkeys(v, named[n]) for n, v in state.items() if isinstance(v, Mapping)
        }
        targets = {"model": msd, "optimizer": {"state": stand_in}}
        cls = sharded.dtensor_class()
        if all(isinstance(_lookup(targets, at), cls) for at, _ in marks):
            return targets
    msd, osd = sharded.state_dicts(model, optimizer)
    return {"model": msd} | ({"optimizer": osd} if optimizer is not None else {})


def _lookup(tree: Any, at: Any) -> Any:
    """The value at location `at` ((parent, key) chain) of `tree`, None where it has none."""
    for key in keys(at):
        if isinstance(tree, Mapping):
            tree = tree.get(key)
        elif isinstance(tree, list) and isinstance(key, int) and key < len(tree):
            tree = tree[key]
        else:
            return None
    return tree


def _fill(tree: Any, at: Any, made: dict) -> Any:
    """The skeleton `tree` with each marker replaced by what `made` has for its location."""
    if _is_mark(tree):
        return made.get(where(at))
    if isinstance(tree, Mapping):
        return type(tree)((k, _fill(v, (at, k), made)) for k, v in tree.items())
    if isinstance(tree, list):
        return [_fill(v, (at, i), made) for i, v in enumerate(tree)]
    return tree


def live_dtensor(target: Any, at: Any) -> Any:
    """`target`, the live value where memory holds shards: a DTensor, or a ValueError naming it."""
    if not isinstance(target, sharded.dtensor_class() or ()):
        raise ValueError(f"{where(at)}: held as shards in memory, but the live one is not")
    return target


def _box(target: Any, mark: dict, at: Any) -> list:
    """[offsets, local shape] of the live DTensor at a marker's location."""
    live_dtensor(target, at)
    shape = mark[MARK][0]
    if list(target.shape) != shape:
        raise ValueError(f"{where(at)}: shape {shape} in memory, {list(target.shape)} in the model")
    return local_box(target)


def local_box(t: Any) -> list:
    """[offsets, local shape] of a DTensor's local shard in its global tensor."""
    (chunk,) = t.__create_chunk_list__()
    return [list(chunk.offsets), list(t.to_local().shape)]


def meet(a: list, b: list) -> tuple[list, list] | None:
    """The intersection of two boxes [offsets, shape] as (lo, hi), None when empty."""
    lo = [max(x, y) for x, y in zip(a[0], b[0])]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1])]
    return None if any(h <= low for h, low in zip(hi, lo)) else (lo, hi)


def window(t: torch.Tensor, lo: list, hi: list, offsets: list | tuple) -> torch.Tensor:
    for d, (low, h) in enumerate(zip(lo, hi)):
        t = t.narrow(d, low - offsets[d], h - low)
    return t


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _bytes(t: torch.Tensor) -> ctypes.Array:
    """A contiguous uint8 tensor's bytes, as a buffer hashlib reads without copying."""
    return (ctypes.c_char * t.numel()).from_address(t.data_ptr())


def _wait(work, seconds: float, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=seconds))
    except RuntimeError as e:
        raise TimeoutError(
            f"the in-memory shard exchange ({what}): no answer from a peer within {seconds:.0f}s "
            f"({e}); this attempt ends so that the next one starts afresh"
        ) from e


def gather_json(obj: Any, multi: bool) -> list[Any]:
    """Every rank's `obj` (JSON), each wait bounded by WAIT."""
    if not multi:
        return [obj]
    group, ranks = cpu_group(), world()
    data = json.dumps(obj).encode()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(ranks)]
    work = dist.all_gather(sizes, torch.tensor([len(data)]), group=group, async_op=True)
    _wait(work, WAIT, "sizes")
    buf = torch.zeros(max(int(s.item()) for s in sizes), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(ranks)]
    _wait(dist.all_gather(out, buf, group=group, async_op=True), WAIT, "requests")
    return [json.loads(_tensor_bytes(o[: int(s.item())])) for o, s in zip(out, sizes)]


class Exchange:
    """The shards of one resume at another world: the skeleton's model and optimizer parts, the
    slots this rank serves ({old rank: state with Chunks}) and which new rank serves each old
    rank. place() is a collective; `received` and `seconds` say what it cost this rank.
    `context`: the (step, lineage) resumed, bound into every message's MAC."""

    def __init__(
        self,
        parts: Mapping[str, Any],
        held: dict[int, Any],
        serves: list[int],
        context: tuple[int, int] = (0, 0),
    ):
        self.parts, self.held, self.serves = dict(parts), held, serves
        self.context = context
        self.received, self.seconds = 0, 0.0

    def place(self, model, optimizer, multi: bool) -> tuple[dict | None, dict | None, str | None]:
        """(model state, optimizer state or None, why not): this rank's new shards received
        from their holders, as DTensors of the live ones' specs, for sharded.apply."""
        t0 = time.perf_counter()
        marks: list = []
        for part in sharded.PARTS:
            _leaves(self.parts.get(part), (None, part), marks, _is_mark)
        why, needs, targets = None, [None] * len(marks), {}
        try:
            targets = _targets(model, optimizer, self.parts.get("optimizer"), marks)
            for i, (at, mark) in enumerate(marks):
                if root(at) in targets:
                    needs[i] = _box(_lookup(targets, at), mark, at)
        except Exception as e:  # noqa: BLE001 - carried to every rank, which then use the disk
            why = f"rank {rank()}: {type(e).__name__}: {e}"
        holds, chunks = self._holds(marks)
        if isinstance(holds, str):
            why, holds = why or holds, {}
        views = gather_json({"why": why, "needs": needs, "holds": holds}, multi)
        why = next((v["why"] for v in views if v["why"]), None)
        made: dict = {}
        if why is None:
            got, why = self._move(views, marks, chunks, multi)
            try:
                why = why or self._assemble(got, marks, needs, targets, made)
            except Exception as e:  # noqa: BLE001 - agreed in Pieces.restore
                why = f"rank {rank()}: placing the shards: {type(e).__name__}: {e}"
        self.seconds = time.perf_counter() - t0
        if why is not None:
            return None, None, why
        m = _fill(self.parts["model"], (None, "model"), made)
        o = None
        if optimizer is not None and "optimizer" in self.parts:
            o = _fill(self.parts["optimizer"], (None, "optimizer"), made)
        return m, o, None

    def _holds(self, marks: list) -> tuple[dict | str, dict]:
        """{old rank: [[offsets, shape] per marker]} of the slots served here, and the chunks."""
        holds, chunks = {}, {}
        for q, state in self.held.items():
            found: list = []
            for part in sharded.PARTS:
                _leaves(state.get(part), (None, part), found, lambda o: isinstance(o, Chunk))
            if [where(a) for a, _ in found] != [where(a) for a, _ in marks]:
                return f"rank {rank()}: rank {q}'s slot holds other tensors than rank 0's", {}
            for (at, c), (_, mark) in zip(found, marks):
                if str(c.tensor.dtype).removeprefix("torch.") != mark[MARK][1]:
                    return f"rank {rank()}: {where(at)} of rank {q} is {c.tensor.dtype}", {}
            holds[str(q)] = [[list(c.offsets), list(c.tensor.shape)] for _, c in found]
            chunks[q] = [c for _, c in found]
        return holds, chunks

    def _plan(self, views: list, marks: list) -> dict[tuple[int, int], list]:
        """(sender, receiver) -> [(old rank, marker, lo, hi)], the same on every rank."""
        owner: dict = {}
        for v in views:
            for q, boxes in v["holds"].items():
                for i, box in enumerate(boxes):
                    key = (i, tuple(box[0]), tuple(box[1]))
                    owner[key] = min(owner.get(key, int(q)), int(q))
        plan: dict[tuple[int, int], list] = {}
        for (i, offsets, shape), q in sorted(owner.items()):
            for dst, v in enumerate(views):
                need = v["needs"][i]
                hit = need and meet(need, [list(offsets), list(shape)])
                if hit:
                    plan.setdefault((self.serves[q], dst), []).append((q, i, *hit))
        return plan

    @staticmethod
    def _size(item: tuple, marks: list) -> int:
        q, i, lo, hi = item
        item_size = getattr(torch, marks[i][1][MARK][1]).itemsize
        return _padded(math.prod(h - low for h, low in zip(hi, lo)) * item_size)

    def _sizes(self, plan: dict, marks: list, pairs: list) -> list[int]:
        """Bytes of the message of each (sender, receiver) pair: its slices, padded, and its
        MAC (none when it has no slice)."""
        sizes = [sum(self._size(it, marks) for it in plan.get(pair, ())) for pair in pairs]
        return [n + seal.SIZE if n else 0 for n in sizes]

    def _mac(self, body: torch.Tensor, src: int, dst: int) -> bytes:
        return seal.mac("shards", (*self.context, src, dst), _bytes(body))

    def _pack(self, inp: torch.Tensor, sends: list, plan: dict, chunks: dict, marks: list) -> None:
        """Each message this rank sends, its slices copied once into `inp`, then its MAC."""
        start, me = 0, rank()
        for dst, n in enumerate(sends):
            at = start
            for q, i, lo, hi in plan.get((me, dst), ()):
                c = chunks[q][i]
                shape = [h - low for h, low in zip(hi, lo)]
                dst_view = inp[at : at + math.prod(shape) * c.tensor.dtype.itemsize]
                dst_view.view(c.tensor.dtype).view(shape).copy_(window(c.tensor, lo, hi, c.offsets))
                at += self._size((q, i, lo, hi), marks)
            if n:
                end = start + n - seal.SIZE
                tag = self._mac(inp[start:end], me, dst)
                inp[end : start + n] = torch.frombuffer(bytearray(tag), dtype=torch.uint8)
                if TAMPER is not None:
                    TAMPER(dst, inp[start : start + n])
            start += n

    def _move(self, views, marks, chunks, multi) -> tuple[list, str | None]:
        """[(old rank, marker, lo, hi, bytes)] received here, or why not. The slices are copied
        once, straight into the buffer all_to_all sends from."""
        me, why, ranks = rank(), None, range(len(views))
        plan = self._plan(views, marks)
        sends = self._sizes(plan, marks, [(me, dst) for dst in ranks])
        inp = torch.zeros(sum(sends), dtype=torch.uint8)
        try:
            self._pack(inp, sends, plan, chunks, marks)
        except Exception as e:  # noqa: BLE001 - the zeros still go: every rank takes part
            why = f"rank {me}: packing the shards it serves: {type(e).__name__}: {e}"
        expect = self._sizes(plan, marks, [(src, me) for src in ranks])
        out = torch.empty(sum(expect), dtype=torch.uint8)
        if multi:
            work = dist.all_to_all_single(out, inp, expect, sends, group=cpu_group(), async_op=True)
            _wait(work, WAIT + (inp.numel() + out.numel()) / SPEED, "shards")
        else:
            out = inp
        self.received = sum(expect) - expect[me]
        got, start = [], 0
        for src, n in enumerate(expect):
            if not n:
                continue
            msg, start = out[start : start + n], start + n
            body = msg[: -seal.SIZE]
            if not seal.matches(_tensor_bytes(msg[-seal.SIZE :]), self._mac(body, src, me)):
                why = why or (
                    f"rank {me}: the shards from rank {src} arrived damaged or changed on the "
                    "way (their MAC does not verify)"
                )
                continue
            at = 0
            for item in plan[(src, me)]:
                size = self._size(item, marks)
                got.append((*item, body[at : at + size]))
                at += size
        return got, why

    @staticmethod
    def _assemble(got: list, marks: list, needs: list, targets: dict, made: dict) -> str | None:
        """Each needed marker's local shard filled from the slices received; why not."""
        out: dict[int, torch.Tensor] = {}
        covered = [0] * len(marks)
        for _, i, lo, hi, raw in got:
            at = marks[i][0]
            target = _lookup(targets, at)
            if i not in out:
                out[i] = torch.empty(needs[i][1], dtype=target.to_local().dtype)
            shape = [h - low for h, low in zip(hi, lo)]
            dtype = getattr(torch, marks[i][1][MARK][1])
            n = math.prod(shape)
            src = raw[: n * dtype.itemsize].view(dtype).view(shape)
            window(out[i], lo, hi, needs[i][0]).copy_(src)
            covered[i] += n
        for i, need in enumerate(needs):
            if need is None:
                continue
            at = marks[i][0]
            total = math.prod(need[1])
            if covered[i] != total:
                return (
                    f"rank {rank()}: {where(at)}: the shards in memory cover {covered[i]} of "
                    f"this rank's {total} values"
                )
            target = _lookup(targets, at)
            local = out.get(i, torch.empty(need[1], dtype=target.to_local().dtype))
            made[where(at)] = like(target, local)
        return None


def like(target: Any, local: torch.Tensor) -> Any:
    """A DTensor of the live `target`'s spec around `local`, this rank's shard."""
    return type(target).from_local(
        local.to(target.to_local().device),
        target.device_mesh,
        target.placements,
        shape=target.shape,
        stride=target.stride(),
        run_check=False,
    )
