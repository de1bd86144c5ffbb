"""worker/loader_exits.py: a DataLoader's "exited unexpectedly" gains its worker's exit status,
from torch's own frame, with a real loader and a real worker process ended by a real signal or
exit; and the error file's message carries it, where the daemon's triage reads it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
from torch.utils.data import DataLoader, Dataset

from elasticd.lifecycle import triage
from elasticd.worker import bootstrap, loader_exits


class Ends(Dataset):
    """Item 0 ends its worker as asked (a code, or waiting to be killed)."""

    def __init__(self, code: int | None) -> None:
        self.code = code

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        if self.code is not None:
            os._exit(self.code)
        time.sleep(60)
        return i


def _error_of_a_loader(code: int | None) -> RuntimeError:
    """torch's "exited unexpectedly": the loader made off the main thread (torch's SIGCHLD
    handler, which names the cause, is the main thread's), its worker ended by `code` or, where
    None, SIGKILLed by the test."""
    got: list[BaseException] = []

    def run() -> None:
        batches = iter(DataLoader(Ends(code), num_workers=1, timeout=1))
        if code is None:
            deadline = time.monotonic() + 30
            while not (workers := psutil.Process().children()):
                assert time.monotonic() < deadline, "no loader worker"
                time.sleep(0.02)
            for w in workers:
                w.send_signal(signal.SIGKILL)
        try:
            next(batches)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and got, "the loader never failed"
    assert isinstance(got[0], RuntimeError) and "exited unexpectedly" in str(got[0]), got
    return got[0]


@pytest.mark.parametrize(
    ("code", "words", "klass"),
    [
        (None, "is killed by signal: Killed.", triage.FailureClass.KILLED),
        (3, "exited with code 3.", triage.FailureClass.USER),
    ],
)
def test_exited_unexpectedly_gains_the_worker_s_exit_status(
    tmp_path, monkeypatch, code, words, klass
):
    exc = _error_of_a_loader(code)
    pid = int(loader_exits.GONE.search(str(exc))["pids"])
    loader_exits.note(exc)
    assert exc.__notes__ == [f"DataLoader worker (pid {pid}) {words} (elasticd: its exit status)"]
    # the error file's message carries it, and the daemon classifies what it reads there
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    bootstrap.write_error_file(exc)
    message = json.loads(path.read_text())["message"]["message"]
    assert message.endswith(f"exited unexpectedly\n{exc.__notes__[0]}"), message
    from elasticd.daemon import spawn

    read, _stack = spawn.read_error_report(path)
    assert triage.classify(1, read, oom_killed=False) is klass
    if klass is triage.FailureClass.KILLED:  # the OOM killer's, where the counters went up
        assert triage.classify(1, read, oom_killed=True) is triage.FailureClass.OOM


def test_other_errors_and_a_chain_without_the_processes_gain_nothing():
    plain = RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
    loader_exits.note(plain)  # raised by hand: no frame holds worker 4242
    assert not getattr(plain, "__notes__", None)
    other = ValueError("DataLoader worker (pid(s) 4242) exited unexpectedly")
    loader_exits.note(other)
    assert not getattr(other, "__notes__", None)


def test_a_signal_s_name_and_an_unknown_signal():
    assert loader_exits.said(7, -signal.SIGSEGV).endswith(
        "is killed by signal: Segmentation fault. (elasticd: its exit status)"
    )
    assert "is killed by signal: " in loader_exits.said(7, -200)


class _Hostile:
    @property
    def __dict__(self):
        raise RuntimeError("an attribute that raises")


def test_an_object_whose_attributes_raise_leaves_the_error_as_it_was():
    """note runs before the error file is written: a script's object in the frames whose
    attributes raise must not cost the rank its error file."""

    def fail() -> None:
        hostile = _Hostile()  # noqa: F841 - a local of the failing frame
        raise RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")

    with pytest.raises(RuntimeError) as got:
        fail()
    loader_exits.note(got.value)
    assert not getattr(got.value, "__notes__", None)


# a script's main thread: a loader (torch's SIGCHLD handler installed) whose worker dies unseen
# (the signal's handler held aside meanwhile), then an error of another kind (the resource
# sharer's reset) handled by the bootstrap's run_once, where the signal comes in late: it prints
# how run_once ended and the error file's message
RESET_WHILE_LOADER_DIES = """
import json, os, signal, time
import psutil
from torch.utils.data import DataLoader, Dataset
from elasticd.worker import bootstrap

class Slow(Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        time.sleep(60)
        return i

batches = iter(DataLoader(Slow(), num_workers=1))
torch_handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # SIG_DFL: the zombie stays
worker = psutil.Process().children()[0]
worker.kill()
while worker.status() != psutil.STATUS_ZOMBIE:
    time.sleep(0.01)
signal.signal(signal.SIGCHLD, torch_handler)

def script(*args):
    raise ConnectionResetError(104, "Connection reset by peer")

def signalled_then_written(exc):
    os.kill(os.getpid(), signal.SIGCHLD)  # the loader's death, signalled late
    time.sleep(0.2)
    real(exc)

bootstrap.run_entrypoint = script
real = bootstrap.write_error_file
bootstrap.write_error_file = signalled_then_written
try:
    bootstrap.run_once("x", [])
except SystemExit as e:
    print("exit", e.code)
print(json.load(open(os.environ["TORCHELASTIC_ERROR_FILE"]))["message"]["message"])
"""


def test_a_loader_s_death_signalled_while_the_bootstrap_handles_another_error(tmp_path):
    """The chaos soak: the script unwound with the resource sharer's ConnectionResetError, and
    torch's SIGCHLD handler raised its "killed by signal" inside the bootstrap's handling of it;
    the rank died without an error file, its failure taken for its own. The handler is held
    while a failure is handled and asked where the error is written: a note says it."""
    import subprocess
    import sys

    path = tmp_path / "error.json"
    out = subprocess.run(
        [sys.executable, "-c", RESET_WHILE_LOADER_DIES],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(path)},
    )
    assert "exit 1" in out.stdout, out.stdout + out.stderr
    message = out.stdout.split("exit 1\n", 1)[1].strip()
    assert message.startswith("ConnectionResetError: [Errno 104] Connection reset by peer\n")
    assert "is killed by signal: Killed." in message, message
    assert triage.classify(1, message.replace("\n", "\\n"), False) is triage.FailureClass.KILLED
