"""The warm spares of one daemon run: processes waiting for a rank, and the fork server that
forks them (workers.ForkServer), or fresh interpreters where the server is unfit.

Spares are asked for while the nodes meet, handed to workers.spawn at a start, and refilled:
at once after a start when the fork server makes them (a fork each: nothing the starting
workers would notice), otherwise once the new workers are past start-up (a fresh interpreter's
imports would slow theirs), or after REFILL_AFTER seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from elasticd import proctitle, workers
from elasticd.config import Config

REFILL_AFTER = 10.0  # seconds after a start that fresh-interpreter spares are refilled at the latest


class SparePool:
    def __init__(self, cfg: Config, token: str, run_dir: Path, event: Callable[..., None]) -> None:
        self.cfg = cfg
        self.token = token
        self.log_path = run_dir / "spares.log"
        self.event = event  # Agent.event: logged and shown in status
        self.spares: list[workers.Spare] = []  # warm processes waiting for a rank
        self.forkserver: workers.ForkServer | None = None
        self.refill_due: float | None = None  # when fresh-interpreter spares are refilled at the latest

    def start(self, reaper: bool) -> None:
        """Start the fork server (its spares are reparented to us: needs `reaper`) and ask for
        the spares, which import torch while the nodes meet."""
        if self.cfg.warm_spawn and reaper:
            self.forkserver = workers.ForkServer(self.token, self.cfg.nproc_per_node, self.cfg.preload,
                                                 self.log_path, self._shown())
        self.top_up()

    @property
    def pending(self) -> int:
        """Spares asked of the fork server and not yet received."""
        return self.forkserver.pending if self.forkserver else 0

    def waitables(self) -> list[workers.ForkServer]:
        """What to select on for spares to arrive (the fork server's connection while it owes some)."""
        fs = self.forkserver
        return [fs] if fs and fs.pending and fs.usable else []

    def top_up(self) -> None:
        """Ask the fork server for the spares missing, or start fresh interpreters where it is unfit."""
        if not self.cfg.warm_spawn:
            return
        self.collect()
        self.spares = [p for p in self.spares if p.proc.poll() is None]
        fs = self.forkserver
        missing = self.cfg.nproc_per_node - len(self.spares) - (fs.pending if fs else 0)
        if fs:
            fs.request(missing)
        else:
            self.spares += [workers.start_spare(self.token, self.cfg.nproc_per_node, self.cfg.preload,
                                                self.log_path, self._shown()) for _ in range(missing)]
        self.refill_due = None

    def collect(self) -> None:
        """Take the spares the fork server forked; if it quit, say why and fall back."""
        fs = self.forkserver
        if fs is None:
            return
        if fs.pending:
            self.spares += fs.collect()
        if not fs.usable:
            self.event("fork_server_off", level="warning",
                       reason=fs.unfit or workers.describe_exit(fs.proc.poll() or 0),
                       fallback="warm spares are fresh interpreters importing torch themselves")
            fs.close()
            self.forkserver = None
            self.top_up()

    def after_spawn(self) -> None:
        """A start took spares: refill now from the fork server, else once the workers stepped."""
        if self.forkserver:
            self.top_up()
        elif self.cfg.warm_spawn:
            self.refill_due = time.monotonic() + REFILL_AFTER

    def refill_if_due(self, stepped: bool, now: float) -> None:
        if self.refill_due is not None and (stepped or now >= self.refill_due):
            self.top_up()

    def keep(self) -> frozenset[int]:
        """Processes a teardown sweep must spare: the spares and their fork server."""
        keep = {p.pid for p in self.spares}
        if self.forkserver:
            keep.add(self.forkserver.proc.pid)
        return frozenset(keep)

    def close(self) -> None:
        workers.discard_spares(self.spares)
        if self.forkserver:
            self.forkserver.close()

    def _shown(self) -> list[str]:
        """The workers' command line as ps shows it (see proctitle)."""
        return proctitle.title(self.cfg.entrypoint, self.cfg.args)
