"""Spares that import what this job's workers import: the daemon's side (`Learning`), which teaches
the fork server the union of what an attempt's workers imported and says its report as events.

Each worker names the library modules it has imported at its first optimizer step
(worker/imported.py, `rankN.modules` beside its heartbeat file). Once every worker of an attempt
has, the daemon writes their union (in import order) to the run directory and asks the fork
server to import it (worker/preload.py: whatever would see the rank's environment differently is
left out); when its report comes back the spares forked before are replaced, so the next restart
takes spares that have the job's frameworks imported: Lightning, transformers' Trainer and the
rest no longer cost their import after a crash. Each module not preloaded is said in one line
with why (grouped by its cause); the whole report stays in the run directory.

A server is taught at most once per attempt and `MAX_TRIES` (3) times per run; a name that ranks
loaded from different files is not taught. The report is said as events: `preload_skipped`, once
per cause, and `preload_learned`. SparePool (spares.py) replaces the spares forked before it, and
a server tainted after all (a rank variable read in the server) by one that learns nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from elasticd import safeio
from elasticd.worker import imported, preload

MAX_TRIES = 3  # teachings per run: a job whose imports keep growing stops being chased


class Learning:
    def __init__(self, run_dir: Path, event: Callable[..., None]) -> None:
        self.run_dir = run_dir
        self.event = event
        self.known: set[str] = set()  # names sent to the fork server already
        self.origins: dict[str, str] = {}  # each name sent: the file the workers loaded it from
        self.tries = 0
        self.done_for: tuple[str, ...] = ()  # the reports of the attempt already taught from
        self.asked: Path | None = None  # the names file of the request in flight
        self.asked_at = 0.0  # when (monotonic), and how many names it holds
        self.asked_count = 0

    def forget(self) -> None:
        """The fork server died: what it learned, and the answer it owed, are gone."""
        self.known.clear()
        self.origins.clear()
        self.asked = None
        self.done_for = ()

    def wanted(self, heartbeats: Sequence[Path]) -> dict[str, str] | None:
        """The union of the workers' reports (each name with the file it was loaded from; a
        name that workers loaded from different files is left out), once every one is there, if
        it names anything not sent before (at most once per attempt, MAX_TRIES per run)."""
        key = tuple(str(p) for p in heartbeats)
        if not key or key == self.done_for or self.tries >= MAX_TRIES or self.asked:
            return None
        union: dict[str, str] = {}
        differ = set()
        for hb in key:
            names = imported.read(imported.report_path(hb))
            if names is None:
                return None  # not every worker has stepped yet
            differ.update(n for n, origin in names.items() if union.get(n, origin) != origin)
            union.update(names)
        self.done_for = key
        new = {n: o for n, o in union.items() if n not in self.known and n not in differ}
        return new or None

    def write(self, names: dict[str, str]) -> Path:
        """The names file the fork server reads (a new one per request): `name<TAB>origin`."""
        self.tries += 1
        path = self.run_dir / f"preload-learned{self.tries}.txt"
        with open(safeio.create(path), "w") as f:
            f.write("".join(f"{n}\t{o}\n" for n, o in names.items()))
        self.known.update(names)
        self.origins.update(names)
        self.asked, self.asked_at, self.asked_count = path, time.monotonic(), len(names)
        return path

    def reported(self) -> dict:
        """The fork server's report on the request in flight (`path`: where it is)."""
        path, self.asked = self.asked, None
        report_path = f"{path}{preload.REPORT_SUFFIX}"
        try:
            with open(safeio.open_existing(report_path)) as f:
                report = json.load(f)
        except (OSError, ValueError) as e:
            report = {"preloaded": [], "excluded": {}, "error": f"no report: {e}"}
        report["path"] = report_path
        return report

    def say(self, report: dict, replaced: list[int]) -> None:
        """The report in events: each cause of a module left out, then the outcome, with the
        spares `replaced` (forked before, without what was learned)."""
        excluded: dict[str, str] = report.get("excluded") or {}
        for module, why, count in causes(excluded):
            self.event("preload_skipped", module=module, why=why, with_it=count)
        self.event(
            "preload_learned",
            level="warning" if report.get("error") or report.get("tainted") else "info",
            preloaded=len(report.get("preloaded") or []),
            skipped=len(excluded),
            error=report.get("error"),
            tainted=report.get("tainted"),
            report=report.get("path"),
            replaced=replaced,
        )


def causes(excluded: dict[str, str]) -> list[tuple[str, str, int]]:
    """One entry per module left out for a reason of its own (it reads a rank variable, fails
    to import, starts a thread...), with how many others were left out because they import it or
    lie inside it."""
    roots = {m: why for m, why in excluded.items() if not why.startswith(("imports ", "inside "))}
    counts = dict.fromkeys(roots, 0)
    for m, why in excluded.items():
        if m in roots:
            continue
        cause = why.split()[1].rstrip(",")
        seen = set()
        while cause in excluded and cause not in roots and cause not in seen:
            seen.add(cause)
            cause = excluded[cause].split()[1].rstrip(",")
        if cause in counts:
            counts[cause] += 1
    return [(m, why, counts[m]) for m, why in roots.items()]
