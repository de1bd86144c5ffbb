"""A manifest.json anyone who can write the checkpoint directory may have crafted: non-finite or
absurd numbers, wrong types, deep nesting, huge, not UTF-8, not a file, names escaping the
directory. Each is reported (one warning naming the manifest) and skipped like a torn checkpoint:
the files are scanned instead and the newest one that verifies is loaded; no worker crashes."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import torch
from structlog.testing import capture_logs

import _ckpt_helpers as helpers
from elasticd import checkpoint
from elasticd.checkpoint import CheckpointManager, load_latest

HUGE = 5 << 20  # bytes of a manifest: more than checkpoint.MAX_MANIFEST


def _saved(directory, steps=(1, 2, 3)) -> dict:
    mgr = CheckpointManager(directory, keep=len(steps), handle_sigterm=False)
    for step in steps:
        mgr.save(step, {"step": step, "w": torch.full((4,), float(step))})
    mgr.close()
    return json.loads((directory / "manifest.json").read_text())


def _newest_entry(doc, **changes) -> bytes:
    doc = json.loads(json.dumps(doc))
    doc["checkpoints"][-1].update(changes)
    return json.dumps(doc).encode()


def _raw(doc, key: str, literal: bytes) -> bytes:
    """The manifest with the newest entry's `key` set to a JSON literal Python would not write."""
    return _newest_entry(doc, **{key: "@@"}).replace(b'"@@"', literal)


def _hostile(doc) -> dict[str, bytes]:
    good = json.dumps(doc).encode()
    deep = b'{"format": 1, "checkpoints": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    return {
        "step 1e999": _raw(doc, "step", b"1e999"),
        "step NaN": _raw(doc, "step", b"NaN"),
        "step -5": _newest_entry(doc, step=-5),
        "step 2**64": _newest_entry(doc, step=2**64),
        "step 3.0": _newest_entry(doc, step=3.0),
        "step true": _newest_entry(doc, step=True),
        "step '3'": _newest_entry(doc, step="3"),
        "time Infinity": _raw(doc, "time", b"Infinity"),
        "epoch list": _newest_entry(doc, epoch=[1]),
        "bytes -1": _newest_entry(doc, bytes=-1),
        "sha256 empty": _newest_entry(doc, sha256=0),
        "sha256 another": _newest_entry(doc, sha256="f" * 64),
        "file ../../etc/passwd": _newest_entry(doc, file="../../etc/passwd"),
        "file /abs": _newest_entry(doc, file="/tmp/ckpt-000000000003-0123456789abcdef.pt"),
        "file number": _newest_entry(doc, file=7),
        "entry a list": good.replace(b'"checkpoints": [{', b'"checkpoints": [[], {'),
        "checkpoints a dict": json.dumps({"format": 1, "checkpoints": {"file": "x"}}).encode(),
        "checkpoints missing": json.dumps({"format": 1}).encode(),
        "format true": json.dumps({**doc, "format": True}).encode(),
        "deep nesting": deep,
        "deep entry": _raw(doc, "epoch", b"[" * 50000 + b"]" * 50000),
        "huge": b" " * HUGE + good,
        "not UTF-8": b"\xff\xfe\x00" + good,
        "a list": b"[1, 2, 3]",
        "number too long": _raw(doc, "step", b"9" * 5000),
    }


def test_every_hostile_manifest_is_reported_and_the_files_are_scanned(tmp_path):
    doc = _saved(tmp_path)
    manifest = tmp_path / "manifest.json"
    for name, data in _hostile(doc).items():
        assert data != json.dumps(doc).encode(), name
        manifest.write_bytes(data)
        with capture_logs() as logs:
            assert checkpoint.read_manifest(tmp_path) is None, name
            assert load_latest(tmp_path)["step"] == 3, name  # the scan finds every file
            assert checkpoint.latest_info(tmp_path)["step"] == 3, name  # what status shows
        warned = [e for e in logs if e["event"].startswith("checkpoint_manifest_")]
        assert warned and all(e["path"] == str(manifest) for e in warned), (name, logs)
    # and the writer, which trusts the manifest to delete old files, deletes none it names
    manifest.write_bytes(_hostile(doc)["file ../../etc/passwd"])
    (tmp_path.parent / "precious").write_text("keep me")
    mgr = CheckpointManager(tmp_path, keep=1, handle_sigterm=False)
    mgr.save(4, {"step": 4})
    mgr.close()
    assert (tmp_path.parent / "precious").read_text() == "keep me"
    assert checkpoint.MAX_MANIFEST < HUGE


def test_a_manifest_that_is_not_a_file_does_not_block_the_reader(tmp_path):
    _saved(tmp_path)
    (tmp_path / "manifest.json").unlink()
    fifo = tmp_path / "manifest.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    got = {}

    def load():
        with capture_logs() as logs:
            got["step"] = load_latest(tmp_path)["step"]
        got["logs"] = logs

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # release it (a writer opens and closes), then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading the checkpoint directory blocked on a FIFO manifest")
    assert got["step"] == 3
    assert [e for e in got["logs"] if e["event"] == "checkpoint_manifest_unreadable"]


def test_a_file_name_with_an_absurd_step_is_skipped(tmp_path):
    _saved(tmp_path)
    newest = sorted(tmp_path.glob("ckpt-*.pt"))[-1]
    absurd = tmp_path / f"ckpt-{'9' * 25}-{newest.name.split('-')[2]}"
    shutil.copy(newest, absurd)  # a step no int64 holds: ranks exchange steps as int64
    with capture_logs() as logs:
        assert load_latest(tmp_path)["step"] == 3
    assert [e for e in logs if e["event"] == "checkpoint_skipped" and e["path"] == str(absurd)]


@pytest.mark.parametrize("hostile", ["step 1e999", "deep nesting"])
def test_job_resumes_from_the_previous_good_checkpoint(tmp_path, capfd, hostile):
    """Two gloo ranks train, save at steps 4 and 8, crash after 10; the newest checkpoint is torn
    and the manifest crafted. The resumed job reports both, loads step 4 and trains to the end."""
    run = tmp_path / "run"
    helpers.run(helpers.train, 2, tmp_path, str(run), 14, None, 10, timeout=90)
    newest = run / checkpoint.latest_info(run)["file"]
    assert checkpoint.latest_info(run)["step"] == 8
    newest.write_bytes(newest.read_bytes()[:100])  # torn
    manifest = run / "manifest.json"
    manifest.write_bytes(_hostile(json.loads(manifest.read_text()))[hostile])
    capfd.readouterr()
    helpers.run(helpers.train, 2, tmp_path, str(run), 14, str(run), None, timeout=90)
    got = torch.load(f"{run}.0.pt", weights_only=True)
    assert got["loaded"]["step"] == 4 and got["step"] == 14
    out = "".join(capfd.readouterr())
    assert "checkpoint_manifest_unreadable" in out and str(manifest) in out, out[:3000]
    assert "checkpoint_skipped" in out and str(newest) in out
