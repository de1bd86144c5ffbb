"""This node's record (daemon/quarantine.py): strikes counted within the window, quarantine at the
limit, the file written whole and never through a symlink, a damaged one refused in one line,
and no worker's error text ever taken for the node's hardware."""

from __future__ import annotations

import json
import os

import pytest

from elasticd import config
from elasticd.config import ConfigError
from elasticd.daemon import quarantine as q
from elasticd.lifecycle import triage
from elasticd.ops.render import status as render
from elasticd.reporting.status_snapshot import Health, Snapshot

DAY = 86400.0


def test_quarantined_at_the_third_strike_within_the_window(tmp_path):
    t = 1.7e9
    assert q.strike(tmp_path, "first", 3, DAY, t).quarantined is None
    # a strike older than the window no longer counts
    assert len(q.strike(tmp_path, "second", 3, DAY, t + DAY + 1).strikes) == 1
    q.strike(tmp_path, "third", 3, DAY, t + DAY + 2)
    record = q.strike(tmp_path, "fourth", 3, DAY, t + DAY + 3)
    assert record.quarantined["why"] == "3 failure(s) within 24 h, the last: fourth"
    assert q.read(tmp_path) == record  # kept across daemons: read back from the file
    assert oct(os.stat(tmp_path / q.FILE).st_mode & 0o777) == "0o640"
    line = q.refusal(record, tmp_path)
    assert line.startswith("elasticd: not starting: this node is quarantined since ")
    assert f"`elasticd node clear --state-dir {tmp_path}`" in line
    assert q.clear(tmp_path) == record and q.read(tmp_path) == q.Record()


def test_zero_never_quarantines(tmp_path):
    for i in range(5):
        record = q.strike(tmp_path, "x", 0, DAY, 1.7e9 + i)
    assert record.quarantined is None and len(record.strikes) == 5


def test_a_strike_at_once_quarantines_under_the_kept_rule_unless_never(tmp_path):
    """A rank the replicas' audit outvoted again (daemon/sdc.py): quarantined by that strike,
    the record still counting by --quarantine-after; --quarantine-after 0 still means never."""
    record = q.strike(tmp_path, "sdc again", 3, DAY, 1.7e9, at_once=True)
    assert record.quarantined is not None and record.after == 3
    never = tmp_path / "never"
    assert q.strike(never, "sdc again", 0, DAY, 1.7e9, at_once=True).quarantined is None


@pytest.mark.parametrize(
    "content",
    [b"{", b"[]", b'{"strikes": [{"at": "x", "why": "y"}]}', b'{"quarantined": 3}', b"\xff"],
)
def test_a_damaged_record_is_refused_in_one_line_and_kept(tmp_path, content):
    (tmp_path / q.FILE).write_bytes(content)
    with pytest.raises(ConfigError, match="move it away") as e:
        q.strike(tmp_path, "x", 3, DAY, 1.7e9)
    assert "\n" not in str(e.value)
    assert (tmp_path / q.FILE).read_bytes() == content  # nothing written over it


def test_the_record_is_never_read_or_written_through_a_symlink(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"strikes": [], "quarantined": None}))
    state = tmp_path / "state"
    state.mkdir()
    (state / q.FILE).symlink_to(target)
    with pytest.raises(ConfigError):
        q.read(state)
    (state / q.FILE).unlink()
    (state / f".{q.FILE}.{os.getpid()}").symlink_to(target)  # a planted temporary file
    q.write(state, q.Record([{"at": 1.0, "why": "x"}]))
    assert json.loads(target.read_text())["strikes"] == []  # the symlink was removed, not followed
    assert q.read(state).strikes == [{"at": 1.0, "why": "x"}]


@pytest.mark.parametrize(
    "text, klass",
    [
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "user"),
        ("NCCL error in: ..., unhandled cuda error (run with NCCL_DEBUG=INFO for details)", "user"),
        ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", "user"),
        ("RuntimeError: bad record: Xid 79 ECC error", "user"),
        ("KeyError: 'xid'", "user"),
        ("ValueError: injected failure at step 3", "user"),
        ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
        (None, "user"),
    ],
)
def test_no_error_text_makes_a_worker_failure_the_nodes(text, klass):
    """A worker's error file is the job's text: whatever it says of ECC or Xid, the failure is
    never of the hardware class, and so judged by the repeat rule like any other; the node is
    struck only by its health check (the one before the restart confirms a fault)."""
    got = triage.classify(1, text, False)
    assert got.value == klass and triage.judged(got)


def test_state_dir_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    cfg = config.build({})
    assert q.state_dir(cfg, tmp_path) == tmp_path / "state"
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/elasticd")
    assert str(q.state_dir(cfg, tmp_path)) == "/var/lib/elasticd"
    assert str(q.state_dir(config.build({"state_dir": "/srv/s"}), tmp_path)) == "/srv/s"


def test_status_shows_quarantine_and_failures():
    snap = Snapshot(state="LEFT", health=Health(quarantined=True, quarantine_reason="3 failures"))
    assert "QUARANTINED: 3 failures (`elasticd node clear`)" in render(snap)
    snap = Snapshot(state="RUNNING", health=Health(strikes=2, quarantine_after=3))
    assert "node failures: 2 (quarantined at 3)" in render(snap)


def test_a_damaged_record_stops_run_and_node_status_with_one_line(tmp_path):
    from harness import assert_one_error, run_cli, script

    (tmp_path / q.FILE).write_text("{not json")
    for cmd in (
        ("node", "status", "--state-dir", str(tmp_path)),
        (
            "run",
            "--state-dir",
            str(tmp_path),
            "--log-dir",
            str(tmp_path / "logs"),
            script("faulty.py"),
        ),
    ):
        assert_one_error(run_cli(*cmd, timeout=60), f"{tmp_path / q.FILE}", "move it away")
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())
    assert (tmp_path / q.FILE).read_text() == "{not json"


def test_node_status_counts_by_the_rule_the_strikes_were_recorded_under(tmp_path):
    """Quarantined at --quarantine-after 2 within 1 h: `node status`, run with the defaults (3,
    24 h), says 2 and 1 h; a record written before the rule was kept falls back to the settings."""
    cfg = config.build({"nproc_per_node": "1"})
    q.strike(tmp_path, "first", 2, 3600.0, 1.7e9)
    record = q.strike(tmp_path, "second", 2, 3600.0, 1.7e9 + 1)
    assert record.quarantined and (record.after, record.window) == (2, 3600.0)
    assert q.read(tmp_path) == record
    (line,) = [x for x in q.describe(record, tmp_path, cfg) if x.startswith("failures")]
    assert line == "failures within 1 h: 0 (quarantine at 2)", line
    older = q.Record(strikes=record.strikes)
    (line,) = [x for x in q.describe(older, tmp_path, cfg) if x.startswith("failures")]
    assert line == "failures within 24 h: 0 (quarantine at 3)", line


@pytest.mark.parametrize(
    "rule", [{"after": "2"}, {"after": True}, {"window": 0}, {"window": "1h"}, {"after": 1.5}]
)
def test_a_record_with_a_damaged_rule_is_refused(tmp_path, rule):
    (tmp_path / q.FILE).write_text(json.dumps({"strikes": [], **rule}))
    with pytest.raises(ConfigError, match="move it away"):
        q.read(tmp_path)
