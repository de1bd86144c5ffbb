"""The fork server importing what this job's workers imported (worker/imported.py reports it,
daemon/learning.py sends the union), where a spare that imported it ahead cannot tell.

A module's import-time code runs once, in the fork server, without the rank's environment: a
module that reads a rank variable there (lightning_fabric's `rank_zero_only.rank` from RANK /
LOCAL_RANK) would keep the server's answer in every spare. So each list is first imported in a
throwaway child (a probe, at idle priority) with every read of os.environ audited: a module on
the import stack while a rank variable (`rank_variable`) was read is not preloaded, nor anything
that imports it, nor a name that fails to import, starts a thread, initialises CUDA or brings in
a module the workers did not have (another sys.path, another import order); the probe is run
again without them until one runs clean (at most ROUNDS), and only then does the server import
that list itself, still audited: a read there after all (import-time code that is not
deterministic) is reported as `tainted`, and the daemon replaces the server. Reads through C's
getenv are not seen: a C extension that reads a rank variable when it is loaded is not caught.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable

from elasticd import names, safeio

ROUNDS = 4
RANK_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)


# elasticd's variables that differ between this server and a worker (spawn.worker_env sets them
# per worker; the server's own list). The others (the daemon's token and pid, settings) are the
# same in both: reading them is harmless (fsspec.config copies the whole environment at import).
PER_WORKER = frozenset(
    {
        names.ENTRYPOINT,
        names.NO_PYTHON,
        names.HEARTBEAT_FILE,
        names.STACK_FILE,
        names.STACK_SIGNAL,
        names.ATTEMPT_DIR,
        names.CHECKPOINT_DIR,
        names.MEMORY_DIR,
        names.STATE_KEY,
        names.LOCAL_RANK,
        names.WARM_PRELOAD,
    }
)


def rank_variable(key: str) -> bool:
    """A variable the rank's environment sets or changes (spawn.worker_env): what a spare's
    imports must not read."""
    return key in RANK_VARIABLES or key in PER_WORKER or key.startswith(("TORCHELASTIC_", "PET_"))


class Origins:
    """While installed (first on sys.meta_path), a module named in `origins` is imported only from
    the file the workers loaded it from (worker/imported.py records it): found elsewhere (a file
    planted earlier on this process's path), its import fails before any of its code runs. Built
    into the interpreter (frozen, built-in) is nothing anyone can plant, so always accepted."""

    def __init__(self, origins: dict[str, str] | None) -> None:
        self.origins = origins

    def find_spec(self, name, path=None, target=None):
        want = self.origins.get(name) if self.origins is not None else None
        if want is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if finder is not self and find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.origin in ("frozen", "built-in") or (
            isinstance(spec.origin, str) and os.path.realpath(spec.origin) == want
        ):
            return spec
        raise ImportError(
            f"{name} is at {spec.origin} here, not {want} where the workers loaded it", name=name
        )

    def __enter__(self) -> Origins:
        if self.origins is not None:
            sys.meta_path.insert(0, self)
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)


class Audit:
    """Every read of a rank variable from os.environ while installed, with the modules whose
    import-time code was running (innermost first), and the value each variable had at its first
    read (`values`: None where it was unset)."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, list[str]]] = []
        self.values: dict[str, str | None] = {}
        self._original = None

    def __enter__(self) -> Audit:
        cls, audit = type(os.environ), self
        original = self._original = cls.__getitem__

        def getitem(env, key):
            if not (env is os.environ and isinstance(key, str) and rank_variable(key)):
                return original(env, key)
            audit.reads.append((key, importing()))
            try:
                value = original(env, key)
            except KeyError:
                audit.values.setdefault(key, None)
                raise
            audit.values.setdefault(key, value)
            return value

        cls.__getitem__ = getitem
        return self

    def __exit__(self, *exc) -> None:
        type(os.environ).__getitem__ = self._original


def importing() -> list[str]:
    """The modules whose top-level code is running on this thread's stack, innermost first."""
    out, frame = [], sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            if isinstance(name, str) and name != "__main__":
                out.append(name)
        frame = frame.f_back
    return out


def _inside(name: str, excluded: dict[str, str]) -> str | None:
    parts = name.split(".")
    for i in range(1, len(parts)):
        if ".".join(parts[:i]) in excluded:
            return ".".join(parts[:i])
    return None


class Edges:
    """Who imports whom at import time, already loaded or not (builtins.__import__ and
    importlib.import_module watched while installed): a module that imports an excluded one
    would import it again in the server, where it is no longer loaded."""

    def __init__(self) -> None:
        self.importers: dict[str, set[str]] = {}

    def _note(self, name: str, fromlist=()) -> None:
        stack = importing()
        if not stack or not isinstance(name, str):
            return
        for target in (name, *(f"{name}.{f}" for f in fromlist or () if isinstance(f, str))):
            self.importers.setdefault(target, set()).add(stack[0])

    def __enter__(self) -> Edges:
        import builtins

        self._saved = builtins.__import__, importlib.import_module
        original_import, original_module = self._saved

        def watched_import(name, globals=None, locals=None, fromlist=(), level=0):
            module = original_import(name, globals, locals, fromlist, level)
            if level == 0:
                self._note(name, fromlist)
            elif fromlist is not None:
                self._note(getattr(module, "__name__", ""), fromlist)
            return module

        def watched_module(name, package=None):
            module = original_module(name, package)
            self._note(module.__name__)
            return module

        builtins.__import__, importlib.import_module = watched_import, watched_module
        return self

    def __exit__(self, *exc) -> None:
        import builtins

        builtins.__import__, importlib.import_module = self._saved

    def spread(self, excluded: dict[str, str]) -> None:
        """Exclude every module that imports an excluded one, transitively."""
        todo = list(excluded)
        while todo:
            name = todo.pop()
            for importer in self.importers.get(name, ()):
                if importer not in excluded:
                    excluded[importer] = f"imports {name}, which is not preloaded"
                    todo.append(importer)


def _more_threads(tasks: int, threads: int) -> bool:
    """More threads than before, once idle BLAS pools are ended (as the server does before it
    forks: worker/forkserver.py)."""
    from elasticd.worker import forkserver

    if len(os.listdir("/proc/self/task")) > tasks:
        forkserver.end_idle_blas_pools()
    return len(os.listdir("/proc/self/task")) > tasks or threading.active_count() > threads


def probe(
    wanted: list[str], expected: set[str], bound: bool = False, origins: dict | None = None
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Import `wanted` in order (in a probe: this process is thrown away); what must not be
    preloaded, each with why, and the rank variables each name's import read. `bound`: for a
    spare that knows its rank (worker/bound.py), where reading one and starting a thread are no
    reason to leave out."""
    excluded: dict[str, str] = {}
    keys: dict[str, list[str]] = {}
    _more_threads(0, 0)  # loads what it needs before the first import is watched
    with Origins(origins), Audit() as audit, Edges() as edges:
        for name in wanted:
            if name in sys.modules or name in excluded or _inside(name, excluded):
                continue
            before, seen, threads = set(sys.modules), len(audit.reads), threading.active_count()
            tasks = len(os.listdir("/proc/self/task"))
            try:
                importlib.import_module(name)
            except BaseException as e:  # noqa: BLE001 - whatever the import raised
                excluded[name] = f"fails to import here: {type(e).__name__}: {e}"[:300]
                continue
            keys[name] = sorted({key for key, _ in audit.reads[seen:]})
            for key, stack in [] if bound else audit.reads[seen:]:
                for i, module in enumerate(stack):
                    why = f"reads {key} at import" if i == 0 else f"imports {stack[0]}"
                    excluded.setdefault(module, why if i == 0 else f"{why}, which reads {key}")
                excluded.setdefault(name, f"imports {stack[0]}, which reads {key} at import")
            if not bound and _more_threads(tasks, threads):
                excluded.setdefault(name, "starts a thread at import")
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                excluded.setdefault(name, "initialises CUDA at import")
                break
            extra = sorted(
                m
                for m in set(sys.modules) - before
                if m not in expected
                and not m.startswith("elasticd.")
                and isinstance(getattr(sys.modules[m], "__file__", None), str)
            )
            if extra:
                excluded.setdefault(name, f"also imports {extra[0]}, which the workers did not")
    edges.spread(excluded)
    return excluded, keys


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


# what the fork server does while a probe runs (set around each learning request): called with
# the probe's pipe, it returns once that is readable
wait_for: Callable[[int], None] | None = None


def _probe_in_child(
    wanted: list[str], expected: set[str], bound: bool = False, origins: dict | None = None
) -> tuple[dict[str, str], dict[str, list[str]]] | None:
    """probe() in a forked child at idle priority; None if the child died (killed by a
    teardown's sweep, or out of memory)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            _die_with_parent()
            with contextlib.suppress(OSError):
                os.nice(19)
            sys.stdout = sys.stderr = open(os.devnull, "w")
            data = json.dumps(probe(wanted, expected, bound, origins)).encode()
            with os.fdopen(write_end, "wb") as f:
                f.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        if wait_for is not None:
            wait_for(read_end)  # the fork server forks spares meanwhile (forkserver._serve_while)
    except BaseException:
        os.close(read_end)  # in such a spare, on its way out of the server's stack
        raise
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return None
    excluded, keys = json.loads(data)
    return excluded, keys


def learn(wanted: list[str], origins: dict[str, str] | None = None) -> dict:
    """Find what of `wanted` can be preloaded (probes), then import it here. The report:
    `preloaded` (names imported), `excluded` (name -> why), and `error` (learning gave up:
    nothing imported) or `tainted` (a rank variable read here after all: the daemon must not
    fork from this server). `origins`: the file each name was loaded from in the workers; a
    name found elsewhere here fails to import (`Origins`), in the probes and here alike."""
    # as the workers see it: absent (the server's own list, read at its start: bootstrap.preload)
    hidden = os.environ.pop(names.WARM_PRELOAD, None)
    try:
        return _learn(wanted, origins)
    finally:
        if hidden is not None:
            os.environ[names.WARM_PRELOAD] = hidden


def _learn(wanted: list[str], origins: dict[str, str] | None) -> dict:
    expected = set(wanted)
    wanted = [n for n in wanted if n not in sys.modules]
    excluded: dict[str, str] = {}
    for _ in range(ROUNDS):
        found = _probe_in_child([n for n in wanted if n not in excluded], expected, False, origins)
        if found is None:
            return {"preloaded": [], "excluded": excluded, "error": "the probe died"}
        new = {k: v for k, v in found[0].items() if k not in excluded}
        excluded.update(new)
        for name in wanted:
            parent = _inside(name, excluded)
            if parent and name not in excluded:
                excluded[name] = f"inside {parent}"
        if not new:
            break
    else:
        return {"preloaded": [], "excluded": excluded, "error": f"no clean list in {ROUNDS} probes"}
    chosen = [n for n in wanted if n not in excluded]
    preloaded = []
    with Origins(origins), Audit() as audit:
        for name in chosen:
            if name in sys.modules:
                continue
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - never breaks the job
                excluded[name] = f"failed to import: {type(e).__name__}: {e}"[:300]
                continue
            preloaded.append(name)
    report = {"preloaded": preloaded, "excluded": excluded}
    if audit.reads:
        key, stack = audit.reads[0]
        report["tainted"] = f"{stack[0] if stack else '?'} read {key} at import"
    else:
        report.update(for_bound_spares(wanted, excluded, expected, origins))
    return report


def reads_rank(name: str, excluded: dict[str, str]) -> bool:
    """Whether `name` was left out only for a rank variable read at import: its own, or one
    by a module it imports or lies inside."""
    seen = set()
    while name in excluded and name not in seen:
        seen.add(name)
        why = excluded[name]
        if why.startswith("reads "):
            return True
        if not why.startswith(("imports ", "inside ")):
            return False
        name = why.split()[1].rstrip(",")
    return False


def for_bound_spares(
    wanted: list[str], excluded: dict[str, str], expected: set[str], origins: dict | None = None
) -> dict:
    """What a spare that knows its rank's environment may import ahead (worker/bound.py): the
    modules left out for reading a rank variable, less those that fail or bring in a module the
    workers did not have (a probe after this server's imports, as a spare's would be), and the
    rank variables their imports read (`reads`: the daemon hands such a spare only a rank whose
    environment has the same values there)."""
    bound = [n for n in wanted if n in excluded and reads_rank(n, excluded)]
    found = _probe_in_child(bound, expected, True, origins) if bound else ({}, {})
    if found is None:
        return {}
    dropped, keys = found
    bound = [n for n in bound if n not in dropped and not _inside(n, dropped)]
    reads = sorted({key for name in bound for key in keys.get(name, ())})
    return {"bound": bound, "reads": reads} if bound else {}


def learn_from(path: str) -> dict:
    """learn() on the names the daemon wrote to `path`, one a line with the file the workers
    loaded it from (`name<TAB>origin`, daemon/learning.py)."""
    origins = {}
    with open(path) as f:
        for line in f:
            name, _, origin = line.rstrip("\n").partition("\t")
            if name and origin:
                origins[name] = origin
    return learn(list(origins), origins)


REQUEST = b"L"  # + the path of the names, from the daemon (daemon/forkclient.py)
ANSWER = b"learned"  # the report is then at that path + REPORT_SUFFIX
REPORT_SUFFIX = ".report.json"


def answer(request: bytes) -> bytes:
    """The fork server's side of a learning request: learn, write the report, say so. Whatever
    goes wrong is in the report, never raised: the server must go on forking spares."""
    from elasticd.worker import forkserver

    path = os.fsdecode(request[len(REQUEST) :])
    try:
        report = learn_from(path)
    except Exception as e:  # noqa: BLE001 - a learning aid: the job goes on without it
        report = {"preloaded": [], "excluded": {}, "error": f"{type(e).__name__}: {e}"}
    forkserver.end_idle_blas_pools()
    forkserver.freeze_imports()
    unfit = forkserver.unfit_reason()
    if unfit and "tainted" not in report:
        report["tainted"] = unfit
    with contextlib.suppress(OSError), os.fdopen(safeio.create(path + REPORT_SUFFIX), "w") as f:
        json.dump(report, f)
    return ANSWER
