"""elasticd.checkpoint with real processes: gloo ranks on CPU, SIGKILL at random instants, a
disk that fills up, hostile files, and a bit-exact resume of a training loop."""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog
import torch
from structlog.testing import capture_logs

import _ckpt_helpers as helpers
from elasticd import checkpoint
from elasticd.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture,
    load_file,
    load_latest,
    restore,
    stop,
)
from elasticd.checkpoint.disk import files
from elasticd.checkpoint.disk.snapshot import Snapshot
from elasticd.sampler import ResumableDistributedSampler


def manager(directory, **kw) -> CheckpointManager:
    kw.setdefault("handle_sigterm", False)  # never touch the test process's own signals
    return CheckpointManager(directory, **kw)


def ckpt_files(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("ckpt-"))


def events(logs, name):
    return [e for e in logs if e["event"] == name]


# -- saving ----------------------------------------------------------------------------------------


def test_save_load_keep_and_manifest(tmp_path):
    mgr = manager(tmp_path, keep=2)
    for step in (1, 2, 3):
        stall = mgr.save(
            step,
            {
                "step": step,
                "w": torch.full((3,), float(step)),
                "sampler": {"epoch": 1, "consumed": 10 * step},
            },
        )
        assert isinstance(stall, float) and stall >= 0
    assert mgr.wait().step == 3
    assert len(ckpt_files(tmp_path)) == 2
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert doc["format"] == checkpoint.FORMAT and doc["latest"] == ckpt_files(tmp_path)[-1]
    e = doc["checkpoints"][-1]
    assert (e["step"], e["epoch"], e["position"], e["world_size"]) == (3, 1, 30, 1)
    assert e["bytes"] == (tmp_path / e["file"]).stat().st_size and len(e["sha256"]) == 64
    assert e["file"] == f"ckpt-{3:012d}-{e['sha256'][:16]}.pt" and e["time"] > 0
    state = load_latest(tmp_path)
    assert state["step"] == 3 and torch.equal(state["w"], torch.full((3,), 3.0))
    assert checkpoint.latest_info(tmp_path)["step"] == 3
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_directory_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTICD_CHECKPOINT_DIR", str(tmp_path / "env"))
    mgr = manager(None)
    mgr.save(5, {"x": 1})
    mgr.close()
    assert load_latest()["x"] == 1
    monkeypatch.delenv("ELASTICD_CHECKPOINT_DIR")
    with pytest.raises(ValueError, match="ELASTICD_CHECKPOINT_DIR"):
        manager(None)


def test_save_is_a_snapshot_and_persists_in_the_background(tmp_path, monkeypatch):
    """The blocking part is the host copy only; the write happens later, one save in flight."""
    real = files.write_checkpoint

    def slow_write(*a, **kw):
        time.sleep(0.4)
        return real(*a, **kw)

    monkeypatch.setattr(files, "write_checkpoint", slow_write)
    mgr = manager(tmp_path, keep=5)
    w = torch.zeros(1000)
    first = mgr.save(1, {"w": w})
    w.add_(1)  # training goes on while the save is in flight
    assert first < 0.2, first
    assert mgr._thread is not None and mgr._thread.is_alive()
    second = mgr.save(2, {"w": w})  # waits for the first: at most one in flight
    assert second >= 0.2, second
    assert mgr.last_stall == second
    mgr.wait()
    assert mgr.last_write >= 0.4
    monkeypatch.setattr(files, "write_checkpoint", real)
    mgr.save(3, {"w": torch.arange(5.0)})  # host buffers are reused: a new shape gets a new one
    mgr.save(4, {"w": w * 7})
    mgr.close()
    got = [load_file(tmp_path / f)["w"] for f in ckpt_files(tmp_path)]
    assert [g.tolist() for g in got] == [
        [0.0] * 1000,
        [1.0] * 1000,
        [0.0, 1.0, 2.0, 3.0, 4.0],
        [7.0] * 1000,
    ]


def test_unsafe_state_is_refused_at_save(tmp_path):
    mgr = manager(tmp_path)
    with pytest.raises(TypeError, match=r"state\['bad'\].*weights_only"):
        mgr.save(1, {"ok": 1, "bad": object()})
    np = pytest.importorskip("numpy")
    mgr.save(2, {"best": np.float64(0.5), "n": np.int64(3), "flag": np.bool_(True)})
    mgr.close()
    state = load_latest(tmp_path)
    assert state == {"best": 0.5, "n": 3, "flag": True}
    assert [type(v) for v in state.values()] == [float, int, bool]


