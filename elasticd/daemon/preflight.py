"""Pre-flight checks of the host, run by the daemon (`elasticd run`) once its Config is built and
before anything starts: the log and checkpoint directories safe and writable, this run's
directory made fresh, the rendezvous port free, the health check and the entrypoint there to run.
Each problem is one ConfigError line (exit code 2), as a bad setting is.

`check_log_dir` judges `--log-dir`, `--checkpoint-dir`, `--state-dir` and the metrics textfile's
directory safe and writable; `make_run_dir` makes this run's directory fresh. A module entrypoint
is found with `find_module`: by the finders, without importing any of its packages (a package's
`__init__` would run in the daemon).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

from elasticd.config import ConfigError


def check_log_dir(path: Path, flag: str = "--log-dir") -> Path:
    """The directory, created if missing (new levels 0750) and resolved, once it is proven safe
    and writable, so a bad one fails before any worker starts.

    The daemon may run as root, and writes there by name: a directory that another user owns, or
    can add entries to (group/world-writable without the sticky bit), anywhere on the path, would
    let them plant symlinks that make it write to any file, so it is refused (root is trusted; a
    sticky directory like /tmp is fine, as the run directory below is always created fresh). The
    path returned has no symlink left that anyone could swap later."""
    import tempfile

    try:
        _make_dirs(path.absolute(), path, flag)
        resolved = _check_tree(path, path, flag)
        with tempfile.TemporaryFile(dir=resolved):
            pass
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise ConfigError(
            f"{flag} {path} is not writable ({reason}): choose a directory this user can write"
        ) from None
    return resolved


def _check_tree(path: Path, shown: Path, flag: str) -> Path:
    """`path` resolved, once neither it nor a directory above it is unsafe (_unsafe_dir)."""
    resolved = Path(os.path.realpath(path))
    for d in (resolved, *resolved.parents):
        why = _unsafe_dir(d, os.lstat(d))
        if why:
            raise ConfigError(f"{flag} {shown}: {why}, or choose another {flag}")
    return resolved


def _make_dirs(path: Path, shown: Path, flag: str) -> None:
    """mkdir -p, each new level 0750 whatever the umask (os.makedirs gives the parents 0777 less
    the umask), and only once the deepest level that exists is checked: nothing is created in an
    unsafe directory."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    if missing:
        _check_tree(path, shown, flag)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o750)
        except FileExistsError:
            pass


