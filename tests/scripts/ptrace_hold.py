"""Hold a process under ptrace, as `gdb -p`, `strace -p` or `py-spy dump --native` do:
`ptrace_hold.py PID SECONDS [attach|seize]`. Attaches (PTRACE_ATTACH, or PTRACE_SEIZE then
PTRACE_INTERRUPT), waits for the tracing stop, holds it, detaches. Prints the state letter and
TracerPid that /proc shows while attached, one line per look."""

import ctypes
import os
import sys
import time

PTRACE_ATTACH, PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 16, 17, 0x4206, 0x4207
WALL = 0x40000000

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def ptrace(request: int, pid: int) -> None:
    if libc.ptrace(request, pid, None, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request}, {pid}): {os.strerror(err)}")


def look(pid: int) -> str:
    stat = open(f"/proc/{pid}/stat").read()
    tracer = next(
        ln.split()[1] for ln in open(f"/proc/{pid}/status") if ln.startswith("TracerPid:")
    )
    return f"state {stat[stat.rfind(')') + 2]} tracer {tracer}"


def main() -> None:
    pid, hold = int(sys.argv[1]), float(sys.argv[2])
    if (sys.argv[3] if len(sys.argv) > 3 else "attach") == "attach":
        ptrace(PTRACE_ATTACH, pid)
    else:
        ptrace(PTRACE_SEIZE, pid)
        ptrace(PTRACE_INTERRUPT, pid)
    os.waitpid(pid, WALL)
    end = time.monotonic() + hold
    while time.monotonic() < end:
        print(look(pid), flush=True)
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))
    ptrace(PTRACE_DETACH, pid)
    print("detached", flush=True)


if __name__ == "__main__":
    main()
