"""The Python face of the C++ engine: load a weights file, run k tokens, generate plainly
or speculatively (draft model or prompt lookup). The whole generation loop runs in C++;
Python hands token ids in and reads tokens and per-stage times out."""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import native
from .errors import LabError
from .formats import ACT_MAX
from .kernels import Pool, _pool_ptr, check_array, split_code

_STATUS = {1: "the context is longer than the cache", 2: "a token id is outside the vocabulary",
           3: "the prompt is empty", 4: "gamma is out of range (1..MAX_K)", 5: "the draft's vocabulary differs from the target's",
           6: "the model is not loaded", 7: "a tensor is missing", 8: "the kernel path is not supported",
           9: f"a NaN, inf or value past {ACT_MAX:.2g} appeared in the activations",
           10: "the automatic policy needs costs and a calibration (lab.policy)"}
KINDS = ("plain", "draft", "lookup")       # the C++ RoundKind, in order


# The C++ Stage enum, in order: where a forward pass spends its time.
STAGES = ("serial", "quantize", "qkv", "attention", "o", "gate_up", "swiglu", "down", "output")


class EngineError(LabError):
    """The engine refused a request; the message says why."""


def _check(rc: int, what: str) -> None:
    if rc:
        raise EngineError(f"{what}: {_STATUS.get(rc, f'error {rc}')}")


