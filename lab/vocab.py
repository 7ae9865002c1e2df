"""A trimmed draft's vocabulary: which N tokens its output layer keeps.

Tokens are ranked by how often they occur in the project's training texts (the distillation
prompts: HumanEval, chat openers, the standard library's code and docs, arithmetic
problems) and, weighted more, in the target's own answers to training prompts — never in
Spec-Bench. Tokens never seen follow in id order (Qwen's ids follow BPE merge order, so a
low id is a common piece). The end-of-sequence ids and the chat template's special tokens
always stay. At run time the round loop adds the prompt's own tokens (names, numbers).
"""
from __future__ import annotations

import sys

import numpy as np

from .native import cache_dir

ANSWER_WEIGHT = 4      # an answer token counts as much as this many prompt-text tokens
DEFAULT_N = 32768      # tokens a trimmed draft keeps unless told otherwise


def default_n(draft_name: str) -> int:
    """The trim a draft gets by default: DEFAULT_N, or none for a tiny model (whose whole
    vocabulary is smaller)."""
    from .models import TINY
    return 0 if draft_name in TINY else DEFAULT_N


def counts(token_lists, size: int) -> np.ndarray:
    """How often each id occurs across the lists."""
    c = np.zeros(size, np.int64)
    for ids in token_lists:
        if len(ids):
            c += np.bincount(np.asarray(ids, np.int64), minlength=size)[:size]
    return c


def rank(freq: np.ndarray, always=()) -> np.ndarray:
    """Every id, most frequent first; ties (the unseen above all) in id order; `always` first."""
    order = np.lexsort((np.arange(freq.size), -freq))
    first = np.asarray(sorted(set(int(a) for a in always if 0 <= a < freq.size)), np.int64)
    return np.concatenate([first, order[~np.isin(order, first)]])


def keep(ranking: np.ndarray, n: int) -> list[int]:
    """The N ids a trimmed draft keeps, ascending (rows in id order read like the full layer)."""
    if not 1 <= n <= ranking.size:
        raise ValueError(f"a trimmed vocabulary keeps 1 to {ranking.size} tokens, not {n}")
    return sorted(int(x) for x in ranking[:n])


def coverage(kept, samples) -> float:
    """The share of answer tokens a trimmed draft can propose: kept, or in the sample's prompt."""
    k = set(kept)
    hit = total = 0
    for prompt, answer in samples:
        have = k | set(prompt)
        hit += sum(t in have for t in answer)
        total += len(answer)
    return hit / max(total, 1)


def training_texts() -> list[str]:
    """Every decontaminated training prompt's text, from every source."""
    from .distill import data
    return [p.text for p in data.select(data.SOURCES, per_source=10 ** 9)["prompts"]]


def ranking_for(draft_name: str, target, tokenizer_size: int, samples, special=(), progress: bool = True) -> np.ndarray:
    """The ranking for a draft with this target, cached by the target's content and the
    answers it was counted from. samples: (prompt ids, answer ids) on training prompts."""
    import hashlib
    from .distill.data import tokenize
    from .models.export import content_id
    h = hashlib.sha256(repr([(list(p), list(a)) for p, a in samples]).encode()).hexdigest()[:12]
    path = cache_dir() / "vocab" / f"{draft_name}-{content_id(target.file)[:12]}-{h}.npy"
    if path.exists():
        return np.load(path)
    if progress:
        print("counting tokens of the training texts ...", file=sys.stderr)
    texts = tokenize(draft_name, training_texts())
    freq = counts(texts, tokenizer_size) + ANSWER_WEIGHT * counts([a for _, a in samples], tokenizer_size)
    r = rank(freq, special)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, r)
    return r


def training_samples(target, target_name: str, sources=None, per_source: int = 24, max_new_tokens: int = 128,
                     part: str = "train") -> list[tuple[list[int], list[int]]]:
    """(prompt, the target's greedy answer) on the training prompts' train or held-out part
    (answers cached: generated once)."""
    from .distill import data
    train, held = data.split(data.select(sources or data.SOURCES, per_source, 0)["prompts"])
    s = data.answers(target, target_name, train if part == "train" else held, max_new_tokens)
    return [(x.prompt, x.answer) for x in s]


