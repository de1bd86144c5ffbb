"""What runs inside the user's worker processes (the bootstrap before the user's code, the
heartbeat writer), or in the fork server that makes them. The daemon only reads the heartbeat
files (health.py's `Reader`) and starts these modules by name (`python -P -m
elasticd.worker.bootstrap`: the working directory never on their path).

Here: the bootstrap every worker starts as (bootstrap, then the user's script or module), the fork
server that forks warm spares (forkserver; what it learns to import: imported, learned; a spare
bound to a rank: bound; torch's threads in a spare: threads), the workers' command line as ps shows
it (proctitle), and the heartbeat file's format (health: the worker writes it, the daemon reads it).
These modules import only the shared top-level modules (names, safeio, logs) and each other: never
the daemon, cluster, control or ops packages (tests/unit/project/test_layout.py checks it), so a
worker loads none of the daemon's code.
"""
