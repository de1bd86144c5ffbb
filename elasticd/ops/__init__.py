"""Operator surfaces: the `elasticd` command line, which runs in the operator's shell (and, for
`run`, becomes the daemon), and what the daemon computes and exports for operators (metrics,
figures, stragglers, replication, the health check, quarantine). Nothing on the worker side
imports this package.

The command line: cli (with the commands to running daemons in daemon_cli, the ledger's check in
ledger_check, run's flags in flags and status's readable form in render); the status snapshot's
types both sides read (snapshot); what the daemon exports and computes for operators (metrics and
its server, figures, stragglers, replication, the user's health check in healthcheck, the node's
record in quarantine); and the generated reference pages (docs, a developer's tool the daemon
never imports). cli (with flags, render and snapshot) imports no torch at module level, so
`elasticd status` stays quick.
"""
