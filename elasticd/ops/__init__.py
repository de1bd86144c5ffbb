"""Operator surfaces: the `elasticd` command line (cli, which runs in the operator's process and
starts the daemon for `run`), what the daemon exports and computes for operators (metrics,
figures, stragglers, the user's health check in healthcheck) and the generated reference pages
(docs, a developer's tool the daemon never imports). cli imports no torch at module level, so
`elasticd status` stays quick. Nothing on the worker side imports this package.
"""
