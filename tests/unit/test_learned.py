"""What the fork server learns to preload (worker/learned.py) and what it leaves out, with real
imports of modules made for the test, in a fresh interpreter each (a probe forks, and the
imports must not land in pytest's process)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from elasticd.daemon import learning
from elasticd.worker import imported, learned
from harness import ROOT

MODULES = {
    # reads a rank variable at import: its answer would be the server's, not the rank's
    "rankread/__init__.py": "import os\nRANK = int(os.environ.get('LOCAL_RANK', 0))\n",
    "rankread/sub.py": "X = 1\n",
    # imports it: importing it would run rankread's code in the server too
    "user_of_rank.py": "import rankread\n",
    # imports it only once rankread is loaded by someone else (a sys.modules hit)
    "late_user.py": "from rankread import RANK\n",
    "clean.py": "import json\nVALUE = 42\n",
    "broken.py": "raise RuntimeError('no GPU here')\n",
    "threaded.py": "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n",
    "reads_other.py": "import os\nDEBUG = os.environ.get('SOME_DEBUG_FLAG')\n",
}


def _learn(tmp_path, wanted: list[str]) -> dict:
    for rel, text in MODULES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    code = (
        "import json, os, sys\n"
        "from elasticd.worker import learned\n"
        f"report = learned.learn({wanted!r})\n"
        "report['loaded'] = sorted(m for m in sys.modules if m in "
        f"{sorted({w.split('.')[0] for w in wanted})!r})\n"
        "report['environ_class_restored'] = type(os.environ).__getitem__.__name__\n"
        "print(json.dumps(report))\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    env.pop("LOCAL_RANK", None)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_rank_readers_and_their_importers_are_left_out_with_why(tmp_path):
    report = _learn(tmp_path, ["rankread", "rankread.sub", "user_of_rank", "late_user", "clean"])
    ex = report["excluded"]
    assert ex["rankread"] == "reads LOCAL_RANK at import"
    assert ex["rankread.sub"] == "inside rankread"
    assert ex["user_of_rank"].startswith("imports rankread")
    # it found rankread already loaded in the probe, yet would import it in the server
    assert ex["late_user"].startswith("imports rankread")
    assert report["preloaded"] == ["clean"]
    assert report["loaded"] == ["clean"]  # nothing that reads the rank ran in the server
    assert "tainted" not in report and "error" not in report
    assert report["environ_class_restored"] == "__getitem__"  # the audit is gone
    assert learning.causes(ex) == [("rankread", "reads LOCAL_RANK at import", 3)]


def test_failing_threaded_and_harmless_reads(tmp_path):
    report = _learn(tmp_path, ["broken", "threaded", "reads_other", "clean"])
    ex = report["excluded"]
    assert ex["broken"].startswith("fails to import here: RuntimeError: no GPU here")
    assert ex["threaded"] == "starts a thread at import"
    assert report["preloaded"] == ["reads_other", "clean"]  # not a rank variable: preloaded


def test_worker_report_names_only_library_modules(tmp_path):
    hb = tmp_path / "rank0.heartbeat"
    assert imported.report_path(str(hb)) == str(tmp_path / "rank0.modules")
    names = imported.library_modules()
    assert "json" in sys.modules and "json" in names
    assert "harness" in sys.modules and "harness" not in names  # the tests' own: not a library
    assert "__main__" not in names
    path = tmp_path / "rank0.modules"
    path.write_text("json\nos.path\n../etc/passwd\nnot a name\n81d2__mypyc\n")
    assert imported.read(str(path)) == ["json", "os.path", "81d2__mypyc"]
    assert imported.read(str(tmp_path / "missing")) is None


def test_the_daemon_teaches_once_every_worker_reported(tmp_path):
    events = []
    learn = learning.Learning(tmp_path, lambda name, **kw: events.append((name, kw)))
    hbs = [tmp_path / "rank0.heartbeat", tmp_path / "rank1.heartbeat"]
    (tmp_path / "rank0.modules").write_text("json\nyaml\n")
    assert learn.wanted(hbs) is None  # rank 1 has not stepped yet
    (tmp_path / "rank1.modules").write_text("yaml\ncsv\n")
    assert learn.wanted(hbs) == ["json", "yaml", "csv"]
    path = learn.write(["json", "yaml", "csv"])
    assert path.read_text() == "json\nyaml\ncsv\n"
    assert learn.wanted(hbs) is None  # one request at a time, once per attempt
    (tmp_path / f"{path.name}.report.json").write_text(
        json.dumps({"preloaded": ["json", "csv"], "excluded": {"yaml": "reads RANK at import"}})
    )
    learn.say(learn.reported(), replaced=[7])
    assert events[0] == (
        "preload_skipped",
        {"module": "yaml", "why": "reads RANK at import", "with_it": 0},
    )
    assert events[1][0] == "preload_learned" and events[1][1]["preloaded"] == 2
    assert events[1][1]["replaced"] == [7]
    next_attempt = [tmp_path / "a2" / "rank0.heartbeat"]
    (tmp_path / "a2").mkdir()
    (tmp_path / "a2" / "rank0.modules").write_text("json\ncsv\n")
    assert learn.wanted(next_attempt) is None  # nothing new to teach
    learn.forget()  # the fork server died: a new one is taught again
    assert learn.wanted(next_attempt) == ["json", "csv"]


def test_spares_bound_to_a_rank_get_the_rank_readers_less_what_else_they_bring(tmp_path):
    MODULES["rank_extra.py"] = "import os, extra_dep\nR = os.environ.get('RANK')\n"
    MODULES["extra_dep.py"] = "X = 1\n"
    report = _learn(
        tmp_path, ["rankread", "rankread.sub", "user_of_rank", "rank_extra", "clean", "broken"]
    )
    assert report["preloaded"] == ["clean"]
    # a spare that knows its rank may import what reads it; not what fails or brings in more
    assert report["bound"] == ["rankread", "rankread.sub", "user_of_rank"]
    assert report["reads"] == ["LOCAL_RANK"]


def _spare(tmp_path) -> subprocess.Popen:
    """A fresh-interpreter warm spare (as forkclient.start_spare), our child."""
    for rel, text in MODULES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", ELASTICD_WARM_PRELOAD="")
    env["ELASTICD_DAEMON_PID"] = str(os.getpid())
    return subprocess.Popen(
        [sys.executable, "-m", "elasticd.worker.bootstrap"],
        env=env,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _job(tmp_path, spare, bound_to: str, given: str) -> dict:
    """Bind `spare` to LOCAL_RANK `bound_to`, hand it `given`; what the script saw."""
    script = tmp_path / "observe.py"
    script.write_text(
        "import json, os, sys\n"
        "ahead = 'rankread' in sys.modules\n"
        "import rankread\n"
        "print(json.dumps({'rank': rankread.RANK, 'ahead': ahead}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", ELASTICD_DAEMON_PID=str(os.getpid()))
    log = tmp_path / f"rank{given}-{bound_to}.log"
    bind = {"bind": {"env": dict(env, LOCAL_RANK=bound_to), "modules": ["rankread"]}}
    job = {"env": dict(env, LOCAL_RANK=given, ELASTICD_ENTRYPOINT=str(script)), "args": []}
    job["log"] = str(log)
    _, err = spare.communicate((json.dumps(bind) + "\n" + json.dumps(job) + "\n").encode(), 60)
    assert spare.returncode == 0, err
    return json.loads(log.read_text().splitlines()[-1])


def test_a_spare_bound_ahead_imports_with_its_rank_and_goes_cold_when_handed_another(tmp_path):
    # the rank it was bound to: the import was done ahead, with that rank's environment
    assert _job(tmp_path, _spare(tmp_path), bound_to="3", given="3") == {"rank": 3, "ahead": True}
    # another rank after all: the spare becomes a cold worker, and the import sees this rank
    assert _job(tmp_path, _spare(tmp_path), bound_to="3", given="1") == {"rank": 1, "ahead": False}


def test_every_elasticd_variable_a_worker_sees_otherwise_than_the_server_is_audited(tmp_path):
    from elasticd.daemon import forkclient, spawn

    # entrypoint, args, nproc, rank base, world, group rank and world, master, restarts, run,
    # attempt directory, token
    spec = spawn.GroupSpec(
        "train.py", (), 2, 0, 2, 0, 1, "127.0.0.1", 29500, 0, 3, "job", tmp_path, "tok"
    )
    spec = dataclasses.replace(spec, no_python=True)
    spec = dataclasses.replace(spec, checkpoint_dir=str(tmp_path), virtual_local_rank=True)
    spec = dataclasses.replace(spec, extra_env={"ELASTICD_MEMORY_DIR": str(tmp_path)})
    worker = spawn.worker_env(spec, 1, spawn._paths(spec, 1))
    server = forkclient._spare_env("tok", 2, ("torch",))
    differ = {k for k in worker.keys() | server.keys() if worker.get(k) != server.get(k)}
    assert {"RANK", "MASTER_PORT", "ELASTICD_HEARTBEAT_FILE"} <= differ
    assert [k for k in differ if not learned.rank_variable(k)] == []
    assert not learned.rank_variable("ELASTICD_AGENT")  # the same token in both


def test_a_rank_takes_the_spare_bound_to_its_values_else_an_unbound_one():
    from elasticd.daemon import forkclient, spawn

    def spare(pid, bound):
        return forkclient.Spare(forkclient.Child(pid), job=None, bound=bound)

    spares = [spare(1, None), spare(2, {"RANK": "1"}), spare(3, {"RANK": "0"}), spare(4, None)]
    assert spawn._pick(spares, {"RANK": "0", "MASTER_PORT": "1"}).pid == 3
    assert spawn._pick(spares, {"RANK": "1"}).pid == 2
    # another world: no bound spare read these values; never one that read others
    assert spawn._pick(spares, {"RANK": "5"}).pid == 1
    assert spawn._pick(spares, {"RANK": "6"}).pid == 4
    assert spawn._pick(spares, {"RANK": "7"}) is None
    assert spawn._pick([spare(5, {"RANK": "0"})], {}) is None  # unset is a value too
