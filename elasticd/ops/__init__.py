"""The operator's command line: `elasticd`, which runs in the operator's shell (and, for `run`,
becomes the daemon). The top of the layout: it starts the daemon and reads what the daemon's
reporting (elasticd/reporting/) publishes; nothing imports it but `python -m elasticd`, and
nothing on the worker side.

cli (with the commands to running daemons in daemon_cli, the ledger's check in ledger_check, run's
flags in flags and status's readable form in render), and the generated reference pages (docs, a
developer's tool the daemon never imports). cli (with flags and render) imports no torch at
module level, so `elasticd status` stays quick.
"""
