"""Every restart cause carries its metric label and whether it restarts the group
(states.RestartCause), and the figures and metrics count a cause by those alone: a cause cannot go
uncounted (store unreachable once did) nor two share a series."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elasticd.lifecycle.states import Failure, RestartCause, Scale
from elasticd.reporting import metrics
from elasticd.reporting.figures import CAUSES, Figures

LABEL = re.compile(r"[a-z][a-z0-9_]*")  # a Prometheus label value that needs no quoting thought


def test_every_cause_has_a_distinct_valid_label():
    labels = [cause.label for cause in RestartCause]
    assert all(isinstance(label, str) and LABEL.fullmatch(label) for label in labels), labels
    assert len(set(labels)) == len(labels), labels
    assert all(isinstance(cause.restarts, bool) for cause in RestartCause)
    assert set(CAUSES) == {c.label for c in RestartCause if c.restarts}
    # those the agent loop never restarts for
    assert {c for c in RestartCause if not c.restarts} == {
        RestartCause.RENDEZVOUS,
        RestartCause.STOP,
        RestartCause.HEALTH,
    }


def test_values_are_the_kinds_status_always_showed():
    assert RestartCause("store unreachable") is RestartCause.STORE_UNREACHABLE
    assert RestartCause.CRASH == "exited" and RestartCause.NODE_LOST.value == "node lost"


def _exposed_restarts(figures: Figures) -> dict[str, float]:
    """elasticd_restarts_total by cause, as a scrape shows it, from the figures' report."""
    snapshot = {"state": "RUNNING", "run_id": "job", "node": "n1", **figures.report(10.0)}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.SnapshotCollector(lambda: snapshot))
    text = generate_latest(registry).decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "elasticd_restarts"]
    return {s.labels["cause"]: s.value for s in family.samples if s.name.endswith("_total")}


@pytest.mark.parametrize("cause", [c for c in RestartCause if c.restarts], ids=lambda c: c.label)
def test_each_restart_is_counted_under_its_label(cause):
    figures = Figures(started=0.0)
    why = Scale(2, "n1") if cause is RestartCause.SCALE else Failure(cause, "why", node="n1")
    figures.on_restart(why, [])
    exposed = _exposed_restarts(figures)
    assert exposed[cause.label] == 1.0
    assert sum(exposed.values()) == 1.0 and set(exposed) == set(CAUSES)


def test_a_store_unreachable_restart_is_counted():
    figures = Figures(started=0.0)
    why = Failure(RestartCause.STORE_UNREACHABLE, "no answer for 10 s", node="n1")
    figures.on_restart(why, [])
    figures.on_restart(why, [])
    assert _exposed_restarts(figures)["store_unreachable"] == 2.0
