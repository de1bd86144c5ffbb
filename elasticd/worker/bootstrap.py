"""Runs inside every worker before the user's code (the parent-death signal, stack dumps, the
heartbeat, the error file), then runs the user's entrypoint as `python` would and gets out of the
way.

`python -m elasticd.worker.bootstrap ARGS...` with ELASTICD_ENTRYPOINT naming a script, module or
module:function. The user's code then runs with the `__main__`, sys.argv, sys.path and exit-code
semantics of `python script.py ARGS` / `python -m module ARGS`. Before that it:
- dies with the daemon (parent-death signal), even if the daemon is SIGKILLed;
- dumps every thread's stack to the rank's stack file on ELASTICD_STACK_SIGNAL (faulthandler);
- beats the heartbeat on every optimizer step (with the rank's own work since the last gradient
  sync, timed around backward()), marks when init_process_group returns, and
  works around a gloo teardown deadlock in destroy_process_group, without importing torch itself;
- writes TORCHELASTIC_ERROR_FILE (torch's @record format) when the entrypoint raises.

The entrypoint runs in a real `__main__` module, as `python -u script.py` / `-m` would run it:
`sys.orig_argv`, unbuffered output, the script's directory (for `-m`, the working directory) put
on sys.path by the bootstrap itself (`entry_path`: the interpreter runs with -P), and an uncaught
exception shown by `sys.excepthook` from the script's first frame (`uncaught`). The heartbeat file
is marked once the entrypoint returned, before interpreter teardown, so that its death no longer
fails the job.

With ELASTICD_NO_PYTHON (torchrun's --no-python) the entrypoint is an executable: the worker
becomes it (exec) once it dies with the daemon, and the rest does not apply.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import faulthandler
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import os
import signal
import sys
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

from elasticd import names, safeio
from elasticd.worker import proctitle, threads

if __name__ == "__main__":  # `python -m elasticd.worker.bootstrap` (a cold start): one module,
    # whatever later imports it by name (the checkpoint library's FAILURE_HOOKS are this one's)
    sys.modules.setdefault("elasticd.worker.bootstrap", sys.modules[__name__])

_PR_SET_PDEATHSIG = 1


def die_with_daemon() -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    expected = os.environ.get(names.DAEMON_PID)
    if expected and os.getppid() != int(expected):
        os._exit(1)  # the daemon died between fork and prctl: nobody would watch us


def arm_stack_dumps() -> None:
    path = os.environ.get(names.STACK_FILE)
    if not path:
        return
    sig = getattr(signal, os.environ.get(names.STACK_SIGNAL, "SIGUSR1"))
    # Kept open for the life of the process: faulthandler writes from a signal handler.
    global _stack_file
    _stack_file = os.fdopen(safeio.append(path), "a")
    faulthandler.register(sig, file=_stack_file, all_threads=True, chain=False)


_stack_file = None


def _register_step_hook(optimizer_module) -> None:
    from elasticd.worker import heartbeat

    writer = heartbeat.writer()
    if writer is not None:
        optimizer_module.register_optimizer_step_post_hook(lambda *_: writer.optimizer_stepped())


def _hook_optimizer_steps(optimizer_module) -> None:
    _register_step_hook(optimizer_module)
    if os.environ.get(names.IN_PLACE_GEN, "0") == "0":  # a rank replaced in place: learned already
        _report_imports_once(optimizer_module)


def _report_imports_once(optimizer_module) -> None:
    """At the first optimizer step, name the library modules imported so far, for the fork
    server to preload in later spares (worker/imported.py); once, a few milliseconds."""
    handle = None

    def first_step(*_):
        handle.remove()
        from elasticd.worker import imported

        imported.report()

    handle = optimizer_module.register_optimizer_step_post_hook(first_step)


def _time_backward(autograd_module) -> None:
    """Note when each backward() begins and returns (the rank's own work per step is the time
    between one step's gradient sync and the next backward: heartbeat.Writer.optimizer_stepped).
    Tensor.backward() calls torch.autograd.backward through the module, so wrapping it there
    covers both; two clock reads per backward."""
    from elasticd.worker import heartbeat

    writer = heartbeat.writer()
    if writer is None:
        return
    backward, clock = autograd_module.backward, time.monotonic

    @functools.wraps(backward)
    def timed_backward(*args, **kwargs):
        writer.backward_in = clock()
        try:
            return backward(*args, **kwargs)
        finally:
            writer.backward_out = clock()

    autograd_module.backward = timed_backward


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once `name` is imported, so torch is never imported on our account."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module):
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_then
        return spec


def _wrap_process_group_calls(dist_module) -> None:
    """Wrap torch.distributed's init_process_group and destroy_process_group, with the same
    signatures, results and exceptions:

    - init: its return is marked in the heartbeat file (the recovery timeline's "process group
      ready"); on the in-place path the group is made to re-form in place, and a script entered
      again finds its group re-formed (worker/reconfigure.py `init`);
    - destroy: afterwards the GIL is let go for a moment, so gloo's worker threads can drop their
      last finished work (which takes the GIL). Otherwise a script that destroys the group and
      then frees its DDP model (returning from main()) deadlocks now and then, in torch under any
      launcher: the Reducer's destructor joins those threads with the GIL held."""
    init, destroy = dist_module.init_process_group, dist_module.destroy_process_group
    path = os.environ[names.HEARTBEAT_FILE]

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        from elasticd.worker import heartbeat

        if os.environ.get(names.IN_PLACE_GEN) is None:  # the restart path: torch's, untouched
            result = init(*args, **kwargs)
        else:
            from elasticd.worker import reconfigure

            result = reconfigure.init(init, dist_module, args, kwargs)

        heartbeat.mark(path, "pg_ready")
        from elasticd.worker import flight

        flight.arm()  # answers the daemon's asks for this rank's collectives
        return result

    @functools.wraps(destroy)
    def destroy_process_group(*args, **kwargs):
        result = destroy(*args, **kwargs)
        time.sleep(0.05)
        return result

    dist_module.init_process_group = init_process_group
    dist_module.destroy_process_group = destroy_process_group


def _after_import(name: str, then) -> None:
    if name in sys.modules:  # a warm spare imported it ahead
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def arm_heartbeat() -> None:
    if not os.environ.get(names.HEARTBEAT_FILE):
        return
    _after_import("torch.optim.optimizer", _hook_optimizer_steps)
    _after_import("torch.autograd", _time_backward)
    _after_import("torch.distributed", _wrap_process_group_calls)


def write_error_file(exc: BaseException) -> None:
    """torch's format (torch.distributed.elastic.multiprocessing.errors), unless the script's own
    @record already wrote one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    data = {
        "message": {
            # with its notes, as the interpreter prints the exception's last lines
            "message": "\n".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", [])]),
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    tmp = f"{path}.tmp{os.getpid()}"
    with os.fdopen(safeio.create(tmp), "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _run_as_main(code, **attrs) -> None:
    """Execute `code` in a fresh `__main__` module that stays in sys.modules, as the interpreter
    does for `python script.py` and `python -m module` (runpy.run_path/run_module would use a
    temporary module and drop it on return).

    Why it matters: the script's objects must live until interpreter shutdown, after atexit
    handlers, when finalization clears `__main__`. Freed earlier, on a live interpreter, a DDP
    model deadlocks now and then: ProcessGroupGloo's destructor joins its worker thread with the
    GIL held while that thread waits for the GIL to drop its last Python reference."""
    main = types.ModuleType("__main__")
    main.__dict__.update(attrs, __builtins__=builtins)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def entry_path(directory: str) -> None:
    """Put `directory` first on sys.path, as `python script.py` (the script's directory) and
    `python -m` (the working directory) do. The daemon starts this process with -P
    (proctitle.command), so that elasticd and torch were not imported from the working directory
    (which someone else may write to); only the user's entrypoint is looked up there, as under
    torchrun. Started without -P (by hand), the entry `-m` put first is replaced."""
    if sys.flags.safe_path or not sys.path:
        sys.path.insert(0, directory)
    else:
        sys.path[0] = directory


# what this process runs (a repro bundle records it: elasticd.checkpoint.bundle)
RUNNING: dict[str, Any] = {}
# called with an exception the script left uncaught, after its error file is written (the
# checkpoint library's repro bundle); each must never raise
FAILURE_HOOKS: list[Callable[[BaseException], None]] = []


def run_entrypoint(entrypoint: str, args: list[str]) -> None:
    RUNNING.update(entrypoint=entrypoint, args=list(args), cwd=os.getcwd())
    if entrypoint.endswith(".py") or os.sep in entrypoint:
        path = os.path.abspath(entrypoint)
        sys.argv = [entrypoint, *args]
        entry_path(os.path.dirname(path))
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
        _run_as_main(
            code,
            __file__=path,
            __cached__=None,
            __package__=None,
            __spec__=None,
            __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        )
    elif ":" in entrypoint:
        module, func = entrypoint.split(":", 1)
        sys.argv = [entrypoint, *args]
        entry_path(os.getcwd())
        target = importlib.import_module(module)
        for part in func.split("."):
            target = getattr(target, part)
        sys.exit(target())
    else:
        entry_path(os.getcwd())
        spec = importlib.util.find_spec(entrypoint)
        if (
            spec is not None and spec.submodule_search_locations is not None
        ):  # a package: its __main__
            spec = importlib.util.find_spec(f"{entrypoint}.__main__")
        if spec is None or spec.loader is None:
            raise ModuleNotFoundError(f"No module named {entrypoint}", name=entrypoint)
        code = spec.loader.get_code(spec.name)
        sys.argv = [spec.origin, *args]  # as `python -m` sets it: the module's file
        _run_as_main(
            code,
            __file__=spec.origin,
            __cached__=spec.cached,
            __package__=spec.parent,
            __spec__=spec,
            __loader__=spec.loader,
        )


def preload() -> None:
    """Import what ELASTICD_WARM_PRELOAD lists (a warm spare, or the fork server of spares)."""
    for name in filter(None, os.environ.get(names.WARM_PRELOAD, "").split(",")):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the script will meet the same error cold
            print(
                f"elasticd warm spare: preloading {name} failed: {e!r}", file=sys.stderr, flush=True
            )
    register_backends()
    threads.remember()


def register_backends() -> None:
    """Since torch 2.14 even gloo and NCCL are registered through entry points at a process's
    first init_process_group: a scan of every installed distribution's metadata (4-10 ms here),
    on a replacement's path to its handle. A spare that preloaded torch.distributed does it while
    it waits (BackendConfig, torch's public class, registers what it names; a no-op before)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not hasattr(dist, "BackendConfig"):
        return
    with contextlib.suppress(Exception):  # the script's own init meets any error itself
        dist.BackendConfig("cpu:gloo,cuda:nccl")


def wait_for_rank() -> list[str] | None:
    """Warm spare: import the heavy modules (if the fork server has not), then block until the
    daemon sends this process its rank's environment, arguments and log file (one JSON line on
    stdin), after a line that binds it to a rank ahead (worker/bound.py), if the daemon sends one.

    Afterwards the process looks like a cold worker to the script: the same environment,
    argv, stdout and stderr on the rank's two log files, stdin on /dev/null. None on EOF (spare
    discarded)."""
    from elasticd.worker import bound  # a spare's only: a cold worker imports no more than it needs

    preload()
    seen = None  # what imports bound to a rank read (worker/bound.py), if the daemon bound it
    while True:
        line = sys.stdin.buffer.readline()
        if not line:
            return None
        job = json.loads(line)
        if "bind" not in job:
            break
        seen = bound.bind(job["bind"])
    sys.stdout.flush()
    sys.stderr.flush()
    log = safeio.create(job["log"], os.O_WRONLY | os.O_APPEND)
    err = safeio.create(job["err"], os.O_WRONLY | os.O_APPEND) if "err" in job else log
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(log, 1)
    os.dup2(err, 2)
    os.dup2(null, 0)
    for fd in {log, err, null}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(job["env"])
    proctitle.show_environ(job["env"])  # what monitors read in /proc/PID/environ, as for a cold one
    if seen is not None and not bound.holds(seen, job["env"]):
        bound.cold_start(job["args"])
    return job["args"]


def unbuffered_output() -> None:
    """sys.stdout and sys.stderr as `python -u` makes them (torchrun starts its workers so: the
    log sees each write at once), where this interpreter's command had no room for -u
    (proctitle.command): text straight to an unbuffered file, newlines untranslated."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(getattr(stream, "buffer", None), io.FileIO):
            continue  # no such stream, or already -u's
        stream.flush()
        raw = io.FileIO(stream.fileno(), "w", closefd=False)
        raw.name = f"<{name}>"
        text = io.TextIOWrapper(
            raw, encoding=stream.encoding, errors=stream.errors, newline="\n", write_through=True
        )
        text.mode = "w"
        setattr(sys, name, text)
        setattr(sys, f"__{name}__", text)


def exec_program(program: str, args: list[str]) -> None:
    """Become `program ARGS` (found on PATH as a shell would), keeping pid, session, environment,
    the log as stdout/stderr and the parent-death signal. A program that cannot be run exits 127,
    as in a shell, with the reason in the error file."""
    try:
        os.execvp(program, [program, *args])
    except OSError as e:
        write_error_file(e)
        print(f"elasticd: cannot run {program}: {e}", file=sys.stderr, flush=True)
        os._exit(127)


_BEFORE = (__file__, importlib.__file__)  # the frames that lead to the script's first


def script_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """`tb` without this shim's frames: those before the script's first (main, run_entrypoint,
    an entrypoint function's import_module) and threads.py's import watcher inside it, so a
    traceback begins where `python script.py`'s does."""
    while tb is not None and tb.tb_frame.f_code.co_filename in _BEFORE:
        tb = tb.tb_next
    link = tb
    while link is not None:
        while link.tb_next is not None and link.tb_next.tb_frame.f_code is threads.WATCHER:
            link.tb_next = link.tb_next.tb_next
        link = link.tb_next
    return tb


def uncaught(exc: BaseException, sigchld: Callable | None = None) -> None:
    """What the interpreter does with an exception the script left uncaught (sys.excepthook,
    sys.last_*, exit status 1), here, so that the traceback starts at the script: raised on, it
    would gain the frames of runpy, the fork server and this shim on its way out. `sigchld`:
    the script's SIGCHLD handler, held while this runs (run_once), asked about dead loaders."""
    exc.__traceback__ = script_traceback(exc.__traceback__)
    from elasticd.worker import loader_exits  # only on a failure: the start imports little

    loader_exits.note(exc, sigchld)
    write_error_file(exc)
    for hook in FAILURE_HOOKS:
        hook(exc)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    sys.excepthook(type(exc), exc, exc.__traceback__)
    raise SystemExit(1)


def _mark(name: str) -> None:
    if os.environ.get(names.HEARTBEAT_FILE):
        from elasticd.worker import heartbeat

        heartbeat.mark(os.environ[names.HEARTBEAT_FILE], name)


def quit_unused(code: int = 0) -> None:
    """Exit a spare or fork server the daemon let go: no user code ran, so there is nothing to
    finish but output; an interpreter's shutdown with torch loaded would keep the daemon's exit
    (it waits for them) ~0.3 s per process. Also a survivor that could not re-enter in place
    (code 1): a thread its script left running would keep an interpreter's shutdown waiting,
    and the daemon restarts the group only once it has exited."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main() -> None:
    die_with_daemon()
    args = sys.argv[1:]
    warm = names.WARM_PRELOAD in os.environ  # a warm spare; the rank's env has no such key
    if warm:
        preloaded = os.environ[names.WARM_PRELOAD].split(",")
        args = wait_for_rank()
        if args is None:
            quit_unused()
        if names.REPLAY_RESULT in os.environ:  # handed the referee's replay, not a rank
            from elasticd.worker import replay

            replay.run(args)
    entrypoint = os.environ[names.ENTRYPOINT]
    if os.environ.get(names.NO_PYTHON):
        exec_program(entrypoint, args)
    unbuffered_output()
    shown = proctitle.title(entrypoint, args)
    proctitle.show(shown)  # ps shows `python -u train.py ...`, as under torchrun
    sys.orig_argv = shown  # and so does the interpreter's record of its command line
    arm_stack_dumps()
    arm_heartbeat()
    if warm:
        threads.follow(preloaded)
    try:
        while not run_once(entrypoint, args):
            pass  # re-entered in place: the script runs again in this process
    finally:
        _mark("exiting")


def run_once(entrypoint: str, args: list[str]) -> bool:
    """Run the entrypoint: True once this process is done with it; False where it unwound from
    a fault elsewhere and the group re-formed in place (worker/reconfigure.py `reenter`), so it
    runs again."""
    try:
        run_entrypoint(entrypoint, args)
    except SystemExit as stop:
        if stop.code is None or stop.code == 0:
            _mark("returned")
        raise
    except KeyboardInterrupt:
        raise  # the interpreter ends the process by SIGINT, as it should
    except BaseException as exc:  # noqa: BLE001 - shown and ended as the interpreter would
        held = _hold_sigchld()
        try:
            if os.environ.get(names.IN_PLACE_GEN) is not None:
                from elasticd.worker import reconfigure

                if not reconfigure.from_elsewhere(exc):
                    uncaught(exc, held)  # its own error: it exits with it, as under torchrun
                if reconfigure.reenter(exc) is None:
                    return False
                try:  # fell back: end now, as a restart expects, whatever threads it left
                    uncaught(exc, held)
                finally:
                    quit_unused(1)
            uncaught(exc, held)
        finally:
            _release_sigchld(held)
    _mark("returned")  # before interpreter teardown: its death no longer fails the job
    return True


def _hold_sigchld() -> Callable | None:
    """A Python SIGCHLD handler (torch's DataLoader's, which raises where a loader worker died)
    swapped, while this shim handles the script's failure, for one that does nothing: torch's
    raised its "killed by signal" inside the shim once (the chaos soak: the error the script
    unwound with was the resource sharer's ConnectionResetError, the loader's death came during
    its handling), and the rank died with no error file, taken for its own error. It is asked
    once, where the error is written (loader_exits.note), and put back for a run again."""
    try:
        held = signal.getsignal(signal.SIGCHLD)
        if not callable(held):
            return None
        signal.signal(signal.SIGCHLD, _noted)
    except (ValueError, OSError):  # not the main thread
        return None
    return held


def _noted(signum, frame) -> None:
    """SIGCHLD while a failure is handled: torch's handler is asked later (_hold_sigchld)."""


def _release_sigchld(held: Callable | None) -> None:
    if held is not None:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGCHLD, held)


if __name__ == "__main__":
    main()
