"""sd_notify over a test-owned datagram socket, the watchdog interval, the unit file, the example
config."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import structlog

from elasticd.daemon import systemd
from harness import ROOT

UNIT = ROOT / "systemd" / "elasticd.service"
EXAMPLE = ROOT / "systemd" / "elasticd.toml.example"


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    """A datagram socket standing in for systemd's, wired into $NOTIFY_SOCKET."""
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(var, raising=False)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    s.bind(str(path))
    s.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield s
    s.close()


def nothing_more(s: socket.socket) -> bool:
    s.settimeout(0.05)
    try:
        s.recv(4096)
    except TimeoutError:
        return True
    return False


def test_each_helper_sends_exactly_its_datagram(notify_socket):
    s = notify_socket
    cases = [
        (lambda: systemd.ready("RUNNING run job42"), b"READY=1\nSTATUS=RUNNING run job42"),
        (lambda: systemd.ready(), b"READY=1"),
        (lambda: systemd.status("RESTARTING 1/3"), b"STATUS=RESTARTING 1/3"),
        (systemd.watchdog, b"WATCHDOG=1"),
        (systemd.stopping, b"STOPPING=1"),
        (lambda: systemd.stopping("stopping workers"), b"STOPPING=1\nSTATUS=stopping workers"),
        (lambda: systemd.extend_timeout(37.5), b"EXTEND_TIMEOUT_USEC=37500000"),
        (lambda: systemd.extend_timeout(-1), b"EXTEND_TIMEOUT_USEC=0"),
        (lambda: systemd.notify("A=1", "B=2"), b"A=1\nB=2"),
        # a status text cannot smuggle in another assignment
        (lambda: systemd.status("oops\nREADY=1"), b"STATUS=oops READY=1"),
    ]
    for send, expected in cases:
        assert send() is True
        assert s.recv(4096) == expected
    assert nothing_more(s)


def test_extend_timeout_clamps_and_never_raises(notify_socket):
    """A stop with an absurd grace (inf, nan, 1e300, an int beyond any float) asks for as much as
    systemd can hold, or nothing: it used to raise OverflowError and take the daemon down
    mid-stop."""
    most = b"EXTEND_TIMEOUT_USEC=18446744073709551614"  # 2**64 - 2: below USEC_INFINITY
    nothing = b"EXTEND_TIMEOUT_USEC=0"
    for seconds, expected in (
        (float("inf"), most),
        (1e300, most),
        (10**400, most),
        (float("nan"), nothing),
        (float("-inf"), nothing),
        (2592000 * 3 + 5, b"EXTEND_TIMEOUT_USEC=7776005000000"),
    ):
        assert systemd.extend_timeout(seconds) is True
        assert notify_socket.recv(4096) == expected, seconds


def test_abstract_namespace_address(monkeypatch):
    name = f"elasticd-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.ready("hello") is True
        assert s.recv(4096) == b"READY=1\nSTATUS=hello"


def test_no_notify_socket_is_a_silent_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    with structlog.testing.capture_logs() as logs:
        assert systemd.ready("x") is False
        assert systemd.watchdog() is False
        assert systemd.notify() is False
    assert logs == []


def test_send_failure_never_raises_and_warns_once(tmp_path, monkeypatch):
    monkeypatch.setattr(systemd, "_warned", False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    with structlog.testing.capture_logs() as logs:
        assert systemd.watchdog() is False
        assert systemd.status("still fine") is False
    assert [e["event"] for e in logs] == ["sd_notify_failed"]
    assert logs[0]["log_level"] == "warning"
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + "x" * 200)  # an address too long for sun_path
    assert systemd.watchdog() is False


