"""Checkpoints through the daemon: crashes resume bit-exactly; stop saves and exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from elasticd import checkpoint
from harness import RESTART, ROOT, wait_until

ARGS = [
    "--steps",
    "60",
    "--checkpoint-every",
    "5",
    "--log-every",
    "1",
    "--samples",
    "1024",
    "--hidden",
    "32",
]
FLAGS = ("--nproc-per-node", "2", "--restart-grace", "1", "--max-restarts", "5")


def tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}[{i}]")


def final_state(directory, step: int = 60):
    state = checkpoint.load_latest(directory)
    assert state is not None and state["user"]["step"] == step
    return state


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="needs a GPU: NCCL, CUDA tensors in the in-memory state, CUDA RNG",
            ),
        ),
    ],
)
def test_kill_9_at_three_steps_resumes_bit_identical(daemons, tmp_path, device):
    nproc = torch.cuda.device_count() if device == "cuda" else 2
    flags = [*FLAGS[:1], str(nproc), *FLAGS[2:], *RESTART]
    args = [*ARGS, "--device", device]
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # the same cuBLAS kernels in every process
    # the fault-free job runs beside the crashed one (two jobs of their own: nothing is shared
    # but the machine), using the CPU the crashed one leaves idle while it sleeps and restarts
    clean = daemons(
        "entrypoints.train",
        *flags,
        "--checkpoint-dir",
        str(tmp_path / "clean"),
        name="clean",
        args=args,
        env=env,
    )
    crashed = daemons(
        "entrypoints.train",
        *flags,
        "--checkpoint-dir",
        str(tmp_path / "crashed"),
        name="crashed",
        args=[*args, "--step-delay", "0.05", "--memory-every", "1"],
        env=env,
    )
    for i, step in enumerate((12, 27, 44)):
        attempt = i + 1
        wait_until(
            lambda: re.search(rf"^step {step}/60", crashed.log_text(0, attempt), re.M),
            90,
            what=f"step {step} in attempt {attempt}",
        )
        victim = i % nproc
        os.kill(crashed.worker_pids()[victim], signal.SIGKILL)
        wait_until(lambda: len(crashed.attempt_dirs()) > attempt, 30, what="the restart")
    assert crashed.wait(120) == 0, crashed.stderr()[-3000:]
    assert clean.wait(120) == 0, clean.stderr()[-3000:]
    assert f"backend {'nccl' if device == 'cuda' else 'gloo'}" in clean.stdout()
    out = crashed.stdout()
    assert out.count("resumed from step") == 3
    # in-memory state: each resume loses at most the step in progress, not the work since the
    # last disk checkpoint (every 5 steps)
    resumed = [int(m) for m in re.findall(r"\[rank0\]: .*resumed from step (\d+)", out)]
    assert len(resumed) == 3 and all(r >= k - 1 for k, r in zip((12, 27, 44), resumed)), resumed
    recovered = [e for e in crashed.events() if e.get("event") == "recovered"]
    assert len(recovered) == 3
    for e in recovered:
        assert (
            e["torn_down"] <= e["spawned"] <= e["pg_ready"] <= e["state_loaded"] <= e["first_step"]
        ), e
    mem = [e["directory"] for e in crashed.events() if e.get("event") == "memory_state"]
    assert (
        len(mem) == 1 and mem[0].startswith("/dev/shm/") and not os.path.exists(mem[0])
    )  # removed at exit
    a, b = final_state(tmp_path / "clean"), final_state(tmp_path / "crashed")
    ta, tb = dict(tensors(a["model"])), dict(tensors(b["model"]))
    assert ta.keys() == tb.keys() and ta
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    oa, ob = dict(tensors(a["optimizer"])), dict(tensors(b["optimizer"]))
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa)
    # the daemon reports the checkpoints it sees, and never writes any itself
    seen = [e for e in crashed.events() if e.get("event") == "checkpoint_seen"]
    assert seen and all(str(tmp_path / "crashed") in e["path"] for e in seen)


def test_stop_saves_a_final_checkpoint_and_exits_0(daemons, tmp_path):
    d = daemons(
        "entrypoints.train",
        *FLAGS,
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--stop-grace",
        "20",
        args=["--steps", "100000", *ARGS[2:], "--step-delay", "0.02", "--checkpoint-every", "1000"],
    )
    wait_until(lambda: re.search(r"^step 20/", d.log_text(0), re.M), 90, what="training")
    r = subprocess.run(
        [sys.executable, "-m", "elasticd", "stop", "--socket", str(d.socket)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert d.wait(30) == 0
    assert "stopping at step" in d.stdout() and "checkpoint saved" in d.stdout()
    stopped_at = int(re.search(r"stopping at step (\d+)", d.stdout()).group(1))
    info = checkpoint.latest_info(tmp_path / "ck")
    assert info["step"] == stopped_at >= 20
    ev = [e for e in d.events() if e.get("event") == "workers_stopped"][-1]
    assert ev["exits"] == {"0": 0, "1": 0}


def test_default_job_is_the_bundled_example_on_nccl_or_gloo(daemons):
    """`elasticd run` with no entrypoint and no worker count: one worker per GPU with NCCL where
    there are GPUs, else two on the CPU with gloo (README's quick start)."""
    d = daemons(
        None, "--restart-grace", "1", args=["--steps", "20", "--log-every", "10", *ARGS[4:]]
    )
    assert d.wait(120) == 0, d.stderr()[-3000:]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = d.stdout()
    assert (
        f"training: world size {gpus or 2}, backend {'nccl' if gpus else 'gloo'}, steps 0->20"
        in out
    ), out[-2000:]
    assert "[rank0]: done: 20 steps" in out
