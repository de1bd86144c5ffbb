"""Triage of a failure, pure: its class (what kind of trouble it is: the user's code, memory, the
hardware, a hang, the cluster, a stop), its signature (what makes two failures the same), which of
an attempt's failures came first (`first`: by time, a rank that died of another's going yielding;
`comes_first` between nodes' restart requests), and the repeat rule that calls a failure
deterministic. Plain data in, plain data out, so that a
table of cases checks every rule (tests/unit/lifecycle/test_triage.py).

Where each is decided: the class of a local worker's failure in daemon/group.py (its exit, the
error file's text, the OOM counters of daemon/oom.py), of the others where their RestartCause is
made (the default of each cause, states.py); a peer's class travels in its restart request. The
repeat verdict is the job's: the closing of the round after a failure compares the failure's
signature with the one the previous closing recorded (cluster/closing.py), so every node reads the
same verdict from the round's members.

`FailureClass` lists the classes (user, oom, hardware, hang, node_lost, store_unreachable, stop,
killed, rendezvous, scale, unknown); `classify` takes a worker's exit, error-file text and OOM
evidence, and never makes a failure `hardware` from its error text (the job writes that: a GPU
fault is the health check's to find). `signature` is the exception type and message with numbers
masked and the innermost user frame, else the exit code or signal. `repeats` is the
deterministic-failure rule (`--deterministic-retries`), and judges user, oom and hardware alike;
a failure its replay reproduced (daemon/replay_verdict.py) is deterministic the first time.
"""

from __future__ import annotations

import enum
import re
import signal

# what a rank meets when another rank, or its node, went away first: never the cause of a job's
# failure while another failure came before (the words, shared with the workers: peer_errors.py)
from elasticd.peer_errors import CONSEQUENCE_TEXTS, consequence  # noqa: F401 - this module's too

# the signals someone else sends to end a process: a death by one of them says nothing of the code
OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
# a shell or launcher between us and the process reports its signal death as 128 + N
SHELL_SIGNAL_BASE = 128
MAX_SIGNATURE = 600  # characters: the signature travels in the restart request


class FailureClass(str, enum.Enum):
    """What kind of trouble a failure is; the values are what status, the final line, the events
    and elasticd_failures_total{class} show."""

    USER = "user"
    """The user's code: an exception, a non-zero exit, a crash of its own (SIGSEGV, SIGABRT)."""
    OOM = "oom"
    """Out of memory: the kernel's OOM killer ended the worker (its cgroup's oom_kill counter or
    the host's went up with its SIGKILL) or its DataLoader worker (torch's error for it, with the
    counters up), or the error file says so (CUDA out of memory)."""
    HARDWARE = "hardware"
    """The node's hardware or health: a failed --health-check (which reads what the job cannot
    write: the driver's ECC counters, DCGM), or a worker's failure while the GPU driver itself
    reported a fault (daemon/driver.py: its Xid records, NVML's counters). Never a worker's own
    words: an error file that names
    a GPU fault (ECC, Xid) is as much the job's text as any other, and one data record or a
    `KeyError: 'xid'` must not condemn the node."""
    HANG = "hang"
    """A worker stopped beating, or stayed stopped or a zombie."""
    NODE_LOST = "node_lost"
    """A peer node went silent."""
    STORE_UNREACHABLE = "store_unreachable"
    """This node could not reach the rendezvous store."""
    STOP = "stop"
    """A stop request or signal."""
    KILLED = "killed"
    """A worker killed by a signal from outside (SIGKILL, SIGTERM, ...) that was no OOM kill, or
    one whose DataLoader worker was (torch's "DataLoader worker (pid N) is killed by signal:
    Killed.", the error the rank raises for it)."""
    RENDEZVOUS = "rendezvous"
    """The rendezvous itself failed (the store lost, the job failed elsewhere)."""
    SCALE = "scale"
    """Not a failure: nodes waiting to join."""
    SDC = "sdc"
    """Silent data corruption: the checkpoint library's audit of the replicas (checkpoint/audit.py)
    found a rank's parameters or optimizer state differ from the others', and every rank ended
    with names.SDC_EXIT (daemon/sdc.py judges it; never a repeat: a rank blamed again is the
    node's, and quarantines it)."""
    UNKNOWN = "unknown"
    """A peer's failure whose class it did not say (an older elasticd)."""


