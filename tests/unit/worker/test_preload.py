"""What the fork server learns to preload (worker/preload.py) and what it leaves out, with real
imports of modules made for the test, in a fresh interpreter each (a probe forks, and the
imports must not land in pytest's process)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from elasticd.daemon import learning
from elasticd.worker import imported, preload
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


def _learn(tmp_path, wanted: list[str], origins: dict | None = None, first: str = "") -> dict:
    """learn(wanted, origins) in a fresh interpreter with the test's modules on its path (after
    `first`, a directory looked in before them)."""
    for rel, text in MODULES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    code = (
        "import json, os, sys\n"
        "from elasticd.worker import preload\n"
        f"report = preload.learn({wanted!r}, {origins!r})\n"
        "report['loaded'] = sorted(m for m in sys.modules if m in "
        f"{sorted({w.split('.')[0] for w in wanted})!r})\n"
        "report['environ_class_restored'] = type(os.environ).__getitem__.__name__\n"
        "print(json.dumps(report))\n"
    )
    path = os.pathsep.join(filter(None, [first, str(ROOT), str(tmp_path)]))
    env = dict(os.environ, PYTHONPATH=path)
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
    assert "json" in sys.modules and names["json"] == os.path.realpath(sys.modules["json"].__file__)
    assert "harness" in sys.modules and "harness" not in names  # the tests' own: not a library
    assert "__main__" not in names
    path = tmp_path / "rank0.modules"
    path.write_text(
        "json\t/lib/json/__init__.py\nos.path\t/lib/posixpath.py\n../etc/passwd\t/x.py\n"
        "not a name\t/x.py\n81d2__mypyc\t/lib/81d2__mypyc.so\nno_origin\nrelative\tlib/r.py\n"
    )
    assert imported.read(str(path)) == {
        "json": "/lib/json/__init__.py",
        "os.path": "/lib/posixpath.py",
        "81d2__mypyc": "/lib/81d2__mypyc.so",
    }
    assert imported.read(str(tmp_path / "missing")) is None


def test_the_daemon_teaches_once_every_worker_reported(tmp_path):
    events = []
    learn = learning.Learning(tmp_path, lambda name, **kw: events.append((name, kw)))
    hbs = [tmp_path / "rank0.heartbeat", tmp_path / "rank1.heartbeat"]
    (tmp_path / "rank0.modules").write_text("json\t/l/json.py\nyaml\t/l/yaml.py\nre\t/l/re.py\n")
    assert learn.wanted(hbs) is None  # rank 1 has not stepped yet
    # a name two workers loaded from different files is not taught
    (tmp_path / "rank1.modules").write_text("yaml\t/l/yaml.py\ncsv\t/l/csv.py\nre\t/o/re.py\n")
    wanted = {"json": "/l/json.py", "yaml": "/l/yaml.py", "csv": "/l/csv.py"}
    assert learn.wanted(hbs) == wanted
    path = learn.write(wanted)
    assert path.read_text() == "json\t/l/json.py\nyaml\t/l/yaml.py\ncsv\t/l/csv.py\n"
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
    (tmp_path / "a2" / "rank0.modules").write_text("json\t/l/json.py\ncsv\t/l/csv.py\n")
    assert learn.wanted(next_attempt) is None  # nothing new to teach
    learn.forget()  # the fork server died: a new one is taught again
    assert learn.wanted(next_attempt) == {"json": "/l/json.py", "csv": "/l/csv.py"}


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


def test_a_name_is_preloaded_only_from_the_file_the_workers_loaded_it_from(tmp_path):
    # The workers loaded `clean` and `json` from the installation; the server's path finds a
    # planted `clean` first (a directory someone else could write to): it is never run there.
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "ran"
    (planted / "clean.py").write_text(f"open({str(marker)!r}, 'w').close()\nVALUE = 0\n")
    origins = {"clean": str(tmp_path / "clean.py"), "json": json.__file__}
    report = _learn(tmp_path, ["clean", "json"], origins, first=str(planted))
    assert not marker.exists()  # not in the probes, not in the server
    why = report["excluded"]["clean"]
    assert why.startswith("fails to import here: ImportError: clean is at " + str(planted))
    assert report["loaded"] == ["json"] and report["preloaded"] == []
    # the file the workers named, first on the path: imported from there
    report = _learn(tmp_path, ["clean"], origins)
    assert report["preloaded"] == ["clean"] and report["excluded"] == {}


def test_the_server_reads_each_name_with_its_file(tmp_path):
    names = tmp_path / "preload-learned1.txt"
    names.write_text(f"json\t{json.__file__}\nno_file\n")
    code = (
        "import json, sys\n"
        "from elasticd.worker import preload\n"
        "seen = []\n"
        "preload.learn = lambda wanted, origins: seen.append((wanted, origins)) or {}\n"
        f"preload.learn_from({str(names)!r})\n"
        "print(json.dumps(seen[0]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [["json"], {"json": json.__file__}]


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
    assert [k for k in differ if not preload.rank_variable(k)] == []
    assert not preload.rank_variable("ELASTICD_AGENT")  # the same token in both


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


def test_a_spare_that_preloaded_torch_reaches_its_group_without_scanning_the_installed_packages():
    """torch 2.14 registers even gloo through an entry point at a process's first
    init_process_group: a scan of every installed distribution's metadata, on a replacement's
    path to its handle. After a spare's preload that scan is done: here any further scan fails
    the script's init_process_group."""
    code = (
        "import os, importlib.metadata as md, torch.distributed as dist\n"
        "from elasticd.worker import bootstrap\n"
        "os.environ['ELASTICD_WARM_PRELOAD'] = 'torch'\n"
        "bootstrap.preload()\n"
        "def scan(*a, **k):\n"
        "    raise AssertionError('entry points scanned after the preload')\n"
        "md.entry_points = scan\n"
        "store = dist.TCPStore('127.0.0.1', 0, 1, True)\n"
        "dist.init_process_group('gloo', store=store, rank=0, world_size=1)\n"
        "dist.destroy_process_group()\n"
        "print('formed')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == "formed", r.stderr[-2000:]
