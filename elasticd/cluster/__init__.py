"""The control plane between nodes, run by the daemon: the key-value protocol every store speaks
(kv: `KV`, `Unreachable`, `LocalKV`), its two stores across nodes (tcpstore: a c10d TCPStore,
the one module here that needs torch.distributed for the store itself; etcd: an etcd cluster
over its v3 API, torch-free), the numbered rendezvous rounds, restart requests and exit barrier
(rendezvous), the nodes' liveness ring (peers) and the job secret's HMAC seal on every value
(signing). Nothing on the worker side imports this package.
"""
