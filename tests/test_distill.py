"""Distillation on tiny models: decontamination, the held-out split, the answer cache that
resumes, a training run that lowers the loss and raises agreement with the teacher (every
method), and a checkpoint that resumes to the same state."""
import json

import numpy as np
import pytest
import torch

from lab.distill import data, teacher
from lab.distill import train as train_module
from lab.distill.student import Student
from lab.distill.train import TrainConfig, batch_at, lr_at, train
from lab.engine import Engine
from lab.kernels import Pool
from lab.models import TINY, tiny_weights
from lab.models import export as ex

NAME = "tiny-qwen2"


def test_thirteen_gram_decontamination():
    dev = json.loads(data.specbench.DATA.read_text().splitlines()[0])["turns"][0]
    words = dev.split()
    assert len(words) >= 14
    banned = data.specbench_ngrams()
    copy13 = data.Prompt("a", "x", "Please help. " + " ".join(words[:13]) + " thanks")
    copy12 = data.Prompt("b", "x", "Please help. " + " ".join(words[:12]) + " thanks")
    shouty = data.Prompt("c", "x", " ".join(words[:13]).upper().replace(" ", ",  "))  # case and punctuation
    kept, dropped = data.decontaminate([copy13, copy12, shouty], banned)
    assert [p.id for p in dropped] == ["a", "c"] and [p.id for p in kept] == ["b"]


def test_sources_and_split_are_stable():
    sel = data.select(("stdlib-text", "math"), per_source=20, seed=3)
    assert len(sel["prompts"]) == 40 and sel["available"]["math"] == 120
    assert [p.id for p in sel["prompts"]] == [p.id for p in data.select(("stdlib-text", "math"), 20, 3)["prompts"]]
    train_a, held_a = data.split(sel["prompts"], 0.25)
    train_b, held_b = data.split(sel["prompts"][:30], 0.25)
    assert {p.id for p in held_b} <= {p.id for p in held_a}                 # growing the set keeps the split
    assert 0 < len(held_a) < 20 and len(train_a) + len(held_a) == 40
    with pytest.raises(ValueError, match="unknown prompt source"):
        data.select(("wikipedia",))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill")
    c = TINY[NAME]
    pool = Pool(min(2, len(__import__("os").sched_getaffinity(0))))
    tw, sw = tiny_weights(c, seed=1), tiny_weights(c, seed=2)
    target = Engine(ex.export(c, tw, d / "t.lab", "q8"), pool=pool, max_context=512)
    stock = Engine(ex.export(c, sw, d / "s.lab", "q8"), pool=pool, max_context=512)
    prompts = [data.Prompt(f"p{i}", "math", t.text) for i, t in enumerate(data.math_problems(24, seed=5))]
    samples = data.answers(target, NAME, prompts, 24, cache=d / "answers.jsonl", progress=False)
    its = teacher.items(samples, target, stock, k=16, cache=d / "teacher", progress=False)
    return {"dir": d, "config": c, "student_weights": sw, "items": its, "target": target, "prompts": prompts}


