"""What the fork server learns to preload (worker/learned.py) and what it leaves out, with real
imports of modules made for the test, in a fresh interpreter each (a probe forks, and the
imports must not land in pytest's process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from elasticd.daemon import learning
from elasticd.worker import imported
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
