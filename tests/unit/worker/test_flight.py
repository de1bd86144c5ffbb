"""worker/flight.py: armed only where the daemon made its FIFO; torch's dump written as it is
(a list where two recorders answer), a recorder's error said in its place."""

from __future__ import annotations

import json
import threading

from elasticd import names
from elasticd.daemon import collective_seq
from elasticd.worker import flight


def test_not_armed_without_the_daemons_fifo(tmp_path, monkeypatch):
    monkeypatch.setattr(flight, "_armed", False)
    monkeypatch.setenv(names.COLLECTIVES_FILE, str(tmp_path / "rank0.collectives.json"))
    before = {t.name for t in threading.enumerate()}
    flight.arm()
    assert not flight._armed and "elasticd-collectives" not in before
    assert "elasticd-collectives" not in {t.name for t in threading.enumerate()}


def test_dump_is_torchs_json_or_a_list_of_them():
    one = json.dumps({"entries": [], "pg_status": {}})

    def broken(*_):
        raise RuntimeError("NCCL's recorder is not on")

    assert flight.dump([lambda *_: one]) == one
    both = json.loads(flight.dump([lambda *_: one.encode(), broken]))
    assert both[0] == json.loads(one) and "NCCL's recorder" in both[1]["errors"][0]
    assert collective_seq.progress(flight.dump([lambda *_: one.encode(), broken])) == {}


def test_this_torch_has_a_recorder():
    """torch 2.13's CPU build: the Flight Recorder's JSON dump (gloo's)."""
    assert flight.recorders()
