"""A repro bundle's file: one file that `elasticd replay BUNDLE` re-runs a failed step from, in a
single process. Torch-free, so that the CLI refuses a bad bundle in one line before anything
heavy loads; the state inside is written and read by elasticd.checkpoint.bundle (weights_only).

Layout: MAGIC, a u32 length and a JSON header, then the payload (torch.save bytes of the
certified pre-step state). The header says what made the bundle (`FORMAT`, elasticd's, torch's
and Python's versions), what to run (entrypoint, args, working directory, the rank's environment
less elasticd's, torchrun's and anything that looks like a secret), where (rank, world, the
certified step, the failed step), what happened (the error's text and traceback), the samples the
ledger says each step since the certified one took, and the payload's length and SHA-256: a bundle
cut short or changed is refused, never half-read. Another elasticd's bundle is refused too: its
payload's meaning (the checkpoint format, the replay's hooks) is that version's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import struct
from pathlib import Path
from typing import Any

from elasticd import __version__, names, safeio

MAGIC = b"ELDREPR1"
FORMAT = 1
SUFFIX = ".repro"
SDC_SUFFIX = ".sdc.repro"  # a replica's bundle of a disagreement, for the referee
MAX_HEADER = 64 << 20  # bytes: a header is small (the samples of a few steps)
# what the replay sets itself, or must never carry: the run's own files, ranks, store, secrets
_DROPPED = re.compile(
    r"^(ELASTICD_|TORCHELASTIC_|PET_|MASTER_(ADDR|PORT)$|(LOCAL_|GROUP_|ROLE_)?(RANK|WORLD_SIZE)$"
    r"|ROLE_NAME$|NOTIFY_SOCKET$|WATCHDOG_)|SECRET|TOKEN|PASSW|CREDENTIAL|_KEY$|^KEY$",
    re.IGNORECASE,
)


class BundleError(ValueError):
    """A file that cannot be replayed: the message is the one line the user sees."""


def kept_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """The rank's environment a replay runs with: less what the run owned and what looks like a
    secret (a bundle is a file people pass around)."""
    return {k: v for k, v in env.items() if not _DROPPED.search(k)}


def write(path: str | os.PathLike, header: dict[str, Any], payload: bytes | memoryview) -> None:
    """Write the bundle at `path` (created new, never through a link; atomic by rename)."""
    head = dict(header)
    head.update(
        format=FORMAT,
        elasticd=__version__,
        payload_bytes=len(payload),
        payload_sha256=hashlib.sha256(payload).hexdigest(),
    )
    data = json.dumps(head).encode()
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with os.fdopen(safeio.create(tmp), "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(data)) + data)
        f.write(payload)
    os.replace(tmp, path)


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """The header and the payload's offset, after every check that needs no torch: the magic,
    the format, elasticd's version, the payload's length and SHA-256. BundleError otherwise."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            start = f.read(len(MAGIC) + 4)
            if len(start) < len(MAGIC) + 4 or not start.startswith(MAGIC):
                raise BundleError(f"{p}: not an elasticd repro bundle (no {MAGIC.decode()} header)")
            (size,) = struct.unpack_from("<I", start, len(MAGIC))
            if size > MAX_HEADER:
                raise BundleError(f"{p}: damaged: its header's length ({size} bytes) is not one")
            head = _header(p, f.read(size), size)
            _check_version(p, head)
            offset = len(MAGIC) + 4 + size
            digest, n = hashlib.sha256(), 0
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                n += len(chunk)
    except FileNotFoundError:
        raise BundleError(
            f"{p}: no such file (a bundle is written only under --ledger, by a script using "
            "CheckpointManager, once a state was kept: the rank's repro_bundle_skipped line "
            "says why not)"
        ) from None
    except OSError as e:
        raise BundleError(f"{p}: cannot read it: {e.strerror}") from None
    if n != head.get("payload_bytes") or digest.hexdigest() != head.get("payload_sha256"):
        raise BundleError(
            f"{p}: damaged: its state ({n} bytes) does not match the SHA-256 its header "
            "records (cut short or changed); nothing of it was loaded"
        )
    return head, offset


def _header(p: Path, raw: bytes, size: int) -> dict[str, Any]:
    if len(raw) != size:
        raise BundleError(f"{p}: damaged: cut short inside its header")
    try:
        head = json.loads(raw)
    except ValueError:
        raise BundleError(f"{p}: damaged: its header is not the JSON elasticd writes") from None
    if not isinstance(head, dict):
        raise BundleError(f"{p}: damaged: its header is not the JSON elasticd writes")
    return head


def _check_version(p: Path, head: dict[str, Any]) -> None:
    fmt, made_by = head.get("format"), head.get("elasticd")
    if fmt != FORMAT or made_by != __version__:
        raise BundleError(
            f"{p}: written by elasticd {made_by} (bundle format {fmt}); this is elasticd "
            f"{__version__} (format {FORMAT}): replay it with the elasticd that wrote it"
        )


def payload(path: str | os.PathLike, offset: int) -> bytes:
    """The payload's bytes (checked again: the file may have changed since read_header)."""
    head, at = read_header(path)
    with open(path, "rb") as f:
        f.seek(at)
        data = f.read()
    if hashlib.sha256(data).hexdigest() != head["payload_sha256"] or at != offset:
        raise BundleError(f"{path}: changed while it was read")
    return data


# -- the replay process, as `elasticd replay` and the referee (daemon/referee.py) start it --------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replay_env(head: dict[str, Any], bundle: str, result: str, ledger_dir: str) -> dict[str, str]:
    """The bundle's environment as a world of one, the replay's variables set."""
    env = dict(head.get("env") or {})
    for key in ("PATH", "HOME"):
        if key not in env and key in os.environ:
            env[key] = os.environ[key]
    env.update(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "GROUP_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_port()),
            names.REPLAY: os.path.abspath(bundle),
            names.REPLAY_AS: f"{int(head['rank'])}/{int(head['world'])}",
            names.REPLAY_RESULT: result,
            names.LEDGER_DIR: ledger_dir,
            names.CHECKPOINT_DIR: os.path.join(os.path.dirname(result), "checkpoints"),
        }
    )
    return env


def read_result(result: str) -> dict[str, Any]:
    """The replay process's result file, or outcome 'lost'."""
    try:
        with open(result) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"outcome": "lost"}