def test_crash_at_any_instant_leaves_a_verifying_checkpoint(tmp_path):
    """SIGKILL a writer saving back to back, 15 times at random instants: every time the
    directory loads a complete checkpoint, and no torn one is ever visible."""
    rng = random.Random(1234)
    last = 0
    for i in range(15):
        proc = helpers.start_saver(str(tmp_path))
        try:
            if i == 0:  # the first run must get something on disk
                deadline = time.monotonic() + 20
                while checkpoint.latest_info(tmp_path) is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.25))
        finally:
            proc.kill()
            proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        with capture_logs() as logs:
            state = load_latest(tmp_path)
        assert not events(logs, "checkpoint_skipped"), logs
        assert state is not None
        assert torch.equal(state["w"], torch.full((256, 1024), float(state["step"])))
        assert state["tag"] == f"s{state['step']}"
        assert state["step"] >= last
        last = state["step"]
        json.loads((tmp_path / "manifest.json").read_text())  # never torn either
    assert last > 15
    mgr = manager(tmp_path, keep=2)  # the next writer sweeps what killed writers left behind
    mgr.save(last + 1, {"step": last + 1})
    mgr.close()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(ckpt_files(tmp_path)) == 2


def test_disk_full_keeps_previous_checkpoint(tmp_path):
    result = tmp_path / "result.txt"
    d = tmp_path / "ckpt"
    helpers.run(helpers.fill_disk, 1, tmp_path, str(d), str(result), distributed=False)
    got = ast.literal_eval(result.read_text())
    assert got["message"].startswith("CheckpointError: saving a checkpoint in"), got
    assert "the previous checkpoint is intact" in got["message"]
    assert "File too large" in got["message"] and "file size limit is full" in got["message"]
    assert got["stall"] < 5
    # Right after the failure: only step 1, no temporary file, and step 1 is still latest.
    ckpts = [n for n in got["files"] if n.startswith("ckpt-")]
    assert len(ckpts) == 1 and ckpts[0].startswith("ckpt-000000000001-") and got["latest"] == 1
    assert not [n for n in got["files"] if n.endswith(".tmp")]
    # Once space is back the next save works.
    assert load_latest(d)["step"] == 3


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    mgr = manager(blocker / "ckpt")
    mgr.save(1, {"x": 1})
    with pytest.raises(CheckpointError, match="saving a checkpoint in"):
        mgr.wait()
    mgr2 = manager(blocker / "ckpt", errors="log")
    with capture_logs() as logs:
        mgr2.save(1, {"x": 1})
        mgr2.save(2, {"x": 1})
        mgr2.close()
    assert len(events(logs, "checkpoint_save_failed")) == 2 and mgr2.last_error is not None


# -- loading ---------------------------------------------------------------------------------------


