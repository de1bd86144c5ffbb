"""The GPU driver's own evidence of a hardware fault (daemon/driver.py), read from its real
interfaces' stand-ins: a regular file of kernel records in /dev/kmsg's form, written by the test,
and an executable standing in for nvidia-smi that answers its --query-gpu from a state file. Only
the kernel's own hardware Xid records written during the attempt count, and a rise of NVML's
counters; without a driver a Watch says nothing; a wedged nvidia-smi is waited for TIMEOUT at most.
The failure's class: tests/unit/lifecycle/test_triage.py; under a daemon:
tests/e2e/test_quarantine_nodes.py.
"""

from __future__ import annotations

import json
import sys
import time

from elasticd.daemon import driver
from elasticd.lifecycle import triage

XID79 = "3,1042,123456789,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n"

# answers `--query-gpu=index,F1,F2 --format=csv,noheader,nounits` from a JSON file of
# {"field": [gpu0's value, gpu1's], ...}; a field it lacks fails the query, as an older driver's
SMI = """#!{python}
import json, sys
fields = sys.argv[1].split("=", 1)[1].split(",")[1:]
state = json.load(open({state!r}))
if any(f not in state for f in fields):
    sys.exit(2)
for gpu in range(2):
    print(", ".join([str(gpu)] + [str(state[f][gpu]) for f in fields]))
"""


def _smi(tmp_path, state: dict):
    path, file = tmp_path / "nvidia-smi", tmp_path / "counters.json"
    file.write_text(json.dumps(state))
    path.write_text(SMI.format(python=sys.executable, state=str(file)))
    path.chmod(0o755)
    return str(path), file


def test_only_the_kernels_own_hardware_xids_count():
    records = (
        XID79
        + " SUBSYSTEM=pci\n"  # a continuation line of the record above
        + "4,1043,123456790,-;NVRM: Xid (PCI:0000:3c:00): 13, Graphics Exception\n"  # the app's
        + "12,1044,123456791,-;NVRM: Xid (PCI:0000:3b:00): 79, written by a process\n"
        + "6,1045,123456792,-;eth0: link up\n"
        + "4,1046,123456793,-;NVRM: Xid (PCI:0000:3d:00): 48, An uncorrectable double bit\n"
    )
    assert driver.xids(records.encode()) == ["Xid 79 (PCI:0000:3b:00)", "Xid 48 (PCI:0000:3d:00)"]


def test_an_xid_logged_during_the_attempt_is_evidence_one_logged_before_is_not(tmp_path):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(XID79)  # a fault before this attempt: not its failure's
    watch = driver.Watch(driver.Sources(kmsg=str(kmsg)))
    with kmsg.open("a") as f:
        f.write("6,1050,123456800,-;eth0: link up\n")
        f.write(XID79.replace("1042", "1051"))
    assert watch.since() == "the GPU driver reported Xid 79 (PCI:0000:3b:00)"
    assert watch.since() == watch.since()  # read once per attempt
    quiet = driver.Watch(driver.Sources(kmsg=str(kmsg)))
    assert quiet.since() == ""


def test_a_rise_of_the_drivers_counters_is_evidence(tmp_path):
    state = {
        "ecc.errors.uncorrected.volatile.total": [0, 0],
        "retired_pages.double_bit.count": ["[N/A]", "[N/A]"],
        "retired_pages.pending": ["No", "No"],
        "remapped_rows.uncorrectable": [0, 3],
        "remapped_rows.pending": ["No", "No"],
        "remapped_rows.failure": ["No", "No"],
    }
    smi, file = _smi(tmp_path, state)
    sources = driver.Sources(kmsg=None, smi=smi)
    assert driver.counters(smi)["gpu 1 remapped_rows.uncorrectable"] == 3
    watch = driver.Watch(sources)
    watch._thread.join(10)  # the baseline, read beside the start
    state["ecc.errors.uncorrected.volatile.total"] = [0, 2]
    state["remapped_rows.pending"] = ["Yes", "No"]
    file.write_text(json.dumps(state))
    got = watch.since()
    assert got.startswith("the GPU driver reported "), got
    assert "gpu 1 ecc.errors.uncorrected.volatile.total 0 -> 2" in got, got
    assert "gpu 0 remapped_rows.pending 0 -> 1" in got, got
    assert "uncorrectable" not in got  # what did not rise is not named
    assert driver.Watch(sources).since() == ""  # nothing rose


def test_a_driver_without_row_remapping_still_gives_its_other_counters(tmp_path):
    smi, _ = _smi(
        tmp_path,
        {
            "ecc.errors.uncorrected.volatile.total": [1, 0],
            "retired_pages.double_bit.count": [0, 0],
            "retired_pages.pending": ["No", "No"],
        },
    )
    got = driver.counters(smi)
    assert got["gpu 0 ecc.errors.uncorrected.volatile.total"] == 1, got
    assert not any("remapped" in k for k in got), got


def test_no_driver_says_nothing_and_a_wedged_nvidia_smi_is_not_waited_for(tmp_path):
    absent = driver.Watch(driver.Sources(kmsg=str(tmp_path / "none"), smi=None))
    assert absent.fd is None and absent.since() == ""
    assert driver.counters(str(tmp_path / "no-such-nvidia-smi")) == {}
    wedged = tmp_path / "wedged"
    wedged.write_text("#!/bin/sh\nexec sleep 30\n")
    wedged.chmod(0o755)
    t0 = time.monotonic()
    watch = driver.Watch(driver.Sources(kmsg=None, smi=str(wedged), timeout=0.5))
    assert watch.since() == ""
    assert time.monotonic() - t0 < 5


def test_the_drivers_evidence_makes_a_failure_hardware_its_text_never_does():
    assert triage.classify(1, "RuntimeError: boom", False, driver_fault=True).value == "hardware"
    assert triage.classify(None, None, False, hung=True, driver_fault=True).value == "hardware"
    assert triage.classify(None, None, False, hung=True).value == "hang"
    text = "RuntimeError: CUDA error: uncorrectable ECC error encountered, Xid 79"
    assert triage.classify(1, text, False).value == "user"
