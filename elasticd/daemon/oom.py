"""Whether the kernel's OOM killer ended a worker, without dmesg (`Counters`, read as an attempt
starts): a SIGKILL looks the same whoever sent it, but an OOM kill also raises counters the kernel
keeps. Two are read: the oom_kill count of the worker's memory cgroup (cgroup v2 `memory.events`, v1
`memory.oom_control`), exact for a cgroup's limit, and the host's /proc/vmstat `oom_kill`, which
every OOM kill raises (a cgroup's or the whole machine's). A counter that went up between the
attempt's start and the worker's SIGKILL calls it an OOM kill; on the host's counter another
process's OOM kill at the same moment would be taken for ours, which the cgroup's counter rules out
where the worker has its own.
"""

from __future__ import annotations

from pathlib import Path

VMSTAT = Path("/proc/vmstat")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _count(path: Path, key: bytes = b"oom_kill") -> int | None:
    """The `key N` line of a kernel counter file, or None where it cannot be read (a byte search:
    /proc/vmstat has some 180 lines, and this is read at every attempt's start)."""
    try:
        data = b"\n" + path.read_bytes()
    except OSError:
        return None
    at = data.find(b"\n" + key + b" ")
    if at < 0:
        return None
    end = data.find(b"\n", at + 1)
    value = data[at + len(key) + 2 : end if end > 0 else len(data)].strip()
    return int(value) if value.isdigit() else None


def cgroup_counter(pid: int) -> Path | None:
    """The file holding the oom_kill count of `pid`'s memory cgroup, or None (the process gone)."""
    try:
        return counter_file(Path(f"/proc/{pid}/cgroup").read_text(), CGROUP_ROOT)
    except OSError:
        return None


def counter_file(membership: str, root: Path) -> Path | None:
    """From a /proc/PID/cgroup text: v1's memory controller's `memory.oom_control`, else the
    unified hierarchy's `memory.events` (at `root` on a v2-only host, under unified/ on a hybrid
    one); None without a memory controller."""
    lines = [line.split(":", 2) for line in membership.splitlines() if line.count(":") >= 2]
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):
            return root / "memory" / path.lstrip("/") / "memory.oom_control"
    for number, _, path in lines:
        if number == "0":
            v2 = root if (root / "cgroup.controllers").exists() else root / "unified"
            return v2 / path.lstrip("/") / "memory.events"
    return None


class Counters:
    """The OOM counters as an attempt started: `killed(pid)` tells whether one went up since."""

    def __init__(self, pids: list[int]) -> None:
        self.host = _count(VMSTAT)
        self.cgroups: dict[int, tuple[Path, int | None]] = {}
        for pid in pids:
            self.note(pid)

    def note(self, pid: int) -> None:
        """Remember `pid`'s memory cgroup and its count (read once per cgroup: workers share)."""
        path = cgroup_counter(pid)
        if path is None:
            return
        known = next((c for p, c in self.cgroups.values() if p == path), None)
        self.cgroups[pid] = (path, known if known is not None else _count(path))

    def killed(self, pid: int) -> bool:
        """Whether an OOM kill happened since the start: in `pid`'s cgroup, or on the host."""
        path, before = self.cgroups.get(pid, (None, None))
        if path is not None and before is not None:
            after = _count(path)
            if after is not None and after > before:
                return True
        now = _count(VMSTAT)
        return self.host is not None and now is not None and now > self.host
