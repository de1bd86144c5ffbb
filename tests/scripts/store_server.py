"""A c10d TCPStore server on ADDR:PORT until killed: a rendezvous store hosted by no node of the
job, so that a test can lose any node (the one holding group rank 0 included).

With JOB and SECRET_FILE it also plays the store's host's part in the rendezvous, as the daemon
on the endpoint's node would: it begins the job's run and beats in it (answering the challenges
of the nodes, which follow a run only once its host answers them there: elasticd/cluster/run.py);
without them it is a bare store (bench/scale.py's simulated nodes have their own host)."""

import datetime
import signal
import sys
import threading

import torch.distributed as dist

store = dist.TCPStore(
    sys.argv[1],
    int(sys.argv[2]),
    None,
    True,
    datetime.timedelta(seconds=3600),
    wait_for_workers=False,
)
stop = threading.Event()
if len(sys.argv) > 4:
    from elasticd import config, logs
    from elasticd.cluster import rendezvous, tcpstore
    from elasticd.cluster.timing import BEAT_EVERY

    logs.setup("json")  # to stderr: stdout says "serving" and nothing else

    cfg = config.build(
        {
            "entrypoint": "x.py",
            "nnodes": "1:2",
            "rdzv_id": sys.argv[3],
            "rdzv_endpoint": f"{sys.argv[1]}:{sys.argv[2]}",
            "rdzv_secret_file": sys.argv[4],
        },
        None,
        environ={},
    )
    kv = tcpstore.TCPStoreKV(tcpstore.tcp_connector(sys.argv[1], int(sys.argv[2])), "store", 2.5)
    host = rendezvous.Rendezvous(cfg, store=kv, begins_run=True)

    def beats() -> None:
        count = 0
        while not stop.wait(BEAT_EVERY):
            count += 1
            host.beat(kv, count)

    threading.Thread(target=beats, daemon=True).start()
print("serving", flush=True)
signal.sigwait({signal.SIGTERM, signal.SIGINT})
stop.set()
