"""worker/threads.py's rule for torch's intra-op threads against real fresh `import torch`s: a
warm spare sets what a cold worker's import would choose from the same environment."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elasticd.worker import threads

torch = pytest.importorskip("torch")

ENVIRONMENTS = [  # each a fresh import of torch, a second or two of CPU
    {},
    {"OMP_NUM_THREADS": "64"},  # capped at the physical cores
    {"OMP_NUM_THREADS": "64", "MKL_DYNAMIC": "FALSE"},  # not capped
    {"OMP_NUM_THREADS": "2,4", "MKL_NUM_THREADS": "1"},  # MKL's wins; a list's first counts
]


def test_cold_count_is_what_a_fresh_import_chooses():
    base = {k: v for k, v in os.environ.items() if k not in threads.VARIABLES}
    code = "import torch; print(torch.get_num_threads())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for env in ENVIRONMENTS
    ]
    got = [int(p.communicate(timeout=120)[0]) for p in procs]
    mkl = torch.backends.mkl.is_available()
    assert got == [threads.cold_count(env, mkl) for env in ENVIRONMENTS], got


def test_the_import_watcher_stays_out_of_tracebacks(monkeypatch):
    """A warm spare's script whose import fails before its first `import torch`: the traceback
    shows the script's frame only, as cold, not the watcher's frame it passed through."""
    import builtins
    import traceback

    from elasticd.worker import bootstrap

    monkeypatch.setattr(builtins, "__import__", builtins.__import__)  # put back afterwards
    monkeypatch.setattr(threads, "_imported_with", {v: None for v in threads.VARIABLES})
    threads.follow([])
    with pytest.raises(ImportError) as info:
        import no_such_module_for_this_test  # noqa: F401
    raw = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert raw == ["test_the_import_watcher_stays_out_of_tracebacks", "watching_import"]
    shown = traceback.extract_tb(bootstrap.script_traceback(info.value.__traceback__))
    assert [f.name for f in shown] == ["test_the_import_watcher_stays_out_of_tracebacks"]
