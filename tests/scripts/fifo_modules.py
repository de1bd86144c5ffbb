"""A worker that leaves a FIFO where its imports report goes (`rank<N>.modules`, beside its
heartbeat file: worker/imported.py), which the daemon's loop reads; then exits with code
argv[2] after argv[1] seconds."""

import os
import sys
import time

heartbeat = os.environ["ELASTICD_HEARTBEAT_FILE"]
base = heartbeat[: -len(".heartbeat")] if heartbeat.endswith(".heartbeat") else heartbeat
os.mkfifo(base + ".modules", 0o600)
print("fifo made", flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(int(sys.argv[2]))
