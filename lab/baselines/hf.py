"""Transformers on the CPU as a baseline: plain greedy `generate`, assisted generation with
a draft model (`assistant_model=`) and prompt lookup (`prompt_lookup_num_tokens=`), each
answering with a Run on the same weights, prompt ids and thread count as the lab.

What is measured: `seconds` is the wall time of the whole `generate` call minus the wall
time of one separately timed forward over the prompt (and, for assisted generation, one
over the draft's prompt as well), run just before it. That is the simplest honest way to
leave the prefill out, with three caveats:
- the remainder covers N-1 decoding steps for N tokens (the prompt's forward gives the
  first), while the lab's engine leaves only the first n-1 prompt tokens out and counts N
  steps: on short runs this flatters transformers by up to N/(N-1);
- in assisted and lookup generation the first round verifies its guesses in the same
  forward as the prompt, so the subtraction is approximate there;
- the two timings are separate runs, so noise in either lands in `seconds`
  (`extra` keeps `total_s` and `prefill_s` so a caller can judge).

Stopping and scoring are set the same way for all three: greedy, stop at max_new_tokens
or at any of the lab's EOS ids (the EOS token is kept, as the engine keeps it), and ids
at or above the tokenizer's size (GGUF padding rows) suppressed, as the engine never
scores them. Transformers promises assisted/lookup output equal to plain greedy; batched
verification rounds differently from one-token steps, so near-ties can still flip (more
so in bf16): `extra["equal_to_plain"]` records it and the caller decides.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from . import Run

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class HF:
    """A transformers model ready to generate: eval mode, its dtype, the lab's EOS ids."""
    name: str
    model: torch.nn.Module
    dtype: str
    eos_ids: list[int]
    tokenizer_size: int               # ids from here up are padding rows, never produced
    threads: int
    plain: dict = field(default_factory=dict, repr=False)   # (prompt, n) -> plain tokens


def load(name: str, dtype: str = "fp32", threads: int | None = None) -> HF:
    """A tiny model (built in code, eager attention) or a registry name / folder (default
    attention, SDPA) in fp32 or bf16; the lab's loader supplies EOS ids and tokenizer size."""
    from ..models.load import load as lab_load
    from ..models.tiny import TINY, hf_model
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    # torch's thread count is process-wide: set it here so the baseline uses the same
    # number of threads as the other systems, and set it again before every generation
    # (another system in this process may change it); it is not restored, since the
    # generations after load() are what it is for.
    if threads is not None:
        torch.set_num_threads(threads)
    m = lab_load(name)
    model = hf_model(m.config, m.weights).to(DTYPES[dtype]) if name in TINY else _from_weights(m, DTYPES[dtype])
    model.eval().requires_grad_(False)
    hf = HF(m.name, model, dtype, list(m.config.eos_ids), m.config.tokenizer_size, torch.get_num_threads())
    _quiet_config(hf)
    with torch.no_grad():                            # the first call pays one-time library setup
        model(torch.ones(1, 4, dtype=torch.long))
    return hf


def _from_weights(m, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers model over the weights the lab's loader already read (fp32 tensors
    are shared, not copied; the file is not read twice)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig
    from transformers.utils import logging as hf_logging
    cfg = AutoConfig.from_pretrained(str(m.folder))
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()               # its per-tensor "Loading weights" bar
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)].from_pretrained(None, config=cfg, state_dict=m.weights,
                                                                      dtype=dtype)
    finally:
        if bar:
            hf_logging.enable_progress_bar()


def _quiet_config(m: HF) -> None:
    """A generation config that says everything itself, so generate neither inherits
    sampling settings from the model folder nor warns about pad/eos ids or attention masks."""
    from transformers import GenerationConfig
    vocab = m.model.config.get_text_config().vocab_size
    m.model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=m.eos_ids or None, pad_token_id=(m.eos_ids or [0])[0],
        suppress_tokens=list(range(m.tokenizer_size, vocab)) or None)


@contextmanager
def _quiet():
    """Transformers' own notices during generate (its assisted path passes a config and
    keyword arguments together, and the suppression processor twice, and says so each
    call): errors only, restored afterwards."""
    import warnings

    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module=r"transformers\.")
            yield
    finally:
        hf_logging.set_verbosity(level)


@torch.no_grad()
def _prefill_s(m: HF, ids: list[int]) -> float:
    t = time.perf_counter()
    m.model(torch.tensor([ids]), use_cache=True)
    return time.perf_counter() - t


