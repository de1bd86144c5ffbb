"""What runs inside the user's worker processes, or makes them: the bootstrap every worker starts
as (bootstrap, then the user's script or module), the fork server that forks warm spares
(forkserver), the workers' command line as ps shows it (proctitle), and the heartbeat file's
format (health: the worker writes it, the daemon reads it). These modules import only the shared
top-level modules (names, safeio, logs) and each other: never the daemon, cluster, control or ops
packages (tests/unit/test_layout.py checks it), so a worker loads none of the daemon's code.
"""