def test_watchdog_interval(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert systemd.watchdog_interval() == 15.0  # half the timeout, as systemd advises
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert systemd.watchdog_interval() is None  # meant for another process
    monkeypatch.setenv("WATCHDOG_PID", "not-a-pid")
    assert systemd.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    for bad in ("0", "-5", "soon", ""):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert systemd.watchdog_interval() is None, bad
    monkeypatch.setenv("WATCHDOG_USEC", "500000")
    assert systemd.watchdog_interval() == 0.25


def test_child_env_strips_the_service_managers_variables():
    env = {
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": "1",
        "LISTEN_FDS": "1",
        "LISTEN_PID": "1",
        "PATH": "/usr/bin",
        "RANK": "0",
    }
    before = dict(env)
    assert systemd.child_env(env) == {"PATH": "/usr/bin", "RANK": "0"}
    assert env == before  # a copy; the daemon keeps its own


# --- the unit file -------------------------------------------------------------------------------

# Lines systemd-analyze may print in a container without systemd as PID 1 or without a bus; they
# say nothing about the unit.
HARMLESS = [
    re.compile(r"System has not been booted with systemd"),
    re.compile(r"Failed to connect to bus"),
    re.compile(r"Failed to (open|create) .*(/run/systemd|/run/user|cgroup|/sys/fs)"),
    re.compile(r"Failed to .* (transient|generator)"),
    re.compile(r"(?i)running in chroot"),
]


def _verify(unit_text: str, tmp_path: Path) -> tuple[int, list[str]]:
    analyze = shutil.which("systemd-analyze")
    unit = tmp_path / "elasticd.service"
    unit.write_text(unit_text)
    r = subprocess.run(
        [analyze, "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, SYSTEMD_LOG_COLOR="0", SYSTEMD_PAGER="cat"),
    )
    lines = [line for line in (r.stderr + r.stdout).splitlines() if line.strip()]
    return r.returncode, [line for line in lines if not any(p.search(line) for p in HARMLESS)]


def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        reason = (
            "systemd-analyze is not installed: "
            "apt-get install systemd (Debian/Ubuntu package 'systemd')"
        )
        print(reason)
        pytest.skip(reason)
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/elasticd run " in text
    exe = shutil.which("elasticd") or sys.executable  # verify insists the executable exists
    rc, complaints = _verify(text.replace("/usr/local/bin/elasticd", exe), tmp_path)
    assert rc == 0 and complaints == [], "\n".join(complaints)
    # and verify does catch mistakes here, so the clean result means something
    rc, complaints = _verify(
        text.replace("KillMode=mixed", "KillMode=mixed\nKilMode=x").replace(
            "/usr/local/bin/elasticd", exe
        ),
        tmp_path,
    )
    assert any("KilMode" in line for line in complaints), complaints


def _settings(text: str) -> dict[str, list[str]]:
    section, out = "", {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(f"{section}.{key}", []).append(value)
    return out


def test_unit_file_settings():
    s = _settings(UNIT.read_text())
    expect = {
        "Service.Type": "notify",
        "Service.NotifyAccess": "main",
        "Service.WatchdogSec": "30",
        "Service.KillMode": "mixed",
        "Service.Restart": "on-failure",
        "Service.RestartPreventExitStatus": "2 6 7",
        "Service.StateDirectory": "elasticd",
        "Service.RuntimeDirectory": "elasticd",
        "Service.RuntimeDirectoryMode": "0750",
        "Service.EnvironmentFile": "-/etc/elasticd/elasticd.env",
        "Service.LimitMEMLOCK": "infinity",
        "Service.LimitNOFILE": "1048576",
        "Unit.After": "network-online.target",
        "Unit.Wants": "network-online.target",
        "Install.WantedBy": "multi-user.target",
        "Service.ExecStart": "/usr/local/bin/elasticd run --config /etc/elasticd/elasticd.toml",
    }
    for key, value in expect.items():
        assert s.get(key) == [value], (key, s.get(key))
    assert (
        "Unit.StartLimitIntervalSec" in s and "Unit.StartLimitBurst" in s
    )  # [Unit], where they work
    assert (
        int(s["Service.TimeoutStopSec"][0]) > 30 + 5
    )  # longer than the default stop grace + kill timeout
    # Sandboxing that breaks GPU workers: device ACLs (ProtectClock implies one on systemd < 253),
    # W^X memory (PyTorch JIT, Triton), a /proc without cpuinfo/meminfo.
    for breaking in (
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",
        "MemoryDenyWriteExecute",
        "ProcSubset",
    ):
        assert not any(k.endswith("." + breaking) for k in s), breaking


HARDENING = {
    "Service.UMask": "0027",
    "Service.LogsDirectoryMode": "0750",
    "Service.NoNewPrivileges": "yes",
    "Service.ProtectSystem": "strict",
    "Service.ReadWritePaths": "-/dev/shm",
    "Service.PrivateTmp": "yes",
    "Service.ProtectHome": "read-only",
    "Service.ProtectKernelTunables": "yes",
    "Service.ProtectControlGroups": "yes",
    "Service.ProtectKernelLogs": "yes",
    "Service.ProtectHostname": "yes",
    "Service.ProtectProc": "invisible",
    "Service.RestrictSUIDSGID": "yes",
    "Service.LockPersonality": "yes",
    "Service.RestrictRealtime": "yes",
    "Service.SystemCallArchitectures": "native",
    "Service.CacheDirectory": "elasticd",
}


def test_unit_file_is_hardened():
    """The hardening directives (docs/service.md, "Running as a service: hardening") are all there,
    the capabilities dropped include ptrace and the clock, and the caches live where the service
    may write."""
    s = _settings(UNIT.read_text())
    for key, value in HARDENING.items():
        assert s.get(key) == [value], (key, s.get(key))
    dropped = s["Service.CapabilityBoundingSet"][0]
    assert dropped.startswith("~") and {"CAP_SYS_PTRACE", "CAP_SYS_TIME", "CAP_SYS_BOOT"} <= set(
        dropped[1:].split()
    )
    assert not {"CAP_MKNOD", "CAP_SYS_MODULE", "CAP_CHOWN", "CAP_IPC_LOCK"} & set(
        dropped[1:].split()
    )
    env = " ".join(s["Service.Environment"])
    assert "TRITON_CACHE_DIR=%C/elasticd/" in env and "XDG_CACHE_HOME=%C/elasticd" in env


def test_unit_file_security_exposure(tmp_path):
    """systemd-analyze's offline exposure score stays at or below what the hardening reached
    (9.6 UNSAFE before it, 7.1 after; docs/service.md)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: apt-get install systemd")
    unit = tmp_path / "elasticd.service"
    unit.write_text(UNIT.read_text())
    r = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, SYSTEMD_LOG_COLOR="0"),
    )
    found = re.search(
        r"Overall exposure level for elasticd.service: ([0-9.]+)", r.stdout + r.stderr
    )
    if found is None and "offline" in r.stderr:
        pytest.skip(f"this systemd-analyze has no offline security mode: {r.stderr.strip()[:200]}")
    assert found, r.stdout[-2000:] + r.stderr[-2000:]
    assert float(found.group(1)) <= 7.1, found.group(0)


# --- the example config ---------------------------------------------------------------------------


def _uncommented_example() -> dict:
    keys = [
        line[2:] for line in EXAMPLE.read_text().splitlines() if re.match(r"# [a-z_]+ = ", line)
    ]
    return tomllib.loads("\n".join(keys))


def test_example_config_mirrors_the_settings_and_loads(tmp_path):
    from elasticd import config

    example = _uncommented_example()
    unknown = set(example) - set(config.FIELDS)
    missing = set(config.FIELDS) - set(example)
    assert not unknown, f"keys the daemon would refuse (exit 2): {sorted(unknown)}"
    assert not missing, f"settings not documented in {EXAMPLE.name}: {sorted(missing)}"
    # every value shown is its default, so uncommenting one changes nothing by itself
    for key, value in example.items():
        default = config.FIELDS[key].default
        assert (tuple(value) if isinstance(value, list) else value) == default, (
            key,
            value,
            default,
        )
    # and the whole file, uncommented, is a valid config
    path = tmp_path / "elasticd.toml"
    path.write_text(
        "\n".join(
            line[2:] for line in EXAMPLE.read_text().splitlines() if re.match(r"# [a-z_]+ = ", line)
        )
    )
    cfg = config.build({}, config_file=str(path), environ={})
    assert cfg.max_restarts == 3 and cfg.stop_grace == 30
