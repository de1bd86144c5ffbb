"""Whether the GPU driver itself reported a hardware fault during an attempt (`Watch`): its Xid
records in the kernel log and NVML's counters, read as the attempt starts and again after a
worker's failure (an exit or a hang). That is evidence the job cannot write: it calls the
failure `hardware` (lifecycle/triage.py) and strikes the node (daemon/quarantine.py), as a failed
--health-check does.

The two sources:

- The kernel log (/dev/kmsg): the driver's `NVRM: Xid (PCI:...): N, ...` records of the Xids that
  name the hardware (HARDWARE_XIDS: ECC, row remapping, NVLink, fallen off the bus, the GPU's
  microcontrollers), not those an application's own bug raises (13, 31, 43, 45: a bad kernel, an
  illegal address). Only records of the kernel's facility count: a process that writes to
  /dev/kmsg (root only) is given the user facility by the kernel, whatever it asks for.
- NVML's counters through `nvidia-smi --query-gpu` (bounded by TIMEOUT): uncorrected ECC errors
  (volatile), pages retired for double-bit errors and pending retirement, rows remapped for
  uncorrectable errors, pending or failed remapping (COUNTERS). A rise of any is evidence.

Where neither exists (no NVIDIA driver: /dev/kmsg unreadable, no nvidia-smi on the daemon's PATH)
a Watch says nothing and costs nothing. The sources are parameters (`Sources`), so that a test
feeds a file of kernel records and a script standing in for nvidia-smi. Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass

KMSG = "/dev/kmsg"
SMI = "nvidia-smi"
TIMEOUT = 3.0  # seconds nvidia-smi may take (a GPU off the bus can wedge it)
MAX_KMSG = 4 << 20  # bytes of new kernel records read after a failure
# Xids of the hardware (NVIDIA's Xid catalog): 48 double-bit ECC, 61/62 microcontroller
# breakpoint/halt, 63/64 page retirement or row remapping event/failure, 74 NVLink, 79 fallen off
# the bus, 92 high single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP timeout or
# error, 140 unrecovered ECC
HARDWARE_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
# NVML's counters, queried in groups (a driver without row remapping refuses the whole query of
# a group that names it): "Yes"/"No" for the pending flags
COUNTERS = (
    ("ecc.errors.uncorrected.volatile.total", "retired_pages.double_bit.count"),
    ("retired_pages.pending",),
    ("remapped_rows.uncorrectable", "remapped_rows.pending", "remapped_rows.failure"),
)
_XID = re.compile(r"NVRM: Xid \((?P<where>[^)]{0,64})\): (?P<xid>\d+)")


@dataclass(frozen=True)
class Sources:
    """Where the driver's evidence is read: the kernel log and the nvidia-smi command (None: not
    read). `found()`: this host's, nvidia-smi looked up on the daemon's PATH."""

    kmsg: str | None = KMSG
    smi: str | None = None
    timeout: float = TIMEOUT

    @classmethod
    def found(cls) -> Sources:
        return cls(KMSG, shutil.which(SMI))


def xids(data: bytes) -> list[str]:
    """The hardware Xids in kernel records (/dev/kmsg's form, `PRI,SEQ,USEC,FLAGS;MESSAGE`): those
    of the kernel's own facility (PRI < 8) only, each as "Xid N (PCI:...)"."""
    found = []
    for line in data.decode("utf-8", "replace").splitlines():
        head, _, message = line.partition(";")
        prefix = head.split(",", 1)[0]
        if not prefix.isdigit() or int(prefix) >> 3 != 0:  # a continuation line, or userspace's
            continue
        m = _XID.search(message)
        if m and int(m["xid"]) in HARDWARE_XIDS:
            found.append(f"Xid {int(m['xid'])} ({m['where']})")
    return found


def counters(smi: str | None, timeout: float = TIMEOUT) -> dict[str, int]:
    """NVML's counters per GPU, as {"gpu 0 remapped_rows.pending": 0, ...}: {} without nvidia-smi
    or where it fails or does not answer within `timeout` (a group it refuses is left out; a
    value it cannot give, "[N/A]", too)."""
    out: dict[str, int] = {}
    for group in COUNTERS if smi else ():
        try:
            done = subprocess.run(
                [smi, f"--query-gpu=index,{','.join(group)}", "--format=csv,noheader,nounits"],
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return out
        if done.returncode != 0:
            continue
        for line in done.stdout.decode("utf-8", "replace").splitlines()[:64]:
            values = [v.strip() for v in line.split(",")]
            if len(values) != len(group) + 1 or not values[0].isdigit():
                continue
            for name, value in zip(group, values[1:]):
                number = {"yes": 1, "no": 0}.get(value.lower(), value)
                if isinstance(number, int) or number.isdigit():
                    out[f"gpu {int(values[0])} {name}"] = int(number)
    return out


class Watch:
    """The driver's evidence over one attempt: opened as it starts (the kernel log's end noted,
    NVML's counters read on a thread of its own: the start does not wait for nvidia-smi), and
    `since()` after a worker's failure: what rose meanwhile, in words ("" where nothing did, or
    there is no driver). Read once: later calls give the same answer."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self.fd = _open_end(sources.kmsg)
        self.before: dict[str, int] = {}
        self._answer: str | None = None
        self._thread: threading.Thread | None = None
        if sources.smi:
            self._thread = threading.Thread(
                target=self._baseline, name="elasticd-driver", daemon=True
            )
            self._thread.start()

    def _baseline(self) -> None:
        self.before = counters(self.sources.smi, self.sources.timeout)

    def since(self) -> str:
        if self._answer is None:
            found = xids(self._read_new())
            if self._thread is not None:
                self._thread.join(self.sources.timeout)
                after = counters(self.sources.smi, self.sources.timeout)
                found += [
                    f"{k} {self.before[k]} -> {v}"
                    for k, v in after.items()
                    if k in self.before and v > self.before[k]
                ]
            self._answer = f"the GPU driver reported {', '.join(found)}" if found else ""
            self.close()
        return self._answer

    def _read_new(self) -> bytes:
        """The kernel records written since the attempt started, at most MAX_KMSG bytes (each
        read of /dev/kmsg is one record; records overwritten meanwhile are skipped)."""
        chunks, size = [], 0
        while self.fd is not None and size < MAX_KMSG:
            try:
                chunk = os.read(self.fd, 8192)
            except OSError as e:
                if e.errno == errno.EPIPE:  # records lost to the ring buffer: go on
                    continue
                break  # EAGAIN: nothing more
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def _open_end(path: str | None) -> int | None:
    """The kernel log opened at its end, without blocking (None where it cannot be read: no such
    file, or no permission)."""
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        os.close(fd)
        return None
    return fd
