"""Spec-Bench development prompts (lab/data/specbench/, Apache-2.0): six groups of 16."""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "specbench" / "dev.jsonl"
GROUPS = ("multiturn", "translation", "summarization", "qa", "math_reasoning", "rag")
_MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def group_of(category: str) -> str:
    return "multiturn" if category in _MT_BENCH else category


def _rows(path: Path):
    """The prompts of a Spec-Bench-format file, each checked: question_id, category, turns."""
    from .errors import LabError
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise LabError(f"cannot read prompts from {path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LabError(f"{path}:{n} is not JSON ({e.msg}): one prompt object per line, please") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns) \
                or "question_id" not in row or not isinstance(row.get("category"), str):
            raise LabError(f"{path}:{n}: a prompt needs question_id, category and turns (a list of strings)")
        yield row


def prompts(groups=GROUPS, per_group: int | None = None, path: Path | None = None) -> list[dict]:
    """[{id, group, turns}] in file order, at most per_group from each group. path: another
    Spec-Bench-format file (its categories outside the six groups form groups of their own)."""
    out, seen = [], {}
    for row in _rows(path or DATA):
        g = group_of(row["category"])
        if (path is None and g not in groups) or (per_group and seen.get(g, 0) >= per_group):
            continue
        seen[g] = seen.get(g, 0) + 1
        out.append({"id": row["question_id"], "group": g, "turns": row["turns"]})
    return out


def chat_ids(tokenizer, turns: list[str], thinking: bool = False, answers: list[list[int]] = ()) -> list[int]:
    """A chat prompt: the user's turns, each after the model's own answers (token ids) to the
    ones before; only the first turn when no answers are given."""
    extra = {} if thinking is None else {"enable_thinking": thinking}
    msgs = []
    for i, t in enumerate(turns[:len(answers) + 1]):
        msgs.append({"role": "user", "content": t})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": tokenizer.decode(answers[i], skip_special_tokens=True)})
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **extra)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(model: str, per_group: int, max_prompt_tokens: int | None = None) -> list[tuple[str, list[int]]]:
    """(group, token ids) of the first turn of each prompt, with the model's chat template;
    tiny models (no tokenizer) take the text's bytes modulo their vocabulary."""
    from .models import TINY
    out = []
    if model in TINY:
        n = TINY[model].tokenizer_size
        for p in prompts(per_group=per_group):
            ids = [b % n for b in p["turns"][0].encode()]
            out.append((p["group"], ids[:max_prompt_tokens] if max_prompt_tokens else ids))
        return out
    from transformers import AutoTokenizer
    from .models.registry import resolve
    tok = AutoTokenizer.from_pretrained(str(resolve(model)))
    for p in prompts(per_group=per_group):
        ids = chat_ids(tok, p["turns"], thinking=False if model.startswith("qwen3") else None)
        out.append((p["group"], ids[-max_prompt_tokens:] if max_prompt_tokens else ids))
    return out
