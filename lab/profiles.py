"""Profiles (params/*.yaml): shared settings plus per-notebook overrides, checked against
each notebook's own parameters cell (types) and the lab's ranges before anything runs."""
from __future__ import annotations

import ast
import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from . import slowcore
from .errors import LabError

ROOT = Path(__file__).resolve().parent.parent
PARAMS = ROOT / "params"
NOTEBOOKS = ROOT / "notebooks"
_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "list": (list,),
          "dict": (dict,)}


class ProfileError(LabError):
    """A profile names a key no notebook takes, or gives a value of the wrong type or range."""


@dataclass(frozen=True)
class Range:
    """What a value's type cannot say: its bounds (None: open; gt: lo itself excluded), why,
    whether null is allowed, and the type where a notebook's default (None or []) cannot say."""
    lo: float | None = None
    hi: float | None = None
    gt: bool = False
    why: str = ""
    null: bool = False
    kind: str = "int"

    def admits(self, x) -> bool:
        if isinstance(x, float) and not math.isfinite(x):
            return False
        return (self.lo is None or (x > self.lo if self.gt else x >= self.lo)) and (self.hi is None or x <= self.hi)

    def text(self) -> str:
        lo = None if self.lo is None else f"{'>' if self.gt else '>='} {self.lo}"
        hi = None if self.hi is None else f"<= {self.hi}"
        if lo and hi and not self.gt:
            s = f"from {self.lo} to {self.hi}"
        else:
            s = " and ".join(x for x in (lo, hi) if x) or "finite"
        return f"{s} ({self.why})" if self.why else s


COUNT = Range(1)            # rounds, prompts, tokens, sizes: at least one


def max_k() -> int:
    """The most tokens one engine call takes (the C++ MAX_K): a round's guesses, a kernel's k."""
    from . import native
    return native.consts().max_k


def guesses() -> Range:
    return Range(1, max_k(), why="MAX_K: the most guesses one round verifies")


def cpu_threads() -> Range:
    return Range(1, len(os.sched_getaffinity(0)), why="the CPUs this process may use")


def ranges() -> dict[str, Range]:
    """Parameter name -> Range, for the numbers (or each item of the lists) it takes; the
    notebooks share their names, so one table serves them all."""
    counts = ("buffer_mb", "rounds", "per_group", "per_source", "max_new_tokens", "top_k", "rank", "steps",
              "batch", "eval_every", "eval_sequences", "specbench_per_group", "bench_new_tokens", "context",
              "contexts", "ks", "window", "windows", "curve_per_group", "calibration_per_source", "vocab_ns", "hf_prompts",
              "sampled_per_group")
    return {**dict.fromkeys(counts, COUNT),
            **dict.fromkeys(("gamma", "gammas", "draft_gammas", "lookup_gammas", "llama_gammas", "max_gamma", "max_k"), guesses()),
            "threads": dataclasses.replace(cpu_threads(), null=True),          # null: every CPU
            "max_prompt_tokens": dataclasses.replace(COUNT, null=True),    # null: no limit
            "draft_vocab": Range(0, why="0: the stock draft"), "warmup": Range(0), "weight": Range(0),
            "lr": Range(0, gt=True), "held_out": Range(0, 1),
            "sampled_temperatures": Range(0, gt=True, why="0 is the greedy run", kind="float"),
            "duties": Range(0, 1, why="a co-runner's busy share of each period", kind="float"),
            "factors": Range(1, slowcore.MAX_FACTOR, gt=True, why="how many times slower the slowed worker runs",
                             kind="float")}


def notebooks() -> list[str]:
    if not NOTEBOOKS.is_dir():
        from .native import CHECKOUT
        raise ProfileError(f"no notebooks/ at {NOTEBOOKS}: {CHECKOUT}")
    return sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))


def defaults(notebook: str) -> dict:
    """The notebook's parameters cell: name -> (default, type name)."""
    import papermill
    path = NOTEBOOKS / f"{notebook}.ipynb"
    if not path.exists():
        raise ProfileError(f"no notebook {notebook!r}; the collection has: {', '.join(notebooks())}")
    out = {}
    for k, v in papermill.inspect_notebook(str(path)).items():
        try:                              # the type of the default: what a profile must give
            default = ast.literal_eval(v["default"])
        except (ValueError, SyntaxError):
            default = v["default"]
        out[k] = (default, type(default).__name__ if default is not None else "None")
    return out


