"""`elasticd status`'s readable form of a status snapshot: one screen, a line per concern (`--json`
has everything). Every line is escaped (logs.printable): failures and events quote what workers
wrote.
"""

from __future__ import annotations

import time

from elasticd.reporting.status_snapshot import Snapshot


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    return f"{seconds * 1e3:.1f}ms" if seconds < 1 else f"{seconds:.2f}s"


def size(n: int | None) -> str:
    """Bytes for people: B, KiB, MiB or GiB."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


def status(s: Snapshot, socket: str | None = None) -> str:
    """The snapshot of the daemon at `socket` (named when several run here)."""
    from elasticd.logs import printable

    lines = _header(s, socket) + _figures(s) + _workers(s) + _history(s)
    return "\n".join(printable(line) for line in lines)


def _header(s: Snapshot, socket: str | None) -> list[str]:
    lines = [
        f"elasticd {s.state}  run {s.run_id}  node {s.node} (pid {s.pid})",
        f"  group rank {s.group_rank} of {s.group_world_size} nodes, world size {s.world_size}, "
        f"round {s.round}",
        f"  restarts {s.restarts}/{s.max_restarts}  uptime {age(s.uptime)}  "
        f"entrypoint {s.entrypoint}",
        f"  logs {s.run_dir}",
    ]
    if socket:  # one of several daemons: the one to name with --socket
        lines.append(f"  socket {socket}")
    ckpt = s.checkpoint
    if ckpt:
        lines.append(
            f"  checkpoint step {ckpt.get('step')} epoch {ckpt.get('epoch')} "
            f"age {age(ckpt.get('age'))} {ckpt.get('path')}"
        )
    else:
        lines.append("  checkpoint none")
    if s.memory_step is not None:
        lines.append(f"  in-memory state step {s.memory_step}")
    down = {n: p for n, p in s.parts.items() if p.state != "up"}
    if down:
        lines.append(
            "  parts not up: "
            + "; ".join(
                f"{n} {p.state} after {p.restarts} restart(s): {p.why}" for n, p in down.items()
            )
        )
    if s.lost_nodes:
        lines.append("  nodes lost when this round formed: " + ", ".join(s.lost_nodes))
    if s.hang_deadline_basis:
        lines.append(f"  hang deadline: {s.hang_deadline_basis}")
    if s.peers:
        lines.append(
            "  watched peer nodes (group rank: last beat) "
            + ", ".join(f"{r}: {age(a)} ago" for r, a in s.peers.items())
        )
    return lines


def _figures(s: Snapshot) -> list[str]:
    """Goodput, steps, restarts by cause, checkpoint and refresh costs, health and stragglers: a
    line each at most."""
    goodput, lost = s.goodput, s.steps_lost
    if lost.unknown or lost.total is None:  # never a number elasticd did not measure
        lost_text = (
            f"steps lost unknown ({lost.unknown} restart(s) whose resume step the script did "
            "not report: elasticd.checkpoint reports it)"
        )
        ratio = "unknown"
    else:
        lost_text = f"steps lost {lost.total}"
        if lost.last is not None:
            lost_text += f" (last restart {lost.last})"
        ratio = "-" if goodput.ratio is None else f"{100 * goodput.ratio:.1f}%"
    productive = (
        f"productive {age(goodput.productive_seconds)} of "
        if goodput.productive_seconds is not None
        else "wall "
    )
    lines = [
        f"  goodput {ratio} ({productive}{age(goodput.wall_seconds)})  step "
        f"{'-' if s.step is None else s.step} at "
        f"{ms(s.step_time)}/step (own work {ms(s.work_time)})  {lost_text}"
    ]
    causes = {c: n for c, n in s.restarts_by_cause.items() if n}
    if causes:
        lines.append(
            "  restarts by cause: "
            + ", ".join(f"{c.replace('_', ' ')} {n}" for c, n in causes.items())
            + f"; budget left {s.budget_left}"
        )
    kept = {c: n for c, n in s.in_place_by_cause.items() if n}
    if kept:
        lines.append(
            "  recovered in place by cause: "
            + ", ".join(f"{c.replace('_', ' ')} {n}" for c, n in kept.items())
        )
    asked = {v: n for v, n in s.hang_inquiries.items() if n}
    if asked:
        lines.append("  hang inquiries: " + ", ".join(f"{v} {n}" for v, n in asked.items()))
    if s.failures_by_class:
        lines.append(
            "  failures by class: " + ", ".join(f"{c} {n}" for c, n in s.failures_by_class.items())
        )
    return lines + _costs(s) + _health(s)


def _costs(s: Snapshot) -> list[str]:
    ckpt, mem = s.checkpoint_costs, s.memory_refresh
    costs = []
    if ckpt.saves:
        costs.append(
            f"saves {ckpt.saves}: stall {ms(ckpt.last_stall_seconds)} last, "
            f"{ms(ckpt.stall_seconds_total)} total, write {ms(ckpt.last_write_seconds)}"
        )
    if mem.refreshes:
        costs.append(
            f"in-memory refresh every {mem.every or '-'} step(s), {ms(mem.last_seconds)} "
            f"last, {ms(mem.seconds_total)} total"
        )
    return (["  " + "; ".join(costs)] if costs else []) + _replica(s)


def _replica(s: Snapshot) -> list[str]:
    """A sharded job's replication and the /dev/shm this node holds for the in-memory state."""
    rep = s.memory_replica
    held = rep.shm_own_bytes + rep.shm_replica_bytes
    if not (rep.state or held):
        return []
    shm = (
        f"/dev/shm {size(held)} (own slots {size(rep.shm_own_bytes)}, replicas "
        f"{size(rep.shm_replica_bytes)})"
    )
    if not rep.state:
        return [f"  in-memory {shm}"]
    what = "on" if rep.state == "on" else f"off ({rep.state.replace('_', ' ')})"
    sent = (
        f": {rep.sends} sends, {size(rep.last_bytes)} per refresh, {size(rep.bytes_total)} "
        f"total, last took {ms(rep.last_seconds)}"
        if rep.sends
        else ""
    )
    return [f"  replica to the next node {what}{sent}; {shm}"]


