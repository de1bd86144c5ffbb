"""The fork server's spares are announced before they become the daemon's children: a teardown
sweep that finds one among the daemon's children must find its pid already known, or it kills a
spare a replay or a restart is about to take (seen in CI: a replay's spare died unannounced)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from harness import ROOT

# A stand-in daemon, in a process of its own (it becomes a child subreaper, which pytest's
# process must not): it asks its fork server for spares one at a time, watches its own children
# as fast as /proc allows, and the moment a spare shows up among them, reads the socket without
# waiting: was the spare's pid there already?
DAEMON = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from elasticd.daemon import forkclient, processes

    assert processes.make_subreaper()
    me = os.getpid()
    tasks = [f"/proc/{me}/task/{t}/children" for t in os.listdir(f"/proc/{me}/task")]

    def children():
        found = set()
        for path in tasks:
            try:
                found.update(int(c) for c in Path(path).read_text().split())
            except OSError:
                pass
        return found

    fs = forkclient.ForkServer("tok", 1, (), Path(sys.argv[1]), ["spare"])
    spares, unknown, deadline = [], [], time.monotonic() + 60
    for _ in range(int(sys.argv[2])):
        before = children() | {fs.proc.pid}
        fs.request(1)
        while time.monotonic() < deadline:
            new = children() - before - {s.pid for s in spares}
            if new:
                got = fs.collect()  # no wait: what is in the socket now
                spares += got
                unknown += sorted(new - {s.pid for s in got})
                spares += fs.collect(timeout=5)  # the late ones, so that they are cleaned up
                break
    result = {"spares": len(spares), "unknown": unknown}
    forkclient.discard_spares(spares)
    fs.close()
    print(json.dumps(result))
    """
)


def test_a_spare_is_announced_before_it_becomes_the_daemons_child(tmp_path):
    rounds = 40
    out = subprocess.run(
        [sys.executable, "-c", DAEMON, str(tmp_path / "spares.log"), str(rounds)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["spares"] == rounds, (result, (tmp_path / "spares.log").read_text())
    assert result["unknown"] == [], (
        f"spares that were the daemon's children before their pid was sent: {result}"
    )
