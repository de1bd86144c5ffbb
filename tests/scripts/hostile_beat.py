"""A worker that writes what no real worker would into its heartbeat file: NaN, infinities, huge
and negative numbers, text bytes, in every running figure, every mark and the header's fields,
through the worker side's own API (heartbeat.Writer, heartbeat.mark) and as raw bytes, as a hostile
worker could. No torch: the daemon's reading is what is tested.

Attempt 0 writes them, beats for `--seconds` and exits 3 (a crash: the daemon works out the
steps lost from the figures at the next start); attempt 1 writes them again and exits 0."""

import math
import os
import struct
import sys
import time

import elasticd
from elasticd import names
from elasticd.worker import heartbeat

BAD = (math.nan, math.inf, -math.inf, 1e300, -5.0, float(2**60))


def hostile(path: str, round_: int) -> None:
    writer = heartbeat.writer()
    for i, name in enumerate(heartbeat.FIGURES):
        writer.note(name, BAD[(i + round_) % len(BAD)])
    # the checkpoint library's mark: the figures count from here
    heartbeat.mark(path, "state_loaded")
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"NaN-text", heartbeat._FIGURES_AT + 8 * heartbeat.FIGURES.index("resumed"))
        os.pwrite(fd, b"\xff" * 8, 40 + 8 * (round_ % 3))  # a mark: a NaN's bytes
        os.pwrite(fd, struct.pack("<d", math.inf), 24)  # the last beat, at infinity
    finally:
        os.close(fd)


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    path = os.environ[names.HEARTBEAT_FILE]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        step += 1
        elasticd.heartbeat(step)
        hostile(path, step)
        print(f"step {step}", flush=True)
        time.sleep(0.1)
    print("done", flush=True)
    sys.exit(3 if attempt == 0 else 0)


if __name__ == "__main__":
    main()