class _Counting:
    """The target engine, counting the answers it generates."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def generate(self, ids, max_new_tokens):
        self.calls += 1
        return self.engine.generate(ids, max_new_tokens)


def test_answers_resume_after_an_interruption(setup, tmp_path):
    cache = tmp_path / "a.jsonl"
    full = data.answers(setup["target"], NAME, setup["prompts"][:6], 24, cache=cache, progress=False)
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])          # cut off mid-line
    resumed = _Counting(setup["target"])
    again = data.answers(resumed, NAME, setup["prompts"][:6], 24, cache=cache, progress=False)
    assert resumed.calls == 3                                 # the last three only: a restart answers all six
    assert [s.answer for s in again] == [s.answer for s in full]
    assert cache.read_text().splitlines() == lines            # the torn line gone, not glued to the next
    assert len(full) == 6 and all(len(s.answer) == 24 for s in full)


def test_teacher_items_follow_the_target(setup):
    it = setup["items"][0]
    logits = teacher.teacher_forced(setup["target"], it.tokens[:it.start + 1], it.tokens[it.start + 1:] + [0])
    assert (it.teacher.ids[:, 0].numpy() == logits.argmax(-1)).all()              # greedy answer = teacher top-1
    assert (it.teacher.next_token == it.teacher.ids[:, 0]).all()


@pytest.mark.parametrize("method,lr,qat", [("full", 3e-3, None), ("frozen-emb", 3e-3, None), ("lora", 1e-2, None),
                                           ("full", 3e-3, "q4-q8out"), ("scales", 3e-2, "q4-q8out")])
def test_training_lowers_loss_and_raises_agreement(setup, method, lr, qat):
    its = setup["items"]
    cfg = TrainConfig(loss="weighted", method=method, lr=lr, steps=30, batch=4, warmup=3, eval_every=30,
                      checkpoint_every=100, device="cpu", qat=qat)
    student = Student(setup["config"], setup["student_weights"], method, rank=8, qat=qat)
    run = train(student, its[:20], its[20:], cfg, progress=False)
    first, last = run.history[0], run.history[-1]
    assert last["held_loss"] < 0.8 * first["held_loss"], (first, last)
    assert last["alpha_greedy"] > first["alpha_greedy"] + 0.1, (first, last)
    assert last["alpha_on_stock_misses"] > first["alpha_on_stock_misses"], (first, last)


def test_checkpoint_resumes_to_the_same_state(setup, tmp_path, monkeypatch):
    its = setup["items"]
    cfg = TrainConfig(loss="fkl", method="lora", lr=1e-2, steps=6, batch=2, warmup=2, eval_every=3,
                      checkpoint_every=1, device="cpu")
    straight = train(Student(setup["config"], setup["student_weights"], "lora", rank=4), its[:20], its[20:], cfg,
                     progress=False)
    ck = tmp_path / "ck.pt"
    train(Student(setup["config"], setup["student_weights"], "lora", rank=4), its[:20], its[20:], cfg, ck,
          stop_at=4, progress=False)
    steps = []                                                # the steps the resumed run takes
    monkeypatch.setattr(train_module, "lr_at", lambda cfg, step: (steps.append(step), lr_at(cfg, step))[1])
    resumed = train(Student(setup["config"], setup["student_weights"], "lora", rank=4), its[:20], its[20:], cfg, ck,
                    progress=False)
    assert steps == [4, 5]                                    # a restart would take all six
    for n, t in straight.student.trainable().items():
        assert torch.equal(t, resumed.student.trainable()[n]), n
    strip = lambda hist: [{k: v for k, v in h.items() if k != "seconds"} for h in hist]
    assert strip(resumed.history) == strip(straight.history)
    with pytest.raises(ValueError, match="other settings"):
        train(Student(setup["config"], setup["student_weights"], "lora", rank=4), its[:20], its[20:],
              TrainConfig(loss="ce", method="lora", steps=6, batch=2), ck, progress=False)


def test_schedule_and_order():
    cfg = TrainConfig(lr=1.0, warmup=4, steps=20, batch=3, seed=1)
    assert [lr_at(cfg, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cfg, 19) < 0.01 and lr_at(cfg, 12) == pytest.approx(0.5)
    seen = [i for s in range(4) for i in batch_at(cfg, 6, s)]            # two epochs of six
    assert sorted(seen[:6]) == list(range(6)) and sorted(seen[6:]) == list(range(6))


def test_merged_lora_exports_what_trained(setup, tmp_path):
    c = setup["config"]
    s = Student(c, setup["student_weights"], "lora", rank=4)
    with torch.no_grad():
        for a, b in s.lora.values():
            b.normal_(0, 0.05)
    ids = setup["items"][0].tokens
    with torch.no_grad():
        want = s.hidden(ids) @ s.output_matrix.T
    from lab.models.reference import Reference
    got = Reference(c, s.merged_weights()).forward(ids, 0)[:, :c.tokenizer_size]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_evaluation_against_the_engine(setup):
    """agreement(): the stock draft against itself agrees everywhere; simulated rounds are
    the engine's; summarize() pools positions; speedups() checks outputs and picks a best γ."""
    from lab.distill import evaluate
    t = setup["target"]
    samples = data.answers(t, NAME, setup["prompts"][:4], 24, cache=setup["dir"] / "answers.jsonl", progress=False)
    drafts = {"stock": t, "same": t}
    rows = evaluate.agreement(t, drafts, samples, gammas=(1, 3))
    assert all(r["matches"] == r["positions"] and r["stock_misses"] == 0 for r in rows)
    table = evaluate.summarize(rows, gammas=(1, 3))
    overall = [r for r in table if r["group"] == "overall"]
    assert [r["tau_3"] for r in overall] == [pytest.approx(96 / 24)] * 2           # 4 answers of 24 tokens, 6 rounds each
    meas = evaluate.speedups(t, {"self": t, "lookup": "lookup"}, [(s.source, s.prompt) for s in samples[:2]], (1, 2), 16)
    assert len(meas) == 2 * 2 * 2 and all(r["speedup"] > 0 for r in meas)
    best = {b["draft"]: b for b in evaluate.best_speedups(meas)}
    geo = {g: np.exp(np.mean(np.log([r["speedup"] for r in meas if r["draft"] == "self" and r["gamma"] == g])))
           for g in (1, 2)}
    assert best["self"]["best γ"] == max(geo, key=geo.get)
    assert best["self"]["speedup"] == pytest.approx(max(geo.values()))
    assert best["self"]["tokens_per_round"] > 1.9


