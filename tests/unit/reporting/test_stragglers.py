"""The straggler rule (stragglers.judge) as a table: figures in, verdict out, no clock, no
heartbeats. The integration through Stragglers.observe is in
tests/unit/reporting/test_metrics.py."""

from __future__ import annotations

import pytest

from elasticd.reporting.stragglers import judge

T = 0.2  # --straggler-threshold: above means more than 1.2x the period's median
W = 3.0  # --straggler-window, seconds

# name, means (windowed), latest (last period), above before, now, slow, above after (ranks)
CASES = [
    ("all alike", {0: 0.1, 1: 0.1, 2: 0.1}, {0: 0.1, 1: 0.1, 2: 0.1}, {}, 10.0, set(), set()),
    (
        "first slow period: above from now, not yet slow",
        {0: 0.1, 1: 0.1, 2: 0.5},
        {0: 0.1, 1: 0.1, 2: 0.5},
        {},
        10.0,
        set(),
        {2},
    ),
    (
        "above for the whole window and over on the whole: slow",
        {0: 0.1, 1: 0.1, 2: 0.5},
        {0: 0.1, 1: 0.1, 2: 0.5},
        {2: (7.0, 1007.0)},
        10.0,
        {2},
        {2},
    ),
    (
        "above, but not yet for the whole window",
        {0: 0.1, 1: 0.1, 2: 0.5},
        {0: 0.1, 1: 0.1, 2: 0.5},
        {2: (7.5, 1007.5)},
        10.0,
        set(),
        {2},
    ),
    (
        "above for the window, but caught up on the whole: not slow",
        {0: 0.1, 1: 0.1, 2: 0.11},
        {0: 0.1, 1: 0.1, 2: 0.5},
        {2: (1.0, 1001.0)},
        10.0,
        set(),
        {2},
    ),
    (
        "a normal period ends it",
        {0: 0.1, 1: 0.1, 2: 0.5},
        {0: 0.1, 1: 0.1, 2: 0.1},
        {2: (1.0, 1001.0)},
        10.0,
        set(),
        set(),
    ),
    (
        "exactly at the limit is not above",
        {0: 0.1, 1: 0.1, 2: 0.12},
        {0: 0.1, 1: 0.1, 2: 0.12},
        {},
        10.0,
        set(),
        set(),
    ),
    (
        "one rank's period figure is no period: nothing changes",
        {0: 0.1, 1: 0.1, 2: 0.5},
        {2: 0.1},
        {2: (1.0, 1001.0)},
        10.0,
        {2},
        {2},
    ),
    (
        "a rank that did not step this period keeps its state",
        {0: 0.1, 1: 0.1, 2: 0.5},
        {0: 0.1, 1: 0.1},
        {2: (1.0, 1001.0)},
        10.0,
        {2},
        {2},
    ),
    (
        "no work at all: nobody is above",
        {0: 0.0, 1: 0.0, 2: 0.0},
        {0: 0.0, 1: 0.0, 2: 0.0},
        {},
        10.0,
        set(),
        set(),
    ),
]


@pytest.mark.parametrize(
    "means, latest, before, now, slow, after", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_rule(means, latest, before, now, slow, after):
    given = dict(before)
    verdict = judge(means, latest, before, now, 1000.0 + now, threshold=T, window=W)
    assert verdict.slow == slow
    assert set(verdict.above) == after
    for local in after:  # a rank keeps the time it first went above; a new one is dated now
        assert verdict.above[local] == before.get(local, (now, 1000.0 + now))
    assert before == given  # the caller's dict is not changed


def test_ratios_are_to_the_windowed_median():
    verdict = judge({0: 0.1, 1: 0.2, 2: 0.4}, {}, {}, 0.0, 0.0, threshold=T, window=W)
    assert verdict.median == 0.2
    assert verdict.ratios == pytest.approx({0: 0.5, 1: 1.0, 2: 2.0})
    assert judge({0: 0.0, 1: 0.0}, {}, {}, 0.0, 0.0, threshold=T, window=W).ratios == {
        0: 1.0,
        1: 1.0,
    }
