"""The operators' Unix control socket: the server the daemon runs on one thread and the client
the CLI (`elasticd status`, `stop`, `stacks`) uses, with the socket's paths, who is admitted and
the JSON protocol between them (channel, one module for now). The server runs in the daemon, the
client in the CLI's process; nothing on the worker side imports this package.
"""
