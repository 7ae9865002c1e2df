"""The engine: the f32 engine follows the reference layer by layer; the quantized engine
tracks its twin; a k-token pass equals k single-token passes bit for bit; greedy
speculative output equals plain greedy output bit for bit; the acceptance rule samples
the target's distribution; bad requests are Python exceptions."""
import ctypes
import ctypes.util
import dataclasses
import math

import numpy as np
import pytest
import torch

from lab import native
from lab.engine import Engine, EngineError
from lab.kernels import Pool
from lab.models import TINY, tiny_weights
from lab.models import export as ex
from lab.models.twin import Twin

from .conftest import path_attention, simd_paths

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Weights files of the tiny models: name -> scheme -> path."""
    d = tmp_path_factory.mktemp("models")
    out = {}
    for name, c in TINY.items():
        w = tiny_weights(c, seed=1)
        out[name] = {s: ex.export(c, w, d / f"{name}-{s}.lab", s) for s in ("f32", "q8", "q4", "q4-q8out")}
    out["tiny-v16-draft"] = {"f32": ex.export(TINY["tiny-v16"], tiny_weights(TINY["tiny-v16"], seed=7),
                                              d / "v16-draft.lab", "f32")}
    return out


@pytest.fixture(scope="module")
def pool():
    return Pool(min(2, len(__import__("os").sched_getaffinity(0))))


def prompts(c, n=6, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, c.tokenizer_size, int(rng.integers(1, 40))).tolist() for _ in range(n)]


# ----------------------------------------------------------------------------
# Against the reference and the twin
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["scalar"] + simd_paths())
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen2", "tiny-llama"])
def test_f32_engine_follows_the_reference(files, pool, name, path):
    """Every layer within float32 rounding of the reference (with the engine's fp16 KV
    cache, or its bf16 one), and identical greedy tokens, on every path (attention at 256
    and 512 bits)."""
    c = TINY[name]
    e = Engine(files[name]["f32"], pool=pool, max_context=256, path=path)
    ref = Twin(c, tiny_weights(c, seed=1), "f32", max_context=256, attention=e.attention)  # f32 weights
    # bf16 operands: a K or V value one float rounding from a bf16 boundary lands on either
    # side of it in the engine and the reference, one bf16 step (0.4%) apart
    tol = 1e-4 if e.attention == "f32" else 1e-3
    for p in prompts(c, 3):
        logits, hidden = e.forward(p, 0, hidden=True)
        want_h = []
        want = ref.forward(p, 0, hidden=want_h)
        for i, h in enumerate(want_h):
            np.testing.assert_allclose(hidden[i], h.numpy(), rtol=tol, atol=tol * float(h.abs().max()))
        np.testing.assert_allclose(logits, want[:, :c.tokenizer_size].numpy(), rtol=tol,
                                   atol=tol * float(want.abs().max()))
        assert e.generate(p, 40).tokens == ref.greedy(p, 40)


@pytest.mark.parametrize("scheme", ["q8", "q4-q8out"])
def test_quantized_engine_tracks_the_twin(files, pool, scheme):
    c = TINY["tiny-qwen2"]
    e = Engine(files["tiny-qwen2"][scheme], pool=pool, max_context=256)
    tw = Twin(c, tiny_weights(c, seed=1), scheme, max_context=256, attention=e.attention)
    same, agree, tvd, n = 0, 0, 0.0, 0
    ps = prompts(c, 8, seed=3)
    for p in ps:
        a = torch.from_numpy(e.forward(p, 0))
        b = tw.forward(p, 0)[:, :c.tokenizer_size]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        tvd += float(0.5 * (torch.softmax(a, -1) - torch.softmax(b, -1)).abs().sum(-1).sum())
        n += len(p)
        same += e.generate(p, 20).tokens == tw.greedy(p, 20)
    assert same >= 6, f"identical greedy continuations on only {same} of 8 prompts"
    assert agree / n > 0.95 and tvd / n < 0.03, (agree / n, tvd / n)


# ----------------------------------------------------------------------------
# Exactness
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("path,attention", path_attention())
@pytest.mark.parametrize("scheme", ["f32", "q8", "q4-q8out"])
def test_k_token_pass_equals_single_passes(files, scheme, path, attention):
    c = TINY["tiny-qwen3"]
    toks = prompts(c, 1, seed=5)[0] + list(range(40))
    for threads in sorted({1, min(2, len(__import__("os").sched_getaffinity(0)))}):
        e = Engine(files["tiny-qwen3"][scheme], threads=threads, max_context=256, path=path, attention=attention)
        e.forward(toks[:8], 0, logits="none")
        singles = np.stack([e.forward([t], 8 + j, logits="last") for j, t in enumerate(toks[8:24])])
        for k in range(1, 17):
            got = e.forward(toks[8:8 + k], 8)
            assert got.tobytes() == singles[:k].tobytes(), (threads, k)


@pytest.mark.parametrize("path,attention", path_attention())
def test_every_attention_split_keeps_every_bit(files, pool, path, attention):
    """Whichever split the tuner picks (att_split_k), and wherever the requests go (att_kv_l2_k),
    a k-token pass equals single passes: a row's numbers do not depend on the rows beside it in
    its task."""
    from lab import tune
    c = TINY["tiny-qwen3"]
    toks = prompts(c, 1, seed=6)[0] + list(range(40))
    e = Engine(files["tiny-qwen3"]["q4-q8out"], pool=pool, max_context=256, path=path, attention=attention)
    before = tune.current()
    try:
        cands = tune.candidates()
        for sets in [*cands["att_split_k"].values(), {"att_split_k": 2}, *cands["att_kv_l2_k"].values(),
                     {"att_kv_l2_k": 1, "att_split_k": 2}]:
            tune.apply({**before, **sets})
            e.forward(toks[:8], 0, logits="none")
            singles = np.stack([e.forward([t], 8 + j, logits="last") for j, t in enumerate(toks[8:24])])
            for k in range(1, 17):
                assert e.forward(toks[8:8 + k], 8).tobytes() == singles[:k].tobytes(), (sets, k)
    finally:
        tune.apply(before)


@pytest.mark.parametrize("path,attention", path_attention())
def test_attention_across_cache_blocks(files, pool, path, attention):
    """Scores over many blocks of the K cache, up to a last position inside a block (a
    max_context of 203, padded to 208): a k-token pass still equals single passes, and every
    path stays within float32 rounding of the scalar reference with the same products."""
    c, n = TINY["tiny-qwen3"], 203
    toks = (prompts(c, 1, seed=9)[0] * n)[:n]
    runs = {}
    for p in ("scalar", path):
        e = Engine(files["tiny-qwen3"]["f32"], pool=pool, max_context=n, path=p, attention=attention)
        e.forward(toks[:180], 0, logits="none")
        runs[p] = np.stack([e.forward([t], 180 + j, logits="last") for j, t in enumerate(toks[180:])])
        for at, k in ((180, 1), (180, 5), (180, 16), (196, 7)):
            got = e.forward(toks[at:at + k], at)
            assert got.tobytes() == runs[p][at - 180:at - 180 + k].tobytes(), (p, at, k)
    want = runs["scalar"]
    np.testing.assert_allclose(runs[path], want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("path,attention", path_attention())
@pytest.mark.parametrize("head_dim", [64, 128])
def test_qwen_wide_heads_k_token_pass_equals_single_passes(tmp_path, pool, path, attention, head_dim):
    """Heads as wide as Qwen's, 6 query heads a KV head (the tiny models' are 16 and 32 wide):
    a k-token pass equals single passes across value blocks and odd counts of positions, on
    every path within float32 rounding of the scalar reference."""
    c = dataclasses.replace(TINY["tiny-qwen3"], num_layers=1, num_heads=12, num_kv_heads=2, head_dim=head_dim)
    model = ex.export(c, tiny_weights(c, seed=2), tmp_path / "wide.lab", "f32")
    toks = (prompts(c, 1, seed=4)[0] * 200)[:200]
    runs = {}
    for p in ("scalar", path):
        e = Engine(model, pool=pool, max_context=200, path=p, attention=attention)
        e.forward(toks[:120], 0, logits="none")
        runs[p] = np.stack([e.forward([t], 120 + j, logits="last") for j, t in enumerate(toks[120:160])])
        for at, k in ((120, 1), (120, 8), (125, 16), (131, 9), (144, 16)):
            got = e.forward(toks[at:at + k], at)
            assert got.tobytes() == runs[p][at - 120:at - 120 + k].tobytes(), (p, at, k)
    tol = 1e-4 if attention == "f32" else 1e-3          # bf16 operands: see the test above
    np.testing.assert_allclose(runs[path], runs["scalar"], rtol=tol, atol=tol * float(np.abs(runs["scalar"]).max()))


@pytest.mark.parametrize("path,attention", path_attention())
def test_windowed_attention(files, pool, path, attention):
    """A windowed engine (sink 32, window 40): a k-token pass whose rows start their windows
    on different blocks still equals single passes; every path stays within float32
    rounding of the scalar reference; tokens outside every window the last token's two
    layers can reach leave its logits unchanged, while without the window they move them."""
    c, n = TINY["tiny-qwen3"], 200
    toks = (prompts(c, 1, seed=9)[0] * n)[:n]
    runs = {}
    for p in ("scalar", path):
        e = Engine(files["tiny-qwen3"]["f32"], pool=pool, max_context=n, path=p, attention=attention)
        e.set_window(40, sink=32)
        e.forward(toks[:100], 0, logits="none")
        runs[p] = np.stack([e.forward([t], 100 + j, logits="last") for j, t in enumerate(toks[100:])])
        for at, k in ((100, 1), (100, 16), (119, 13), (150, 5), (184, 16)):
            got = e.forward(toks[at:at + k], at)
            assert got.tobytes() == runs[p][at - 100:at - 100 + k].tobytes(), (p, at, k)
    want = runs["scalar"]
    np.testing.assert_allclose(runs[path], want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))

    e = Engine(files["tiny-qwen3"]["f32"], pool=pool, max_context=n, path=path, attention=attention)
    changed = toks[:40] + [(t + 1) % c.tokenizer_size for t in toks[40:96]] + toks[96:]
    full = [e.forward(t, 0, logits="last") for t in (toks, changed)]
    assert not np.array_equal(*full)
    e.set_window(40, sink=32)       # position 199 sees 160 on; the first layer there, 96 on
    assert np.array_equal(*(e.forward(t, 0, logits="last") for t in (toks, changed)))
    with pytest.raises(EngineError, match="multiple of 32"):
        e.set_window(40, sink=16)


@pytest.mark.parametrize("attention", [
    pytest.param(a, marks=pytest.mark.skipif(("avx512vnni", a) not in path_attention(), reason=f"no {a} on this CPU"))
    for a in ("bf16", "amx")])
def test_bf16_values_ignore_what_the_cache_holds_past_them(pool, tmp_path, attention):
    """The bf16 cache pairs positions, so an odd count of them reads a neighbour it does not
    see: an infinity a failed pass left there must not reach the outputs."""
    c = TINY["tiny-qwen2"]
    w = tiny_weights(c, seed=1)
    hot = 7
    w["model.embed_tokens.weight"][:, 0] = 0.0                # V's first value: 0 for every token ...
    w["model.embed_tokens.weight"][hot, 0] = 1000.0
    v = w["model.layers.0.self_attn.v_proj.weight"]
    v[0] = 0.0
    v[0, 0] = 6e37                                            # ... but infinite for `hot`
    e = Engine(ex.export(c, w, tmp_path / "hot.lab", "f32"), pool=pool, max_context=64, path="avx512vnni",
               attention=attention)
    toks = [1, 2, 3, 4, 5]
    want = e.forward(toks, 0)
    assert np.isfinite(want).all()
    with pytest.raises(EngineError, match="NaN, inf or value past"):
        e.forward([hot], len(toks))                           # leaves its infinite V at position 5
    assert e.forward(toks, 0).tobytes() == want.tobytes()


def test_every_split_gives_the_same_logits(files, pool):
    toks = prompts(TINY["tiny-qwen3"], 1, seed=3)[0] + list(range(20))
    e = Engine(files["tiny-qwen3"]["q4-q8out"], pool=pool, max_context=128)
    want = e.forward(toks, 0)                      # the default split: "auto"
    for split in (0, 1, 8, "guided", "redo", "auto"):
        e.set_chunk(split)
        assert e.forward(toks, 0).tobytes() == want.tobytes(), split
    from lab import tune
    before = tune.current()
    try:                                           # guided shares down to one tile even here
        tune.apply({**before, "guided_from_bytes": 0, "guided_min_bytes": 1})
        assert e.forward(toks, 0).tobytes() == want.tobytes()
    finally:
        tune.apply(before)
    for bad in (-8, "fast"):
        with pytest.raises(EngineError, match="split"):
            e.set_chunk(bad)


def test_redo_split_with_late_workers_gives_the_same_logits(files):
    """Under "redo", a worker slowed 16x still holds pieces when thread 0 has waited its few
    pieces' time for them: thread 0 computes them again and goes on while the worker is late,
    its commits refused. Every pass gives the one-thread logits bit for bit, and an engine
    freed while a worker may still be late waits for it (no crash)."""
    cpus = sorted(__import__("os").sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("a late worker needs a second CPU")
    # passes over different tokens by turns, so a late worker's piece of one would be wrong in the next
    runs = [prompts(TINY["tiny-qwen3"], 1, seed=s)[0] + list(range(24)) for s in (5, 6)]
    one = Engine(files["tiny-qwen3"]["q4-q8out"], pool=Pool(1), max_context=128)
    want = [one.forward(toks, 0).tobytes() for toks in runs]
    slow = Pool(2, cpus=cpus[:2]).slow(cpus[1], 16.0)
    from lab import tune
    before = tune.current()
    try:                                           # pieces of a tile, so the tiny matrices have several
        tune.apply({**before, "guided_min_bytes": 1})
        for _ in range(3):
            e = Engine(files["tiny-qwen3"]["q4-q8out"], pool=slow, max_context=128)
            e.set_chunk("redo")
            for i in range(8):
                assert e.forward(runs[i % 2], 0).tobytes() == want[i % 2], i
            del e
    finally:
        tune.apply(before)


def test_stage_profile_accounts_for_the_pass(files, pool):
    """Profiling times every stage of a pass without changing its logits; the stages cover
    the pass's time; their bytes add up to the bytes a pass reads."""
    import time
    from lab.protocol import forward_samples
    from lab.engine import STAGES
    e = Engine(files["tiny-qwen3"]["q4-q8out"], pool=pool, max_context=128)
    toks = np.arange(1, 17, dtype=np.int32)
    want = e.forward(toks, 0)
    e.profile(True)
    assert e.forward(toks, 0).tobytes() == want.tobytes()
    e.profile(True)                                        # cleared
    t0 = time.perf_counter()
    passes = forward_samples(e, toks, 0, reps=5)       # a warm-up pass, then 5 timed in C++
    wall = time.perf_counter() - t0
    secs = e.stage_seconds()
    assert list(secs) == list(STAGES)
    assert all(secs[s] > 0 for s in ("qkv", "attention", "o", "gate_up", "down", "output", "quantize")), secs
    assert 0.8 * sum(passes) < sum(secs.values()) < wall, (secs, passes, wall)
    e.profile(False)
    assert sum(e.stage_seconds().values()) == 0            # cleared, and no longer adding
    e.forward(toks, 0)
    assert sum(e.stage_seconds().values()) == 0
    nbytes = e.stage_bytes()
    assert sum(nbytes.values()) == e.weight_bytes
    assert all(nbytes[s] > 0 for s in ("qkv", "o", "gate_up", "down", "output"))
    assert all(nbytes[s] == 0 for s in ("serial", "quantize", "attention", "swiglu"))