# error texts of memory exhaustion raised as an exception
OOM_TEXTS = re.compile(
    r"\bOutOfMemoryError\b|CUDA out of memory|\bMemoryError\b|out of memory", re.IGNORECASE
)
# torch's DataLoader's words for a worker of its (the rank's child) that died of SIGKILL, which the
# rank raises as its own error: the OOM killer's (the counters went up) or someone's kill, not the
# code's. "exited unexpectedly" names no signal: an OOM kill only where the counters say so. The
# words may follow a line break that the message's escaping made "\n" (the worker's note of a
# loader's exit status after torch's "exited unexpectedly": worker/loader_exits.py): no \b first
LOADER_KILLED = re.compile(
    r"DataLoader worker \(pid\(?s?\)? [\d, ]+\) is killed by signal: Killed\b"
)
LOADER_GONE = re.compile(r"DataLoader worker \(pid\(?s?\)? [\d, ]+\) exited unexpectedly")

_HEX = "[0-9a-fA-F]"
# what differs between attempts of the same failure, each as a regular expression and what it
# becomes, tried in order at each place: ids first (a uuid, a run of hex digits with a letter and
# a digit, a temporary file's random name), then hex addresses, then numbers (a sign where one
# can stand, decimals, dotted parts (an address, a version), an exponent; each size of a shape,
# 32x784). Digits glued to a letter before them are a name's (float32, conv2d, layer3.weight)
# and stay: another name, another failure.
_MASKS = {
    "ID": rf"(?<![0-9A-Za-z]){_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
    rf"|(?<![0-9A-Za-z])(?={_HEX}*[a-fA-F])(?={_HEX}*\d){_HEX}{{8,}}(?![0-9A-Za-z])"
    r"|(?<=\btmp)[a-z0-9_]{8}\b|(?<=\btorchelastic_)[a-z0-9_]{8}\b",
    "N": rf"(?<![0-9A-Za-z])0[xX]{_HEX}+"
    r"|(?:(?<![0-9A-Za-z.])|(?<=\dx))(?:[-+](?=\.?\d))?"
    r"(?:\d+(?:\.\d+)*|\.\d+)(?:[eE][-+]?\d+)?",
}
_MASK = re.compile("|".join(f"(?P<{name}>{rx})" for name, rx in _MASKS.items()))
# "File "/path/x.py", line 12, in main" in a Python traceback
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
# paths that are not the user's code: the interpreter's library, installed packages, elasticd
_LIBRARY = re.compile(
    r"/lib/python\d[\d.]*/|site-packages/|dist-packages/|/elasticd/(worker|checkpoint|daemon)/"
    r"|^<frozen "
)


def mask_numbers(text: str) -> str:
    """Numbers as N (a step, a port, a pid, a pointer, a loss: -0.2718, 3.2e-05, 0x7f3a2c00) and
    ids as ID (a uuid, a hex digest, a temporary file's name): what differs between attempts of
    the same failure. A table of real messages: tests/unit/lifecycle/test_triage.py."""
    return _MASK.sub(lambda m: m.lastgroup or "N", text)


def user_frame(callstack: str | None) -> str:
    """The innermost frame of the user's code in a Python traceback, as FILE:LINE in FUNCTION
    (the file's base name: nodes may run the job from different checkouts); "" when none."""
    found = ""
    for line in (callstack or "").splitlines():
        m = _FRAME.match(line)
        if m and not _LIBRARY.search(m["path"]):
            found = f"{m['path'].rsplit('/', 1)[-1]}:{m['line']} in {m['func'].strip()}"
    return found


def signature(exit_code: int | None, exception: str | None, callstack: str | None) -> str:
    """What makes two failures of a worker the same: the exception's type and message, numbers
    masked, and the innermost frame of user code (the error file); else the exit code or the
    signal."""
    if exception:
        frame = user_frame(callstack)
        text = mask_numbers(exception.strip())
        return (f"{text} at {frame}" if frame else text)[:MAX_SIGNATURE]
    if exit_code is None:
        return ""
    if exit_code < 0:
        return f"signal {_signal_name(-exit_code)}"
    return f"exit code {exit_code}"


def at_step(step: int | None) -> str:
    """Where in the training a failure happened, as the repeat rule compares it."""
    return f"step {step}" if step is not None and step >= 0 else "before the first step"


