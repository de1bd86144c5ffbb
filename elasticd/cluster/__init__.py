"""The control plane between nodes, run by the daemon: the key-value protocol every store speaks
(kv: `KV`, `Unreachable`, `LocalKV`), its two stores across nodes (tcpstore: a c10d TCPStore,
the one module here that needs torch.distributed for the store itself; etcd/: an etcd cluster
over its v3 API, torch-free) and which one a config opens (stores); the numbered rendezvous
rounds (rendezvous, and its parts: run, joining, arrivals, closing with its pure rule
closing_rule, barrier, values, rounds, errors, timing), the nodes' liveness ring (peers, its
pure rule silence) and the job secret's HMAC seal on every value (signing). Nothing on the
worker side imports this package.
"""