def _eos_engine(path, pool, eos):
    e = Engine(path, pool=pool, max_context=512)
    e.eos_ids = eos
    return e


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen2", "tiny-llama"])
def test_greedy_speculation_equals_plain_greedy(files, pool, name):
    c = TINY[name]
    target = Engine(files[name]["q4-q8out"], pool=pool, max_context=512)
    drafts = [Engine(files[name]["q4"], pool=pool, max_context=512),          # a near twin: long accepted runs
              Engine(files[name]["q4-q8out"], pool=pool, max_context=512),    # the target itself: all accepted
              "lookup"]
    for p in prompts(c, 5, seed=11) + [[5, 6, 7, 5, 6, 7, 5, 6]]:
        plain = target.generate(p, 48).tokens
        for d in drafts:
            for gamma in range(1, 9):
                r = target.speculate(p, d, gamma=gamma, max_new_tokens=48)
                assert r.tokens == plain, (p, d, gamma)
    r = target.speculate(p, drafts[1], gamma=4, max_new_tokens=48)
    assert r.per_round[:5] == [(4, 4)] * 5                              # all-accepted rounds in a row


def test_a_requests_setup_is_the_prompts_time(files, pool):
    """Pinning, buffers and a trimmed draft's rows for the prompt count with the prompt, not
    with decoding (a short answer's speedup would pay for them); a one-token prompt has
    setup but no prompt rate."""
    target = Engine(files["tiny-qwen2"]["q4-q8out"], pool=pool, max_context=256)
    for r in (target.generate([7], 4), target.speculate([7], "lookup", gamma=2, max_new_tokens=4)):
        assert r.t_prompt > 0 and math.isnan(r.prompt_tokens_per_s)
        assert r.t_generate == pytest.approx(r.t_total - r.t_prompt)
    r = target.generate(prompts(TINY["tiny-qwen2"], 1)[0] + [1, 2], 4)
    assert r.prompt_tokens_per_s > 0


