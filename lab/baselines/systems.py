"""Each system as the baselines study runs it: a name, a plain run and its speculative
settings, all greedy, all taking the same token ids and the same number of new tokens."""
from __future__ import annotations

from dataclasses import dataclass

from . import Run
from .study import System


def from_result(r) -> Run:
    """A lab engine Result as a Run (prefill excluded, like the others)."""
    return Run(r.tokens, r.t_generate, r.rounds, r.drafted, r.accepted)


def lab_system(target, draft, policy, max_new_tokens: int) -> System:
    """The lab: plain, and its automatic policy with the (trimmed) draft and prompt lookup."""
    return System("lab", {
        "plain": lambda ids: from_result(target.generate(ids, max_new_tokens)),
        "auto": lambda ids: from_result(target.speculate(ids, draft, policy=policy, max_new_tokens=max_new_tokens))})


def llamacpp_system(target, draft, max_new_tokens: int, gammas=(4,), lookup_gammas=(4,)) -> System:
    """llama.cpp: plain, its draft/verify loop with the 0.5B at each γ, and prompt lookup.
    Recorded, not enforced, against its plain output: its pass over k tokens does not give
    bit for bit the logits of k one-token passes, so a near tie can flip a greedy token."""
    settings = {"plain": lambda ids: target.generate(ids, max_new_tokens)}
    for g in gammas:
        settings[f"draft γ={g}"] = lambda ids, g=g: target.speculate(ids, draft, g, max_new_tokens)
    for g in lookup_gammas:
        settings[f"lookup γ={g}"] = lambda ids, g=g: target.lookup(ids, g, max_new_tokens)
    return System("llama.cpp", settings, exact=False)


class _Lazy:
    """A transformers pair loaded on first use and dropped by release(): the fp32 1.5B alone
    holds about 7 GB, needed only for the first few prompts."""

    def __init__(self, target: str, draft: str, dtype: str, threads: int):
        self.args, self.pair = (target, draft, dtype, threads), None

    def get(self):
        from . import hf
        if self.pair is None:
            t, d, dtype, threads = self.args
            self.pair = hf.load(t, dtype, threads), hf.load(d, dtype, threads)
        return self.pair

    def release(self) -> None:
        self.pair = None


def transformers_system(target: str, draft: str, dtype: str, threads: int, max_new_tokens: int,
                        prompts: int | None, lookup_tokens: int = 4) -> System:
    """transformers: plain, assisted generation with the draft, and prompt lookup; on the
    first `prompts` prompts only (it is an order of magnitude slower). Recorded, not
    enforced, against its plain output (bf16 rounds differently in a longer pass)."""
    from . import hf
    pair = _Lazy(target, draft, dtype, threads)
    return System(f"transformers {dtype}", {
        "plain": lambda ids: hf.generate(pair.get()[0], ids, max_new_tokens),
        "assisted": lambda ids: hf.assisted(*pair.get(), ids, max_new_tokens),
        f"lookup {lookup_tokens}": lambda ids: hf.lookup(pair.get()[0], ids, max_new_tokens, lookup_tokens)},
        exact=False, prompts=prompts, release=pair.release)


@dataclass
class Setup:
    """The engines a baselines run holds: the lab's target, draft and policy, and llama.cpp's
    pair (None, with the reason, where llama-cpp-python is absent)."""
    pool: object
    target: object
    draft: object
    policy: object
    llama: object = None
    llama_draft: object = None
    absent: str | None = None


def setup(target: str, draft: str, scheme: str = "q4-q8out", draft_vocab: int = 0, threads: int | None = None,
          calibration: dict | None = None) -> Setup:
    """Loads every system's models for the pair: the lab's (its draft trimmed to draft_vocab
    rows unless 0; its policy fitted where no fit is saved, with calibration's arguments to
    policy.fitted_policy) and llama.cpp's, on the same number of threads."""
    from .. import policy, vocab
    from ..engine import Engine
    from ..kernels import Pool
    from ..models.export import engine_file
    from . import llamacpp
    pool = Pool(threads)
    t = Engine(engine_file(target, scheme), pool=pool, max_context=4096)
    d = Engine(vocab.trimmed_draft_file(draft, target, draft_vocab) if draft_vocab else engine_file(draft, scheme),
               pool=pool, max_context=4096)
    s = Setup(pool, t, d, policy.fitted_policy(t, d, target, **(calibration or {})), absent=llamacpp.available())
    if s.absent is None:
        s.llama = llamacpp.LlamaCpp(llamacpp.gguf_for(target), pool.threads)
        s.llama_draft = llamacpp.LlamaCpp(llamacpp.gguf_for(draft), pool.threads)
    return s


def chosen(s: Setup, target: str, draft: str, max_new_tokens: int, llama_gammas=(4,), lookup_gammas=(4,),
           hf_dtypes=("fp32", "bf16"), hf_prompts: int | None = None) -> list[System]:
    """Every system the generation part runs: the lab, llama.cpp where present, transformers
    in each dtype."""
    out = [lab_system(s.target, s.draft, s.policy, max_new_tokens)]
    if s.llama is not None:
        out.append(llamacpp_system(s.llama, s.llama_draft, max_new_tokens, llama_gammas, lookup_gammas))
    for dt in hf_dtypes:
        out.append(transformers_system(target, draft, dt, s.pool.threads, max_new_tokens, hf_prompts))
    return out
