"""Hold many idle connections to a control socket, as a hostile or buggy process would: PROCS
processes keep PER_PROC connections open each, never sending a request, and open a new one
whenever the daemon answers (its deadline, or "busy": then after 0.2 s) and closes one. Each
process appends "opened N busy B" to REPORT when SECONDS are up.

As a worker: python hog_control.py SOCKET PROCS PER_PROC SECONDS REPORT."""

import os
import selectors
import socket
import sys
import time


def _hold(path: str, n: int, deadline: float) -> tuple[int, int]:
    sel = selectors.DefaultSelector()
    opened = busy = 0
    while time.monotonic() < deadline:
        while len(sel.get_map()) < n and time.monotonic() < deadline:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(2)
            try:
                s.connect(path)
            except OSError:
                s.close()
                time.sleep(0.05)
                continue
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            opened += 1
        for key, _ in sel.select(0.05):
            s = key.fileobj
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            sel.unregister(s)
            s.close()
            if b"busy" in data:
                busy += 1
                time.sleep(0.2)  # keeps trying, but does not flood: a connect storm is another test
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    return opened, busy


def hog(path: str, procs: int, per_proc: int, seconds: float, report: str) -> None:
    """Fork `procs` holders and wait for them (each ends after `seconds`)."""
    deadline = time.monotonic() + seconds
    pids = []
    for _ in range(procs):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                opened, busy = _hold(path, per_proc, deadline)
                fd = os.open(report, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
                os.write(fd, f"opened {opened} busy {busy}\n".encode())
                os.close(fd)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    hog(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
