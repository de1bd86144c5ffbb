"""A repro bundle's file (elasticd/repro.py): what it keeps, and every bad bundle refused in one
line before anything of its state is loaded (damaged, cut short, another version's, not one)."""

from __future__ import annotations

import json
import struct

import pytest

from elasticd import __version__, repro

HEAD = {"rank": 1, "world": 2, "certified_step": 5, "failed_step": 7, "entrypoint": "t.py"}


def _bundle(tmp_path, payload: bytes = b"state" * 100):
    path = tmp_path / "rank1.repro"
    repro.write(path, HEAD, payload)
    return path


def test_a_bundle_reads_back_with_its_versions_and_checksum(tmp_path):
    path = _bundle(tmp_path)
    head, offset = repro.read_header(path)
    assert {k: head[k] for k in HEAD} == HEAD
    assert head["format"] == repro.FORMAT and head["elasticd"] == __version__
    assert repro.payload(path, offset) == b"state" * 100
    assert not list(tmp_path.glob("*.tmp*"))  # written by rename


@pytest.mark.parametrize("at", [-1, -250, -499])
def test_a_changed_byte_of_the_state_is_refused(tmp_path, at):
    path = _bundle(tmp_path)
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(repro.BundleError, match="damaged: its state .* SHA-256"):
        repro.read_header(path)


@pytest.mark.parametrize("keep", [0, 5, 10, 40, -1])
def test_a_bundle_cut_short_is_refused(tmp_path, keep):
    path = _bundle(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(repro.BundleError) as e:
        repro.read_header(path)
    assert "\n" not in str(e.value)
    assert "damaged" in str(e.value) or "not an elasticd repro bundle" in str(e.value)


@pytest.mark.parametrize("field, value", [("elasticd", "0.0.9"), ("format", 99)])
def test_another_versions_bundle_is_refused(tmp_path, field, value):
    path = _bundle(tmp_path)
    data = path.read_bytes()
    (size,) = struct.unpack_from("<I", data, len(repro.MAGIC))
    start = len(repro.MAGIC) + 4
    head = json.loads(data[start : start + size])
    head[field] = value
    raw = json.dumps(head).encode()
    path.write_bytes(repro.MAGIC + struct.pack("<I", len(raw)) + raw + data[start + size :])
    with pytest.raises(repro.BundleError, match="replay it with the elasticd that wrote it"):
        repro.read_header(path)


def test_not_a_bundle(tmp_path):
    other = tmp_path / "x.repro"
    other.write_bytes(b"PK\x03\x04 a zip, say a torch.save file")
    with pytest.raises(repro.BundleError, match="not an elasticd repro bundle"):
        repro.read_header(other)
    with pytest.raises(repro.BundleError, match="no such file .* repro_bundle_skipped"):
        repro.read_header(tmp_path / "missing.repro")
    with pytest.raises(repro.BundleError, match="cannot read it"):
        repro.read_header(tmp_path)  # a directory
    garbled = tmp_path / "g.repro"
    garbled.write_bytes(repro.MAGIC + struct.pack("<I", 3) + b"{x}")
    with pytest.raises(repro.BundleError, match="header is not the JSON"):
        repro.read_header(garbled)


def test_the_environment_kept_drops_the_runs_own_and_anything_secret():
    env = {
        "PYTHONPATH": "/src",
        "CUDA_VISIBLE_DEVICES": "0",
        "OMP_NUM_THREADS": "1",
        "ELASTICD_STATE_KEY": "k",
        "ELASTICD_HEARTBEAT_FILE": "/run/x",
        "TORCHELASTIC_RUN_ID": "r",
        "MASTER_ADDR": "h",
        "RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "WANDB_API_KEY": "s",
        "HF_TOKEN": "s",
        "AWS_SECRET_ACCESS_KEY": "s",
        "DB_PASSWORD": "s",
        "NOTIFY_SOCKET": "/run/n",
    }
    assert repro.kept_env(env) == {
        "PYTHONPATH": "/src",
        "CUDA_VISIBLE_DEVICES": "0",
        "OMP_NUM_THREADS": "1",
    }
