"""Bad nodes remembered: this node's record of failures that were the node's, not the job's (its
health check failed: before a start, at a restart after a worker's failure, or while training; a
worker failed while the GPU driver itself reported a fault, daemon/driver.py; the replicas' audit
outvoted one of its ranks, daemon/sdc.py, which quarantines at once when it happens again), kept in
its state directory across daemon restarts and jobs. A worker's failure is never a strike by its
text, whatever its error file says (a job writes that text: "Xid 79" in a data record, a `KeyError:
'xid'`); the health check that runs before the restart confirms or clears the node.
--quarantine-after such failures within --quarantine-window quarantine the node: it leaves the job
(the others go on without it, as for a failed health check) and `elasticd run` refuses to start
here, with one line and exit code 7, until an operator runs `elasticd node clear` (a scheduler
drains the node on that code; systemd's unit does not restart it). Torch-free: the CLI reads the
record without a daemon (`elasticd node status / clear`).

`strike` records one, the node quarantined once --quarantine-after fall within the window;
`refusal` is the line `run` refuses with (`ExitCode.QUARANTINED`, 7); `node_command` is `elasticd
node status / clear`; `Quarantine` is the daemon's side (strikes as they happen, the departure,
status's fields).

The record (`node-record.json` in --state-dir) is one small JSON file written whole (a fresh file
renamed over the old, never through a symlink: safeio); a file that is not of its form stops the
start with one line rather than being taken for a clean record or overwritten."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elasticd import logs, safeio
from elasticd.config import Config, ConfigError
from elasticd.exit_codes import ExitCode

FILE = "node-record.json"
MAX_STRIKES = 100  # strikes kept (the newest): the file stays small whatever happens
MAX_WHY = 300  # characters of a strike's reason kept


@dataclass
class Record:
    strikes: list[dict[str, Any]] = field(default_factory=list)  # {"at": wall time, "why": ...}
    quarantined: dict[str, Any] | None = None  # {"at": wall time, "why": ...}
    # the rule the strikes were counted under (--quarantine-after, --quarantine-window of the
    # daemon that wrote them), which `node status` shows whatever its own settings; None in a
    # record written before it was kept, or cleared
    after: int | None = None
    window: float | None = None


def state_dir(cfg: Config, log_base: Path) -> Path:
    """--state-dir, else systemd's StateDirectory ($STATE_DIRECTORY), else <log dir>/state (made
    at the node's first failure, so that a log directory holds only runs until then)."""
    if cfg.state_dir:
        return Path(cfg.state_dir)
    systemd = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(systemd) if systemd else log_base / "state"


def read(directory: Path) -> Record:
    """The node's record (empty where there is none); ConfigError, one line, for a file that is
    not one (nothing is decided on it, nor written over it)."""
    path = directory / FILE
    try:
        with os.fdopen(safeio.open_existing(path), "rb") as f:
            data = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        return Record()
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{path}: not a readable node record ({getattr(e, 'strerror', None) or e}): move it "
            "away to start this node's record afresh"
        ) from None
    record = _parsed(data)
    if record is None:
        raise ConfigError(f"{path}: not a node record; move it away to start it afresh")
    return record


def _parsed(data: Any) -> Record | None:
    def entry(x: Any) -> bool:
        return (
            isinstance(x, dict)
            and isinstance(x.get("at"), (int, float))
            and isinstance(x.get("why"), str)
        )

    if not isinstance(data, dict) or not isinstance(data.get("strikes", []), list):
        return None
    strikes, quarantined = data.get("strikes", []), data.get("quarantined")
    if not all(entry(s) for s in strikes) or not (quarantined is None or entry(quarantined)):
        return None
    after, window = data.get("after"), data.get("window")
    if not (after is None or (isinstance(after, int) and not isinstance(after, bool))):
        return None
    if not (window is None or (isinstance(window, (int, float)) and window > 0)):
        return None
    return Record(strikes, quarantined, after, window)


def write(directory: Path, record: Record) -> None:
    """Replace the record whole: a fresh file (O_EXCL, no symlink followed), synced, renamed. The
    directory is made here where missing (the default one, under the checked log directory)."""
    path, tmp = directory / FILE, directory / f".{FILE}.{os.getpid()}"
    if not directory.is_dir():
        safeio.mkdir(directory)
    try:
        tmp.unlink()  # left by a daemon that died while writing
    except FileNotFoundError:
        pass
    with os.fdopen(safeio.create(tmp), "w") as f:
        json.dump(asdict(record), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def strike(
    directory: Path, why: str, after: int, window: float, now: float, at_once: bool = False
) -> Record:
    """Record one failure of the node's; quarantined once `after` (> 0) fall within `window`, or
    by this one where `at_once` (and `after` is not 0: never)."""
    record = read(directory)
    recent = [s for s in record.strikes if now - s["at"] < window]
    record.strikes = [*recent, {"at": now, "why": why[:MAX_WHY]}][-MAX_STRIKES:]
    record.after, record.window = after, window
    if after and (at_once or len(record.strikes) >= after) and record.quarantined is None:
        record.quarantined = {
            "at": now,
            "why": f"{len(record.strikes)} failure(s) within {_span(window)}, the last: {why}"[
                : 2 * MAX_WHY
            ],
        }
    write(directory, record)
    return record


def clear(directory: Path) -> Record:
    """The operator repaired the node: quarantine and strikes forgotten; the record before."""
    before = read(directory)
    write(directory, Record())
    return before


def refusal(record: Record, directory: Path) -> str:
    """The one line a quarantined node refuses to start with."""
    q = record.quarantined or {}
    since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(q.get("at", 0)))
    return logs.printable(
        f"elasticd: not starting: this node is quarantined since {since} ({q.get('why', '?')}); "
        f"repair it, then `elasticd node clear --state-dir {directory}`"
    )