def classify(
    exit_code: int | None,
    exception: str | None,
    oom_killed: bool,
    hung: bool = False,
    driver_fault: bool = False,
) -> FailureClass:
    """The class of a local worker's failure: `exit_code` (negative: a signal), the error file's
    text (`exception`: its message, and its traceback where the message is empty), whether the
    OOM counters went up with its death (daemon/oom.py), and whether the GPU driver reported a
    hardware fault meanwhile (`driver_fault`: daemon/driver.py, the driver's own Xid records and
    counters). The text names no hardware fault here: the job writes it (a GPU fault is the
    driver's or the health check's to find, `HARDWARE`)."""
    if driver_fault:  # the cause, whatever followed: an exit, a hang
        return FailureClass.HARDWARE
    if hung:
        return FailureClass.HANG
    text = exception or ""
    if OOM_TEXTS.search(text):
        return FailureClass.OOM
    killed_by = _signal_of(exit_code)
    if killed_by == signal.SIGKILL and oom_killed:
        return FailureClass.OOM
    loader_killed = LOADER_KILLED.search(text)
    if loader_killed or LOADER_GONE.search(text):
        if oom_killed:  # the counters went up with the rank's exit (daemon/oom.py)
            return FailureClass.OOM
        if loader_killed:
            return FailureClass.KILLED
    if killed_by in OUTSIDE_SIGNALS and not text:
        return FailureClass.KILLED
    return FailureClass.USER


def judged(klass: FailureClass) -> bool:
    """Whether the repeat rule judges failures of this class: every class a worker's own failure
    can have (user, oom, hardware: no class exempts the same failure at the same step from being
    called deterministic, so no text a worker writes buys endless retries). A hang or an outside
    kill is not the code's doing, and has no signature of the worker's own."""
    return klass in (FailureClass.USER, FailureClass.OOM, FailureClass.HARDWARE)


def repeats(
    previous: tuple[str, int] | None, current: str | None, retries: int, reproduced: bool = False
) -> tuple[int, bool]:
    """The repeat rule: (how many consecutive attempts ended in this same failure, whether it is
    deterministic). `previous`: the signature and count the closing before this one recorded, None
    where it recorded none (a node lost, a scale event, a first failure); `current`: this
    failure's key (signature and step), None where the rule does not judge it; `retries`: how many
    identical repeats are retried (--deterministic-retries; 0: never called deterministic);
    `reproduced`: a replay of the failed step from its repro bundle gave the same failure
    (daemon/replay_verdict.py): deterministic at its first time, no second failure needed."""
    if not current:
        return 0, False
    count = previous[1] + 1 if previous is not None and previous[0] == current else 1
    return count, retries > 0 and (count > retries or reproduced)


def _signal_of(exit_code: int | None) -> int | None:
    if exit_code is None or exit_code == 0:
        return None
    if exit_code < 0:
        return -exit_code
    if SHELL_SIGNAL_BASE < exit_code < SHELL_SIGNAL_BASE + 65:
        return exit_code - SHELL_SIGNAL_BASE
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


# seconds by which a failure named a consequence may come before the failure it follows: clocks
# of different nodes, and the daemon's view of an exit (its poll) that comes after the fact
CLOCK_SLACK = 1.0


def first(failures: list[tuple[float, bool]]) -> list[int]:
    """The failures of an attempt in the order they are told (their indexes): the cause first,
    then the consequences by time. `failures`: (when it happened, Unix time; whether its text is
    a consequence's). The earliest is the cause, unless its text is a consequence's and a failure
    that is not came at most CLOCK_SLACK after it: then the earliest of those."""
    by_time = sorted(range(len(failures)), key=lambda i: (failures[i][0], i))
    if not by_time:
        return []
    cause = by_time[0]
    if failures[cause][1]:
        primary = [i for i in by_time if not failures[i][1]]
        if primary and failures[primary[0]][0] <= failures[cause][0] + CLOCK_SLACK:
            cause = primary[0]
    return [cause, *(i for i in by_time if i != cause)]


def comes_first(ours: dict, theirs: dict) -> bool:
    """Whether our restart request's failure comes before theirs (`first`), so that ours should
    take its place: both a failure's that spends the budget, with its time (`at`; a request of an
    older elasticd has none, and stays); or ours names a lost node that went quiet before theirs,
    a rank's death of a closed connection, happened (or at most CLOCK_SLACK after: clocks)."""
    times = [r.get("at") for r in (theirs, ours)]
    if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in times):
        return False
    if ours.get("lost") and not ours.get("spends"):
        return bool(theirs.get("spends") and theirs.get("consequence")) and (
            times[1] <= times[0] + CLOCK_SLACK
        )
    if not (ours.get("spends") and theirs.get("spends")):
        return False
    return (
        first(
            [(times[0], bool(theirs.get("consequence"))), (times[1], bool(ours.get("consequence")))]
        )[0]
        == 1
    )
