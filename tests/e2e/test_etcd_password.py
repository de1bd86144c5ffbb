"""The etcd password, through the CLI: its file follows the job secret's rules (a regular file,
not a link, owned by this user or root, mode 600), and a user over plain http, where the password
and its token would cross the network in clear, is refused unless --etcd-allow-plain-password
says so; each refusal one line, exit 2, nothing started."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from e2e.test_etcd_hostile_members import run_flags
from elasticd import config
from fake_member import FakeMember, response
from harness import ROOT, final_lines, free_port

NOBODY = 65534


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elasticd", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def password_file(path, text: str = "s3cret\n", mode: int = 0o600) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def assert_refused(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("elasticd: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("case", ["world-readable", "symlink", "foreign owner"])
def test_an_unsafe_password_file_is_refused(case, tmp_path):
    """The job secret's rules hold for the etcd password file: a regular file, not a link, owned
    by this user or root, mode 600 (one line, exit 2, nothing started)."""
    pw = password_file(tmp_path / "pw", mode=0o644 if case == "world-readable" else 0o600)
    needle = {
        "world-readable": "chmod 600",
        "symlink": "not a symbolic link",
        "foreign owner": "owned by uid",
    }[case]
    if case == "symlink":
        (tmp_path / "link").symlink_to(pw)
        pw = str(tmp_path / "link")
    elif case == "foreign owner":
        if os.geteuid() != 0:
            pytest.skip("chown needs root")
        os.chown(pw, NOBODY, NOBODY)
    r = cli(
        "--log-dir",
        str(tmp_path / "logs"),
        "--socket",
        str(tmp_path / "s"),
        *run_flags(
            f"127.0.0.1:{free_port()}",
            "--etcd-user",
            "u",
            "--etcd-password-file",
            pw,
            "--etcd-allow-plain-password",
            "--join-timeout",
            "1",
        ),
    )
    assert_refused(r, "--etcd-password-file", needle)


@pytest.mark.parametrize(
    "endpoint, tls",
    [("127.0.0.1:2379", ()), ("h1:2379,http://h2:2379", ("--etcd-cacert", "/ca.pem"))],
    ids=["http", "one-member-http-beside-tls"],
)
def test_a_password_over_plain_http_is_refused(endpoint, tls, tmp_path):
    """A user and password to a member reached over plain http would cross the network in
    clear: refused unless the operator says so, one line naming the problem and both fixes."""
    pw = password_file(tmp_path / "pw")
    flags = [*tls, "--etcd-user", "u", "--etcd-password-file", pw, "--join-timeout", "1"]
    r = cli(
        "--log-dir",
        str(tmp_path / "logs"),
        "--socket",
        str(tmp_path / "s"),
        *run_flags(endpoint, *flags),
    )
    assert_refused(
        r, "--etcd-user over plain http", "in clear", "--etcd-cacert", "--etcd-allow-plain-password"
    )


def test_tls_or_the_flag_lets_a_password_through(daemons, tmp_path):
    """With TLS the configuration is accepted as is; over plain http with
    --etcd-allow-plain-password the daemon starts and logs in with the file's password (here
    the member refuses it: one line, exit 1)."""
    common = {
        "rdzv_backend": "etcd",
        "etcd_user": "u",
        "etcd_password_file": "/pw",
        "entrypoint": "x.py",
    }
    config.build({**common, "rdzv_endpoint": "h1:2379", "etcd_cacert": "/ca.pem"})
    config.build({**common, "rdzv_endpoint": "https://h1:2379,https://h2:2379"})

    def refuse_logins(member, conn, path, body):
        conn.sendall(
            response(
                json.dumps(
                    {
                        "error": "etcdserver: authentication failed, invalid user ID or password",
                        "code": 3,
                    }
                ).encode(),
                "401 Unauthorized",
            )
        )
        return True

    pw = password_file(tmp_path / "pw")
    with FakeMember(refuse_logins) as m:
        d = daemons(
            None,
            *run_flags(
                m.endpoint,
                "--etcd-user",
                "u",
                "--etcd-password-file",
                pw,
                "--etcd-allow-plain-password",
                "--join-timeout",
                "5",
            ),
        )
        code = d.wait(20)
    lines = final_lines(d.stderr())
    assert code == 1, d.stderr()[-3000:]
    assert len(lines) == 1 and "refused us" in lines[0] and "authentication failed" in lines[0], (
        lines
    )
    assert ("/v3/auth/authenticate", {"name": "u", "password": "s3cret"}) in m.requests
