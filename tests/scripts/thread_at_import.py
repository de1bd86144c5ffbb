"""A module that starts a thread when imported: a `--preload` entry that makes forking unsafe."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), name="started-at-import", daemon=True).start()
