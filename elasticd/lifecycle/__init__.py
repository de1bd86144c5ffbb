"""The daemon process's vocabulary and its parts' lifecycle, below every package that uses them:
the agent's states, restart causes and failures (states.py), the failure classes and what makes
two failures the same (triage.py), and the supervision of the daemon's own threads and helper
processes (supervise.py). The daemon, the line between nodes (cluster/), the control socket
(control/) and the operators' reporting (ops/) all speak it; it imports none of them."""