def _health(s: Snapshot) -> list[str]:
    """The health check, the peers that left after failing theirs, and the stragglers."""
    lines, health = [], s.health
    if health.check:
        last = health.last
        when = f", {age(time.time() - last.at)} ago" if last and last.at else ""
        lines.append(
            f"  health check {health.state}: {health.check}"
            + (f" ({last.reason}, {ms(last.seconds)}{when})" if last else "")
        )
    for left in health.peers_left[-2:]:
        lines.append(f"  node {left.node} left the job: health check failed: {left.reason}")
    if health.quarantined:
        lines.append(f"  QUARANTINED: {health.quarantine_reason} (`elasticd node clear`)")
    elif health.strikes:
        limit = health.quarantine_after or "never"
        lines.append(f"  node failures: {health.strikes} (quarantined at {limit})")
    for st in s.stragglers:
        since = time.time() - (st.since if st.since is not None else time.time())
        lines.append(
            f"  straggler: rank {st.rank} (local {st.local_rank}) on node {st.node}: "
            f"{st.ratio:.2f}x the node's median own work per step ({ms(st.work_time)} vs "
            f"{ms(st.median)}) for {age(since)}"
        )
    return lines


def _workers(s: Snapshot) -> list[str]:
    replicas = any(w.replica for w in s.workers)
    head = "  RANK  PID      STATE                 BEAT   STEP     TIME/STEP  OWN WORK   RSS"
    width = len(head) + 6  # the REPLICA column's start, past the widest RSS ("1023MiB")
    lines = [f"{head:<{width}}REPLICA LAST/THIS ATTEMPT" if replicas else head]
    for w in s.workers:
        rss = f"{w.rss_bytes / 2**20:.0f}MiB" if w.rss_bytes else "-"
        step = "-" if w.step is None else str(w.step)
        work = ms(w.work_time) + ("!" if w.straggler else "")
        line = (
            f"  {w.rank:<5} {w.pid:<8} {w.state:<21} {age(w.heartbeat_age):<6} {step:<8} "
            f"{ms(w.step_time):<10} {work:<10} {rss}"
        )
        if replicas:
            line = f"{line:<{width}}" + (
                f"{size(w.replica_last_bytes)}/{size(w.replica_bytes)} in "
                f"{ms(w.replica_last_seconds)}"
                if w.replica == "on"
                else (w.replica or "-").replace("_", " ")
            )
        lines.append(line)
    return lines


def _history(s: Snapshot) -> list[str]:
    """The last failure, the last recovery's timeline and the recent events."""
    lines = []
    f = s.last_failure
    if f:
        who = f"rank {f.rank}" + (f" (node {f.node})" if f.node else "")
        if f.rank is None:  # a node's failure (lost, unreachable): the node first
            who = f"node {f.node or '?'}"
        lines.append(
            f"  last failure: {who}"
            + f" {f.reason}"
            + (f": {f.exception}" if f.exception else "")
            + (f" ({f.frame})" if f.frame else "")
            + (f" (log {f.log_path})" if f.log_path else "")
            + (f" [class {f.failure_class}]" if f.failure_class else "")
        )
        lines += [f"    stacks {path}" for path in f.stacks]
        lines += [f"    GPU driver: {f.driver}"] if f.driver else []
        lines += [f"    then {c}" for c in f.consequences]
    if s.last_recovery:
        lines.append(
            "  last recovery (s after detection): "
            + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in s.last_recovery.items())
        )
    if s.events:
        lines.append("  recent events:")
        for e in s.events[-8:]:
            extra = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "event"))
            when = time.strftime("%H:%M:%S", time.localtime(e["time"]))
            lines.append(f"    {when} {e['event']} {extra}"[:160])
    return lines
