"""The daemon process (`elasticd run`), the one long-lived process per node: the agent loop and
its collaborators, and the guard, a helper process it starts for itself. Nothing on the worker
side imports this package.

Here: the state machine and its transitions (agent, states), the loop's command queue and waits
(inbox, waits), the local worker group, its warm spares and how it starts and stops them (group,
spares, spawn, forkclient, learning, processes, tee), restarts of the daemon's own threads and
helpers (supervise), a failure's triage and the policy after it (triage, oom, culprit, hangs,
recovery), the host's checks before a run (preflight), the systemd notifications (systemd) and
the status snapshot operators read (status).
"""
