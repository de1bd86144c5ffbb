"""Sharded disk checkpoints with real FSDP2 (fully_shard) on forked gloo ranks: the same
capture/restore/CheckpointManager calls as a DDP job; every rank writes its own shards in
torch.distributed.checkpoint's format; a resume is bit-exact; torch's own reader loads the
directory; another world size reshards; a corrupt shard or a planted `.metadata` makes every rank
fall back to the previous checkpoint, and the planted file is never unpickled."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
import time

import pytest
import structlog
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import _ckpt_helpers as helpers
from elasticd.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    Entry,
    capture,
    load_latest,
    restore,
)
from elasticd.checkpoint.disk import shard_files
from elasticd.checkpoint.disk.format import files_digest

fsdp = pytest.importorskip("torch.distributed.fsdp")


def _model(seed: int, kind: str = "fsdp"):
    """FSDP2: a model whose 1x8 layer shards unevenly (rank 1 holds an empty shard on 2 ranks).
    Tensor parallel: the first layer column-wise, the second row-wise, on a 1-D mesh."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    if kind == "tp":
        from torch.distributed.tensor import parallel as tp

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        plan = {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()}
        tp.parallelize_module(model, mesh, plan)
    else:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in (model[0], model[2], model):
            fsdp.fully_shard(layer, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _step(model, opt) -> None:
    model(torch.randn(3, 4)).pow(2).sum().backward()  # the data comes from the restored RNG
    opt.step()
    opt.zero_grad()


def _full(model, opt) -> dict[str, torch.Tensor]:
    """Every value gathered (a collective), for comparing runs."""
    out = {f"model.{k}": v.full_tensor().clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            out[f"optim.{i}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def train_and_resume(rank: int, world: int, disk: str, out: str, kind: str = "fsdp") -> None:
    model, opt = _model(0, kind)
    mgr = CheckpointManager(disk, handle_sigterm=False, every_steps=3, keep=2)
    stalls = []
    for step in range(1, 7):
        _step(model, opt)
        if mgr.maybe_save(step, lambda step=step: capture(model=model, optimizer=opt, step=step)):
            stalls.append(mgr.last_stall)
    mgr.close()
    at6 = _full(model, opt)
    for _ in range(2):
        _step(model, opt)
    final = _full(model, opt)
    if rank == 0:
        torch.save(at6, os.path.join(out, "at6.pt"))
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump({"stall": max(stalls), "write": mgr.last_write}, f)

    model, opt = _model(1, kind)  # other weights: restore must overwrite them all
    torch.manual_seed(123)
    mgr = CheckpointManager(disk, handle_sigterm=False, every_steps=3, keep=2)
    t0 = time.perf_counter()
    user = restore(mgr.load_latest(), model=model, optimizer=opt)
    took = time.perf_counter() - t0
    assert user == {"step": 6} and mgr.loaded.step == 6
    _same(_full(model, opt), at6)
    for _ in range(2):
        _step(model, opt)
    _same(_full(model, opt), final)  # RNG, params and optimizer: bit-identical onwards
    if rank == 0:
        with open(os.path.join(out, "times.json")) as f:
            times = json.load(f)
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump(times | {"load": took}, f)


def load_at_world(rank: int, world: int, disk: str, out: str, step: int) -> None:
    """A resume at this world size: the state equals the one saved (DCP reshards)."""
    model, opt = _model(1)
    with structlog.testing.capture_logs() as logs:
        mgr = CheckpointManager(disk, handle_sigterm=False)
        state = mgr.load_latest()
    assert mgr.loaded is not None and mgr.loaded.step == step, logs
    assert restore(state, model=model, optimizer=opt) == {"step": step}
    ref = os.path.join(out, f"at{step}.pt")
    if os.path.exists(ref):
        _same(_full(model, opt), torch.load(ref))
    skipped = [e for e in logs if e["event"] == "checkpoint_skipped"]
    with open(os.path.join(out, f"skipped{rank}.json"), "w") as f:
        json.dump([e["reason"] for e in skipped], f)


def _newest(disk: str) -> str:
    with open(os.path.join(disk, MANIFEST)) as f:
        return os.path.join(disk, json.load(f)["latest"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank run that saved at steps 3 and 6 and resumed from 6 bit-exact."""
    tmp = tmp_path_factory.mktemp("sharded")
    disk, out = str(tmp / "disk"), str(tmp / "out")
    os.mkdir(out)
    helpers.run(train_and_resume, 2, tmp, disk, out, timeout=120)
    with open(os.path.join(out, "times.json")) as f:
        print("sharded save/load seconds:", json.load(f))
    return tmp, disk, out


def test_fsdp2_save_and_resume_is_bit_exact(saved):
    _, disk, _ = saved
    newest = _newest(disk)
    assert os.path.basename(newest).startswith("ckpt-000000000006-")
    assert sorted(os.listdir(newest)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    with open(os.path.join(disk, MANIFEST)) as f:
        doc = json.load(f)
    assert [e["step"] for e in doc["checkpoints"]] == [3, 6]
    assert all(set(e["files"]) == set(os.listdir(_newest(disk))) for e in doc["checkpoints"][1:])


def test_torch_reads_an_elasticd_checkpoint_without_elasticd(saved):
    _, disk, out = saved
    code = textwrap.dedent(
        """
        import sys, torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        path, ref = sys.argv[1], torch.load(sys.argv[2])
        md = dcp.FileSystemReader(path).read_metadata()
        sd = {
            k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in md.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata) and k.startswith("model.")
        }
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        assert sorted(sd) == sorted(k for k in ref if k.startswith("model.")), sorted(sd)
        assert all(torch.equal(sd[k], ref[k]) for k in sd)
        assert not [m for m in sys.modules if m.startswith("elasticd")]
        print("ok", len(sd))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", code, _newest(disk), os.path.join(out, "at6.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env=env,
    )
    assert r.returncode == 0 and r.stdout.startswith("ok 4"), r.stderr


def test_another_world_size_reshards(saved):
    tmp, disk, out = saved
    helpers.run(load_at_world, 1, tmp, disk, out, 6, timeout=120)


def load_unsharded(rank: int, world: int, disk: str, out: str) -> None:
    """One process without torch.distributed, the model not sharded: restore gathers it."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mgr = CheckpointManager(disk, handle_sigterm=False)
    assert restore(mgr.load_latest(), model=model, optimizer=opt) == {"step": 6}
    at6 = torch.load(os.path.join(out, "at6.pt"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, at6[f"model.{k}"]), k
    for i, moments in opt.state_dict()["state"].items():
        assert torch.equal(moments["exp_avg"], at6[f"optim.{i}.exp_avg"]), i


def test_an_unsharded_model_in_one_process_reads_it(saved):
    tmp, disk, out = saved
    helpers.run(load_unsharded, 1, tmp, disk, out, distributed=False, timeout=120)


def save_once(rank: int, world: int, disk: str, out: str | None = None) -> None:
    model, opt = _model(2)
    _step(model, opt)
    with CheckpointManager(disk, handle_sigterm=False) as mgr:
        mgr.save(7, capture(model=model, optimizer=opt, step=7))
    full = _full(model, opt)
    if out is not None and rank == 0:
        torch.save(full, os.path.join(out, "at7.pt"))


def test_one_rank_grows_to_two(tmp_path):
    disk, out = str(tmp_path / "disk"), str(tmp_path / "out")
    os.mkdir(out)
    helpers.run(save_once, 1, tmp_path, disk, out, timeout=120)
    helpers.run(load_at_world, 2, tmp_path, disk, out, 7, timeout=120)


def test_tensor_parallel_save_and_resume_is_bit_exact(tmp_path):
    disk, out = str(tmp_path / "disk"), str(tmp_path / "out")
    os.mkdir(out)
    helpers.run(train_and_resume, 2, tmp_path, disk, out, "tp", timeout=120)


def test_a_directory_the_manifest_does_not_name_is_removed(saved):
    """A writer killed between renaming its directory into place and writing the manifest."""
    tmp, disk, _ = saved
    copy = str(tmp / f"copy-{time.monotonic_ns()}")
    subprocess.run(["cp", "-a", disk, copy], check=True)
    orphan = os.path.join(copy, "ckpt-000000000009-0123456789abcdef.dcp")
    os.mkdir(orphan)
    helpers.run(save_once, 1, tmp, copy, timeout=120)
    with open(os.path.join(copy, MANIFEST)) as f:
        listed = [e["file"] for e in json.load(f)["checkpoints"]]
    assert [int(n[5:17]) for n in listed] == [3, 6, 7]
    assert sorted(n for n in os.listdir(copy) if n.endswith(".dcp")) == listed


def save_forever(rank: int, world: int, disk: str) -> None:
    """Sharded saves back to back until killed; every value of checkpoint `step` is `step`."""
    model, opt = _model(0)
    _step(model, opt)
    mgr = CheckpointManager(disk, handle_sigterm=False, keep=2)
    state = mgr.load_latest()  # resumes as a restarted job does
    step = restore(state, model=model, optimizer=opt)["step"] if state else 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(float(step))
        mgr.save(step, capture(model=model, optimizer=opt, step=step))


def _newest_listed(disk: str) -> int:
    """The newest step the manifest lists (0 before the first; a manifest is replaced whole)."""
    try:
        with open(os.path.join(disk, MANIFEST)) as f:
            return max((e["step"] for e in json.load(f)["checkpoints"]), default=0)
    except FileNotFoundError:
        return 0


def test_a_crash_at_any_instant_leaves_a_checkpoint_that_loads(tmp_path):
    """SIGKILL both ranks saving back to back, at random instants: the directory always loads a
    whole checkpoint (no torn one is ever listed) and the next writer sweeps what they left.
    Each round waits for one save past the last round's before its random kill, so a loaded
    machine (slow start-up) cannot turn the rounds into kills before any save."""
    disk, rng, last = str(tmp_path / "disk"), random.Random(7), 0
    for _ in range(8):
        procs = helpers.start(save_forever, 2, tmp_path, disk)
        try:
            deadline = time.monotonic() + 60
            while _newest_listed(disk) <= last:
                assert time.monotonic() < deadline, "no save within 60 s"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 1.0))
        finally:
            for p in procs:
                p.kill()
            for p in procs:
                p.join(10)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        with structlog.testing.capture_logs() as logs:
            state = load_latest(disk)
        assert not [e for e in logs if e["event"] == "checkpoint_skipped"], logs
        step = restore(state, model=model)["step"]
        assert all(torch.equal(p, torch.full_like(p, float(step))) for p in model.parameters())
        assert step > last
        last = step
    helpers.run(save_once, 1, tmp_path, disk, timeout=120)
    assert not [n for n in os.listdir(disk) if n.endswith(".tmp")]
    assert len([n for n in os.listdir(disk) if n.endswith(".dcp")]) == 3


def one_rank_cannot_write(rank: int, world: int, disk: str) -> None:
    """Rank 1's shard write fails (a file size limit, as a full disk): every rank reports the
    failed save, none hangs, the previous checkpoint stays latest, the next save succeeds."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    model, opt = _model(0)
    _step(model, opt)
    mgr = CheckpointManager(disk, handle_sigterm=False)
    mgr.save(1, capture(model=model, optimizer=opt, step=1))
    mgr.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    mgr.save(2, capture(model=model, optimizer=opt, step=2))
    with pytest.raises(CheckpointError, match="File too large.*the previous checkpoint is intact"):
        mgr.wait()
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert mgr.last_saved.step == 1
    mgr.save(3, capture(model=model, optimizer=opt, step=3))
    mgr.close()
    assert restore(mgr.load_latest(), model=model, optimizer=opt) == {"step": 3}
    with open(os.path.join(disk, MANIFEST)) as f:
        assert [e["step"] for e in json.load(f)["checkpoints"]] == [1, 3]


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(tmp_path):
    helpers.run(one_rank_cannot_write, 2, tmp_path, str(tmp_path / "disk"), timeout=120)
    left = [n for n in os.listdir(tmp_path / "disk") if n.endswith(".tmp")]
    assert not left, [os.listdir(tmp_path / "disk" / n) for n in left]


class _Planted:
    def __reduce__(self):
        return (open, (os.environ["PLANTED_MARKER"], "w"))


def _fallback(saved, damage) -> list:
    tmp, disk, out = saved
    copy = str(tmp / f"copy-{time.monotonic_ns()}")
    subprocess.run(["cp", "-a", disk, copy], check=True)
    damage(_newest(copy))
    helpers.run(load_at_world, 2, tmp, copy, out, 3, timeout=120)
    reasons = []
    for r in range(2):
        with open(os.path.join(out, f"skipped{r}.json")) as f:
            reasons += json.load(f)
    return reasons, _newest(copy)


def test_a_corrupt_shard_falls_back_on_every_rank(saved):
    def flip(path):
        with open(os.path.join(path, "__1_0.distcp"), "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 1]))

    reasons, _ = _fallback(saved, flip)
    assert any("__1_0.distcp: checksum mismatch" in r for r in reasons), reasons


def test_a_planted_metadata_is_never_unpickled(saved, tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))

    def plant(path):
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(_Planted(), f)

    reasons, newest = _fallback(saved, plant)
    assert any(".metadata: checksum mismatch" in r for r in reasons), reasons
    assert not marker.exists()
    with open(os.path.join(newest, ".metadata"), "rb") as f:
        pickle.load(f)  # what torch's own reader would have done
    assert marker.exists()


def test_a_planted_metadata_that_the_manifest_names_still_runs_nothing(tmp_path, monkeypatch):
    """Whoever can rewrite the manifest too gets past the checksum: DCP's `.metadata` is then
    read with only the classes its format uses, so the planted pickle runs nothing."""
    marker = tmp_path / "ran"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))
    data = pickle.dumps(_Planted())
    (tmp_path / ".metadata").write_bytes(data)
    on_disk = shard_files.OnDisk(str(tmp_path), hashlib.sha256(data).hexdigest(), ("model",))
    with pytest.raises(pickle.UnpicklingError, match="not part of a checkpoint's metadata"):
        shard_files.verified_reader(on_disk).read_metadata()
    assert not marker.exists()


def _entry(files: dict) -> dict:
    digest = files_digest(files)
    return {"file": f"ckpt-000000000003-{digest[:16]}.dcp", "step": 3, "sha256": digest} | {
        "files": files
    }


@pytest.mark.parametrize(
    "files, why",
    [
        ({".metadata": "a" * 64}, "no list of files"),
        ({".metadata": "a" * 64, "state.pt": "b" * 64, "../x": "c" * 64}, "not a sharded"),
        ({".metadata": "a" * 64, "state.pt": "b" * 64, "__0_0.distcp": "c" * 63}, "is not one"),
    ],
)
def test_a_hostile_sharded_entry_is_refused(files, why):
    with pytest.raises(ValueError, match=why):
        Entry.from_json(_entry(files))
    good = _entry({".metadata": "a" * 64, "state.pt": "b" * 64})
    assert Entry.from_json(good).files == ((".metadata", "a" * 64), ("state.pt", "b" * 64))
    with pytest.raises(ValueError, match="do not give its sha256"):
        Entry.from_json(good | {"files": {".metadata": "a" * 64, "state.pt": "c" * 64}})
