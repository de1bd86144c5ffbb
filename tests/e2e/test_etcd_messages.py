"""What the daemon says when it cannot use the etcd cluster it was given, end to end: a host name
that does not resolve, or a certificate that does not verify, will not heal by waiting: one line
naming it, at once (not after the default 600 s --join-timeout with a hint about the quorum);
nothing listening may heal (etcd restarting): retried until --join-timeout, the cause in every
retry's event and in the last line."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import time

import pytest

from e2e.test_etcd_hostile_members import run_flags
from fake_member import FakeMember, healthy
from harness import final_lines, free_port


def test_a_host_name_that_does_not_resolve_fails_at_once(daemons):
    """A typo in --rdzv-endpoint (a name under .invalid never resolves): one line naming it, at
    once, not after the default 600 s --join-timeout with a hint about the quorum. The one test
    that needs the DNS server's word (that the name does not exist): the tests' resolver sends
    no query (tests/conftest.py), and a name it cannot ask about is a failure to try again."""
    t0 = time.monotonic()
    d = daemons(None, *run_flags("etcd-typo.invalid:2379"), env={"RES_OPTIONS": ""})
    code = d.wait(30)
    took = time.monotonic() - t0
    lines = final_lines(d.stderr())
    assert code == 1, d.stderr()[-3000:]
    assert len(lines) == 1 and "cannot resolve host etcd-typo.invalid" in lines[0], lines
    assert "check the host names in --rdzv-endpoint" in lines[0] and "quorum" not in lines[0]
    assert took < 15, took
    assert "Traceback" not in d.stderr()


@pytest.fixture
def self_signed(tmp_path):
    """A TLS server context with a self-signed certificate for 127.0.0.1 (no client trusts it)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "key.pem",
            "-out",
            "cert.pem",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=30,
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    return ctx


def test_a_certificate_that_does_not_verify_fails_at_once(daemons, self_signed):
    """An https member whose certificate the system's CAs did not sign: one line saying the
    verification failed, at once, not after the 600 s --join-timeout."""
    with FakeMember(healthy(), tls=self_signed) as m:
        t0 = time.monotonic()
        d = daemons(None, *run_flags(f"https://{m.endpoint}"))
        code = d.wait(30)
        took = time.monotonic() - t0
    lines = final_lines(d.stderr())
    assert code == 1, d.stderr()[-3000:]
    assert (
        len(lines) == 1 and "certificate verify failed" in lines[0] and "--etcd-cacert" in lines[0]
    ), lines
    assert took < 15, took
    assert "Traceback" not in d.stderr()


def test_nothing_listening_is_retried_and_named(daemons):
    """Connection refused may heal (etcd restarting): retried until --join-timeout, with the
    cause in every retry's event; the last line names it and what to check."""
    endpoint = f"127.0.0.1:{free_port()}"
    d = daemons(None, *run_flags(endpoint, "--join-timeout", "2.5", "--peer-timeout", "2"))
    code = d.wait(20)
    lines = final_lines(d.stderr())
    assert code == 1, d.stderr()[-3000:]
    assert (
        len(lines) == 1 and "connection refused" in lines[0] and "nothing listens there" in lines[0]
    ), lines
    assert "quorum" not in lines[0]
    retries = [e for e in d.events() if e.get("event") == "store_connect_retry"]
    assert retries and all("connection refused" in e["why"] for e in retries), retries
