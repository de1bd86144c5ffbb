"""The job secret, and the signatures on every value the daemons exchange through the store; the
rules every file holding a secret follows (the job's, etcd's password: read_private).

The rendezvous store (a c10d TCPStore, as under torchrun) has no authentication: anyone who can
reach its port reads and writes every key. So nothing a daemon reads from it is trusted unless it
carries an HMAC made with the job's secret, bound to the job, the round and the key it was written
under (a value copied from another key or an earlier round does not verify). Torch-free: the CLI
reads the secret file before anything starts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass, field

from elasticd import logs
from elasticd.config import Config, ConfigError

log = logs.get("elasticd.rendezvous")

MIN_SECRET = 16  # bytes: 128 bits, the least an HMAC key should carry
MAX_SECRET = 4096
MAC_HEX = 64  # hex digits of an HMAC-SHA256
# bytes: the largest of our own values is a round's members (about 100 bytes a node: 100,000 nodes
# at most); a larger value is refused before its HMAC is computed
MAX_VALUE = 32 * 1024 * 1024


def new_secret() -> bytes:
    """A single-node job's secret: nothing outside the daemon needs to know it."""
    return secrets.token_bytes(32)


def job_secret(cfg: Config) -> bytes:
    """The key every value in the store is signed with: --rdzv-secret-file's content; for a
    single-node job without one, a random key only this daemon knows. A multi-node job without
    one runs only with --insecure-no-secret (config_values.validate), and says so once."""
    if cfg.rdzv_secret_file:
        return load_secret(cfg.rdzv_secret_file)
    if cfg.max_nodes == 1:
        return new_secret()
    log.warning(
        "rdzv_no_secret",
        endpoint=cfg.rdzv_endpoint,
        fix="give every node --rdzv-secret-file (the same file): with --insecure-no-secret, "
        "anyone who reaches the store can restart, stop or redirect the job",
    )
    return b""


def state_key(secret: bytes, job: str) -> bytes:
    """The key of the MACs on the in-memory state's bytes that the workers send each other
    (elasticd/checkpoint/memory/seal.py), handed to them (names.STATE_KEY): derived from the job
    secret and id, the same on every node, and never the secret that seals the store's values."""
    return hmac.new(secret, f"elasticd/state-key/1\0{job}".encode(), hashlib.sha256).digest()


def load_secret(path: str) -> bytes:
    """Read --rdzv-secret-file (read_private's rules). Every node of the job reads the same
    bytes."""
    where = f"--rdzv-secret-file {path}"
    data = read_private(
        path,
        where,
        MAX_SECRET + 1,
        "create it on every node with the same content, e.g. "
        "head -c 32 /dev/urandom | base64 > FILE && chmod 600 FILE",
    ).strip()  # + a newline
    if len(data) > MAX_SECRET:
        raise ConfigError(
            f"{where} is larger than {MAX_SECRET} bytes: a secret of 32 random bytes is enough"
        )
    if len(data) < MIN_SECRET:
        raise ConfigError(
            f"{where} holds {len(data)} bytes, fewer than {MIN_SECRET}: write at least "
            "32 random bytes, e.g. head -c 32 /dev/urandom | base64 > FILE"
        )
    return data


def load_password(path: str, flag: str = "--etcd-password-file") -> str:
    """Read a password file (read_private's rules): its text, less the newline that ends it."""
    where = f"{flag} {path}"
    data = read_private(path, where, MAX_SECRET, "create it (mode 600) holding the password")
    try:
        return data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text: write the password as UTF-8") from None


def read_private(path: str, where: str, limit: int, missing: str) -> bytes:
    """The content of a file holding a secret, at most `limit` bytes: a regular file (not a link),
    owned by this user or root, that no one else can read or write; else ConfigError naming
    `where` and the fix (`missing`: the fix when there is no file). Whoever can read it knows the
    secret, and whoever can write it (or swap it) chooses it: the job secret, etcd's password."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist: {missing}") from None
    except OSError as e:
        raise ConfigError(
            f"{where} cannot be opened ({os.strerror(e.errno or 0)}): give a regular file "
            "this user can read (not a symbolic link)"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where} is not a regular file: give a file holding the secret")
        if st.st_uid not in (os.geteuid(), 0):
            raise ConfigError(
                f"{where} is owned by uid {st.st_uid}, not by this user or root: "
                "anyone who owns it can change the secret; chown it"
            )
        if st.st_mode & 0o077:
            raise ConfigError(
                f"{where} can be read or written by other users "
                f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 {path}"
            )
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ConfigError(
            f"{where} is larger than {limit} bytes: give the file of the secret itself"
        )
    return data


@dataclass
class Signer:
    """Seals values as `<hex HMAC> <payload>` and opens them again; `scope` names what the value
    is (round and key), so a sealed value verifies only where it was written."""

    key: bytes
    run_id: str
    rejected: int = field(default=0, compare=False)  # values that failed to open, for status/tests

    def mac(self, scope: str, payload: bytes) -> str:
        head = f"elasticd/1\0{self.run_id}\0{scope}\0".encode()
        return hmac.new(self.key, head + payload, hashlib.sha256).hexdigest()

    def seal(self, scope: str, payload: str | bytes) -> bytes:
        data = payload.encode() if isinstance(payload, str) else payload
        return self.mac(scope, data).encode() + b" " + data

    def open(self, scope: str, raw: bytes) -> bytes | None:
        """The payload, or None when the value was not sealed here with this secret."""
        if (
            not isinstance(raw, bytes)
            or len(raw) > MAX_VALUE + MAC_HEX + 1
            or raw[MAC_HEX : MAC_HEX + 1] != b" "
        ):
            self.rejected += 1
            return None
        data = raw[MAC_HEX + 1 :]
        if not hmac.compare_digest(raw[:MAC_HEX], self.mac(scope, data).encode()):
            self.rejected += 1
            return None
        return data