def test_eos_inside_an_accepted_block_and_budget_mid_round(files, pool):
    path = files["tiny-qwen2"]["q8"]
    p = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = Engine(path, pool=pool, max_context=512).generate(p, 40).tokens
    eos = plain[9]
    stop_at = plain.index(eos) + 1
    for gamma in (3, 5, 8):
        t = _eos_engine(path, pool, [eos])
        d = _eos_engine(path, pool, [eos])                                # same model: guesses all accepted
        r = t.speculate(p, d, gamma=gamma, max_new_tokens=40)
        assert r.tokens == plain[:stop_at] and r.stopped_on_eos
        for budget in (1, 6, 7, 13):                                      # budgets that end mid-round
            r = t.speculate(p, d, gamma=gamma, max_new_tokens=budget)
            want = plain[:budget]
            if eos in want:
                want = want[:want.index(eos) + 1]
            assert r.tokens == want


# ----------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------

# The scalar reference and, where this CPU has one, a SIMD path: every SIMD path samples with
# the same AVX2 code, so one stands for them all.
SAMPLERS = ["scalar", *simd_paths()[:1]]


def chi2_critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty: the chi-square value a correct sampler exceeds with probability ~5e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    stat = float((((counts[big] - exp[big]) ** 2) / exp[big]).sum())
    rest_o, rest_e = counts[~big].sum(), exp[~big].sum()
    df = int(big.sum()) - 1
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        df += 1
    assert counts[probs == 0].sum() == 0, "sampled a token of probability zero"
    return stat, df