def _kinds(default, rule: Range | None) -> tuple[str | None, str | None]:
    """(the value's type, its items' type): the default's, or the rule's where a None or [] default cannot say."""
    if isinstance(default, list):
        return "list", type(default[0]).__name__ if default else (rule.kind if rule else None)
    if default is None:
        return (rule.kind if rule else None), None
    return type(default).__name__, None


def _check_one(x, kind: str | None, rule: Range | None, name: str, where: str) -> None:
    """One value or list item: its type, and for a number its range (finite, at least)."""
    kinds = _TYPES.get(kind or "")
    if kinds and (not isinstance(x, kinds) or (isinstance(x, bool) and bool not in kinds)):
        raise ProfileError(f"{where}: {name} must be {kind}, got {type(x).__name__} {x!r}")
    rule = rule or Range()
    if isinstance(x, (int, float)) and not isinstance(x, bool) and not rule.admits(x):
        raise ProfileError(f"{where}: {name} must be {rule.text()}, got {x!r}")


def _check(value, default, rule: Range | None, key: str, where: str) -> None:
    """The value against the notebook's default (its type, its items' type) and the key's Range."""
    if value is None:
        if default is None or (rule and rule.null):
            return
        raise ProfileError(f"{where}: {key} must be {type(default).__name__}, got null")
    kind, item = _kinds(default, rule)
    _check_one(value, kind, None if kind == "list" else rule, key, where)
    if kind == "list":
        for i, x in enumerate(value):
            _check_one(x, item, rule, f"{key}[{i}]", where)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """The parser's complaint in a few words, with its line where it has one."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{problem} at line {mark.line + 1}" if mark else problem


def _mapping(value, where: str, what: str) -> dict:
    """A profile section: a mapping (null: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProfileError(f"{where} must be a mapping of {what}, got {type(value).__name__} {value!r:.60}")
    return value


def load(profile: str, selected: list[str] | None = None, overrides: dict | None = None) -> dict[str, dict]:
    """-> notebook -> parameters, every key, type and range checked against the notebooks."""
    path = Path(profile) if profile.endswith((".yaml", ".yml")) else PARAMS / f"{profile}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PARAMS.glob("*.yaml")))
        raise ProfileError(f"no profile {profile!r} ({path}); known: {known}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ProfileError(f"{path} is not valid YAML: {_yaml_problem(e)}") from None
    data = _mapping(data, f"{path}: the profile", "description, shared and notebooks")
    extra = set(data) - {"description", "shared", "notebooks"}
    if extra:
        raise ProfileError(f"{path}: unknown top-level key(s) {sorted(extra)}; use description, shared, notebooks")
    shared = _mapping(data.get("shared"), f"{path}: shared", "parameter: value")
    per_nb = _mapping(data.get("notebooks"), f"{path}: notebooks", "notebook name: parameters")
    unknown = set(per_nb) - set(notebooks())
    if unknown:
        raise ProfileError(f"{path}: no notebook named {sorted(unknown)}; the collection has: {', '.join(notebooks())}")
    out, rules = {}, ranges()
    for nb in selected or notebooks():
        spec = defaults(nb)
        params = {}
        own = _mapping(per_nb.get(nb), f"{path}: notebooks.{nb}", "parameter: value")
        for source, values in (("shared", shared), (f"notebooks.{nb}", own), ("--set", overrides or {})):
            for key, value in values.items():
                if key not in spec:
                    if source == "shared":
                        continue            # shared keys apply to the notebooks that take them
                    raise ProfileError(f"{path}: {source}.{key} is not a parameter of {nb}.ipynb "
                                       f"(it takes: {', '.join(spec)})")
                _check(value, spec[key][0], rules.get(key), key, f"{path} {source}")
                params[key] = value
        out[nb] = params
    return out


def parse_set(items: list[str]) -> dict:
    """--set key=value (values parsed as YAML: 3, 0.5, true, [1, 2], text)."""
    out = {}
    for item in items or []:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise ProfileError(f"--set {item!r}: write key=value")
        try:
            out[k.strip()] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise ProfileError(f"--set {k.strip()}: {v!r} is not a valid YAML value ({_yaml_problem(e)}); "
                               f"write 3, 0.5, true, [1, 2] or quote text") from None
    return out