@torch.no_grad()
def _timed(m: HF, ids: list[int], max_new_tokens: int, prefill_s: float, **kw) -> tuple[list[int], dict]:
    """New tokens of one greedy generate call, and its timings."""
    torch.set_num_threads(m.threads)
    x = torch.tensor([ids])
    with _quiet():
        t = time.perf_counter()
        out = m.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               do_sample=False, **kw)
        total = time.perf_counter() - t
    return out[0, len(ids):].tolist(), {"total_s": total, "prefill_s": prefill_s, "threads": m.threads,
                                        "dtype": m.dtype, "system": "transformers"}


def generate(model: HF, ids: list[int], max_new_tokens: int) -> Run:
    """Plain greedy decoding (one target forward per token; rounds/drafted/accepted stay 0)."""
    pre = _prefill_s(model, ids)
    tokens, extra = _timed(model, ids, max_new_tokens, pre)
    model.plain[(tuple(ids), max_new_tokens)] = tokens
    return Run(tokens, extra["total_s"] - pre, extra=extra)


@contextmanager
def _counting(m: HF, drafted: list[int]):
    """Appends each round's number of guesses to `drafted`. Transformers does not report
    them, so this wraps the candidate generator of the next generate call (a private hook:
    where it is missing, drafted stays empty and the counts are reported as 0)."""
    make = getattr(m.model, "_get_candidate_generator", None)
    if make is None:
        yield
        return

    def wrapped(*a, **k):
        gen = make(*a, **k)
        get = gen.get_candidates

        def counted(input_ids, *a, **k):
            cand, logits = get(input_ids, *a, **k)
            drafted.append(cand.shape[1] - input_ids.shape[1])
            return cand, logits
        gen.get_candidates = counted
        return gen
    m.model._get_candidate_generator = wrapped       # an instance attribute shadows the method
    try:
        yield
    finally:
        del m.model._get_candidate_generator


def _speculative(m: HF, ids: list[int], max_new_tokens: int, pre: float, **kw) -> Run:
    """One assisted/lookup generation -> Run with rounds, guesses and accepted ones. Every
    round emits its accepted guesses plus one target token, so accepted = tokens - rounds."""
    drafted: list[int] = []
    with _counting(m, drafted):
        tokens, extra = _timed(m, ids, max_new_tokens, pre, **kw)
    plain = m.plain.get((tuple(ids), max_new_tokens))
    if plain is None:                                 # untimed: only for the comparison
        plain = generate(m, ids, max_new_tokens).tokens
    extra["equal_to_plain"] = tokens == plain
    rounds = len(drafted)
    return Run(tokens, extra["total_s"] - pre, rounds, sum(drafted), len(tokens) - rounds if rounds else 0,
               extra)


def assisted(model: HF, draft: HF, ids: list[int], max_new_tokens: int, gamma: int | None = None) -> Run:
    """Assisted generation with `draft` (same vocabulary). gamma None: transformers' own
    defaults (up to 20 guesses a round, drafting stops when the draft's top probability
    falls under 0.4); an int: exactly that many guesses a round (what the lab calls a
    fixed policy), confidence stop off. Set on every call, since transformers keeps such
    state on the draft's generation_config between calls."""
    gc = draft.model.generation_config
    gc.num_assistant_tokens = gamma
    gc.num_assistant_tokens_schedule = None if gamma is None else "constant"
    gc.assistant_confidence_threshold = None if gamma is None else 0.0
    pre = _prefill_s(model, ids) + _prefill_s(draft, ids)
    r = _speculative(model, ids, max_new_tokens, pre, assistant_model=draft.model)
    r.extra.update(drafter=draft.name, gamma=gamma)
    return r


def lookup(model: HF, ids: list[int], max_new_tokens: int, n: int = 10, ngram: int | None = None) -> Run:
    """Prompt lookup: up to n guesses a round copied from after the first (leftmost) earlier
    match of the context's last ngram tokens (longest ngram first; None: transformers'
    default, 2); a round with no match is a plain step with 0 guesses."""
    pre = _prefill_s(model, ids)
    r = _speculative(model, ids, max_new_tokens, pre, prompt_lookup_num_tokens=n, max_matching_ngram_size=ngram)
    r.extra.update(drafter="lookup", gamma=n, ngram=ngram)
    return r
