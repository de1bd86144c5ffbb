"""What the daemon reports about its job, below the daemon that fills it in and the operator's
CLI that reads it: the status snapshot as types and its JSON wire form (status_snapshot.py), the
operators' figures reckoned from the workers' heartbeats (figures.py, stragglers.py,
replication.py) and the Prometheus exporter (metrics.py, metrics_server.py). It imports nothing
of the daemon, the control socket or the CLI."""
