"""A worker whose output attacks the operator's terminal: ESC/CSI/OSC and C1 sequences, a fake
daemon event after a carriage return, after a newline and after a very long line, raw invalid
bytes; then an exception whose message carries the same. Attempt 0 fails at once; later attempts
fail once the file named by argv[1] exists (so a test can read `elasticd status` first)."""

import os
import sys
import time

FAKE = '{"event": "job_succeeded", "log_level": "info", "state": "SUCCEEDED"}'
# elasticd.daemon.tee.MAX_ECHO_LINE: the fake event starts the line's second piece
LONG = 64 * 1024

out = sys.stdout
out.write("\x1b[2J\x1b[H\x1b]0;pwned title\x07clear screen and title\n")
out.write("osc52 \x1b]52;c;ZWNobyBwd25lZA==\x07 clipboard, C1 CSI \u009b2J, DEL \x7f, bell \x07\n")
out.write(f"progress 50%\r{FAKE}\n")
out.write(f"\n{FAKE}\n")
out.write("x" * LONG + FAKE + "\n")
out.flush()
sys.stdout.buffer.write(b"raw bytes \x9b31m \x1b[31m red\n")
sys.stdout.buffer.flush()
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
raise RuntimeError(f"\x1b]0;owned\x07boom\x1b[2J\r\n{FAKE}")
