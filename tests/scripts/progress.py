"""A tqdm progress bar: `progress.py UPDATES [SECONDS [QUIET]]` prints "quiet" and waits QUIET
seconds (a window to measure the daemon without output), then redraws the bar UPDATES times
(every update, no rate limit of tqdm's own) spread over about SECONDS, then prints "done"."""

import sys
import time

from tqdm import tqdm

updates = int(sys.argv[1])
pause = float(sys.argv[2]) / updates if len(sys.argv) > 2 else 0.0
print("quiet", flush=True)
time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
for _ in tqdm(range(updates), mininterval=0, miniters=1, ascii=True, desc="train"):
    if pause:
        time.sleep(pause)
print("done", flush=True)