def trimmed_draft_file(draft_name: str, target_name: str, n: int, fmt: str = "q4", scheme: str = "q4-q8out",
                       progress: bool = True):
    """The draft's engine file with its output layer trimmed to the n top-ranked tokens for
    this target (in fmt), exported once into the model cache."""
    from .engine import Engine
    from .models.export import engine_file, export, up_to_date
    from .models.load import load
    from .models.registry import models_dir
    out = models_dir() / draft_name / f"{scheme}-v{n}{fmt}-for-{target_name}.lab"
    if up_to_date(out):
        return out
    target = Engine(engine_file(target_name, progress=progress), max_context=4096)
    m = load(draft_name, tokenizer=True)
    special = list(m.config.eos_ids)
    if m.tokenizer is not None:
        special += list(m.tokenizer.all_special_ids)
    r = ranking_for(draft_name, target, m.config.tokenizer_size, training_samples(target, target_name),
                    special, progress)
    if progress:
        print(f"exporting {draft_name} trimmed to {n} tokens ({fmt}) ...", file=sys.stderr)
    meta = {"source": draft_name, "tokenizer": str(m.folder) if m.folder else None, "target": target_name}
    return export(m.config, m.weights, out, scheme, meta, keep=keep(r, n), keep_fmt=fmt)


def greedy_hits(draft, prompt: list[int], answer: list[int]) -> np.ndarray:
    """Whether the draft's greedy token is the answer's, at each answer position, teacher-forced
    along it, the draft scoring the prompt's own tokens as the round loop does."""
    from .policy import teacher_forced
    draft.set_extra_rows(prompt)
    logits = np.concatenate([x for _, x in teacher_forced(draft, prompt, answer)])
    return logits.argmax(-1) == np.asarray(answer)


def curve(target, draft_name: str, target_name: str, ns=(8192, 16384, 32768, 65536), fmt: str = "q4",
          samples=(), context: int = 512, rounds: int = 5, progress: bool = True) -> list[dict]:
    """c, greedy α per group and coverage of the draft trimmed to each N (0: the stock draft).
    c: draft steps over target steps at `context`, all drafts interleaved with the target in
    one run; α: teacher-forced along the target's greedy answers, samples = [(group, prompt,
    answer)], each draft scoring the prompt's own tokens as the round loop does."""
    from tqdm.auto import tqdm
    from .engine import Engine
    from .models.export import engine_file
    from .protocol import fill, flat, forward_samples, interleave, paired_ratio
    files = {n: trimmed_draft_file(draft_name, target_name, n, fmt, progress=progress) if n else engine_file(draft_name)
             for n in ns}
    drafts = {n: Engine(f, pool=target.pool, max_context=target.max_context) for n, f in files.items()}
    ids = fill(target, context, *drafts.values())
    one = ids[-1:].copy()
    cands = {"target": lambda: forward_samples(target, one, context, 3)}
    cands.update({n: (lambda d=d: forward_samples(d, one, context, 3)) for n, d in drafts.items()})
    timed = interleave(cands, rounds)
    rows = []
    for n, d in tqdm(drafts.items(), desc="α per N", unit="draft", disable=not progress, file=sys.stderr):
        hits: dict[str, list[float]] = {}
        for group, prompt, answer in samples:
            hits.setdefault(group, []).extend(greedy_hits(d, prompt, answer).tolist())
        kept = d.kept_ids[:n] if n else None
        row = {"N": n or int(d.vocab), "trimmed": bool(n), "format": fmt if n else "stock",
               "c": paired_ratio(timed[n], timed["target"])["median"],
               "step_ms": float(np.median(flat(timed[n]))) * 1e3,
               "alpha": float(np.mean([h for v in hits.values() for h in v])) if hits else float("nan"),
               "coverage": coverage(kept, [(p, a) for _, p, a in samples]) if n else 1.0}
        row.update({f"alpha_{g}": float(np.mean(v)) for g, v in hits.items()})
        rows.append(row)
    return rows
