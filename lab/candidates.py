"""Would checking two candidates in one target pass pay? A replay along the target's own
greedy answers to training prompts.

Along the target's greedy text, a guess is accepted exactly when it is the next token,
so each round's outcome is known for every drafter: the draft's chain (teacher forced:
its i-th guess sees the right prefix whenever the guesses before it were right) and
prompt lookup's continuation. One candidate a round is compared with both checked in one
pass of len(lookup) + γ + 1 tokens (a tree of two branches off the last token), which
keeps the longer accepted run and pays for the wider pass. The single-candidate side is
taken at its best: a rule on lookup's match length, and hindsight (per round, whichever
candidate made more tokens per cost), which a real policy can only approach.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .policy import lookup, teacher_forced


@dataclass
class Answer:
    draft_run: np.ndarray         # [j]: how many draft guesses from position j are right in a row
    lookup: list                  # [j]: (matched n-gram length, guesses proposed, guesses right)


def replay_data(target, draft, samples, ngram_max: int = 8, max_lookup: int = 8) -> list[Answer]:
    """Per (prompt, answer): the draft's runs of right guesses and lookup's outcome at
    each position."""
    out = []
    for prompt, answer in samples:
        draft.set_extra_rows(prompt)
        guess = np.concatenate([x.argmax(-1) for _, x in teacher_forced(draft, prompt, answer)])
        right = guess == np.asarray(answer)
        run = np.zeros(len(answer) + 1, int)
        for j in range(len(answer) - 1, -1, -1):
            run[j] = run[j + 1] + 1 if right[j] else 0
        looks = []
        for j in range(len(answer)):
            n, cont = lookup(prompt + answer[:j], ngram_max, max_lookup)
            cont = cont[:len(answer) - j]
            ok = next((i for i, t in enumerate(cont) if t != answer[j + i]), len(cont))
            looks.append((n, len(cont), ok))
        out.append(Answer(run[:-1], looks))
    return out


def _round(a: Answer, j: int, how: str, gamma: int, min_n: int, room: int):
    """One round at position j, at most `room` guesses -> (tokens accepted, lookup guesses
    verified, draft guesses verified, whether the draft's chain was the one kept)."""
    n, proposed, ok = a.lookup[j]
    d_ok = min(gamma, int(a.draft_run[j]))
    if how == "draft" or proposed == 0 or (how == "rule" and n < min_n):
        return d_ok, 0, gamma, True
    if how in ("lookup", "rule"):
        return min(ok, room), min(proposed, room), 0, False
    proposed = min(proposed, room - gamma)                 # both, in one pass the costs cover
    ok = min(ok, proposed)
    return max(ok, d_ok), proposed, gamma, d_ok >= ok


def replay(a: Answer, how: str, gamma: int, v: dict, c: float, o: float, min_n: int = 1,
           look: int = 8) -> float:
    """Tokens per target step for one answer: how is "draft", "rule" (lookup when its
    n-gram match is at least min_n long, else the draft), "both", or "hindsight"; lookup
    proposes at most `look` guesses."""
    top = max(v)
    j, spent, lag = 0, 0.0, 1                     # lag: tokens the draft's cache lacks
    while j < len(a.draft_run):
        options = ["draft", "lookup"] if how == "hindsight" else [how]
        best = None
        for h in options:
            acc, n_look, n_draft, kept_draft = _round(a, j, h, gamma, min_n, min(top - 1, look + gamma))
            cost = v[n_look + n_draft + 1] + o
            if n_draft:
                cost += c * (v[min(lag, top)] + n_draft - 1)
            if best is None or (acc + 1) / cost > (best[0] + 1) / best[1]:
                best = (acc, cost, n_draft, kept_draft)
        acc, cost, n_draft, kept_draft = best
        spent += cost
        if n_draft and kept_draft:
            lag = 2 if acc == n_draft else 1
        elif n_draft:                             # lookup's branch won: the draft saw a wrong chain
            lag = acc - min(n_draft, int(a.draft_run[j])) + 1
        else:
            lag += acc + 1
        j += acc + 1
    return len(a.draft_run) / spent


def study(answers: list[Answer], v: dict, c: float, o: float, gammas=(1, 2, 3, 4), min_ns=(1, 2, 3, 4),
          looks=(1, 2, 4, 8)) -> list[dict]:
    """Each strategy at its best γ, lookup length and (for the rule) min_n: geometric-mean
    tokens per target step over the answers."""
    def score(how, g, n, k):
        return float(np.exp(np.mean([np.log(replay(a, how, g, v, c, o, n, k)) for a in answers])))
    rows = []
    for how in ("draft", "rule", "hindsight", "both"):
        grid = [(g, n, k) for g in gammas for n in (min_ns if how == "rule" else (1,))
                for k in (looks if how != "draft" else (0,))]
        s, g, n, k = max((score(how, *x), *x) for x in grid)
        rows.append({"strategy": how, "speedup": s, "gamma": g, "lookup_guesses": k,
                     **({"min_ngram": n} if how == "rule" else {})})
    return rows


def report(target: str = "qwen2.5-coder-1.5b", draft: str = "qwen2.5-coder-0.5b", part: str = "train") -> list[dict]:
    """The study for a pair with its trimmed draft, priced with this machine's cached costs
    at each of their contexts: `python -c "from lab import candidates; candidates.report()"`."""
    from . import policy, vocab
    from .engine import Engine
    from .kernels import Pool
    from .models.export import engine_file
    pool = Pool(None)
    t = Engine(engine_file(target), pool=pool, max_context=4096)
    d = Engine(vocab.trimmed_draft_file(draft, target, vocab.DEFAULT_N), pool=pool, max_context=4096)
    costs = policy.costs_for(t, d)
    answers = replay_data(t, d, vocab.training_samples(t, target, part=part))
    rows = []
    for ctx in costs.contexts:
        v, c = costs.at(ctx)
        rows += [{"context": ctx, **r} for r in study(answers, v, c, costs.o)]
    for r in rows:
        print(r)
    return rows
