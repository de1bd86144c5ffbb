"""Operator surfaces: the `elasticd` command line (cli, with run's flags in flags and status's
readable form in render; it runs in the operator's process and starts the daemon for `run`), the
status snapshot's types both sides read (snapshot), what the daemon exports and computes for
operators (metrics and its server, figures, stragglers, the user's health check in healthcheck)
and the generated reference pages (docs, a developer's tool the daemon never imports). cli imports
no torch at module level, so `elasticd status` stays quick. Nothing on the worker side imports
this package.
"""