@dataclass
class Result:
    tokens: list[int]
    prompt_tokens: int
    rounds: int
    drafted: int
    accepted: int
    per_round: list[tuple[int, int]]        # (drafted, accepted)
    kinds: list[str]                        # per round: what drafted ("plain", "draft", "lookup")
    t_prompt: float
    t_draft: float
    t_verify: float
    t_sample: float
    t_total: float
    stopped_on_eos: bool

    @property
    def t_generate(self) -> float:
        return self.t_total - self.t_prompt

    @property
    def prompt_tokens_per_s(self) -> float:
        return (self.prompt_tokens - 1) / self.t_prompt if self.prompt_tokens > 1 and self.t_prompt > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.t_generate if self.t_generate > 0 else float("nan")

    @property
    def tokens_per_round(self) -> float:
        return len(self.tokens) / self.rounds if self.rounds else float("nan")

    @property
    def acceptance(self) -> float:
        """Accepted guesses over drafted ones."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    def summary(self) -> dict:
        return {"new_tokens": len(self.tokens), "prompt_tokens": self.prompt_tokens,
                "prompt_tokens_per_s": self.prompt_tokens_per_s, "tokens_per_s": self.tokens_per_s,
                "rounds": self.rounds, "tokens_per_round": self.tokens_per_round,
                "drafted": self.drafted, "accepted": self.accepted, "acceptance": self.acceptance,
                "t_prompt": self.t_prompt, "t_draft": self.t_draft, "t_verify": self.t_verify,
                "t_sample": self.t_sample, "t_total": self.t_total, "stopped_on_eos": self.stopped_on_eos}


def attention_mode(path_id: int, name: str | None, head_dim: int) -> str:
    """What attention=name runs as on this path: "f32", "bf16" or "amx"; an EngineError where it cannot."""
    modes = native.consts().attention
    if name is not None and name not in modes:
        raise EngineError(f"attention={name!r}: choose one of {', '.join(modes)} (or None for the path's own)")
    mode = int(native.lib().attention_mode(path_id, -1 if name is None else modes[name], head_dim))
    if mode < 0:
        need = "AMX-BF16 (lent by the OS)" if name == "amx" else "AVX512_BF16"
        raise EngineError(f"attention={name!r} needs {need} on the avx512vnni path and a head_dim that is a "
                          f"multiple of 16 (or the scalar reference, path='scalar'); this engine runs path "
                          f"{native.consts().paths[path_id]!r}: use attention='f32'")
    return next(n for n, m in modes.items() if m == mode)


class Engine:
    """A model from the engine's weights file, with its own thread pool and KV cache.

    in_memory (default) copies the checked file onto 2 MB pages; False runs straight from
    the read-only mapping of the file (less memory, slower decoding: 4 KB pages). verify
    checks the file's content hash the first time each version of it loads (default: yes,
    unless LAB_VERIFY=0, which `lab --no-verify` sets). attention: its products in "f32"
    (an fp16 KV cache, read as floats), "bf16" (a bf16 KV cache, and every other operand
    rounded to bf16: twice the multiply-adds per instruction) or "amx" (bf16's operands, summed
    by AMX tiles); None: the fastest the path has in hardware (amx on AVX-512 with AMX-BF16,
    bf16 with AVX512_BF16), f32 elsewhere. `self.attention` says which runs.
    """

    def __init__(self, model_file: str | Path, threads: int | None = None, cpus: list[int] | None = None,
                 max_context: int = 4096, path: str | None = None, pool: Pool | None = None,
                 in_memory: bool = True, verify: bool | None = None, attention: str | None = None):
        ns = native.lib()
        if not 1 <= int(max_context) < 2 ** 31:
            raise EngineError(f"max_context must be between 1 and 2^31 - 1 tokens, got {max_context}")
        self.path_id = native.path_id(path)
        self.pool = pool or Pool(threads, cpus)
        self.file = Path(model_file)
        if not self.file.exists():
            raise EngineError(f"no weights file at {self.file}: export one with lab.models.export")
        from . import tune
        tune.ensure()                       # first use: measures the kernels' choices unless cached
        self._m = ns.Model()
        if not self._m.load(str(self.file), int(max_context), bool(in_memory)):
            raise EngineError(str(self._m.error()))
        if verify if verify is not None else os.environ.get("LAB_VERIFY", "1") != "0":
            from .models.export import verify_once
            verify_once(self.file)
        h = self._m.config()
        self.vocab = int(self._m.vocab())
        self.vocab_rows = int(h.vocab_size)
        self.hidden_size = int(h.hidden_size)
        self.num_layers = int(h.num_layers)
        self.max_context = int(max_context)
        self.eos_ids = [int(h.eos[i]) for i in range(int(h.n_eos))]
        self.arch = {i: a for a, i in native.consts().archs.items()}[int(h.arch)]
        self.trimmed = bool(self._m.out_ids())     # a draft whose logits cover only some tokens
        self.attention = attention_mode(self.path_id, attention, int(h.head_dim))
        self._m.set_attention(native.consts().attention[self.attention])

    @property
    def kept_ids(self) -> np.ndarray | None:
        """A trimmed draft: the token each of its logits rows stands for, the request's extra
        rows included (None: the whole vocabulary)."""
        if not self.trimmed:
            return None
        return np.frombuffer(self._m.out_ids(), np.int32, int(self._m.out_rows())).copy()

    def set_extra_rows(self, tokens) -> int:
        """A trimmed draft scores these tokens too (the prompt's), as the round loop does per
        request; returns how many it lacked. Other models: 0."""
        ids = self._ids(tokens)
        n = int(self._m.set_extra_rows(ids, ids.size))
        if n < 0:
            raise EngineError(f"{self.file}: its full output layer is not quantized, so no rows can be added")
        return n

    def set_chunk(self, tiles: int | str) -> None:
        """Matmul work split: 0 static halves, n > 0 chunks of n 16-row tiles, "guided"
        (shares of what is left, shrinking to ~96 KB of weights; matrices under 4 MB in static
        ranges sized to each thread's speed, as the pool measures it), "redo" (each thread's
        share sized to its speed, in pieces either thread may compute, so thread 0 computes a
        piece again rather than wait for a worker the OS has taken away), or "auto" (the
        default: redo or guided, as `lab tune` chose; `lab info` shows it). The same bits
        whichever."""
        try:
            self._m.set_chunk(split_code(tiles))
        except ValueError as e:
            raise EngineError(str(e)) from None

    def set_window(self, window: int, sink: int | None = None) -> None:
        """Attention over the first `sink` positions and the last `window` (up to a block
        more) once a token has seen more than both: a draft's cost then stops growing with
        the context, and the target's verification keeps the output exact. window 0: every
        position (the default). sink: one block unless given, a whole number of blocks."""
        block = native.consts().window_block
        sink = block if sink is None else sink
        if not self._m.set_window(int(sink), int(window)):
            raise EngineError(f"attention window {window} with sink {sink}: both >= 0, the sink a multiple of {block}")

    @property
    def weight_bytes(self) -> int:
        return int(self._m.weight_bytes())

    def profile(self, on: bool = True) -> None:
        """Start or stop timing the stages of every forward pass; either way the sums restart at 0."""
        self._m.profile(bool(on))

    def stage_seconds(self) -> dict[str, float]:
        """Seconds spent in each stage since profile(True)."""
        secs = np.zeros(len(STAGES))
        self._m.stage_seconds(secs)
        return dict(zip(STAGES, secs.tolist()))

    def stage_bytes(self) -> dict[str, int]:
        """Weight bytes each stage reads in one pass (the output layer: one token's logits)."""
        b = np.zeros(len(STAGES), np.int64)
        self._m.stage_bytes(b)
        return dict(zip(STAGES, b.tolist()))

    def _ids(self, tokens, name="tokens") -> np.ndarray:
        ids = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).reshape(-1))
        if ids.size == 0:
            raise EngineError(f"{name} is empty: give at least one token id")
        bad = (ids < 0) | (ids >= self.vocab_rows)
        if bad.any():
            raise EngineError(f"{name} holds id {int(ids[bad][0])}, outside the vocabulary [0, {self.vocab_rows})")
        return ids.astype(np.int32)

    def forward(self, tokens, pos: int = 0, logits: str = "all", hidden: bool = False):
        """Runs tokens at positions pos.. (filling the KV cache) -> logits [k, vocab] (or [vocab]
        for logits="last"), and with hidden=True also [layers, k, hidden] after every layer."""
        ids = self._ids(tokens)
        k = ids.size
        if pos < 0 or pos + k > self.max_context:
            raise EngineError(f"positions {pos}..{pos + k - 1} do not fit the cache of {self.max_context}")
        mode = native.consts().logits[logits]
        out = np.zeros((k if mode == 2 else 1, int(self._m.out_rows())), np.float32)
        hid = np.zeros((self.num_layers, k, self.hidden_size), np.float32) if hidden else None
        import cppyy
        _check(self._m.forward(ids, k, pos, out, mode, hid if hidden else cppyy.nullptr,
                               self.pool._pool, self.path_id), "forward")
        if self.trimmed and mode:               # the vocabulary's logits: -inf off the kept set
            full = np.full((out.shape[0], self.vocab), -np.inf, np.float32)
            full[:, self.kept_ids] = out
            out = full
        res = out if mode == 2 else out[0]
        return (res, hid) if hidden else res

    def _params(self, max_new_tokens, temperature, top_k, top_p, seed, gamma=4, threshold=0.0, ngram=3, mode=0,
                policy=None):
        ns = native.lib()
        if not 1 <= max_new_tokens:
            raise EngineError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if mode and not 1 <= gamma <= int(ns.MAX_K):
            raise EngineError(f"gamma={gamma} is out of range: one round verifies 1 to {int(ns.MAX_K)} guesses")
        if not math.isfinite(temperature) or temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise EngineError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0, please")
        gp = ns.GenParams()
        gp.mode, gp.max_new_tokens, gp.gamma, gp.threshold, gp.ngram_max = mode, max_new_tokens, gamma, threshold, ngram
        gp.sample.temperature, gp.sample.top_k, gp.sample.top_p = temperature, top_k, top_p
        gp.seed = seed
        if policy is not None:
            gp.policy = policy
        eos = self.eos_ids[:4]
        gp.n_eos = len(eos)
        for i, e in enumerate(eos):
            gp.eos[i] = e
        return gp

    def _run(self, gen, prompt, gp, on_token=None) -> Result:
        ids = self._ids(prompt, "prompt")
        n = int(gp.max_new_tokens)
        out = np.zeros(n, np.int32)
        rounds = n + 1
        drafted, accepted, kinds = (np.zeros(rounds, np.int32) for _ in range(3))
        rc = [0]

        def work():
            rc[0] = gen.run(ids, ids.size, gp, out, drafted, accepted, kinds, rounds)
        if on_token is None:
            work()
        else:                                   # stream: C++ runs (GIL released), Python polls
            t = threading.Thread(target=work)
            t.start()
            seen = 0
            while t.is_alive() or seen < gen.produced():
                now = gen.produced()
                for i in range(seen, now):
                    on_token(int(out[i]))
                seen = now
                time.sleep(0.005)
            t.join()
        _check(rc[0], "generate")
        s = gen.stats()
        r = int(s.rounds)
        m = min(r, rounds)
        return Result(out[:int(s.new_tokens)].tolist(), int(s.prompt_tokens), r, int(s.drafted), int(s.accepted),
                      list(zip(drafted[:m].tolist(), accepted[:m].tolist())), [KINDS[k] for k in kinds[:m]],
                      float(s.t_prompt), float(s.t_draft), float(s.t_verify), float(s.t_sample), float(s.t_total),
                      bool(s.stopped_on_eos))

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, on_token=None) -> Result:
        """Plain decoding; greedy when temperature is 0."""
        import cppyy
        gen = native.lib().Generator(self._m, cppyy.nullptr, self.pool._pool, self.path_id)
        return self._run(gen, prompt, self._params(max_new_tokens, temperature, top_k, top_p, seed), on_token)

    def speculate(self, prompt, draft: "Engine | str | None" = "lookup", gamma: int | None = None,
                  max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0, threshold: float = 0.0, ngram: int = 3, policy=None, on_token=None) -> Result:
        """Speculative decoding with a draft Engine, prompt lookup (draft="lookup"), or, under the
        automatic policy, both: each round takes lookup, the draft or a plain step, and as many
        guesses as pay. policy: "fixed" (gamma guesses a round, 4 by default), "auto" (this
        machine's cached costs and the draft's calibration, lab.policy) or a lab.policy.Policy;
        by default "fixed" when gamma is given, else "auto"."""
        import cppyy
        if isinstance(draft, Engine) and draft.vocab != self.vocab:
            raise EngineError(f"the draft's vocabulary ({draft.vocab}) differs from the target's ({self.vocab})")
        if not (isinstance(draft, Engine) or draft in ("lookup", None)):
            raise EngineError(f"draft must be an Engine, 'lookup' or None, got {draft!r}")
        policy = policy or ("fixed" if gamma is not None or threshold > 0 else "auto")
        dm = draft._m if isinstance(draft, Engine) else cppyy.nullptr
        gen = native.lib().Generator(self._m, dm, self.pool._pool, self.path_id)
        if policy == "fixed":
            if draft is None:
                raise EngineError("a fixed policy needs a drafter: a draft Engine or 'lookup'")
            gp = self._params(max_new_tokens, temperature, top_k, top_p, seed, 4 if gamma is None else gamma,
                              threshold, ngram, 1 if isinstance(draft, Engine) else 2)
        else:
            from . import policy as P
            pol = P.policy_for(self, draft if isinstance(draft, Engine) else None, temperature) if policy == "auto" \
                else policy
            if not isinstance(pol, P.Policy):
                raise EngineError(f"policy must be 'fixed', 'auto' or a lab.policy.Policy, got {policy!r}")
            native_pol = pol.native()           # a local: alive while C++ reads it through gp
            gp = self._params(max_new_tokens, temperature, top_k, top_p, seed, pol.max_gamma, 0.0, ngram, 3,
                              native_pol)
        return self._run(gen, prompt, gp, on_token)
