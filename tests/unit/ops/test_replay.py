"""`elasticd replay`'s verdict (daemon/replay_verdict.py `verdict`, pure, the daemon's too) and
its refusal of a bad bundle, in one line, exit 2, before torch loads (the real replay of a real
failure: tests/e2e/test_replay.py)."""

from __future__ import annotations

import pytest

from elasticd import repro
from elasticd.daemon import replay_verdict
from harness import run_cli

TB = 'Traceback (most recent call last):\n  File "/src/train.py", line {line}, in main\n'
HEAD = {
    "rank": 1,
    "world": 2,
    "certified_step": 6,
    "failed_step": 7,
    "samples": {},
    "error": {
        "exception": "ValueError: sample 37 has a malformed label at step 7",
        "callstack": TB.format(line=52),
    },
}


def _error(text: str, line: int = 52) -> dict:
    return {"outcome": "error", "exception": text, "callstack": TB.format(line=line)}


@pytest.mark.parametrize(
    "got, seen, code, words",
    [
        (_error("ValueError: sample 37 has a malformed label at step 7"), {}, 0, "reproduced"),
        # numbers masked: the same failure (a loss, a step differ between runs)
        (_error("ValueError: sample 38 has a malformed label at step 7"), {}, 0, "reproduced"),
        (_error("ValueError: sample 37 has a malformed label at step 7", 60), {}, 3, "another"),
        (_error("KeyError: 'x'"), {}, 3, "undecided: another error"),
        ({"outcome": "completed", "step": 7, "digest": 255}, {}, 1, "00000000000000ff"),
        ({"outcome": "completed", "step": 7, "digest": None}, {}, 1, "step 7 completed"),
        ({"outcome": "ended", "code": 0}, {}, 3, "ended (exit 0) before step 7"),
        ({"outcome": "lost"}, {}, 3, "without a result"),
        ({"outcome": "refused", "why": "x: damaged"}, {}, 2, "damaged"),
    ],
)
def test_the_verdict(got, seen, code, words):
    assert replay_verdict.verdict(HEAD, got, seen)[0] == code
    assert words in replay_verdict.verdict(HEAD, got, seen)[1]


def test_samples_that_differ_from_the_ledgers_make_it_no_replay_of_the_step():
    head = {**HEAD, "certified_step": 4, "samples": {"5": [1, 2], "6": [3, 4]}}
    same = _error(HEAD["error"]["exception"])
    assert replay_verdict.verdict(head, same, {5: [1, 2], 6: [3, 4], 7: [9]})[0] == 0
    code, words = replay_verdict.verdict(head, same, {5: [1, 2], 6: [4, 3]})
    assert code == 3 and "step 6's samples differ from the ledger's" in words


def test_the_replays_environment_is_a_world_of_one_standing_for_the_failed_rank():
    head = {**HEAD, "env": {"PYTHONPATH": "/src", "RANK": "1"}}
    env = repro.replay_env(head, "b.repro", "/tmp/r.json", "/tmp/l")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("0", "1", "1")
    assert env["ELASTICD_REPLAY_AS"] == "1/2" and env["PYTHONPATH"] == "/src"
    assert env["ELASTICD_LEDGER_DIR"] == "/tmp/l" and env["ELASTICD_REPLAY"].endswith("b.repro")


def test_a_bad_bundle_is_refused_in_one_line(tmp_path):
    path = tmp_path / "rank1.repro"
    repro.write(path, HEAD, b"x" * 64)
    data = bytearray(path.read_bytes())
    data[-1] ^= 4
    path.write_bytes(bytes(data))
    for bad in (path, tmp_path / "missing.repro"):
        r = run_cli("replay", str(bad), timeout=60)
        assert r.returncode == 2, (r.stdout, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("elasticd replay: refused: "), r.stderr
        assert r.stdout == ""


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "soon"])
def test_a_timeout_that_is_no_number_of_seconds_is_bad_input(timeout):
    r = run_cli("replay", "x.repro", "--timeout", timeout, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "number of seconds" in lines[0], r.stderr
