"""A Rich progress bar (Lightning's default kind): `rich_progress.py UPDATES SECONDS` advances
it UPDATES times over about SECONDS, then prints "done"."""

import sys
import time

from rich.progress import Progress

updates, seconds = int(sys.argv[1]), float(sys.argv[2])
with Progress() as progress:
    task = progress.add_task("train", total=updates)
    for _ in range(updates):
        time.sleep(seconds / updates)
        progress.advance(task)
print("done", flush=True)