def test_truncated_newest_falls_back_to_previous(tmp_path):
    mgr = manager(tmp_path)
    for step in (1, 2):
        mgr.save(step, {"step": step, "w": torch.randn(100)})
    mgr.close()
    newest = tmp_path / ckpt_files(tmp_path)[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with capture_logs() as logs:
        state = manager(tmp_path).load_latest()
    assert state["step"] == 1
    skipped = events(logs, "checkpoint_skipped")
    assert (
        len(skipped) == 1
        and skipped[0]["path"] == str(newest)
        and skipped[0]["log_level"] == "warning"
    )
    assert "checksum mismatch" in skipped[0]["reason"]
    # Rendered, it is one line that names the file.
    out = io.StringIO()
    structlog.configure(
        processors=[structlog.processors.JSONRenderer()],
        logger_factory=structlog.WriteLoggerFactory(file=out),
    )
    try:
        load_latest(tmp_path)
    finally:
        structlog.reset_defaults()
    line = [ln for ln in out.getvalue().splitlines() if "checkpoint_skipped" in ln]
    assert len(line) == 1 and json.loads(line[0])["path"] == str(newest)


def test_corrupt_or_missing_manifest_falls_back_to_scanning(tmp_path):
    mgr = manager(tmp_path)
    for step in (1, 2, 3):
        mgr.save(step, {"step": step})
    mgr.close()
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"format": 1, "checkpoints": [{"fi')
    with capture_logs() as logs:
        assert load_latest(tmp_path)["step"] == 3
    assert events(logs, "checkpoint_manifest_unreadable")
    manifest.write_text(json.dumps({"format": 99, "checkpoints": "whatever"}))
    with capture_logs() as logs:
        assert load_latest(tmp_path)["step"] == 3
    assert events(logs, "checkpoint_manifest_unknown_format")
    manifest.unlink()
    assert load_latest(tmp_path)["step"] == 3
    (tmp_path / ckpt_files(tmp_path)[-1]).write_bytes(
        b"garbage"
    )  # scanned: name holds the checksum
    with capture_logs():
        assert load_latest(tmp_path)["step"] == 2
    mgr = manager(tmp_path, keep=2)  # and the next save writes a good manifest again
    mgr.save(4, {"step": 4})
    mgr.close()
    assert [e["step"] for e in json.loads(manifest.read_text())["checkpoints"]] == [3, 4]  # keep=2


def test_crafted_manifest_cannot_reach_outside_the_directory(tmp_path):
    d = tmp_path / "ckpt"
    victim = tmp_path / "precious.pt"
    victim.write_bytes(b"keep me")
    mgr = manager(d, keep=1)
    mgr.save(1, {"step": 1})
    mgr.close()
    doc = json.loads((d / "manifest.json").read_text())
    doc["checkpoints"].insert(0, {**doc["checkpoints"][0], "file": "../precious.pt", "time": 0})
    (d / "manifest.json").write_text(json.dumps(doc))
    with capture_logs() as logs:
        mgr = manager(d, keep=1)
        mgr.save(2, {"step": 2})
        mgr.close()
        assert load_latest(d) == {"step": 2}
    assert events(logs, "checkpoint_manifest_unreadable")
    assert victim.read_bytes() == b"keep me"


def test_reads_a_format_1_layout(tmp_path):
    """The on-disk contract, written by hand: later versions must keep reading it."""
    payload = {"format": 1, "step": 7, "meta": {"step": 7}, "state": {"a": torch.arange(3)}}
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    name = f"ckpt-000000000007-{sha[:16]}.pt"
    (tmp_path / name).write_bytes(data)
    (tmp_path / "manifest.json").write_text(
        json.dumps(
            {
                "format": 1,
                "latest": name,
                "checkpoints": [
                    {
                        "file": name,
                        "step": 7,
                        "epoch": 0,
                        "position": 12,
                        "world_size": 2,
                        "time": 1.0,
                        "bytes": len(data),
                        "sha256": sha,
                    }
                ],
            }
        )
    )
    assert torch.equal(load_latest(tmp_path)["a"], torch.arange(3))
    assert checkpoint.latest_info(tmp_path)["position"] == 12


class Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "ckpt"
    mgr = manager(d)
    mgr.save(1, {"step": 1})
    mgr.close()
    time.sleep(0.01)
    import hashlib

    for i, data in enumerate(
        [
            None,  # a torch.save zip file with the pickle inside
            pickle.dumps(
                {"format": 1, "step": 9, "state": Evil(str(marker))}, protocol=2
            ),  # a bare pickle
        ]
    ):
        if data is None:
            buf = io.BytesIO()
            torch.save({"format": 1, "step": 9, "meta": {}, "state": {"x": Evil(str(marker))}}, buf)
            data = buf.getvalue()
        sha = hashlib.sha256(data).hexdigest()  # a valid checksum: weights_only must stop it
        path = d / f"ckpt-{9 + i:012d}-{sha[:16]}.pt"
        path.write_bytes(data)
        with capture_logs() as logs:
            assert load_latest(d) == {"step": 1}
        (skipped,) = events(logs, "checkpoint_skipped")
        assert skipped["path"] == str(path) and "weights_only" in skipped["reason"]
        with pytest.raises(ValueError, match="weights_only"):
            load_file(path)
        path.unlink()
    assert not marker.exists()


# -- capture / restore -----------------------------------------------------------------------------


def test_capture_restore_single_process_unwraps_and_restores_rng(tmp_path):
    import numpy as np

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sampler = ResumableDistributedSampler(list(range(10)), num_replicas=1, rank=0)
    sampler.advance(4)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    state = capture(model=model, optimizer=opt, scaler=scaler, sampler=sampler, step=12, best=0.25)
    expected = (torch.rand(3), random.random(), np.random.rand())
    buf = io.BytesIO()
    torch.save(Snapshot().take(state), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert set(state["model"]) == {"0.weight", "0.bias"}

    model2 = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    sampler2 = ResumableDistributedSampler(list(range(10)), num_replicas=1, rank=0)
    scaler2 = torch.amp.GradScaler("cpu")
    torch.manual_seed(0)
    user = restore(state, model=model2, optimizer=opt2, scaler=scaler2, sampler=sampler2)
    assert user == {"step": 12, "best": 0.25}
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values())
    )
    assert (
        opt2.param_groups[0]["lr"] == 0.1
        and sampler2.consumed == 4
        and scaler2.get_scale() == 128.0
    )
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]
    with pytest.raises(KeyError, match="scheduler"):
        restore(state, scheduler=torch.optim.lr_scheduler.StepLR(opt2, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_capture_reads_cuda_rng_only_in_a_process_that_uses_cuda():
    """A CPU job on a GPU machine must not create a CUDA context on every GPU (nor fail in a
    process forked from one that touched CUDA) just to save RNG states it never drew from."""
    code = (
        "import torch\n"
        "from elasticd.checkpoint import capture\n"
        "s = capture(model=torch.nn.Linear(2, 2))\n"
        "assert 'cuda' not in s['rng']['ranks'][0] and not torch.cuda.is_initialized()\n"
        "torch.ones(1, device='cuda')\n"
        "s = capture()\n"
        "assert len(s['rng']['ranks'][0]['cuda']) == torch.cuda.device_count()\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_rng_state_per_rank_and_derived_for_new_ranks(tmp_path, monkeypatch):
    helpers.run(helpers.gather_rng, 2, tmp_path, str(tmp_path / "rng"), timeout=60)
    got = [torch.load(tmp_path / f"rng.{r}.pt", weights_only=True) for r in range(2)]
    state = got[0]["state"]
    assert state["rng"]["world_size"] == 2
    for r in range(2):  # restored as rank r, the process draws what rank r would have drawn
        monkeypatch.setenv("RANK", str(r))
        restore(state)
        assert torch.equal(torch.rand(4), got[r]["next"])
    monkeypatch.setenv("RANK", "2")  # a rank the checkpoint never had
    restore(state)
    a = torch.rand(4)
    restore(state)
    assert torch.equal(torch.rand(4), a) and not any(torch.equal(a, g["next"]) for g in got)


@pytest.mark.parametrize("like_nccl", [False, True])
def test_broadcast_restore_only_the_sender_has_the_directory(tmp_path, like_nccl):
    """Two 'nodes' without a shared filesystem: each rank reads only its own directory."""
    d0, d1, empty = tmp_path / "node0", tmp_path / "node1", tmp_path / "nothing"
    mgr = manager(d0)
    mgr.save(5, {"step": 5, "w": torch.randn(64, 64), "name": "from node0"})
    mgr.close()
    d0_file = ckpt_files(d0)[0]
    mgr = manager(d1)  # node1 holds newer ones (rank 0 moved between rounds); its newest is torn
    mgr.save(8, {"step": 8, "w": torch.randn(8), "name": "from node1"})
    mgr.save(9, {"step": 9, "w": torch.randn(8), "name": "torn"})
    mgr.close()
    torn = d1 / ckpt_files(d1)[-1]
    torn.write_bytes(torn.read_bytes()[:100])
    scenarios = [
        [str(d0), str(empty)],
        [str(empty), str(d1)],
        [str(d0), str(d1)],
        [str(empty), str(empty)],
    ]
    helpers.run(
        helpers.load_from, 2, tmp_path, scenarios, str(tmp_path / "got"), like_nccl, timeout=60
    )
    got = [torch.load(tmp_path / f"got.{r}.pt", weights_only=True) for r in range(2)]
    for r0, r1 in zip(*got):
        assert r0["file"] == r1["file"]
        if r0["state"] is None:
            assert r1["state"] is None
            continue
        assert r0["state"]["name"] == r1["state"]["name"]
        assert torch.equal(r0["state"]["w"], r1["state"]["w"])
    names = [g["state"] and g["state"]["name"] for g in got[0]]
    assert names == ["from node0", "from node1", "from node1", None]
    assert got[1][0]["file"] == d0_file
    assert torch.equal(got[1][0]["state"]["w"], load_latest(d0)["w"])


# -- exact resume ----------------------------------------------------------------------------------


def final_tensors(path):
    got = torch.load(path, weights_only=True)
    return {
        **{f"model.{k}": v for k, v in got["model"].items()},
        **{f"opt.{k}.{n}": t for k, s in got["optimizer"]["state"].items() for n, t in s.items()},
    }


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_is_bit_exact_single_process(tmp_path):
    helpers.train(0, 1, str(tmp_path / "ref"), 14, str(tmp_path / "ref"), None)
    helpers.train(0, 1, str(tmp_path / "run"), 14, None, crash_after=10)  # saved at 8, lost 9-10
    assert checkpoint.latest_info(tmp_path / "run")["step"] == 8
    helpers.train(0, 1, str(tmp_path / "run"), 14, str(tmp_path / "run"), None)
    assert_identical(final_tensors(tmp_path / "ref.0.pt"), final_tensors(tmp_path / "run.0.pt"))
    # Restoring all but the RNG states gives other weights (dropout): the test can tell.
    helpers.train(0, 1, str(tmp_path / "norng"), 14, None, crash_after=10)
    helpers.train(0, 1, str(tmp_path / "norng"), 14, str(tmp_path / "norng"), None, rng=False)
    ref = final_tensors(tmp_path / "ref.0.pt")
    assert not all(
        torch.equal(v, final_tensors(tmp_path / "norng.0.pt")[k]) for k, v in ref.items()
    )


def test_resume_is_bit_exact_with_two_gloo_ranks(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    procs_ref = helpers.start(helpers.train, 2, tmp_path, str(ref), 14, str(ref), None)
    assert helpers.join(procs_ref, 90) == [0, 0]
    helpers.run(
        helpers.train, 2, tmp_path, str(run), 14, None, 10, timeout=90
    )  # crash after step 10
    info = checkpoint.latest_info(run)
    assert (info["step"], info["epoch"], info["position"], info["world_size"]) == (8, 1, 16, 2)
    helpers.run(helpers.train, 2, tmp_path, str(run), 14, str(run), None, timeout=90)
    for r in range(2):
        assert_identical(final_tensors(f"{ref}.{r}.pt"), final_tensors(f"{run}.{r}.pt"))


# -- stopping --------------------------------------------------------------------------------------


def _step(progress: Path) -> int:
    """The step a rank last wrote (0 before its first): read once, since the rank rewrites the
    file in place every step (two reads could see it written, then truncated: '' in CI)."""
    try:
        text = progress.read_text()
    except FileNotFoundError:
        return 0
    return int(text) if text.strip().isdigit() else 0


def test_sigterm_to_one_rank_saves_and_stops_every_rank(tmp_path):
    d, progress, out = tmp_path / "ckpt", tmp_path / "progress", tmp_path / "stopped"
    procs = helpers.start(helpers.until_stopped, 2, tmp_path, str(d), str(progress), str(out))
    try:
        deadline = time.monotonic() + 30
        while _step(progress) < 5:
            assert time.monotonic() < deadline, "ranks never got going"
            time.sleep(0.02)
        os.kill(procs[1].pid, signal.SIGTERM)
    finally:
        codes = helpers.join(procs, 60)
    assert codes == [0, 0]
    stopped = [int(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert stopped[0] == stopped[1] < 3000
    state = load_latest(d)
    assert state["user"]["step"] == stopped[0]
    assert torch.equal(state["user"]["w"], torch.full((3,), 2.0 * stopped[0]))


def test_sigterm_while_stuck_still_ends_the_process(tmp_path):
    progress = tmp_path / "progress"
    (proc,) = helpers.start(
        helpers.stuck_after_sigterm, 1, tmp_path, str(progress), distributed=False
    )
    try:
        deadline = time.monotonic() + 30
        while not progress.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(10)
        took = time.monotonic() - t0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert proc.exitcode == 128 + signal.SIGTERM
    assert took < 5, took


def test_maybe_save_cadence(tmp_path, monkeypatch):
    mgr = manager(tmp_path, every_steps=3, every_seconds=3600)
    saved = [s for s in range(1, 10) if mgr.maybe_save(s, {"s": s})]
    assert saved == [3, 6, 9]
    mgr._last_time -= 4000  # an hour passed
    assert mgr.maybe_save(10, {"s": 10}) and not mgr.maybe_save(11, {"s": 11})
    assert not mgr.should_stop()
    monkeypatch.setattr(stop.PROCESS, "requested", type(stop.PROCESS.requested)())
    checkpoint.request_stop()
    assert mgr.maybe_save(12, {"s": 12})  # the final save
    assert mgr.should_stop() and not mgr.maybe_save(13, {"s": 13})
    mgr.close()
    assert load_latest(tmp_path) == {"s": 12}
