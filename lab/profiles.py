"""Profiles (params/*.yaml): shared settings plus per-notebook overrides, checked against
each notebook's own parameters cell before anything runs."""
from __future__ import annotations

import ast
from pathlib import Path

import yaml

from .errors import LabError

ROOT = Path(__file__).resolve().parent.parent
PARAMS = ROOT / "params"
NOTEBOOKS = ROOT / "notebooks"
_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "list": (list,),
          "dict": (dict,)}


class ProfileError(LabError):
    """A profile names a key no notebook takes, or gives a value of the wrong type."""


def notebooks() -> list[str]:
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


def _check(value, type_name: str, key: str, where: str) -> None:
    if value is None or type_name in ("None", ""):
        return
    kinds = _TYPES.get(type_name.split("[")[0])
    if kinds and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
        raise ProfileError(f"{where}: {key} must be {type_name}, got {type(value).__name__} {value!r}")


def load(profile: str, selected: list[str] | None = None, overrides: dict | None = None) -> dict[str, dict]:
    """-> notebook -> parameters, every key and type checked against the notebooks."""
    path = Path(profile) if profile.endswith((".yaml", ".yml")) else PARAMS / f"{profile}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PARAMS.glob("*.yaml")))
        raise ProfileError(f"no profile {profile!r} ({path}); known: {known}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ProfileError(f"{path} is not valid YAML: {e}") from None
    extra = set(data) - {"description", "shared", "notebooks"}
    if extra:
        raise ProfileError(f"{path}: unknown top-level key(s) {sorted(extra)}; use description, shared, notebooks")
    per_nb = data.get("notebooks") or {}
    unknown = set(per_nb) - set(notebooks())
    if unknown:
        raise ProfileError(f"{path}: no notebook named {sorted(unknown)}; the collection has: {', '.join(notebooks())}")
    out = {}
    for nb in selected or notebooks():
        spec = defaults(nb)
        params = {}
        for source, values in (("shared", data.get("shared") or {}), (f"notebooks.{nb}", per_nb.get(nb) or {}),
                               ("--set", overrides or {})):
            for key, value in values.items():
                if key not in spec:
                    if source == "shared":
                        continue            # shared keys apply to the notebooks that take them
                    raise ProfileError(f"{path}: {source}.{key} is not a parameter of {nb}.ipynb "
                                       f"(it takes: {', '.join(spec)})")
                _check(value, spec[key][1], key, f"{path} {source}")
                params[key] = value
        out[nb] = params
    return out


def parse_set(items: list[str]) -> dict:
    """--set key=value (values parsed as YAML: 3, 0.5, true, [1, 2], text)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ProfileError(f"--set {item!r}: write key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out
