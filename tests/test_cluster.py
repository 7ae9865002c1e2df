"""`lab run --scheduler`: a LocalCluster on the loopback runs a tiny collection on every
machine; a worker killed mid-notebook fails only its own machine's row and keeps its last
good report; a worker with other sources is refused, both sides named; Ctrl-C stops the
notebooks; an unreachable scheduler is one line within seconds."""
import _thread
import json
import os
import re
import signal
import socket
import threading
import time

import pytest
from distributed import Client

from lab import cli, cluster, profiles, runner
from tests.test_run import make_collection

WORK = """import os, signal
from lab import report
if os.environ.get("LAB_TEST_KILL"):          # the worker dies here, mid-notebook
    os.kill(os.getppid(), signal.SIGKILL)
    os._exit(0)
report.save("work", {"n": n}, {"n squared": n * n, "worker pid": os.getppid()})"""


@pytest.fixture
def collection(tmp_path, monkeypatch):
    return make_collection(tmp_path, monkeypatch,
                           {"work": WORK, "more": WORK.replace('"work"', '"more"'), "nap": "import time\ntime.sleep(n)"},
                           "notebooks:\n  work: {n: 3}\n  more: {n: 4}\n  nap: {n: 120}\n")


# functions the tests run on the workers (client.run)
def _use_collection(path):
    from pathlib import Path
    profiles.NOTEBOOKS = Path(path)


def _arm_kill():
    os.environ["LAB_TEST_KILL"] = "1"


def _other_sources():
    cluster.source_hash = lambda: "0123456789abcdef0123"


def _omp():
    return os.environ.get("OMP_NUM_THREADS")


def _kernels():
    return len(cluster.notebook_kernels())


@pytest.fixture
def loopback(collection):
    """Two loopback workers that see the test's notebooks -> (client, {name: address}, scheduler)."""
    with cluster.local_cluster(2) as lc, Client(lc) as client:
        client.run(_use_collection, str(profiles.NOTEBOOKS))
        names = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
        yield client, names, lc.scheduler_address


def _entries(home):
    return {e["notebook"]: e for e in json.loads((home / "index.json").read_text())["entries"]}


def _row(page, name):
    return next(r for r in page.split("<tr>") if f">{name}</a>" in r)


@pytest.mark.slow
def test_each_runs_the_profile_on_every_machine(loopback, collection):
    client, names, address = loopback
    out = collection / "out"
    page, entries = cluster.run(["work"], "p", out_dir=str(out), scheduler=address, on="each")
    assert sorted(e["machine"] for e in entries) == ["local-0", "local-1"]
    assert all(e["status"] == "ok" for e in entries)
    html = page.read_text()
    pids = set()
    for name in ("local-0", "local-1"):
        results = json.loads((out / name / "work.json").read_text())
        assert _entries(out / name)["work"]["status"] == "ok" and (out / name / "work.html").exists()
        row = _row(html, name)
        assert f"<td>{results['headline']['worker pid']}</td>" in row and "<td>9</td>" in row
        assert f"href='{name}/work.html'" in row and results["machine"]["cpu"] in row
        pids.add(results["headline"]["worker pid"])
    assert len(pids) == 2                        # each row's figures are its own machine's


@pytest.mark.slow
def test_a_worker_killed_mid_notebook_fails_only_its_machine(loopback, collection):
    client, names, address = loopback
    out = collection / "out"
    # local-1 had a good report from an earlier run
    home = out / "local-1"
    home.mkdir(parents=True)
    (home / "work.html").write_text("<p>the earlier good report</p>")
    (home / "work.json").write_text(json.dumps({"headline": {"n squared": 4}}))
    old = {"cpu": "earlier", "logical_cpus": 2, "kernel_path": "avx2", "commit": "x", "date": "then"}
    runner.write_index(home, [{"notebook": "work", "status": "ok", "html": "work.html", "headline": {}}], "p", old)
    client.run(_arm_kill, workers=[names["local-1"]])
    start = time.monotonic()
    page, entries = cluster.run(["work"], "p", out_dir=str(out), scheduler=address, on="each")
    assert time.monotonic() - start < 90
    by = {e["machine"]: e for e in entries}
    assert by["local-0"]["status"] == "ok" and (out / "local-0" / "work.html").exists()
    assert by["local-1"]["status"] == "failed" and "left the cluster mid-notebook" in by["local-1"]["error"]
    assert (home / "work.html").read_text() == "<p>the earlier good report</p>"      # nothing partial replaced it
    assert _entries(home)["work"]["previous_report"] == "work.html"
    row = _row(page.read_text(), "local-1")
    assert "failed" in row and "last good" in row and "<td>4</td>" in row


@pytest.mark.slow
def test_under_any_a_notebook_whose_worker_dies_is_retried_elsewhere(loopback, collection):
    client, names, address = loopback
    out = collection / "out"
    client.run(_arm_kill, workers=[names["local-1"]])
    # two notebooks, one machine each at a time: one of them lands on local-1 and dies there
    page, entries = cluster.run(["work", "more"], "p", out_dir=str(out), scheduler=address, on="any")
    assert [(e["notebook"], e["status"], e["machine"]) for e in sorted(entries, key=lambda e: e["notebook"])] == \
        [("more", "ok", "local-0"), ("work", "ok", "local-0")]
    assert set(_entries(out / "local-0")) == {"work", "more"} and not (out / "local-1").exists()
    assert "<td>16</td>" in _row(page.read_text(), "local-0")


