"""A sharded checkpoint's `.metadata` from someone who can write the checkpoint directory and
rewrite its manifest to match (security, round 4, point 7): its pickle sets no state but the
fields DCP writes (no other attribute, no `__class__`, no slot), and DCP reads data only from the
checkpoint's own regular files that the manifest lists, never a file elsewhere (a relative path,
an absolute one, a symlink, a FIFO, a file the manifest leaves out)."""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
)

from elasticd.checkpoint.collectives import to_bytes
from elasticd.checkpoint.disk import shard_files
from elasticd.checkpoint.disk.format import FORMAT, Entry, files_digest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(directory: pathlib.Path, value: float) -> None:
    """A DCP directory holding a model of one 3x2 tensor filled with `value` (one process)."""
    dcp.save({"model": {"w": torch.full((3, 2), value)}}, checkpoint_id=directory, no_dist=True)


def _entry(path: pathlib.Path, shards=("__0_0.distcp",)) -> Entry:
    """The manifest's entry for the files in `path` as they are now (whoever rewrote the manifest
    made it match them)."""
    files = {n: hashlib.sha256((path / n).read_bytes()).hexdigest() for n in shards}
    for name in (".metadata", "state.pt"):
        files[name] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    return Entry(file=path.name, step=1, sha256=files_digest(files), files=tuple(files.items()))


@pytest.fixture
def checkpoint(tmp_path):
    """A sharded checkpoint of w = 1.0, and a root-only file outside it in DCP's format holding
    w = 7.0 (what the job must never read)."""
    path = tmp_path / "ckpt-000000000001-0000000000000000.dcp"
    _save(path, 1.0)
    rest = {"format": FORMAT, "step": 1, "meta": {}, "parts": ["model"], "state": {}}
    (path / "state.pt").write_bytes(to_bytes(rest))
    outside = tmp_path / "secret"
    _save(outside, 7.0)
    (outside / "__0_0.distcp").chmod(0o600)
    return path, outside / "__0_0.distcp"


def _rewrite(path: pathlib.Path, relative_path) -> None:
    """`.metadata` with every item read from `relative_path`."""
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        info.relative_path = relative_path
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _load(path: pathlib.Path, entry: Entry) -> torch.Tensor:
    """What restore() does with the checkpoint's model: dcp.load through elasticd's reader."""
    on_disk = shard_files._open(str(path.parent), entry)["model"]
    out = {"model": {"w": torch.zeros(3, 2)}}
    dcp.load(
        out,
        storage_reader=shard_files.verified_reader(on_disk),
        planner=shard_files._planner(),
        no_dist=True,
    )
    return out["model"]["w"]


def test_a_checkpoint_loads_through_the_checked_reader(checkpoint):
    path, _ = checkpoint
    assert torch.equal(_load(path, _entry(path)), torch.full((3, 2), 1.0))


@pytest.mark.parametrize("how", ["relative", "absolute", "unlisted", "symlink", "fifo"])
def test_data_is_read_only_from_the_files_the_manifest_lists(checkpoint, how):
    """The load read w = 7.0 from the root-only file outside the checkpoint."""
    path, secret = checkpoint
    shards = ("__0_0.distcp",)
    if how == "relative":
        _rewrite(path, os.path.relpath(secret, path))
    elif how == "absolute":
        _rewrite(path, str(secret))
    elif how == "unlisted":  # a file of the directory that the manifest does not list
        (path / "__5_0.distcp").write_bytes(secret.read_bytes())
        _rewrite(path, "__5_0.distcp")
    entry = _entry(path, shards)
    if how == "symlink":  # swapped in after the ranks verified the files
        (path / "__0_0.distcp").unlink()
        (path / "__0_0.distcp").symlink_to(secret)
    elif how == "fifo":
        (path / "__0_0.distcp").unlink()
        os.mkfifo(path / "__0_0.distcp")
    got = None
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException is a BaseException
        got = _load(path, entry)
    assert got is None
    assert not isinstance(e.value, (KeyboardInterrupt, SystemExit))
    why = {
        "relative": "not a shard file of the checkpoint",
        "absolute": "not a shard file of the checkpoint",
        "unlisted": "not a shard file of the checkpoint",
        "symlink": "Too many levels of symbolic links",
        "fifo": "not a regular file",
    }[how]
    assert why in str(e.value), e.value


def _built(cls: type, state) -> bytes:
    """A pickle of cls.__new__(cls) whose BUILD sets `state` (what a planted file can say):
    state as pickle's own opcodes (bytes), or an object pickled to them."""
    if not isinstance(state, bytes):
        state = pickle.dumps(state, protocol=2)[2:-1]  # less PROTO and STOP
    head = f"c{cls.__module__}\n{cls.__qualname__}\n".encode()
    return b"\x80\x04" + head + pickle.EMPTY_TUPLE + pickle.NEWOBJ + state + pickle.BUILD + b"."


def test_real_metadata_unpickles_as_pickle_does(checkpoint):
    path, _ = checkpoint
    data = (path / ".metadata").read_bytes()
    assert shard_files.MetadataUnpickler(io.BytesIO(data)).load() == pickle.loads(data)


# pickle's own set (protocol 4), which no find_class sees: {"offsets": set(), "sizes": ()}
_A_SET = (
    pickle.EMPTY_DICT
    + pickle.SHORT_BINUNICODE
    + b"\x07offsets"
    + pickle.EMPTY_SET
    + pickle.SETITEM
    + pickle.SHORT_BINUNICODE
    + b"\x05sizes"
    + pickle.EMPTY_TUPLE
    + pickle.SETITEM
)


@pytest.mark.parametrize(
    "cls, state, needle",
    [
        # a field DCP never writes: any attribute on an allowed class
        (Metadata, {"state_dict_metadata": {}, "planner": "x"}, "'planner'"),
        # a slot state: setattr of __class__, turning one record into another class
        (StorageMeta, (None, {"__class__": ChunkStorageMetadata}), "tuple"),
        # a path whose cached text lies about it
        (pathlib.PosixPath, (None, {"_str": "/etc/shadow"}), "PosixPath"),
        # a field holding a value of a kind DCP's metadata never holds
        (ChunkStorageMetadata, _A_SET, "'offsets'"),
    ],
)
def test_a_pickle_sets_only_the_fields_dcp_writes(cls, state, needle):
    """Each was set on the object as the pickle said (pickle's BUILD)."""
    data = _built(cls, state)
    with pytest.raises(pickle.UnpicklingError, match="refused, not loaded") as e:
        shard_files.MetadataUnpickler(io.BytesIO(data)).load()
    assert needle in str(e.value), e.value
