"""`lab run --scheduler`: the study fanned out over a Dask cluster, and `lab worker`.

Each task is one notebook under one profile on one worker. Workers hold the resource
machine=1 and every task asks for it, so two benchmarks never share a machine. The task
runs `runner.run_one` into a scratch folder on the worker and returns the files as bytes;
the client stages them into outputs/<profile>/<machine>/ and renames, so nothing partial
replaces a good report. Before any work each worker is asked for its project commit and
native-source hash; a worker that differs from the client is refused, and each task checks
again. machines.html, one row per machine, is rebuilt from the per-machine JSON.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import fcntl
import hashlib
import html
import json
import logging
import re
import shutil
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import dask
from distributed import Client, LocalCluster, Nanny, get_worker

from . import native, profiles, runner
from .errors import LabError
from .files import write_text_atomic
from .machine import commit, machine

CONNECT_TIMEOUT = 5          # seconds: an unreachable scheduler is an error this soon
LOCAL_WORKERS = 2            # `--scheduler local` without :N
LOCAL_START_TIMEOUT = 120    # seconds for a LocalCluster's processes to join on a busy machine
RESOURCES = {"machine": 1}   # every worker holds one machine, every task takes it
GATHER_TIMEOUT = 300         # seconds to bring a finished task's files back
_POLL = 0.5                  # seconds between looks at the futures and the workers alive
# Dask caps these at 1 in the processes its nanny starts; the engine and torch in the
# notebooks should see every CPU, as they do under a plain `lab run`.
_THREAD_CAPS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# machines.html columns in the order one reads a machine: its ceiling, its costs, then speedups
FIRST = ("bandwidth", "vk", "gamma", "policy", "threads", "quant_ppl", "distill")


class ClusterError(LabError):
    """The scheduler cannot be reached, has no workers, or no worker can take the work."""


# ----------------------------------------------------------------------------
# Who a worker is: the commit and native sources it would run
# ----------------------------------------------------------------------------

def source_hash() -> str:
    """A hash of kernels_cpp/ alone: unlike the build key, the compiler and flags may differ per machine."""
    h = hashlib.sha256()
    for p in native._sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def identity() -> dict:
    return {"commit": commit(), "native": source_hash()}


def refusal(name: str, client: dict, worker: dict) -> str | None:
    """Why the worker named name may not run the client's work (None: it may), both sides named."""
    words = {"commit": "project commit", "native": "native-source hash"}
    diffs = [f"{words[k]} {worker[k]} (worker) against {client[k]} (client)" for k in words if worker[k] != client[k]]
    if not diffs:
        return None
    return (f"machine {name} refused: {'; '.join(diffs)}; check out the client's commit there "
            f"(git checkout {client['commit']}) and restart lab worker")


# ----------------------------------------------------------------------------
# The worker's side
# ----------------------------------------------------------------------------

def _describe(client_id: dict, dask_worker=None) -> dict:
    """Runs on each worker before any work (client.run): its name, machine and refusal, if any."""
    name = str(dask_worker.name)
    return {"name": name, "machine": machine(), "refused": refusal(name, client_id, identity())}


def needed_models(params: dict) -> list[str]:
    """The registry models a notebook's parameters name (targets, drafts, model lists)."""
    from .models.registry import REGISTRY
    names = []
    for key in ("target", "draft", "models"):
        value = params.get(key)
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, str) and x in REGISTRY and x not in names:
                names.append(x)
    return names