def describe(record: Record, directory: Path, cfg: Config) -> list[str]:
    """`elasticd node status`: the record as lines for people, counted by the rule its strikes
    were recorded under (the settings given here only for a record that does not say)."""
    lines = [f"node record: {directory / FILE}"]
    q = record.quarantined
    if q:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(q["at"]))
        lines.append(f"quarantined since {when}: {q['why']}")
    else:
        lines.append("not quarantined")
    now = time.time()
    window = record.window if record.window is not None else cfg.quarantine_window
    after = record.after if record.after is not None else cfg.quarantine_after
    recent = [s for s in record.strikes if now - s["at"] < window]
    lines.append(
        f"failures within {_span(window)}: {len(recent)} (quarantine at {after or 'never'})"
    )
    for s in recent[-10:]:
        lines.append(f"  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s['at']))}  {s['why']}")
    return [logs.printable(line) for line in lines]


def node_command(action: str, directory: Path, cfg: Config, as_json: bool) -> int:
    """`elasticd node status` (exit 7 while quarantined) or `clear`, printed; its exit code."""
    record = read(directory)
    if action == "clear":
        if record.quarantined or record.strikes:
            clear(directory)
        was = f"; it was quarantined: {record.quarantined['why']}" if record.quarantined else ""
        print(
            logs.printable(
                f"cleared {directory / FILE}: this node may start again "
                f"({len(record.strikes)} failure(s) forgotten{was})"
            )
        )
        return 0
    if as_json:
        print(json.dumps({"state_dir": str(directory), **asdict(record)}))
    else:
        print("\n".join(describe(record, directory, cfg)))
    return ExitCode.QUARANTINED if record.quarantined else ExitCode.OK


def _span(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"


class Quarantine:
    """The daemon's side: strikes recorded as they happen (each failed health check, each failure
    with the GPU driver's evidence), the departure they cause, the record in status (`report`,
    merged into status's `health`) and so in the metrics."""

    def __init__(self, cfg: Config, node: str, event: Callable[..., None]) -> None:
        self.cfg = cfg
        self.node = node
        self.event = event
        self.directory = Path(cfg.state_dir) if cfg.state_dir else None  # set by `run`'s checks
        self.record = read(self.directory) if self.directory else Record()

    def strike(self, why: Any, at_once: bool = False) -> bool:
        """Record `why` (a Failure) against this node; whether it is now quarantined. `at_once`:
        quarantined by this strike, whatever the count (a rank whose state the replicas' audit
        outvoted again: daemon/sdc.py), unless --quarantine-after 0 says never."""
        if self.directory is None:
            return False
        try:
            self.record = strike(
                self.directory,
                why.summary(),
                self.cfg.quarantine_after,
                self.cfg.quarantine_window,
                time.time(),
                at_once,
            )
        except (OSError, ConfigError) as e:
            self.event("node_record_unwritable", level="error", why=str(e))
            return False
        quarantined = self.record.quarantined is not None
        self.event(
            "node_quarantined" if quarantined else "node_strike",
            level="error" if quarantined else "warning",
            strikes=len(self.record.strikes),
            limit=self.cfg.quarantine_after,
            why=why.summary(),
        )
        return quarantined

    def departure(self, joined: bool = True) -> tuple[str, str, int]:
        """What a node leaving for quarantine tells the others, its line, its exit code."""
        why = (self.record.quarantined or {}).get("why", "")
        line = refusal(self.record, self.directory)
        if joined:
            line = line.replace("not starting: this node is", "this node left the job: it is", 1)
        return f"node {self.node} left the job: quarantined: {why}", line, ExitCode.QUARANTINED

    def report(self) -> dict[str, Any]:
        """Status's quarantine fields (reporting/status_snapshot.py `Health`)."""
        q = self.record.quarantined
        now = time.time()
        return {
            "quarantined": q is not None,
            "quarantined_since": q["at"] if q else None,
            "quarantine_reason": q["why"] if q else None,
            "strikes": sum(
                1 for s in self.record.strikes if now - s["at"] < self.cfg.quarantine_window
            ),
            "quarantine_after": self.cfg.quarantine_after,
            "state_dir": str(self.directory) if self.directory else None,
        }