def torch_warp(logits, temperature, top_k=0, top_p=1.0):
    """The warping rule, written independently: top-k (ties to the lower id), softmax at the
    temperature, then the shortest most-probable prefix reaching top_p."""
    logits = torch.as_tensor(logits, dtype=torch.float64)
    n = logits.numel()
    order = sorted(range(n), key=lambda i: (-float(logits[i]), i))
    keep = order[:top_k] if 0 < top_k < n else order
    e = torch.exp((logits[keep] - logits.max()) / temperature)
    pr = e / e.sum()
    if top_p < 1:
        cum = torch.cumsum(pr, 0)
        cut = int((cum >= top_p).nonzero()[0]) + 1
        keep, pr = keep[:cut], pr[:cut] / pr[:cut].sum()
    out = torch.zeros(n, dtype=torch.float64)
    out[keep] = pr
    return out.numpy()


@pytest.mark.parametrize("path", SAMPLERS)
@pytest.mark.parametrize("warp", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.9)])
def test_acceptance_rule_chi_square(ns, warp, path):
    """Draft x ~ q, accept with min(1, p/q), else resample from max(0, p - q): x ~ p."""
    n, draws, path = 12, 100_000, native.path_id(path)
    rng = np.random.default_rng(0)
    T, k, tp = warp
    sp = ns.SampleParams()
    sp.temperature, sp.top_k, sp.top_p = T, k, tp
    p_logits, q_logits = rng.standard_normal(n).astype(np.float32) * 2, rng.standard_normal(n).astype(np.float32)
    p, q = np.zeros(n, np.float32), np.zeros(n, np.float32)
    ns.warp(p_logits, n, sp, p, path)
    sq = ns.SampleParams()
    sq.temperature = 1.0
    ns.warp(q_logits, n, sq, q, path)
    np.testing.assert_allclose(p, torch_warp(p_logits, T, k, tp), atol=1e-6)
    out = np.zeros(draws, np.int32)
    ns.accept_trials(p, q, n, draws, 42, out, path)
    counts = np.bincount(out, minlength=n)
    stat, df = chi2(counts, p.astype(np.float64) / p.sum())
    assert stat < chi2_critical(df), (stat, df)