def _fetch_models(nb: str, params: dict) -> None:
    """Fetches the models the notebook needs that are absent here, one fetch per host at a time
    (LocalCluster workers share a cache)."""
    from .models import registry
    full = {k: default for k, (default, _) in profiles.defaults(nb).items()} | params
    missing = [n for n in needed_models(full) if not registry.status(n)["present"]]
    if not missing:
        return
    registry.models_dir().mkdir(parents=True, exist_ok=True)
    with open(registry.models_dir() / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in missing:
            registry.fetch(name)


def _failed(nb: str, pname: str, error: str, machine_name: str | None) -> dict:
    return {"notebook": nb, "profile": pname, "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "status": "failed", "error": error[:500], "seconds": 0.0, "machine": machine_name}


def task(nb: str, params: dict, pname: str, client_id: dict) -> dict:
    """One notebook on this worker -> {machine, entry, files: name -> bytes}."""
    name = str(get_worker().name)
    why = refusal(name, client_id, identity())      # a worker may have changed since the pre-flight
    if why:
        return {"machine": name, "entry": _failed(nb, pname, why, name), "files": {}}
    try:
        _fetch_models(nb, params)
    except LabError as e:
        return {"machine": name, "entry": _failed(nb, pname, f"fetching its models: {e}", name), "files": {}}
    scratch = Path(tempfile.mkdtemp(prefix="lab-task-"))
    try:
        entry = runner.run_one(nb, params, scratch, pname)
        files = {f.name: f.read_bytes() for f in scratch.iterdir() if f.is_file()}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"machine": name, "entry": {**entry, "machine": name}, "files": files}


def notebook_kernels() -> list:
    """This process's live notebook kernels (psutil processes)."""
    import psutil
    kernels = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):          # gone, or a zombie, since the listing
            if p.status() != psutil.STATUS_ZOMBIE and "ipykernel" in " ".join(p.cmdline()):
                kernels.append(p)
    return kernels


def _stop_notebooks() -> int:
    """Kills this worker's notebook kernels: a cancelled task's thread then ends at once."""
    import psutil
    kernels = notebook_kernels()
    for p in kernels:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return len(kernels)


# ----------------------------------------------------------------------------
# Connecting: a scheduler's address, or a LocalCluster on the loopback
# ----------------------------------------------------------------------------

def local_workers(scheduler: str) -> int | None:
    """N for "local" or "local:N" (None: an address); the CLI checks N before this."""
    if scheduler == "local":
        return LOCAL_WORKERS
    if scheduler.startswith("local:"):
        return int(scheduler.split(":", 1)[1])
    return None


def _unreachable(address: str, e: BaseException) -> ClusterError:
    reason = "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    return ClusterError(f"cannot reach the Dask scheduler at {address} within {CONNECT_TIMEOUT} s: {reason}")


def _nanny_config() -> dict:
    """Dask's nanny settings with the thread caps dropped (None: not set)."""
    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
    return {"distributed.nanny.pre-spawn-environ": env | dict.fromkeys(_THREAD_CAPS)}


class _Loopback(LocalCluster):
    """A LocalCluster whose workers are named local-0, local-1, ...: each is one "machine"."""

    def _new_worker_name(self, worker_number):
        return f"local-{worker_number}"


def local_cluster(n: int) -> LocalCluster:
    """n worker processes on 127.0.0.1, each one machine with one Dask thread; a worker that
    dies mid-task costs that task one retry (allowed_failures=1), not Dask's default three."""
    with dask.config.set(_nanny_config()):         # each nanny reads it as it starts
        cluster = _Loopback(n_workers=0, processes=True, threads_per_worker=1, host="127.0.0.1",
                            dashboard_address=None, resources=RESOURCES, silence_logs=logging.ERROR,
                            scheduler_kwargs={"allowed_failures": 1})
        try:
            cluster.scale(n)
            cluster.wait_for_workers(n, timeout=LOCAL_START_TIMEOUT)
        except BaseException:
            cluster.close()
            raise
    return cluster


@contextlib.contextmanager
def connect(scheduler: str):
    """A Client on the scheduler (local[:N]: a LocalCluster started here), closed with its
    cluster on the way out, Ctrl-C included."""
    n = local_workers(scheduler)
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(local_cluster(n)) if n else None
        address = cluster.scheduler_address if cluster else scheduler
        try:
            client = stack.enter_context(Client(address, timeout=CONNECT_TIMEOUT))
        except (OSError, TimeoutError) as e:
            raise _unreachable(address, e) from None
        try:
            client.wait_for_workers(1, timeout=CONNECT_TIMEOUT)
        except TimeoutError:
            raise ClusterError(f"the Dask scheduler at {address} has no workers: start one on each machine "
                               f"with `lab worker {address}`") from None
        yield client


# ----------------------------------------------------------------------------
# The client's side
# ----------------------------------------------------------------------------

@dataclass
class _Job:
    notebook: str
    allowed: set[str]            # worker addresses it may run on
    machine: str | None          # the machine it is pinned to (--on each)


