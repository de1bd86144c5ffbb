"""What a worker imported from the Python installation, reported once, at its first optimizer
step, beside its heartbeat file (`rankN.modules`): the daemon teaches the union to the fork
server, so later spares start with this job's frameworks already imported
(daemon/learning.py, worker/preload.py). Only modules whose file lies in the interpreter's
standard library or site-packages are named: never the script's own modules, which the fork
server must not run with another sys.path, and which the user may edit between attempts. Each
name goes with the file it was loaded from (`name<TAB>path`, the path resolved): the fork server
imports a name only from that file (learned.Origins), never one that the server's own sys.path
finds first elsewhere.

The daemon reads a report back (`read`) as a regular file only, never blocking or through a link
(a FIFO there names nothing), its names checked for their form, its size bounded (MAX_BYTES)."""

from __future__ import annotations

import os
import re
import site
import sys
import sysconfig

from elasticd import names, safeio

SUFFIX = ".modules"
MAX_BYTES = 4 << 20  # a report larger than this is not read
MAX_NAMES = 20000
_MAINS = ("__main__", "__mp_main__")  # the script (or a tool's main) runs once, in its worker
_NAME = re.compile(r"\w+(\.\w+)*\Z", re.ASCII)  # mypyc helpers begin with a digit
_ORIGIN = re.compile(r"/[^\x00-\x1f]{0,4095}\Z")  # an absolute path on one line


def library_dirs() -> tuple[str, ...]:
    """The installation's module directories, each as given and resolved, ending in a slash;
    and elasticd's own package, wherever it was imported from (it is the daemon's and the fork
    server's code, never the user's: its checkpoint library is on a fresh rank's path to its
    first step)."""
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    dirs.add(os.path.dirname(os.path.abspath(names.__file__)))  # elasticd/
    out = set()
    for d in filter(None, dirs):
        out.update({d.rstrip(os.sep) + os.sep, os.path.realpath(d) + os.sep})
    return tuple(sorted(out))


def library_modules(modules: dict | None = None) -> dict[str, str]:
    """The names in sys.modules, in import order, of modules loaded from the installation, each
    with its file (its directory resolved, once per directory: a realpath per module took 60 ms
    of a fresh rank's first step for torch's 2,000 modules; a module file that is itself a link
    then names the link, and the fork server, which resolves it, does not preload it)."""
    dirs = library_dirs()
    out: dict[str, str] = {}
    resolved: dict[str, str] = {}
    for name, module in list((sys.modules if modules is None else modules).items()):
        # from the module's dict: a lazy module's __getattr__ is not run for a missing __file__
        path = getattr(module, "__dict__", {}).get("__file__")
        if name in _MAINS or not isinstance(path, str) or not path.startswith(dirs):
            continue
        if _NAME.match(name) and _ORIGIN.match(path):
            folder, _, base = path.rpartition(os.sep)
            if folder not in resolved:
                resolved[folder] = os.path.realpath(folder)
            out[name] = f"{resolved[folder]}{os.sep}{base}"
    return out


def report_path(heartbeat_path: str) -> str:
    base = heartbeat_path[: -len(".heartbeat")] if heartbeat_path.endswith(".heartbeat") else ""
    return (base or heartbeat_path) + SUFFIX


def report() -> None:
    """Write this worker's library modules, one name a line (written whole, then renamed)."""
    heartbeat = os.environ.get(names.HEARTBEAT_FILE)
    if not heartbeat:
        return
    path = report_path(heartbeat)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with os.fdopen(safeio.create(tmp), "w") as f:
            lines = [f"{n}\t{p}" for n, p in list(library_modules().items())[:MAX_NAMES]]
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # a learning aid only: the job goes on without it


def read(path: str) -> dict[str, str] | None:
    """A worker's report: valid module names in its order, each with its file, or None while
    there is none. A line of another form is skipped (a worker is the user's code: its file is
    not trusted; the file it names only narrows where the fork server may import from). Read
    without blocking or following a link, at most MAX_BYTES: a FIFO, a device or a symlink in
    its place reads as a report that names nothing (the daemon's loop reads it, and must never
    wait on a worker's file)."""
    try:
        data = safeio.read_regular(path, MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    out = {}
    for line in data.decode("utf-8", errors="replace").split("\n")[:MAX_NAMES]:
        name, _, origin = line.partition("\t")
        if _NAME.match(name) and _ORIGIN.match(origin):
            out[name] = origin
    return out
