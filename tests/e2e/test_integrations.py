"""The framework integrations (elasticd.integrations) under `elasticd run`, 2 gloo CPU workers: a
worker's `kill -9` mid-training resumes the framework's own step counter from elasticd's memory
(the step before the kill, not the last disk checkpoint), exit 0, and the run ends bit-identical
to one never interrupted. Nothing is downloaded: tiny models built in the scripts."""

from __future__ import annotations

import importlib.util
import os
import re
import signal

import pytest
import torch

from harness import script

FLAGS = ("--nproc-per-node", "2", "--restart-grace", "1", "--max-restarts", "3")


def needs(*modules: str):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(
        bool(missing), reason=f"needs {', '.join(missing)}: pip install -e '.[integrations]'"
    )


def steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"^step (\d+)\b", text, re.M)]


def resumed_at(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"^resumed at (\d+)\b", text, re.M)]


def assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _args(tmp_path, run: str, total: int, disk: int) -> list[str]:
    """The script's (tests/scripts/*_train.py) with the integration on, refreshed every step."""
    out = ["--out", str(tmp_path / run), "--final", str(tmp_path / f"{run}.pt")]
    every = ["--steps", str(total), "--save-every", str(disk), "--memory-every", "1"]
    return [*out, *every, "--step-time", "0.03"]


def crash_and_compare(
    daemons, tmp_path, name: str, total: int, kill_at: int, disk: int, in_place: bool = False
):
    """A clean run and one whose rank 1 is SIGKILLed once rank 0 logged `kill_at`, side by side;
    returns the crashed run's rank 0 log of the attempt that resumed. `in_place`: with
    --in-place auto, rank 0 re-entered in its own process (the part of its log after it
    re-entered)."""
    clean = daemons(script(name), *FLAGS, name="clean", args=_args(tmp_path, "clean", total, disk))
    args = _args(tmp_path, "crashed", total, disk)
    flags = (*FLAGS, "--in-place", "auto" if in_place else "off")
    crashed = daemons(script(name), *flags, name="crashed", args=args)
    crashed.wait_for_step(0, kill_at, 120)
    before = max(steps(crashed.log_text(0)))
    pids = crashed.worker_pids()
    os.kill(pids[1], signal.SIGKILL)
    assert crashed.wait(180) == 0, crashed.stderr()[-3000:]
    assert clean.wait(180) == 0, clean.stderr()[-3000:]
    log = crashed.log_text(0)
    if in_place:
        assert len(crashed.attempt_dirs()) == 1, "no restart"
        replaced = [e for e in crashed.events() if e.get("event") == "replaced_in_place"]
        assert len(replaced) == 1 and replaced[0]["survivors"] == [pids[0]], replaced
        assert "in_place_fallback" not in log, log[-3000:]
        log = log.split("re_entered", 1)[1]  # rank 0's second run of the script
    else:
        assert len(crashed.attempt_dirs()) == 2, "one restart"
    (resumed,) = resumed_at(log)
    # every=1: memory holds the step before the kill (one more may have finished meanwhile);
    # the disk checkpoint is older (every `disk` steps)
    assert before - 1 <= resumed <= before + 2, (before, resumed)
    assert resumed > (before // disk) * disk or before % disk <= 2, (before, resumed)
    assert steps(log)[0] == resumed + 1, "the framework's own counter goes on from there"
    assert_same(torch.load(tmp_path / "clean.pt"), torch.load(tmp_path / "crashed.pt"))
    return log


@needs("pytorch_lightning")
def test_lightning_resumes_its_loop_from_memory_bit_identical(daemons, tmp_path):
    crash_and_compare(daemons, tmp_path, "lightning_train.py", 60, kill_at=33, disk=20)


@needs("transformers", "accelerate")
def test_transformers_trainer_resumes_its_state_from_memory_bit_identical(daemons, tmp_path):
    crash_and_compare(daemons, tmp_path, "transformers_train.py", 60, kill_at=33, disk=20)


@needs("accelerate")
def test_accelerate_recipe_resumes_from_memory_bit_identical(daemons, tmp_path):
    """docs/checkpoints.md's recipe: elasticd.checkpoint in an Accelerate loop."""
    crash_and_compare(daemons, tmp_path, "accelerate_train.py", 60, kill_at=33, disk=20)


FRAMEWORKS = [
    pytest.param("lightning_train.py", marks=needs("pytorch_lightning"), id="lightning"),
    pytest.param("transformers_train.py", marks=needs("transformers", "accelerate"), id="hf"),
    pytest.param("accelerate_train.py", marks=needs("accelerate"), id="accelerate"),
]


@pytest.mark.skipif(
    not hasattr(torch.distributed, "_reconfigure"), reason="in place needs torch>=2.14"
)
@pytest.mark.parametrize("name", FRAMEWORKS)
def test_each_framework_re_enters_in_place_bit_identical(daemons, tmp_path, name):
    """--in-place auto: the survivor's framework (Lightning's Trainer, transformers' Trainer over
    Accelerate's state, an Accelerate loop) unwinds from the failed collective, the script runs
    again in the same process, the framework's init finds the re-formed group, and its own step
    counter resumes from elasticd's memory: no restart, no fallback, bit-identical."""
    crash_and_compare(daemons, tmp_path, name, 60, kill_at=33, disk=20, in_place=True)