def _preflight(client: Client, me: dict) -> tuple[dict[str, dict], dict[str, dict]]:
    """Asks every worker who it is -> (accepted, refused), each address -> its description."""
    answers = client.run(_describe, me, on_error="return")
    accepted, refused = {}, {}
    for addr, a in answers.items():
        if isinstance(a, BaseException):
            a = {"name": addr, "machine": None, "refused": f"machine at {addr} did not answer: {a}"}
        (refused if a["refused"] else accepted)[addr] = a
        if a["refused"]:
            print(f"lab: {a['refused']}", file=sys.stderr, flush=True)
    return accepted, refused


def _submit(client: Client, names: list[str], params: dict, pname: str, me: dict,
            accepted: dict[str, dict], on: str) -> dict:
    """-> future -> _Job. each: one task per machine and notebook, pinned; any: one per notebook,
    on any accepted machine, retried once (a worker that joined since is not trusted)."""
    jobs = {}
    for nb in names:
        targets = [[addr] for addr in accepted] if on == "each" else [list(accepted)]
        for addrs in targets:
            pinned = accepted[addrs[0]]["name"] if on == "each" else None
            key = f"{nb}@{pinned or 'any'}-{uuid.uuid4().hex[:8]}"
            f = client.submit(task, nb, params[nb], pname, me, key=key, workers=addrs, allow_other_workers=False,
                              resources=RESOURCES, retries=0 if on == "each" else 1, pure=False)
            jobs[f] = _Job(nb, set(addrs), pinned)
    return jobs


def _folder(name: str) -> str:
    """A machine's name as a folder name."""
    return re.sub(r"[^\w.-]", "_", name) or "_"


def _save(out: Path, entry: dict, files: dict, pname: str, info: dict | None) -> None:
    """Stages a task's files beside the machine's folder and renames them in (the page last),
    then adds its row to the machine's own index."""
    home = out / _folder(entry["machine"])
    home.mkdir(parents=True, exist_ok=True)
    if files:
        stage = home / ".staging" / entry["notebook"]
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        for name, data in files.items():
            (stage / Path(name).name).write_bytes(data)
        runner.install(stage, home)
        shutil.rmtree(home / ".staging", ignore_errors=True)
    runner.write_index(home, [entry], pname, info)


def _killed_on(e: BaseException) -> str | None:
    """The machine a KilledWorker last ran on."""
    name = getattr(getattr(e, "last_worker", None), "name", None)
    return None if name is None else str(name)


def _outcome(client: Client, f, job: _Job, pname: str) -> tuple[dict, dict]:
    """A future that is done, or whose machines all left -> (entry, files)."""
    if f.status == "finished":
        try:
            r = f.result(timeout=GATHER_TIMEOUT)
            return r["entry"], r["files"]
        except TimeoutError:
            why = "its results were lost with its machine before they came back"
    elif f.status == "error":
        e = f.exception()
        where = _killed_on(e)
        why = (f"its worker died on every try, the last on {where}" if where else f"{type(e).__name__}: {e}")
        return _failed(job.notebook, pname, why, job.machine or where), {}
    else:
        why = (f"machine {job.machine} left the cluster mid-notebook (its worker died)" if job.machine
               else "every accepted machine left the cluster before it finished")
    client.cancel(f)
    return _failed(job.notebook, pname, why, job.machine), {}