@pytest.mark.parametrize("path", SAMPLERS)
def test_sample_draws_from_unnormalised_weights(ns, path):
    """sample() across many blocks of its running sum: weights of any total, zeros never drawn."""
    n, draws, path = 3000, 60_000, native.path_id(path)
    rng = np.random.default_rng(5)
    w = np.zeros(n, np.float32)
    hot = rng.choice(n, 40, replace=False)                 # spread over the blocks, last entry too
    hot[0] = n - 1
    w[hot] = rng.random(40).astype(np.float32) * 7
    r = ns.Rng(11)
    counts = np.bincount([ns.sample(w, n, r, path) for _ in range(draws)], minlength=n)
    stat, df = chi2(counts, w.astype(np.float64) / w.sum())
    assert stat < chi2_critical(df), (stat, df)
    assert ns.sample(np.zeros(5, np.float32), 5, r, path) == 0   # nothing positive: the argmax
    assert ns.sample(np.array([-1, 0, -3], np.float32), 3, r, path) == 1


def _draw_spec(w: np.ndarray, u: float, block: int = 256) -> int:
    """sample()'s order of additions, written out: blocks of 256 summed in four lanes
    (the tail into lane 0), blocks in order, then the running sum inside the block found."""
    w = np.where(w > 0, w, 0).astype(np.float64)
    sums = []
    for b in range(0, w.size, block):
        x = w[b:b + block]
        m = x.size // 4 * 4
        lanes = [float(np.cumsum(np.r_[0.0, x[j:m:4]])[-1]) for j in range(4)]
        for t in x[m:]:
            lanes[0] += t
        sums.append((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
    total = float(np.cumsum(np.r_[0.0, sums])[-1])
    u, cum = u * total, 0.0
    for b, s in enumerate(sums):
        if u < cum + s:
            break
        cum += s
    for i in range(b * block, min(w.size, (b + 1) * block)):
        if w[i] > 0:
            cum += w[i]
            if u < cum:
                return i
    raise AssertionError("not reached for these weights")


@pytest.mark.parametrize("path", SAMPLERS)
def test_sample_follows_its_order_of_additions(ns, path):
    """A seed gives one sample on every CPU and path: the draw is the one the written-out order gives."""
    rng, path = np.random.default_rng(8), native.path_id(path)
    for n in (5, 257, 1027, 151665):
        w = (rng.random(n) ** 8).astype(np.float32)
        w[rng.random(n) < 0.3] = 0
        w[rng.integers(0, n)] = -0.5
        for seed in range(20):
            u = ns.Rng(seed).uniform()
            assert ns.sample(w, n, ns.Rng(seed), path) == _draw_spec(w, u), (n, seed)


@pytest.mark.parametrize("path", SAMPLERS)
def test_argmax_is_the_first_maximum(ns, path):
    rng, path = np.random.default_rng(4), native.path_id(path)
    for n in (1, 7, 8, 9, 16, 31, 1000, 151936):
        x = rng.standard_normal(n).astype(np.float32)
        if n > 20:                                         # ties: the first one wins
            x[[3, n - 2, n // 2]] = x.max() + 1
        assert ns.argmax(x, n, path) == int(np.argmax(x)), n
    z = np.zeros(40, np.float32)
    z[5], z[9] = -0.0, 0.0
    assert ns.argmax(z, 40, path) == 0
    z[[0, 11]] = np.nan                                   # NaNs: no crash, an index in range
    assert 0 <= ns.argmax(z, 40, path) < 40


def scalar_softmax(logits: np.ndarray, T: float) -> tuple[np.ndarray, float]:
    """The scalar reference of warp() at a temperature alone, written out: e^((l - max) * (1/T))
    in float32 through libm's expf (what std::exp calls), summed in order in doubles, each
    scaled by the sum's reciprocal in float32 -> (probabilities, the sum)."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.argtypes, libm.expf.restype = [ctypes.c_float], ctypes.c_float
    e = np.array([libm.expf(float(v)) for v in (logits - logits.max()) * (np.float32(1) / np.float32(T))],
                 np.float32)
    z = 0.0
    for v in e:                                             # in order (sum() compensates)
        z += float(v)
    return e * np.float32(1.0 / z), z


@pytest.mark.parametrize("path", SAMPLERS)
def test_sampling_runs_the_path_it_is_given(ns, path):
    """On the scalar path warp() and top_probability() are the scalar reference bit for bit; on
    a SIMD path, the vector code's own bits (the same distribution to rounding): the path the
    engine is given -- LAB_KERNEL_PATH=scalar included -- and not the CPU decides which runs."""
    rng, pid = np.random.default_rng(9), native.path_id(path)
    n, T = 1000, 0.8
    logits = (rng.standard_normal(n) * 3).astype(np.float32)
    want, _ = scalar_softmax(logits, T)
    sp = ns.SampleParams()
    sp.temperature = T
    got = np.zeros(n, np.float32)
    ns.warp(logits, n, sp, got, pid)
    top = ns.top_probability(logits, n, np.zeros(n, np.float32), pid)
    assert str(ns.sampler_name(pid)) == ("scalar" if path == "scalar" else "avx2")
    if path == "scalar":
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        assert top == np.float32(1.0 / scalar_softmax(logits, 1.0)[1])
    else:
        assert not np.array_equal(got.view(np.uint32), want.view(np.uint32))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)


def _joint2(c, prompt, T):
    """The target's distribution over the next two tokens, enumerated in PyTorch."""
    ref = Twin(c, tiny_weights(c, seed=1), "f32", max_context=64)
    p1 = torch_warp(ref.forward(prompt, 0)[-1].numpy(), T)
    joint = np.zeros((16, 16))
    for a in range(16):
        ref.reset(len(prompt))
        joint[a] = p1[a] * torch_warp(ref.forward([a], len(prompt))[-1].numpy(), T)
    return joint


@pytest.mark.parametrize("drafter", ["draft", "lookup"])
def test_speculative_samples_of_every_length2_continuation(files, pool, drafter):
    """End to end: the engine's speculative samples (temperature 1.5, a draft model or prompt
    lookup) of the next two tokens follow the target's distribution enumerated in PyTorch."""
    # lookup guesses 5 (the target gives it 0.58), then 3, 9
    prompt = [3, 9, 5, 3, 9] if drafter == "lookup" else [3, 9, 1]
    T = 1.5
    joint = _joint2(TINY["tiny-v16"], prompt, T)
    target = Engine(files["tiny-v16"]["f32"], pool=pool, max_context=64)
    draft = Engine(files["tiny-v16-draft"]["f32"], pool=pool, max_context=64) if drafter == "draft" else "lookup"
    counts = np.zeros((16, 16))
    runs = 12_000
    for seed in range(runs):
        t = target.speculate(prompt, draft, gamma=(seed % 3) + 1, max_new_tokens=2, temperature=T, seed=seed).tokens
        counts[t[0], t[1]] += 1
    stat, df = chi2(counts.ravel(), joint.ravel())
    assert stat < chi2_critical(df), (stat, df)


# ----------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------

def test_bad_requests_are_exceptions(files, pool, tmp_path):
    e = Engine(files["tiny-qwen3"]["q8"], pool=pool, max_context=64)
    with pytest.raises(EngineError, match="do not fit the cache"):
        e.forward(list(range(70)), 0)
    with pytest.raises(EngineError, match="context is longer than the cache"):
        e.generate(list(range(40)), max_new_tokens=30)
    with pytest.raises(EngineError, match="prompt is empty"):
        e.generate([], 5)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        e.generate([1, 2, 10_000], 5)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        e.forward([-1])
    for g in (0, -2, 17):
        with pytest.raises(EngineError, match="gamma"):
            e.speculate([1, 2], "lookup", gamma=g)
    other = Engine(files["tiny-llama"]["q8"], pool=pool, max_context=64)
    with pytest.raises(EngineError, match="vocabulary"):
        e.speculate([1, 2], other)
    raw = bytearray(files["tiny-qwen3"]["q8"].read_bytes())
    raw[12:16] = (7).to_bytes(4, "little")
    (tmp_path / "alien.lab").write_bytes(bytes(raw))
    with pytest.raises(EngineError, match="architecture 7"):
        Engine(tmp_path / "alien.lab", pool=pool)
    with pytest.raises(EngineError, match="no weights file"):
        Engine(tmp_path / "missing.lab", pool=pool)
    with pytest.raises(EngineError, match="choose one of f32, bf16"):
        Engine(files["tiny-qwen3"]["q8"], pool=pool, max_context=64, attention="fp8")
    with pytest.raises(EngineError, match="needs AVX512_BF16 on the avx512vnni path"):
        Engine(files["tiny-qwen3"]["q8"], pool=pool, max_context=64, path="avx2", attention="bf16")
    with pytest.raises(EngineError, match="needs AMX-BF16 .* on the avx512vnni path"):
        Engine(files["tiny-qwen3"]["q8"], pool=pool, max_context=64, path="avx2", attention="amx")


def test_bf16_rounding_matches_torch():
    """The scalar reference's bf16 (to nearest, ties to even) is torch's for normal floats,
    across ties, carries into the exponent and the largest values; a denormal becomes a zero
    of its sign, as the instruction's own conversion makes it."""
    ns = native.lib()
    rng = np.random.default_rng(4)
    bits = np.concatenate([rng.integers(0x00800000, 0x7f7f0000, 20000, dtype=np.uint32),
                           np.array([0x3f808000, 0x3f818000, 0x3f80ffff, 0x3fffffff, 0x7f7effff], np.uint32)])
    x = np.concatenate([bits, bits | 0x80000000]).view(np.float32)
    x = np.concatenate([x, np.float32([1e-40, -1e-40])])
    got = np.empty_like(x)
    ns.round_bf16_row(x, x.size, got)
    want = torch.from_numpy(x).bfloat16().float().numpy()
    want[-2:] = [0.0, -0.0]
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("scheme", ["q8", "f32"])
@pytest.mark.parametrize("where", ["model.layers.0.input_layernorm.weight",
                                   "model.layers.0.post_attention_layernorm.weight"])
def test_overflowing_activations_are_an_error(pool, tmp_path, where, scheme):
    """Activations that overflow (before the attention, or in the feed-forward block) stop the
    pass with a clear error rather than wrong logits, float weights as well as quantized."""
    c = TINY["tiny-qwen3"]
    w = tiny_weights(c, seed=1)
    w[where] = w[where] * 3e38                             # overflows to inf in the next product
    e = Engine(ex.export(c, w, tmp_path / "hot.lab", scheme), pool=pool, max_context=64)
    with pytest.raises(EngineError, match="NaN, inf or value past"):
        e.forward([1, 2, 3], 0)


def test_lab_generate_streams_and_reports(tmp_path):
    import os
    import subprocess
    import sys
    env = dict(os.environ, LAB_MODELS=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "lab.cli", "generate", "5 6 7 8", "--model", "tiny-qwen2",
                        "--max-new-tokens", "12", "--lookup", "--gamma", "3"], capture_output=True, text=True,
                       env=env, timeout=300, cwd=native.SOURCE_DIR.parent)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 12
    assert "tokens/round" in r.stderr and "generation: 12 tokens" in r.stderr
