"""The warm spares of one daemon run (`SparePool`): processes waiting for a rank, and the fork
server that forks them (forkclient.ForkServer), or fresh interpreters where the server is unfit;
when they are refilled.

A fork server that dies (an OOM killer's pick: torch imported, a large RSS) is started again
after a backoff (supervise.Part), while fresh-interpreter spares cover the gap; an unfit one would
be unfit again, and stays off.

Spares are asked for while the nodes meet, handed to spawn.spawn at a start (or to the referee's
replays, daemon/referee.py), and refilled: at once after a start when the fork server makes them
(a fork each: nothing the starting workers would notice), otherwise once the new workers are past
start-up (a fresh interpreter's imports would slow theirs), or after REFILL_AFTER seconds. A
spare that died (killed: an OOM killer's pick too) is replaced.

Once learning (learning.py) found modules that read a rank variable, one more spare per local rank
is bound to its environment in the running attempt (worker/bound.py; the `spares_bound` event);
those bound to another world's environments are let go at the next start.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from elasticd.config import Config
from elasticd.daemon import forkclient, learning, processes
from elasticd.lifecycle import supervise
from elasticd.worker import proctitle

REFILL_AFTER = (
    10.0  # seconds after a start that fresh-interpreter spares are refilled at the latest
)


class SparePool:
    def __init__(self, cfg: Config, token: str, run_dir: Path, event: Callable[..., None]) -> None:
        self.cfg = cfg
        self.token = token
        self.log_path = run_dir / "spares.log"
        self.event = event  # Agent.event: logged and shown in status
        self.spares: list[forkclient.Spare] = []  # warm processes waiting for a rank
        # forked after a learning report the loop has not handled yet (collected by keep())
        self.after_report: list[forkclient.Spare] = []
        self.forkserver: forkclient.ForkServer | None = None
        self.refill_due: float | None = (
            None  # when fresh-interpreter spares are refilled at the latest
        )
        self.part: supervise.Part | None = None  # the fork server's health, once there is one
        self.respawn_at: float | None = None  # when a dead fork server is started again
        self.learning = learning.Learning(run_dir, event) if cfg.learn_preload else None
        # spares bound to a rank ahead (worker/bound.py): what they import, the variables read
        self.binding: tuple[dict[str, str], list[str]] | None = None  # modules (origins), reads
        self.expected: list[dict[str, str]] = []  # the running attempt's environments
        self.environ_check: subprocess.Popen | None = None  # can spares show a rank's environ?

    def _start_server(self) -> None:
        self.forkserver = forkclient.ForkServer(
            self.token, self.cfg.nproc_per_node, self.cfg.preloaded, self.log_path, self._shown()
        )

    def start(self, reaper: bool) -> None:
        """Start the fork server (its spares are reparented to us: needs `reaper`) and ask for
        the spares, which import torch while the nodes meet."""
        if self.cfg.warm_spawn and reaper:
            self.part = supervise.part("fork_server", event=self.event)
            self._start_server()
        if self.cfg.warm_spawn:
            self.environ_check = subprocess.Popen(
                [sys.executable, "-P", "-c", proctitle.CHECK],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        self.top_up()

    def _say_environ(self) -> None:
        """Once the check started at start() ended: one line where a spare handed a rank cannot
        show that rank's environment in /proc/PID/environ (proctitle.show_environ)."""
        check = self.environ_check
        if check is None or check.poll() is None:
            return
        self.environ_check = None
        if check.returncode != 0:
            self.event(
                "worker_environ_hidden",
                level="warning",
                why="the kernel refuses prctl(PR_SET_MM): no checkpoint/restore support and no "
                "CAP_SYS_RESOURCE (run the daemon as root)",
                effect="/proc/PID/environ of a worker started from a warm spare shows the "
                "spare's environment, without RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR...; "
                "the worker itself (os.environ) has its rank's",
                fix="--no-warm-spawn, where a monitor maps pids to ranks by their environment",
            )

    @property
    def pending(self) -> int:
        """Spares asked of the fork server and soon received (none while it learns: a start
        does not wait for them)."""
        fs = self.forkserver
        return fs.pending if fs and not fs.learning else 0

    def waitables(self) -> list[forkclient.ForkServer]:
        """What to select on for spares or a learning report to arrive."""
        fs = self.forkserver
        return [fs] if fs and (fs.pending or fs.learning) and fs.usable else []

    def learn(self, workers: list) -> None:
        """Once every worker (spawn.Worker) named its imports, have the fork server import them
        (daemon/learning.py)."""
        fs = self.forkserver
        if self.learning is None or fs is None or not fs.usable or fs.learning:
            return
        names = self.learning.wanted([w.heartbeat_path for w in workers])
        if names:
            fs.teach(self.learning.write(names))

    def _learned(self, fs: forkclient.ForkServer) -> None:
        """The fork server's report came: replace the spares forked before it (they lack what
        it imported); a server tainted after all is replaced by one that learns nothing."""
        fs.learned = False
        late, self.after_report = self.after_report, []
        if self.learning is None:
            self._place(late)
            return
        report = self.learning.reported()
        replace = bool(report.get("preloaded") or report.get("tainted"))
        # (else nothing new in the server: the spares are as good)
        self.learning.say(report, replaced=[p.pid for p in self.spares] if replace else [])
        if not replace:
            self._place(late)
            return
        forkclient.discard_spares(self.spares)
        if report.get("bound"):
            origins = self.learning.origins
            modules = {n: origins[n] for n in report["bound"] if n in origins}
            self.binding = modules, report.get("reads") or []
        if report.get("tainted"):
            forkclient.discard_spares(late)
            self.learning = self.binding = None
            fs.close()
            self._start_server()
        else:
            self._place(late)  # forked after the report: they hold what it imported
        self._fill()

    def take(self) -> forkclient.Spare | None:
        """A warm spare for work other than a rank's (the replays: torch and the job's imports
        already loaded); None where none is ready. The next top-up replaces it."""
        for i, spare in enumerate(self.spares):
            if _free(spare):
                return self.spares.pop(i)
        return None

    def missing(self) -> str:
        """Why `take` has none now, in words (the `replay_spare_missing` event's): warm spawn
        off, the spares bound to ranks or dead, those being forked, the fork server's state."""
        if not self.cfg.warm_spawn:
            return "warm spawn is off (--no-warm-spawn)"
        fs = self.forkserver
        bound = sum(p.bound is not None for p in self.spares)
        dead = [code for code in (p.proc.poll() for p in self.spares) if code is not None]
        server = (
            "no fork server (fresh interpreters)"
            if fs is None
            else "the fork server unusable"
            if not fs.usable
            else "the fork server learning the workers' imports (no forks meanwhile)"
            if fs.learning
            else "the fork server ready"
        )
        return (
            f"{len(self.spares)} spare(s), {bound} bound to ranks, {len(dead)} dead {dead}; "
            f"{fs.pending if fs else 0} being forked; {server}"
        )

    def ready_or_none_coming(self) -> bool:
        """Whether `take` has one now, or none is on its way (asked of the fork server: a refill
        after a start, say, forked while it learns too): what a wait for one checks."""
        fs = self.forkserver
        coming = fs is not None and fs.usable and fs.pending > 0
        return not coming or any(map(_free, self.spares))

    def top_up(self) -> None:
        """Ask the fork server for the spares missing, or start fresh interpreters where it is
        unfit."""
        if not self.cfg.warm_spawn:
            return
        self.collect()
        self._fill()

    def _unbound_ranks(self) -> list[dict[str, str]]:
        """The running attempt's environments that no spare is bound to yet."""
        if self.binding is None:
            return []
        bound = [p for p in self.spares if p.bound is not None]
        out = []
        for env in self.expected:
            fit = next((p for p in bound if p.fits(env)), None)
            if fit is None:
                out.append(env)
            else:
                bound.remove(fit)
        return out

    def _place(self, new: list[forkclient.Spare]) -> None:
        """Spares just forked: bound to the ranks that have no bound spare, first (worker/bound.py:
        a restart at this world takes those), the rest kept unbound (for another world)."""
        todo, bound = self._unbound_ranks(), {}
        for spare in new:
            if todo and self.binding is not None:
                env = todo.pop(0)
                spare.bind(env, *self.binding)
                bound[spare.pid] = env.get("RANK")
            self.spares.append(spare)
        if bound:
            self.event("spares_bound", spares=bound, modules=len(self.binding[0]))

    def _fill(self) -> None:
        self.spares = [p for p in self.spares if p.proc.poll() is None]
        fs = self.forkserver
        unbound = sum(p.bound is None for p in self.spares)
        missing = self.cfg.nproc_per_node - unbound + len(self._unbound_ranks())
        missing -= fs.pending if fs else 0
        if fs:
            fs.request(missing)
        else:
            self.spares += [
                forkclient.start_spare(
                    self.token,
                    self.cfg.nproc_per_node,
                    self.cfg.preloaded,
                    self.log_path,
                    self._shown(),
                )
                for _ in range(missing)
            ]
        self.refill_due = None

    def collect(self) -> None:
        """Take the spares the fork server forked and replace those that died (killed: an OOM
        killer's pick too); if the server quit, fall back to fresh interpreters and start it again
        after a backoff (not an unfit one), or once that is due."""
        self._say_environ()
        if any(p.proc.poll() is not None for p in self.spares):
            self._fill()
        fs, part = self.forkserver, self.part
        if fs is None or part is None:
            if part and self.respawn_at is not None and time.monotonic() >= self.respawn_at:
                self.respawn_at = None
                self._start_server()
                part.restarted()
                self._fill()
            return
        if fs.pending or fs.learning:
            self._place(fs.collect())
        if fs.learned:
            self._learned(fs)
            return
        if not fs.usable:
            fs.close()
            self.forkserver = None
            if self.learning:
                self.learning.forget()  # the next server knows nothing: the next attempt teaches
            self.binding = None
            if fs.unfit:
                part.off(fs.unfit, level="warning")
            else:
                delay = part.failed(processes.describe_exit(fs.proc.poll() or 0))
                self.respawn_at = None if delay is None else time.monotonic() + delay
            self._fill()

    def after_spawn(self, envs: list[dict[str, str]]) -> None:
        """A start took spares: refill now from the fork server, else once the workers stepped.
        `envs`: the new workers' environments, which spares are bound to from now on; a spare
        bound to none of them (another world's) is let go."""
        self.expected = envs
        self._say_unlearned()
        stale = [p for p in self.spares if p.bound is not None and not any(map(p.fits, envs))]
        if stale:
            self.spares = [p for p in self.spares if p not in stale]
            forkclient.discard_spares(stale)
        if self.forkserver:
            self.top_up()
        elif self.cfg.warm_spawn:
            self.refill_due = time.monotonic() + REFILL_AFTER

    def _say_unlearned(self) -> None:
        """One line where a start comes while the fork server still learns what the workers
        imported (in a job's first minute: a bad node, a bad config, an OOM at the first big
        batch): the start did not wait for it, and why this one may take longer than later ones."""
        fs, learned = self.forkserver, self.learning
        if not (fs and fs.learning and learned and learned.asked):
            return
        self.event(
            "restart_before_learned",
            level="warning",
            learning_for=round(time.monotonic() - learned.asked_at, 3),
            modules=learned.asked_count,
            why="the workers' imports were still being learned (a probe at idle priority), so "
            "the new workers are spares that hold torch and the preloaded modules and import the "
            "rest themselves (a framework: seconds on a loaded machine)",
            then="starts after preload_learned take spares that hold them",
        )

    def refill_if_due(self, stepped: bool, now: float) -> None:
        if self.refill_due is not None and (stepped or now >= self.refill_due):
            self.top_up()

    def keep(self) -> frozenset[int]:
        """Processes a teardown sweep must spare (asked at each of its rounds): the spares,
        those the fork server forked since the last collect (reparented to the daemon, like a
        worker's descendants: the sweep killed them, and a replay then found its spare dead),
        the server and its descendants (a spare being forked; a learning probe: killed, the
        learning the next start needs would be lost)."""
        fs = self.forkserver
        if fs is not None and (fs.pending or fs.learning) and fs.usable:
            if not fs.learned:
                self._place(fs.collect())  # no new ones asked for: nothing is forked on its own
            if fs.learned:  # collect stopped at a report; what came after waits for _learned
                self.after_report += fs.collect()
        keep = {p.pid for p in self.spares + self.after_report}
        if fs is not None:
            keep.add(fs.proc.pid)
            with contextlib.suppress(psutil.Error):
                keep.update(c.pid for c in psutil.Process(fs.proc.pid).children(recursive=True))
        return frozenset(keep)

    def close(self) -> None:
        if self.environ_check is not None and self.environ_check.poll() is None:
            self.environ_check.kill()
            self.environ_check.wait()
        forkclient.discard_spares(self.spares)
        forkclient.discard_spares(self.after_report)
        if self.forkserver:
            self.forkserver.close()

    def _shown(self) -> list[str]:
        """The workers' command line as ps shows it (see proctitle)."""
        return proctitle.title(self.cfg.entrypoint, self.cfg.args)


def _free(spare: forkclient.Spare) -> bool:
    """Alive and bound to no rank: a spare `take` may hand out."""
    return spare.bound is None and spare.proc.poll() is None