def _alive(client: Client) -> set[str] | None:
    """The workers the scheduler holds now, or None when it did not answer: the client's cached
    view, which scheduler_info() falls back to then, lists no workers, so every machine would
    read as gone."""
    try:
        return set(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
    except OSError:
        return None


def _collect(client: Client, jobs: dict, out: Path, pname: str, infos: dict[str, dict]) -> list[dict]:
    """Saves each result as it comes; a job whose machines have all left is failed, not waited on."""
    entries, total = [], len(jobs)
    while jobs:
        alive = _alive(client)
        for f, job in list(jobs.items()):
            if not f.done() and (alive is None or job.allowed & alive):
                continue
            del jobs[f]
            entry, files = _outcome(client, f, job, pname)
            entries.append(entry)
            if entry["machine"] is not None:
                _save(out, entry, files, pname, infos.get(entry["machine"]))
            error = f": {entry['error']}" if entry["status"] != "ok" else ""
            print(f"[{len(entries)}/{total}] {entry['notebook']} on {entry['machine'] or '?'}: "
                  f"{entry['status']} in {entry.get('seconds', 0)} s{error}", file=sys.stderr, flush=True)
        if jobs:
            time.sleep(_POLL)
    return entries


def _cancel(client: Client, jobs: dict) -> None:
    """Ctrl-C: cancels what is left and stops the notebooks already running, so no machine is left busy."""
    client.cancel(list(jobs))
    used = sorted(set().union(*(job.allowed for job in jobs.values()))) if jobs else []
    with contextlib.suppress(Exception):
        client.run(_stop_notebooks, workers=used, on_error="return")


def run(selected: list[str] | None, profile: str = "quick", overrides: dict | None = None,
        out_dir: str | None = None, scheduler: str = "local", on: str = "any") -> tuple[Path, list[dict]]:
    """The notebooks on the cluster -> (machines.html, this run's entries)."""
    names = selected or profiles.notebooks()
    params = profiles.load(profile, names, overrides)       # every profile error before connecting
    pname = Path(profile).stem
    out = runner.output_dir(pname, out_dir)
    with connect(scheduler) as client:
        me = identity()                     # just before the workers are asked: a local cluster shares this tree
        accepted, refused = _preflight(client, me)
        if not accepted:
            raise ClusterError("no worker can take the work: " + "; ".join(a["refused"] for a in refused.values()))
        entries = _refuse(out, names, pname, refused) if on == "each" else []
        infos = {a["name"]: a["machine"] for a in accepted.values()}
        print(f"lab: {len(names)} notebook(s) on {len(accepted)} machine(s) ({', '.join(sorted(infos))}), "
              f"--on {on}", file=sys.stderr, flush=True)
        jobs = _submit(client, names, params, pname, me, accepted, on)
        try:
            entries += _collect(client, jobs, out, pname, infos)
        except KeyboardInterrupt:
            _cancel(client, jobs)
            raise
        finally:
            page = write_machines_index(out, pname)
    return page, entries


def _refuse(out: Path, names: list[str], pname: str, refused: dict[str, dict]) -> list[dict]:
    """--on each: a refused machine's notebooks are marked failed with the reason, in its own index."""
    entries = []
    for a in refused.values():
        for nb in names:
            entries.append(_failed(nb, pname, a["refused"], a["name"]))
            if a["machine"]:                    # one that did not answer has no machine to file it under
                _save(out, entries[-1], {}, pname, a["machine"])
    return entries


# ----------------------------------------------------------------------------
# machines.html: one row per machine, from each machine's own JSON
# ----------------------------------------------------------------------------

def _machine_rows(out: Path) -> list[dict]:
    """Each machine folder's index.json, with each notebook's headline from its results JSON."""
    rows = []
    for idx in sorted(out.glob("*/index.json")):
        data = json.loads(idx.read_text())
        if not isinstance(data.get("machine"), dict):
            continue
        home = idx.parent
        figures = {}
        for e in data["entries"]:
            results = home / f"{e['notebook']}.json"
            figures[e["notebook"]] = json.loads(results.read_text()).get("headline", {}) if results.exists() else {}
        rows.append({"name": home.name, "machine": data["machine"], "entries": {e["notebook"]: e for e in data["entries"]},
                     "figures": figures, "reports": {nb for nb in figures if (home / f"{nb}.html").exists()}})
    return rows


def _columns(rows: list[dict]) -> dict[str, list[str]]:
    """notebook -> its headline keys over every machine, the notebooks in FIRST's order."""
    cols: dict[str, list[str]] = {}
    for r in rows:
        for nb in r["entries"]:
            keys = cols.setdefault(nb, [])
            keys += [k for k in r["figures"].get(nb, {}) if k not in keys]
    order = sorted(cols, key=lambda nb: (FIRST.index(nb) if nb in FIRST else len(FIRST), nb))
    return {nb: cols[nb] for nb in order}


def _cell(value) -> str:
    return "—" if value is None or value == "" else html.escape(str(value))


def _report_cell(r: dict, nb: str) -> str:
    """That machine's report of the notebook: a link, failed (with its last good report), or —."""
    e, link = r["entries"].get(nb), f"{html.escape(_folder(r['name']))}/{html.escape(nb)}.html"
    if e is None:
        return "—"
    if e["status"] == "ok":
        return f"<a href='{link}'>report</a>"
    last = f" (<a href='{link}'>last good</a>)" if nb in r["reports"] else ""
    return f"<span style='color:#b00' title='{html.escape(e.get('error', ''))}'>failed</span>{last}"


def _row(r: dict, cols: dict[str, list[str]]) -> str:
    m = r["machine"]
    cells = [f"<a href='{html.escape(_folder(r['name']))}/index.html'>{html.escape(r['name'])}</a>",
             _cell(m.get("cpu")), _cell(m.get("logical_cpus")), _cell(m.get("kernel_path")), _cell(m.get("commit"))]
    for nb, keys in cols.items():
        cells.append(_report_cell(r, nb))
        cells += [_cell(r["figures"].get(nb, {}).get(k)) for k in keys]
    failures = [f"{nb}: {e.get('error', '')}" for nb, e in r["entries"].items() if e["status"] != "ok"]
    cells.append("<br>".join(html.escape(x) for x in failures) or "—")
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def write_machines_index(out: Path, profile: str) -> Path:
    """out/machines.html from out/<machine>/index.json and its notebooks' JSON: the same page
    whether one machine ran or ten; a figure a machine lacks shows as —."""
    rows = _machine_rows(out)
    cols = _columns(rows)
    fixed = "".join(f"<th rowspan=2>{h}</th>" for h in ("machine", "CPU", "logical CPUs", "kernel path", "commit"))
    groups = "".join(f"<th colspan={len(keys) + 1}>{html.escape(nb)}</th>" for nb, keys in cols.items())
    keys = "".join("<th>report</th>" + "".join(f"<th>{html.escape(k)}</th>" for k in ks) for ks in cols.values())
    page = f"""<!DOCTYPE html><html><head><meta charset="utf-8"><title>lab — {html.escape(profile)}, by machine</title>
<style>{runner.STYLE}body{{max-width:none}}th{{white-space:nowrap}}</style></head><body>
<h1>Speculative decoding on a CPU — profile <i>{html.escape(profile)}</i>, {len(rows)} machine(s)</h1>
<p>Each machine's figures come from its own reports under this folder; — marks a figure it lacks.</p>
<table><tr>{fixed}{groups}<th rowspan=2>failures</th></tr><tr>{keys}</tr>
{''.join(_row(r, cols) for r in rows)}</table></body></html>"""
    write_text_atomic(out / "machines.html", page)
    return out / "machines.html"


# ----------------------------------------------------------------------------
# lab worker
# ----------------------------------------------------------------------------

async def _reachable(address: str) -> None:
    from distributed.comm import connect as comm_connect
    try:
        comm = await comm_connect(address, timeout=CONNECT_TIMEOUT)
    except (OSError, TimeoutError) as e:
        raise _unreachable(address, e) from None
    await comm.close()


async def _serve(address: str, name: str) -> None:
    """One nanny, one worker process, one Dask thread, the machine resource; until it ends or a signal."""
    from distributed._signals import wait_for_signals
    await _reachable(address)
    async with Nanny(address, nthreads=1, resources=RESOURCES, name=name) as nanny:
        ended = [asyncio.ensure_future(nanny.finished()), asyncio.ensure_future(wait_for_signals())]
        _, pending = await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()


def serve(address: str, name: str | None = None) -> int:
    """`lab worker ADDRESS`: builds the native library first (a build error shows here, not in
    the first task), says who it is, then serves the scheduler."""
    native.build()
    me, name = identity(), name or socket.gethostname()
    print(f"lab worker {name}: commit {me['commit']}, native-source hash {me['native']}; joining {address}",
          file=sys.stderr, flush=True)
    with dask.config.set(_nanny_config()):
        asyncio.run(_serve(address, name))
    return 0


def _dask_ssh_worker(argv: list[str]) -> int:
    """`dask ssh --remote-dask-worker lab.cluster` starts `python -m lab.cluster HOST:PORT` with
    dask worker's flags: a lab worker instead, named after its host (its thread count ignored)."""
    import argparse
    from . import cli
    p = argparse.ArgumentParser(prog="python -m lab.cluster")
    p.add_argument("address")
    p.add_argument("--nworkers", default="1")
    args, _ = p.parse_known_args(argv)
    if args.nworkers != "1":
        print("lab: error: a lab worker is one process a machine: drop dask ssh's --nworkers", file=sys.stderr)
        return 2
    return cli.main(["worker", args.address])


if __name__ == "__main__":
    sys.exit(_dask_ssh_worker(sys.argv[1:]))
