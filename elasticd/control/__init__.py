"""The operators' Unix control socket: its server runs on a thread of the daemon, its client in
the CLI's process. Nothing on the worker side imports this package.

The daemon side: server (the thread that serves it), commands (what it answers and what it hands to
the agent loop), access (who is let in, how many connections each may hold), socketfile (the socket
file made safely). The CLI side: client (one request, one reply). Both: protocol (version, limits,
errors) and paths (where sockets are, which daemons a CLI call means). The client's side loads
nothing of the daemon's (tests/unit/project/test_layout.py).
"""
