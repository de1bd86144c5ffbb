"""The daemon process (`elasticd run`): the agent loop and its collaborators. Everything here runs
inside the one long-lived daemon per node, or in a helper process it starts for itself (guard):
the state machine and its transitions (agent, states), the loop's command queue (inbox), the local
worker group, its warm spares and how it starts and stops them (group, spares, workers), restarts
of the daemon's own threads and helpers (supervise), the policy after a failure (recovery), the
systemd notifications (systemd) and the status snapshot operators read (status). Nothing on the
worker side imports this package.
"""
