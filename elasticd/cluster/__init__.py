"""The control plane between nodes, run by the daemon (and by bench/scale.py's simulated nodes):
the store every node talks to and the protocol over it. Torch-free but tcpstore.py (the c10d
store), which stores.py and joining.py import only where they host or reach one (a multi-node
c10d store, a round's worker store); the daemon loads it at start (daemon/serve.py).

Here: the key-value protocol every store speaks
(kv: `KV`, `Unreachable`, `LocalKV`), its two stores across nodes (tcpstore: a c10d TCPStore,
the one module here that needs torch.distributed for the store itself; etcd/: an etcd cluster
over its v3 API, torch-free) and which one a config opens (stores); the numbered rendezvous
rounds (rendezvous, and its parts: run, joining, arrivals, closing with its pure rule
closing_rule, barrier, values, rounds, errors, timing), the nodes' liveness ring (peers, its
pure rule silence) and the job secret's HMAC seal on every value (signing). The rules the
protocol decides by are pure functions with their own table tests (closing_rule.py, silence.py:
tests/unit/). Nothing on the worker side imports this package.
"""
