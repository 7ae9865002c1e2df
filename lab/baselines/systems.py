"""Each system as the baselines study runs it: a name, a plain run and its speculative
settings, all greedy, all taking the same token ids and the same number of new tokens."""
from __future__ import annotations

from . import Run
from .study import System


def from_result(r) -> Run:
    """A lab engine Result as a Run (prefill excluded, like the others)."""
    return Run(r.tokens, r.t_generate, r.rounds, r.drafted, r.accepted)


def lab(target, draft, policy, max_new_tokens: int) -> System:
    """The lab: plain, and its automatic policy with the (trimmed) draft and prompt lookup."""
    return System("lab", {
        "plain": lambda ids: from_result(target.generate(ids, max_new_tokens)),
        "auto": lambda ids: from_result(target.speculate(ids, draft, policy=policy, max_new_tokens=max_new_tokens))})


def llamacpp(target, draft, max_new_tokens: int, gammas=(4,), lookup_gammas=(4,)) -> System:
    """llama.cpp: plain, its draft/verify loop with the 0.5B at each γ, and prompt lookup."""
    settings = {"plain": lambda ids: target.generate(ids, max_new_tokens)}
    for g in gammas:
        settings[f"draft γ={g}"] = lambda ids, g=g: target.speculate(ids, draft, g, max_new_tokens)
    for g in lookup_gammas:
        settings[f"lookup γ={g}"] = lambda ids, g=g: target.lookup(ids, g, max_new_tokens)
    return System("llama.cpp", settings)


def transformers(model, draft, max_new_tokens: int, prompts: int | None, lookup_tokens: int = 4) -> System:
    """transformers: plain, assisted generation with the draft, and prompt lookup; on the
    first `prompts` prompts only (it is an order of magnitude slower). Its bf16 runs need not
    equal plain, so they are recorded, not enforced."""
    from . import hf
    return System(f"transformers {model.dtype}", {
        "plain": lambda ids: hf.generate(model, ids, max_new_tokens),
        "assisted": lambda ids: hf.assisted(model, draft, ids, max_new_tokens),
        f"lookup {lookup_tokens}": lambda ids: hf.lookup(model, ids, max_new_tokens, lookup_tokens)},
        exact=False, prompts=prompts)
