"""A plain script that never beats: no optimizer, no elasticd import. Sleeps, then exits 0."""

import sys
import time

time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 3.0)
print("done", flush=True)