def test_best_speedups_by_hand():
    """γ is chosen by geometric mean: γ = 1's speedups 1 and 4 average 2.5 but multiply out
    to 2, under γ = 2's steady 2.2."""
    from lab.distill import evaluate
    rows = [{"draft": "d", "gamma": g, "speedup": s, "tokens_per_round": g + 1.0, "acceptance": a}
            for g, s, a in ((1, 1.0, 0.2), (1, 4.0, 0.4), (2, 2.2, 0.6), (2, 2.2, 0.8))]
    (best,) = evaluate.best_speedups(rows)
    assert best["best γ"] == 2 and best["speedup"] == pytest.approx(2.2)
    assert best["tokens_per_round"] == 3.0 and best["acceptance"] == pytest.approx(0.7)


def test_summarize_by_hand():
    from lab.distill import evaluate
    rows = [{"group": "a", "draft": "stock", "positions": 10, "matches": 5, "beta": 6.0, "stock_misses": 5,
             "miss_matches": 0, "rounds_2": 6},
            {"group": "b", "draft": "stock", "positions": 30, "matches": 27, "beta": 24.0, "stock_misses": 3,
             "miss_matches": 0, "rounds_2": 12}]
    s = {r["group"]: r for r in evaluate.summarize(rows, gammas=(2,))}
    assert s["overall"]["alpha_greedy"] == 32 / 40 and s["overall"]["alpha_sampled"] == 30 / 40
    assert s["overall"]["tau_2"] == 40 / 18 and s["a"]["tau_2"] == 10 / 6


def test_quantization_aware_student_is_the_twin(setup):
    """Under qat the student computes what the twin computes (bar the twin's fp16 KV cache),
    and gradients pass the rounding straight through to the fp32 weights."""
    from lab.models.twin import Twin
    c, w = setup["config"], setup["student_weights"]
    ids = setup["items"][0].tokens
    for method in ("full", "lora"):
        s = Student(c, w, method, rank=4, qat="q4-q8out")
        logits = s.hidden(ids) @ s.output_matrix.T
        twin = Twin(c, w, "q4-q8out").forward(ids, 0)[:, :c.tokenizer_size]
        assert (logits.argmax(-1) == twin.argmax(-1)).float().mean() > 0.95
        assert (logits - twin).abs().max() < 0.05 * twin.abs().max()
        logits.logsumexp(-1).sum().backward()
        grads = [t.grad for t in s.trainable().values()]
        assert sum(int(g is not None and bool(g.abs().sum() > 0)) for g in grads) >= len(grads) // 2


@pytest.mark.parametrize("method", ["scales", "full"])
def test_quantized_students_export_exactly_what_they_computed(setup, method):
    """Under qat the exported weights re-quantize to the very values the student trained
    through (codes and fp16 scales), so the engine runs the trained draft, not a rounding of it."""
    from lab.models.twin import fake_quant_weight, tensor_format
    c = setup["config"]
    s = Student(c, setup["student_weights"], method, qat="q4-q8out")
    with torch.no_grad():
        for t in s.trainable().values():
            t.mul_(1 + 0.01 * torch.randn_like(t))
    s.refresh()
    merged = s.merged_weights()
    for n, w in merged.items():
        fmt = tensor_format(n, "q4-q8out")
        if fmt != "f32":
            assert torch.equal(fake_quant_weight(w, fmt), w), n
    with pytest.raises(ValueError, match="qat"):
        Student(c, setup["student_weights"], "scales")


def test_simulator_check_reproduces_the_engine_rounds(setup, tmp_path):
    from lab.distill import evaluate
    t = setup["target"]
    c = setup["config"]
    # a draft that half agrees: the student's weights moved part way to the target's
    tw = tiny_weights(c, seed=1)
    mix = {n: 0.7 * w + 0.3 * setup["student_weights"][n] for n, w in tw.items()}
    d = Engine(ex.export(c, mix, tmp_path / "d.lab", "q8"), pool=t.pool, max_context=512)
    samples = data.answers(t, NAME, setup["prompts"][:4], 24, cache=setup["dir"] / "answers.jsonl", progress=False)
    rows = evaluate.agreement(t, {"stock": d}, samples, gammas=(1, 3))
    assert 0 < sum(r["matches"] for r in rows) < sum(r["positions"] for r in rows)
    meas = evaluate.speedups(t, {"stock": d}, [(s.source, s.prompt) for s in samples], (1, 3), 24)
    check = evaluate.simulator_check(rows, meas)
    assert check["rounds"] > 20 and check["equal"] == check["rounds"]


def test_a_draft_from_another_family_is_refused_before_any_work(setup, tmp_path):
    from lab.distill import pipeline
    c = TINY["tiny-llama"]
    other = Engine(ex.export(c, tiny_weights(c), tmp_path / "llama.lab", "q8"), pool=setup["target"].pool)
    with pytest.raises(ValueError, match="vocabulary"):
        pipeline.prepare(setup["target"], NAME, other, ["math"], 4, 0.2, 8, 64, 8)
