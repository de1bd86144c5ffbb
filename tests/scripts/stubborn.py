"""A plain script that ignores SIGTERM and sleeps: only SIGKILL ends it."""

import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring SIGTERM", flush=True)
for _ in range(600):
    time.sleep(0.1)
