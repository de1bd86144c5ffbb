"""In-memory state: ranks resume from the step before a crash, agree on it, and fall back to disk
when it is missing, partial, damaged or older (world-size changes: test_memory_elastic.py)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

import _ckpt_helpers as helpers
from elasticd import checkpoint
from elasticd.checkpoint import CheckpointManager, stop
from elasticd.checkpoint import rng as ckpt_rng
from elasticd.checkpoint.memory import cadence, description, directory, reader, slots, writer
from elasticd.checkpoint.training_state import REFRESH, Refresh
from harness import script


def final(path):
    got = torch.load(path, weights_only=True)
    tensors = {
        **{f"model.{k}": v for k, v in got["model"].items()},
        **{f"opt.{k}.{n}": t for k, s in got["optimizer"]["state"].items() for n, t in s.items()},
    }
    return tensors, got["loaded"]


def assert_same(ref, run):
    assert ref.keys() == run.keys() and ref
    for k in ref:
        assert torch.equal(ref[k], run[k]), k


@pytest.fixture
def reference(tmp_path):
    ref = tmp_path / "ref"
    helpers.run(helpers.train, 2, tmp_path, str(ref), 14, str(ref), None, timeout=90)
    return [final(f"{ref}.{r}.pt")[0] for r in range(2)]


def crashed_run(tmp_path, mem):
    """Two gloo ranks train with disk checkpoints every 4 steps and in-memory state every step,
    then die after step 10: disk holds step 8, memory steps 9 and 10."""
    run = tmp_path / "run"
    helpers.run(helpers.train, 2, tmp_path, str(run), 14, None, 10, 4, True, str(mem), timeout=90)
    assert checkpoint.latest_info(run)["step"] == 8
    for r in range(2):
        assert slots.steps(str(mem), world=2, rank=r, local_rank=r) == [10, 9]
    return run


def resume(tmp_path, run, mem):
    helpers.run(
        helpers.train, 2, tmp_path, str(run), 14, str(run), None, 4, True, str(mem), timeout=90
    )
    return [final(f"{run}.{r}.pt") for r in range(2)]


def test_two_ranks_resume_from_memory_bit_exact(tmp_path, reference):
    mem = tmp_path / "mem"
    mem.mkdir()
    run = crashed_run(tmp_path, mem)
    for r, (tensors, loaded) in enumerate(resume(tmp_path, run, mem)):
        assert loaded["step"] == 10 and loaded["file"].startswith("memory:"), loaded
        assert_same(reference[r], tensors)


@pytest.mark.parametrize("damage", ["one rank missing", "full state truncated", "disk is newer"])
def test_falls_back_to_disk_and_stays_bit_exact(tmp_path, reference, damage):
    mem = tmp_path / "mem"
    mem.mkdir()
    run = crashed_run(tmp_path, mem)
    if damage == "one rank missing":
        for k in range(slots.SLOTS):
            os.unlink(slots.slot_path(str(mem), 1, k))
    elif damage == "full state truncated":  # both steps damaged: nothing in memory is usable
        for k in range(slots.SLOTS):
            os.truncate(slots.slot_path(str(mem), 0, k), slots.HEADER + 100)
    else:  # memory from an older timeline than the disk: disk wins
        for r in range(2):
            for k in range(slots.SLOTS):
                with open(slots.slot_path(str(mem), r, k), "r+b") as f:
                    f.seek(16)  # the step field
                    step = int.from_bytes(f.read(8), "little")
                    f.seek(16)
                    f.write((step - 3).to_bytes(8, "little"))
    expect = 8
    for r, (tensors, loaded) in enumerate(resume(tmp_path, run, mem)):
        assert loaded["step"] == expect and not loaded["file"].startswith("memory:"), loaded
        assert_same(reference[r], tensors)


def test_a_smaller_world_resumes_from_memory_and_drops_stale_steps(tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir()
    crashed_run(tmp_path, mem)
    held_rng = reader.load(str(mem), 0, 10, slots.held(str(mem), 0)[0].lineage)["rng"]
    # one process now, local rank 0 of the same node: world size 1 resumes from the node's memory
    mgr = CheckpointManager(tmp_path / "run", handle_sigterm=False, memory_dir=mem)
    state = mgr.load_latest()
    assert (
        mgr.loaded.step == 10
        and mgr.loaded.file.startswith("memory:")
        and mgr.loaded.world_size == 2
    )
    assert state["user"]["step"] == 10
    (mine,) = state["rng"]["ranks"]  # its own RNG, that old rank 0 held
    assert torch.equal(mine["torch"], held_rng["torch"])
    assert [h.step for h in slots.held(str(mem), 0)] == [
        10
    ]  # this rank's other slot (step 9) was dropped
    assert [h.step for h in slots.held(str(mem), 1)] == [10, 9]  # no local rank 1 here: left alone


def refresh_loop(tmp_path, steps: int, pause: float = 0.0, **kw):
    """One process refreshing a tiny model's state for `steps` steps, `pause` s of "training"
    each."""
    mem = tmp_path / "mem"
    mem.mkdir()
    mgr = CheckpointManager(tmp_path / "disk", handle_sigterm=False, memory_dir=mem, **kw)
    model = torch.nn.Linear(3, 1)
    for step in range(1, steps + 1):
        time.sleep(pause)
        mgr.maybe_save(step, lambda: checkpoint.capture(model=model, step=step))
    return mgr, mem, model


def test_single_process_refresh_every_n_steps_and_keep_two(tmp_path):
    mgr, mem, model = refresh_loop(tmp_path, 7, memory_every=2)
    assert slots.steps(str(mem), world=1, rank=0, local_rank=0) == [6, 4]
    assert directory.newest_step(str(mem)) == 6
    state = CheckpointManager(tmp_path / "disk", handle_sigterm=False, memory_dir=mem).load_latest()
    assert state["user"]["step"] == 6 and torch.equal(
        state["model"]["weight"], model.weight.detach()
    )
    assert mgr.last_memory_stall > 0


def test_the_final_save_of_a_stop_refreshes_memory_off_its_cadence(tmp_path, monkeypatch):
    """A stop (a node joining restarts the group) at a step the cadence skips: the memory holds
    that step too, so the resume that follows takes it from memory, not from the disk."""
    monkeypatch.setattr(stop.PROCESS, "requested", type(stop.PROCESS.requested)())
    mgr, mem, model = refresh_loop(tmp_path, 5, memory_every=2)
    assert slots.steps(str(mem), world=1, rank=0, local_rank=0) == [4, 2]
    checkpoint.request_stop()
    assert mgr.maybe_save(7, lambda: checkpoint.capture(model=model, step=7))  # the final save
    assert slots.steps(str(mem), world=1, rank=0, local_rank=0) == [7, 4]
    mgr.close()
    resumed = CheckpointManager(tmp_path / "disk", handle_sigterm=False, memory_dir=mem)
    assert resumed.load_latest()["user"]["step"] == 7
    assert resumed.loaded.file.startswith("memory:"), resumed.loaded


def test_a_disk_saves_step_is_in_memory_too_so_a_resume_never_reads_the_disk(tmp_path):
    """Disk saves every 4 steps and refreshes every 3 (a big state's cadence on fast steps): the
    disk's steps are in memory as well, so the resume after step 8 reads step 8 from memory, not
    from the disk (0.84 s against 0.20 s for 1 GB on CPU)."""
    mgr, mem, model = refresh_loop(tmp_path, 8, memory_every=3, every_steps=4)
    assert slots.steps(str(mem), world=1, rank=0, local_rank=0) == [8, 6]
    mgr.close()
    resumed = CheckpointManager(tmp_path / "disk", handle_sigterm=False, memory_dir=mem)
    assert resumed.load_latest()["user"]["step"] == 8
    assert resumed.loaded.file.startswith("memory:"), resumed.loaded
    assert list((tmp_path / "disk").glob("ckpt-000000000008*")), "the disk holds step 8 too"


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
        ),
    ],
)
def test_overlap_on_a_cpu_or_small_state_copies_synchronously(tmp_path, device):
    """memory_overlap (the default) only queues copies of CUDA tensors, and only of a state
    worth it (writer.OVERLAP_MIN_BYTES): a CPU job's refreshes, or a small model's on a GPU, are
    the plain synchronous ones (and exact), and no side stream or thread is made for them; a
    CPU job loads nothing CUDA."""
    code = (
        "import sys, torch\n"
        "from elasticd import checkpoint\nfrom elasticd.checkpoint.memory import reader\n"
        "from elasticd.checkpoint import CheckpointManager\n"
        f"mem = {str(tmp_path / 'mem')!r}\n"
        "mgr = CheckpointManager(mem + '-disk', handle_sigterm=False, memory_dir=mem, "
        "memory_every=1)\n"
        f"model = torch.nn.Linear(3, 1).to({device!r})\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(1, 5):\n"
        f"    model(torch.ones(2, 3, device={device!r})).sum().backward()\n"
        "    opt.step()\n"
        "    mgr.maybe_save(step, "
        "lambda: checkpoint.capture(model=model, optimizer=opt, step=step))\n"
        "    assert mgr._memory.writer.overlap and not mgr._memory.writer.queued\n"
        "    got = reader.read(mem, step, world=1, rank=0, local_rank=0)\n"
        "    assert torch.equal(got['model']['weight'], model.weight.detach().cpu())\n"
        "assert 'elasticd.checkpoint.overlap' not in sys.modules\n"
        f"assert torch.cuda.is_initialized() == ({device!r} == 'cuda')\n"
        "print('ok')\n"
    )
    (tmp_path / "mem").mkdir()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_refresh_capture_names_exactly_what_only_the_optimizer_writes():
    """Overlapped copies run beside the next forward and backward only for tensors nothing but
    the optimizer's step writes: its parameters and its state, as the very objects the refresh
    copies. Buffers (batch norm's running statistics, updated by forward) are not among them."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    token = REFRESH.set(refresh := Refresh(whole=True, owned=set()))
    try:
        state = checkpoint.capture(model=model, optimizer=opt, step=1)
    finally:
        owned = refresh.owned
        REFRESH.reset(token)
    params = {id(p) for p in model.parameters()}
    moments = {id(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
    assert len(params) == 4 and len(moments) == 12 and owned == params | moments
    copied = {k: id(t) for k, t in state["model"].items()}
    assert {copied[k] for k in ("0.weight", "0.bias", "1.weight", "1.bias")} == params
    assert (
        not {copied[k] for k in ("1.running_mean", "1.running_var", "1.num_batches_tracked")}
        & owned
    )
    assert {id(t) for s in state["optimizer"]["state"].values() for t in s.values()} == moments


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
OVERLAP = script("overlap_refresh.py")


@pytest.fixture
def shm_dir():
    """A memory directory on tmpfs, as the daemon's: pinning a disk file's pages can be refused."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="elasticd-test-", dir=directory.ROOT)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@GPU
def test_overlapped_refresh_lands_whole_and_turns_itself_off_when_unsafe(tmp_path, shm_dir):
    out = subprocess.run(
        [sys.executable, OVERLAP, "check", shm_dir, str(tmp_path / "disk")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "overlap check ok" in out.stdout, out.stdout + out.stderr


@GPU
def test_sigkill_mid_overlapped_refresh_always_leaves_a_whole_step(tmp_path, shm_dir):
    """As the synchronous test below, with the copies queued on the GPU and committed by a thread:
    a refresh killed in flight is never read, and each step read is whole (no optimizer step
    overwrote the parameter while its copy ran)."""
    import random
    import signal

    rng = random.Random(11)
    last, in_flight = 0, 0
    for _ in range(6):
        proc = subprocess.Popen(
            [sys.executable, OVERLAP, "forever", shm_dir, str(tmp_path / "disk")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while (
                (directory.newest_step(shm_dir) or 0) < last + 3
                and time.monotonic() < deadline
                and proc.poll() is None
            ):
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.05))
        finally:
            proc.kill()
            output = proc.communicate(timeout=30)[0]
        assert proc.returncode == -signal.SIGKILL, output
        held = slots.steps(shm_dir, world=1, rank=0, local_rank=0)
        assert held, "no whole step left"
        in_flight += len(held) == 1
        got = reader.read(shm_dir, held[0], world=1, rank=0, local_rank=0)
        w = got["model"]["w"]
        assert torch.equal(w, torch.full_like(w, float(held[0]))), (held, w.unique()[:4])
        assert held[0] >= last + 2, (last, held)
        last = held[0]
    assert in_flight, "no kill found a refresh in flight: the test did not test one"


def test_cadence_keeps_refreshes_within_budget_and_every_rank_in_step(tmp_path):
    """A 32 MiB state on 2 ms steps costs far more than the budget (0.75% of a step) to refresh
    every step: the ranks space refreshes out, agree on one cadence (rank 1, with its cheap
    RNG-only slot, follows rank 0) and keep holding the same steps, so a resume from memory
    still works."""
    mem = tmp_path / "mem"
    mem.mkdir()
    helpers.run(
        helpers.memory_cadence,
        2,
        tmp_path,
        str(tmp_path / "disk"),
        str(mem),
        str(tmp_path / "result"),
        timeout=90,
    )
    got = [eval((tmp_path / f"result.{r}").read_text()) for r in range(2)]
    every = got[0]["every"]
    assert every >= 10 and got[1]["every"] == every, (
        got
    )  # 32 MiB take over a millisecond: N = cost / (0.0075 * 2 ms)
    events = got[0]["events"]
    assert (
        1 <= len(events) <= 3 and events[-1]["every"] == every and events[-1]["refresh_ms"] > 0.5
    ), got
    assert not got[1]["events"]  # rank 0 reports the cadence
    held = [slots.steps(str(mem), world=2, rank=r, local_rank=r) for r in range(2)]
    assert held[0] == held[1] and held[0], held


def test_cadence_stays_every_step_when_a_refresh_is_cheap(tmp_path):
    # 20 ms steps: up to 4 ms of refresh per step is within this budget; this state costs far less
    mgr, mem, _model = refresh_loop(tmp_path, 15, 0.02, memory_budget=0.2)
    assert mgr.memory_every == 1
    assert slots.steps(str(mem), world=1, rank=0, local_rank=0) == [15, 14]


def test_cadence_moves_on_a_full_window_at_its_own_cadence_or_at_once_far_over_budget():
    """N follows a full window of refreshes measured at the current N: neither the slow
    refreshes of a start nor a burst of slow ones move it, while a state far over budget is
    spaced out after five refreshes; each change measures afresh; neighbours do not flap."""
    c = cadence.Cadence(budget=0.01)
    c.steps.extend([0.023] * 15)  # 23 ms steps: 0.23 ms of refresh per step is the budget

    def refreshes(n, seconds):
        for _ in range(n):
            c.costs.append(seconds)

    refreshes(5, 0.0006)  # start-up: 2.6x the budget, from five refreshes
    assert c.proposal() == 1
    refreshes(cadence.WINDOW - 5, 0.0003)  # a full window: 0.3 ms needs every second step
    assert c.proposal() == 2 and c.adopt(2) and c.every == 2 and not c.costs
    assert c.measured == (0.0003, 0.023)
    refreshes(10, 0.0009)  # a burst at 2x the budget: no change before the window is full
    assert c.proposal() == 2
    refreshes(cadence.WINDOW - 10, 0.0003)
    assert c.proposal() == 2 and not c.adopt(2)
    refreshes(5, 0.01)  # a big state: 10 ms a refresh, 43x the budget, acted on at once
    assert c.proposal() == 44 and c.adopt(44) and c.every == 44
    refreshes(cadence.WINDOW - 1, 0.0003)  # back down only on a full window at N=44
    assert c.proposal() == 44
    refreshes(1, 0.0003)
    assert c.proposal() == 2 and c.adopt(2)
    c.every = 10
    assert not c.adopt(9) and not c.adopt(12) and c.adopt(8) and c.every == 8


@pytest.mark.parametrize(
    "kw, hint",
    [
        ({"memory_every": -1}, "memory_every must be a number of steps"),
        ({"memory_budget": 0}, "memory_budget is a share of step time"),
        ({"memory_budget": 1.5}, "memory_budget is a share of step time"),
    ],
)
def test_bad_cadence_settings_are_refused(tmp_path, kw, hint):
    with pytest.raises(ValueError, match=hint):
        CheckpointManager(tmp_path / "disk", handle_sigterm=False, memory_dir=tmp_path, **kw)


def test_unusable_directory_turns_memory_off_and_disk_goes_on(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    mgr = CheckpointManager(
        tmp_path / "disk", handle_sigterm=False, memory_dir=not_a_dir, every_steps=2
    )
    model = torch.nn.Linear(3, 1)
    for step in range(1, 5):
        mgr.maybe_save(step, lambda: checkpoint.capture(model=model, step=step))
    mgr.close()
    assert mgr.memory_every == 0
    assert checkpoint.latest_info(tmp_path / "disk")["step"] == 4


def test_daemon_side_create_remove_and_reap(tmp_path, monkeypatch):
    monkeypatch.setattr(directory, "ROOT", str(tmp_path))
    path = directory.create("job/../x")
    assert (
        path and os.path.dirname(path) == str(tmp_path) and "/../" not in path[len(str(tmp_path)) :]
    )
    assert os.stat(path).st_mode & 0o777 == 0o700
    # a daemon that died without cleaning up: its process is gone, and with it the lock it held
    code = (
        "import sys; from elasticd.checkpoint.memory import directory; "
        "directory.ROOT = sys.argv[1]; print(directory.create('old'))"
    )
    stale = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert os.path.isdir(stale)
    assert directory.reap_stale() == [stale]
    assert os.path.isdir(path)  # ours: this process holds its lock
    directory.remove(path)
    assert not os.path.exists(path)


def test_sigkill_mid_refresh_always_leaves_a_whole_step(tmp_path):
    """SIGKILL a process refreshing 8 MiB back to back, 15 times at random instants, each new one
    resuming from the last: the newest readable step is always whole (every tensor equals its
    step) and never goes backwards; a slot torn by the kill is seen as invalid, not read."""
    import random
    import signal
    import time

    rng = random.Random(7)
    mem = str(tmp_path)
    last, torn = 0, 0
    for _ in range(15):
        proc = helpers._fork.Process(
            target=helpers._child, args=(helpers.refresh_memory_forever, 0, 1, None, (mem,))
        )
        proc.start()
        try:
            deadline = time.monotonic() + 20
            while (directory.newest_step(mem) or 0) < last + 2 and time.monotonic() < deadline:
                time.sleep(0.005)  # this process has written twice
            time.sleep(rng.uniform(0.0, 0.1))
        finally:
            proc.kill()
            proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        held = slots.steps(mem, world=1, rank=0, local_rank=0)
        assert held, "no whole step left"
        torn += len(held) == 1
        state = reader.read(mem, held[0], world=1, rank=0, local_rank=0)
        step = held[0]
        assert torch.equal(state["model"]["w"], torch.full((2048, 1024), float(step)))
        assert torch.equal(state["model"]["b"], torch.full((3,), step)) and state["user"] == {
            "step": step
        }
        assert torch.equal(state["rng"]["ranks"][0]["torch"], torch.full((5,), step))
        assert step >= last and directory.newest_step(mem) == step
        assert not os.listdir(mem) or set(os.listdir(mem)) == {"l0.0", "l0.1"}  # no file per step
        last = step
    assert torn, "no kill landed mid-write: the test did not test torn slots"
    assert last >= 2


def test_full_tmpfs_turns_memory_off_and_disk_goes_on(tmp_path):
    import ast

    result = tmp_path / "result.txt"
    mem = tmp_path / "mem"
    mem.mkdir()
    helpers.run(
        helpers.memory_on_full_tmpfs,
        1,
        tmp_path,
        str(tmp_path / "disk"),
        str(mem),
        str(result),
        distributed=False,
    )
    got = ast.literal_eval(result.read_text())
    assert got["memory_every"] == 0 and got["disk"] == 4, got
    assert len(got["warnings"]) == 1 and "File too large" in got["warnings"][0]["error"], got


def test_state_round_trips_exactly_and_only_as_plain_data(tmp_path):
    from collections import OrderedDict

    state = {
        "model": OrderedDict(
            w=torch.randn(3, 4).t(),
            h=torch.ones(2, dtype=torch.bfloat16),
            m=torch.tensor([True, False]),
            e=torch.empty(0, 3),
        ),
        "optimizer": {
            "state": {0: {"momentum_buffer": torch.arange(4.0)}},
            "param_groups": [{"params": [0], "lr": 0.1, "betas": (0.9, 0.999), "nesterov": False}],
        },
        "user": {
            "step": 3,
            "best": float("inf"),
            "nan": float("nan"),
            "name": "x",
            "blob": b"\x00\xff",
            "tags": {"a"},
            "z": 1 + 2j,
            "dtype": torch.float16,
            "dev": torch.device("cpu"),
            "size": torch.Size([2, 3]),
            "none": None,
        },
    }
    w = writer.Writer(str(tmp_path), 0)
    w.write(3, state, world=1, rank=0)
    got = reader.read(str(tmp_path), 3, world=1, rank=0, local_rank=0)
    assert isinstance(got["model"], OrderedDict) and list(got["model"]) == ["w", "h", "m", "e"]
    for k, t in state["model"].items():
        assert got["model"][k].dtype == t.dtype and torch.equal(got["model"][k], t), k
    assert torch.equal(got["optimizer"]["state"][0]["momentum_buffer"], torch.arange(4.0))
    assert got["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    u = got["user"]
    assert math.isnan(u.pop("nan"))
    assert u == {k: v for k, v in state["user"].items() if k != "nan"}
    assert isinstance(u["size"], torch.Size) and isinstance(u["dtype"], torch.dtype)
    # Whatever the file says, reading builds plain data: an unknown entry is refused.
    path = slots.slot_path(str(tmp_path), 0, 0)
    with pytest.raises(
        TypeError, match=r"state\['user'\]\['obj'\]: a builtins.object cannot be kept"
    ):
        w.write(4, {"user": {"obj": object()}}, world=1, rank=0)
    with pytest.raises(ValueError, match="unknown entry"):
        description.rebuild({"\x00x": 1}, [])
    assert slots.header(path)["step"] == 3  # the refused write never touched the whole step


def test_refreshes_reuse_unchanged_description_but_never_a_changed_value(tmp_path):
    """A refresh re-encodes only the entries that changed since the last one. Values that are
    equal under == but not the same (1, 1.0, True; 0.0 and -0.0) and keys that come and go are
    changes: each step reads back exactly what was written."""
    w = writer.Writer(str(tmp_path), 0)
    model = {"w": torch.ones(2)}
    values = [1, 1.0, True, 1, 0.0, -0.0, 0, False, [1, 2], (1, 2), {"a": 1}, {"a": 1.0}]
    for step, v in enumerate(values, 1):
        state = {"model": model, "v": v, "user": {"step": step}}  # "v" alone in its entry
        if step % 3 == 0:
            state["extra"] = {"seen": step}
        w.write(step, state, world=1, rank=0)
        got = reader.read(str(tmp_path), step, world=1, rank=0, local_rank=0)
        assert got["user"] == {"step": step} and got["v"] == v, step
        assert type(got["v"]) is type(v) and repr(got["v"]) == repr(v), (step, v)
        assert ("extra" in got) == (step % 3 == 0) and torch.equal(got["model"]["w"], torch.ones(2))


def test_dicts_of_named_tensors_reuse_their_description_only_while_it_still_fits(tmp_path):
    """A dict of str -> tensor (a model's state_dict) is described once and then handed out
    again: while the names, their order, the dict's type and where its tensors start all stay
    the same. Any of those changing, or a value that is no tensor, is a new description; and a
    tensor whose layout stays but which is no longer contiguous is still copied right."""
    from collections import OrderedDict

    w = writer.Writer(str(tmp_path), 0)
    sq = torch.arange(9.0).view(3, 3)
    models = [
        OrderedDict(a=torch.ones(2), b=torch.zeros(3)),
        OrderedDict(a=torch.full((2,), 2.0), b=torch.ones(3)),  # same names: reused
        OrderedDict(b=torch.ones(3), a=torch.ones(2)),  # order changed
        dict(b=torch.ones(3), a=torch.ones(2)),  # dict, not OrderedDict
        OrderedDict(a=torch.ones(2), b=torch.zeros(3), c=sq),  # a name more
        OrderedDict(a=torch.ones(2), b=torch.zeros(3), c=sq.t()),  # same layout, not contiguous
        OrderedDict(a=torch.ones(2), b=torch.zeros(3), c=sq),
        OrderedDict(a=torch.ones(2), b=3),  # not all tensors
        OrderedDict(a=torch.ones(2), b=torch.zeros(3)),
    ]
    for step, model in enumerate(models, 1):
        state = {"model": model, "user": {"step": step}}
        if step in (6, 7):  # the model's tensors start later: another tensor comes first
            state = {"first": torch.tensor([7]), **state}
        w.write(step, state, world=1, rank=0)
        got = reader.read(str(tmp_path), step, world=1, rank=0, local_rank=0)
        assert type(got["model"]) is type(model) and list(got["model"]) == list(model), step
        for k, v in model.items():
            assert (
                torch.equal(got["model"][k], v)
                if isinstance(v, torch.Tensor)
                else got["model"][k] == v
            ), (step, k)
        assert ("first" in got) == (step in (6, 7))


def test_rng_capture_shortcuts_never_go_stale():
    """capture() skips re-reading numpy's and Python's generators while they are untouched;
    whatever is drawn in between, each capture equals the generators' real state."""
    import random

    import numpy as np

    def check():
        rng = ckpt_rng.get_state()
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        n = rng["numpy"]
        assert torch.equal(n["keys"], torch.from_numpy(keys.astype(np.int64))) and n["pos"] == pos
        assert (n["has_gauss"], n["cached_gaussian"]) == (has_gauss, cached)
        version, key, gauss = random.getstate()
        assert tuple(rng["python"]["state"].tolist()) == key
        assert (rng["python"]["version"], rng["python"]["gauss_next"]) == (version, gauss)

    np.random.seed(3)
    check()
    check()  # untouched: the cached values
    np.random.rand()
    check()
    np.random.standard_normal()  # draws a pair, caches the second
    check()
    np.random.standard_normal()  # returns the cached one: the generator's words do not move
    check()
    random.random()
    check()
    np.random.seed(3)
    check()
    # Python's generator is compared by its words in place (CPython): draws, a cached Gaussian,
    # a whole regeneration that leaves the index where it was, seeding, and setstate all show.
    assert ckpt_rng._python_rng.usable == (sys.implementation.name == "cpython")
    before = random.getstate()
    check()
    random.gauss(0, 1)  # draws a pair, keeps the second in gauss_next
    check()
    random.gauss(0, 1)  # returns gauss_next: the words do not move
    check()
    for _ in range(624):  # exactly one twist of 32-bit words: the same index, new words
        random.getrandbits(32)
    check()
    random.setstate(before)
    check()
    random.seed(11)
    check()