def _unsafe_dir(d: Path, st: os.stat_result) -> str | None:
    """Why someone other than this user or root could change what `d` holds, or None."""
    import pwd
    import stat

    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):  # realpath resolved them all: one appeared since
        return f"{d} was just replaced by a symlink"
    if st.st_uid not in (0, me):
        try:
            who = f"uid {st.st_uid} ({pwd.getpwuid(st.st_uid).pw_name})"
        except KeyError:
            who = f"uid {st.st_uid}"
        mine = "root" if me == 0 else "this user or root"
        return (
            f"{d} belongs to {who}, who could plant symlinks there that make elasticd write to any "
            f"file: use a directory owned by {mine}"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        who = "other users" if st.st_mode & 0o002 else "its group"
        return (
            f"{d} is writable by {who} without the sticky bit, so they could plant symlinks there "
            f"that make elasticd write to any file: chmod go-w {d}"
        )
    return None


def make_run_dir(base: Path, name: str) -> Path:
    """This run's directory, created fresh (0750) in a checked base: its name is predictable, and
    one that exists (someone may have planted it, with links inside) is never reused; a random
    suffix is tried instead."""
    import secrets

    from elasticd import safeio

    for suffix in ("", *(f"-{secrets.token_hex(4)}" for _ in range(3))):
        path = base / f"{name}{suffix}"
        try:
            safeio.mkdir(path)
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(
                f"--log-dir {base} is not writable ({e.strerror}): choose a directory this user "
                "can write"
            ) from None
        return path
    raise ConfigError(
        f"--log-dir {base}: a run directory of that name already exists, again and again: "
        "choose a --log-dir only this user can write"
    )


def check_port_free(host: str, port: int) -> None:
    """Fail early with a clear line when the rendezvous port is taken by someone else."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"--rdzv-endpoint port {port} on {host} is in use by another process: "
                    "pick a free port"
                ) from None
            raise ConfigError(
                f"--rdzv-endpoint {host}:{port} cannot be bound here ({e.strerror})"
            ) from None


def check_health_check(command: str) -> None:
    """--health-check's program exists and may be run (its arguments are its own)."""
    import shlex

    program = shlex.split(command)[0]
    if shutil.which(program, path=os.environ.get("PATH", os.defpath)) is None:
        raise ConfigError(
            f"--health-check {command!r}: {program!r} is not an executable file on PATH or at that "
            "path: give a program with its x bit set (e.g. deploy/healthcheck/gpu-check)"
        )


def find_module(name: str, directory: str) -> ModuleSpec | None:
    """Where `python -m name` run in `directory` finds `name`, found without running any code of
    it: importlib.util.find_spec("pkg.mod") imports `pkg` (its __init__ would run here, in the
    daemon, maybe as root, from a directory someone else may write to). The top-level name is
    looked up by the import system's finders with `directory` first on sys.path (a module already
    loaded: its own spec), each further part in the package directories of the one before."""
    import importlib.util

    parts = name.split(".")
    sys.path.insert(0, directory)
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: nothing is imported
    finally:
        sys.path.remove(directory)
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None  # not a package: nothing inside it to find
        spec = _find_inside(".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    return spec


def _find_inside(fullname: str, path: list[str]) -> ModuleSpec | None:
    """A submodule's spec, by the finders the import system asks, given its package's
    directories (a finder locates; it runs nothing)."""
    loaded = sys.modules.get(fullname)
    if loaded is not None:
        return getattr(loaded, "__spec__", None)
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(fullname, path) if find is not None else None
        if spec is not None:
            return spec
    return None


def check_entrypoint(entrypoint: str, cwd: str | None = None, no_python: bool = False) -> None:
    """Resolve the entrypoint the way the worker will, without running the user's code."""
    import ast

    if no_python:
        if shutil.which(entrypoint, path=os.environ.get("PATH", os.defpath)) is None:
            raise ConfigError(
                f"--no-python: entrypoint {entrypoint!r} is not an executable file on PATH or at "
                "that path: give a program (e.g. /usr/bin/env or ./run.sh with its x bit set)"
            )
        return
    if entrypoint.endswith(".py") or os.sep in entrypoint:
        if not os.path.isfile(entrypoint):
            raise ConfigError(
                f"entrypoint script {entrypoint} does not exist: give a path to a .py file, "
                "a module name, or module:function"
            )
        return
    module, _, func = entrypoint.partition(":")
    if not module or (":" in entrypoint and not func):
        raise ConfigError(f"entrypoint {entrypoint!r} is not MODULE, MODULE:FUNCTION or PATH.py")
    directory = cwd or os.getcwd()  # the worker runs with its working directory on sys.path
    try:
        spec = find_module(module, directory)
    except (ImportError, ValueError) as e:
        spec, why = None, f" ({e})"
    else:
        why = ""
    if spec is None:
        raise ConfigError(
            f"entrypoint module {module!r} cannot be found{why}: check the name, "
            "the working directory, or install its package"
        )
    if spec.submodule_search_locations is not None and not func:
        main = find_module(module + ".__main__", directory) if spec.origin else None
        if main is None:
            raise ConfigError(
                f"entrypoint {module!r} is a package without __main__: name a module in it"
            )
    if func:
        origin = spec.origin or ""
        if origin.endswith(".py"):
            with open(origin, encoding="utf-8") as f:
                tree = ast.parse(f.read(), origin)
            top = tree.body
            defined = {
                n.name
                for n in top
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            }
            defined |= {
                t.id
                for n in top
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            defined |= {
                a.asname or a.name
                for n in top
                if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names
            }
            if func.split(".")[0] not in defined:
                raise ConfigError(
                    f"entrypoint {entrypoint!r}: module {module!r} ({origin}) has no function "
                    f"{func!r}"
                )