@pytest.mark.slow
def test_a_worker_with_other_native_sources_is_refused(loopback, collection):
    client, names, address = loopback
    out = collection / "out"
    client.run(_other_sources, workers=[names["local-1"]])
    mine = cluster.source_hash()
    page, entries = cluster.run(["work"], "p", out_dir=str(out), scheduler=address, on="each")
    by = {e["machine"]: e for e in entries}
    assert by["local-0"]["status"] == "ok"
    why = by["local-1"]["error"]
    assert by["local-1"]["status"] == "failed" and why.startswith("machine local-1 refused")
    assert f"native-source hash 0123456789abcdef0123 (worker) against {mine} (client)" in why
    assert not (out / "local-1" / "work.json").exists() and "refused" in _row(page.read_text(), "local-1")
    # with every worker refused there is nothing to run on: one error naming each
    client.run(_other_sources)
    with pytest.raises(cluster.ClusterError, match=r"no worker can take the work: machine local-\d refused.*; machine"):
        cluster.run(["work"], "p", out_dir=str(out), scheduler=address)


@pytest.fixture
def ctrl_c():
    """Python's Ctrl-C handler for the test: a run started in the background (`cmd &`) inherits
    SIGINT ignored, and a simulated Ctrl-C (_thread.interrupt_main) then does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_ctrl_c_cancels_and_stops_the_running_notebooks(loopback, collection, ctrl_c):
    client, names, address = loopback
    done = threading.Event()

    def interrupt_once_running():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(client.run(_kernels).values()) < 2:
            time.sleep(0.5)
        if not done.is_set():                   # never into a later test
            _thread.interrupt_main()

    threading.Thread(target=interrupt_once_running, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            cluster.run(["nap"], "p", out_dir=str(collection / "out"), scheduler=address, on="each")
    finally:
        done.set()
    assert time.monotonic() - start < 60                        # the naps were for 120 s
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (sum(client.run(_kernels).values()) or
                                           client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))):
        time.sleep(0.5)
    assert sum(client.run(_kernels).values()) == 0
    assert client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)) == 0


@pytest.mark.slow
def test_local_starts_loopback_workers_each_one_machine():
    with cluster.connect("local:2") as client:
        workers = client.scheduler_info()["workers"]
        assert sorted(w["name"] for w in workers.values()) == ["local-0", "local-1"]
        assert all(a.startswith("tcp://127.0.0.1:") for a in workers)
        assert all(w["resources"] == {"machine": 1} and w["nthreads"] == 1 for w in workers.values())
        # Dask's nanny would cap these at 1; the engine and torch get every CPU instead
        assert set(client.run(_omp).values()) == {os.environ.get("OMP_NUM_THREADS")}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["run", "work", "--profile", "p", "--scheduler"], ["worker"]])
def test_an_unreachable_scheduler_is_one_line_within_seconds(collection, capsys, argv):
    address = f"tcp://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    assert cli.main([*argv, address]) == 2
    assert time.monotonic() - start < 20
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lab: error")]
    assert err == [err[0]] and err[0].startswith(f"lab: error: cannot reach the Dask scheduler at {address} within 5 s: ")


def test_flags(capsys):
    assert cli.main(["run", "--on", "each"]) == 2
    assert "--on each only applies to a cluster" in capsys.readouterr().err
    assert cli.main(["run", "--scheduler", "local:0"]) == 2
    assert "local:N takes N worker processes" in capsys.readouterr().err


def test_refusal_names_both_sides():
    me = {"commit": "abc1234", "native": "n1"}
    assert cluster.refusal("m", me, dict(me)) is None
    why = cluster.refusal("m", me, {"commit": "def5678", "native": "n1"})
    assert why.startswith("machine m refused: project commit def5678 (worker) against abc1234 (client)")
    assert "native-source" not in why


def test_machines_index_is_built_from_each_machines_json(tmp_path):
    """One machine or three, the same code; a figure a machine lacks is —."""
    info = {"cpu": "CPU A", "logical_cpus": 8, "kernel_path": "avx2", "commit": "c", "date": "d"}
    figures = {"a": {"bandwidth": {"read ceiling (GB/s)": 20.5}, "vk": {"v(2)": 1.1, "c": None}},
               "b": {"bandwidth": {"read ceiling (GB/s)": 9.0}}}
    for name, nbs in figures.items():
        home = tmp_path / name
        home.mkdir()
        for nb, headline in nbs.items():
            (home / f"{nb}.json").write_text(json.dumps({"headline": headline}))
            (home / f"{nb}.html").write_text("report")
        entries = [{"notebook": nb, "status": "ok", "html": f"{nb}.html"} for nb in nbs]
        entries += [{"notebook": "gamma", "status": "failed", "error": "boom"}] if name == "b" else []
        runner.write_index(home, entries, "p", {**info, "cpu": f"CPU {name}"})
    page = cluster.write_machines_index(tmp_path, "p").read_text()
    a, b = _row(page, "a"), _row(page, "b")
    assert "<td>20.5</td>" in a and "<td>1.1</td>" in a and "CPU a" in a
    assert "<td>9.0</td>" in b and "gamma: boom" in b
    assert re.findall(r"<td>([^<]*)</td>", b).count("—") >= 3           # b's vk report, v(2) and c
    assert page.index(">bandwidth<") < page.index(">vk<") < page.index(">gamma<")
    assert "2 machine(s)" in page
