"""llama.cpp beside the lab, through llama-cpp-python's low-level API.

The fair twin of the lab's engine (4-bit blocks of 32 for the body, an 8-bit output layer)
is llama.cpp's Q4_0 with a Q8_0 output tensor: `gguf_for(name)` makes that file once beside
the lab's weights, by requantizing the registry's GGUF, or, for the tiny models built in
code, by writing their weights as a GGUF first. `LlamaCpp` then runs it as the lab runs
its own engine: the prompt (all but its last token) is prefilled untimed, and every round
decodes the pending token plus any guesses in one pass, so plain, draft-speculative and
prompt-lookup decoding are the same loop with different guessers, all greedy.

Why the low-level API: v(k) = t(k)/t(1) is the time of ONE llama_decode over k tokens with
logits for all of them, and speculation needs the KV cache cut back to the accepted length;
the high-level Llama class hides both behind its own batching, sampling and cache policy.
"""
from __future__ import annotations

import collections
import ctypes
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from . import Run
from . import llamacpp_files as files
from .llamacpp_files import LlamaCppError

FILE = "llamacpp-q4_0-q8out.gguf"
_LOG: collections.deque = collections.deque(maxlen=64)   # llama.cpp's recent log lines, for errors
_STATE: dict = {}


def available() -> str | None:
    """None when llama-cpp-python imports, else why not (one line)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:                      # a missing or broken build alike
        return f"llama-cpp-python is not importable ({type(e).__name__}: {e}); install it with make llama"
    return None


def version() -> str:
    import llama_cpp
    return llama_cpp.__version__


def _lib():
    """llama_cpp, initialised once, its log captured instead of printed."""
    if "lib" not in _STATE:
        reason = available()
        if reason:
            raise LlamaCppError(reason)
        import llama_cpp as L

        @L.llama_log_callback
        def log(level, text, user_data):
            _LOG.append(text.decode("utf-8", "replace") if text else "")
        _STATE["log"] = log                     # a live reference: C keeps only the pointer
        L.llama_log_set(log, ctypes.c_void_p(0))
        L.llama_backend_init()
        _STATE["lib"] = L
    return _STATE["lib"]


def _last_error() -> str:
    """Why a call failed, from llama.cpp's log since it was cleared: the first error line
    (the cause; later ones only say that the caller failed), else the last line."""
    lines = [s.strip() for s in "".join(_LOG).splitlines() if s.strip()]
    errors = [s for s in lines if "error" in s.lower() or "fail" in s.lower()]
    return errors[0] if errors else (lines or ["no message from llama.cpp"])[-1]


# ----------------------------------------------------------------------------
# The weights file
# ----------------------------------------------------------------------------

def gguf_for(name: str) -> Path:
    """llama.cpp's Q4_0 + Q8_0-output file for a registry name, made once under
    <models>/<name>/ and reused; it appears whole (written beside, renamed at the end)."""
    from ..models import registry
    from ..models.tiny import TINY
    out = registry.models_dir() / name / FILE
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if name in TINY:
        src = out.with_name(f"llamacpp-f32.{os.getpid()}.partial.gguf")
        try:
            files.write_tiny(name, src)
            return _quantize(src, out)
        finally:
            src.unlink(missing_ok=True)
    s = registry.spec(name)
    if s.index is None:
        raise LlamaCppError(f"{name} has no GGUF in the registry (it comes from {s.hf_id}): "
                            f"llama.cpp runs only the index models and the tiny ones")
    src = registry.gguf_path(name)
    if not src.exists():
        raise LlamaCppError(f"{src} is missing: run `lab models fetch {name}`")
    return _quantize(src, out)


def _quantize(src: Path, out: Path, threads: int = 0) -> Path:
    """src -> out as Q4_0 with the output layer (and the token embedding, the same matrix
    when the two are tied, as in Qwen2.5) in Q8_0, like the lab's q4-q8out; 1-d tensors
    (norms, biases) stay f32 as llama.cpp always keeps them. Requantizing a K-quant source
    goes through f32, so the result is what Q4_0 of those weights is."""
    L = _lib()
    p = L.llama_model_quantize_default_params()
    p.ftype = L.LLAMA_FTYPE_MOSTLY_Q4_0
    p.allow_requantize = True
    p.output_tensor_type = L.GGML_TYPE_Q8_0
    p.token_embedding_type = L.GGML_TYPE_Q8_0
    p.nthread = threads
    tmp = out.with_name(f"{out.name}.{os.getpid()}.partial")
    print(f"quantizing {src.name} to Q4_0 + Q8_0 output for llama.cpp (once) ...", file=sys.stderr)
    _LOG.clear()
    try:
        rc = L.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(p))
        if rc != 0 or not tmp.exists():
            raise LlamaCppError(f"llama.cpp could not quantize {src}: {_last_error()}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out



def _placement(mp, tensors: list):
    """Where the weights live. llama.cpp's default would put every matrix it can in the AMX
    buffer on a CPU with AMX, and ggml_backend_amx_mul_mat segfaults on this build (any
    quantized model, any batch), so the extra buffer types are switched off and the Q4_0
    body is placed by hand in CPU_REPACK, the interleaved layout llama.cpp uses on any
    AVX2/AVX-512 CPU without AMX; the rest stays in the plain CPU buffer.
    -> (a label for the report, the override array to keep alive while loading)."""
    import gguf
    mp.use_extra_bufts = False
    body = [t for t in tensors if re.match(files.BODY, t[0])]
    buft = _repack_buffer_type()
    if not body or buft is None or any(kind != gguf.GGMLQuantizationType.Q4_0 or shape[1] % 8
                                       for _, kind, shape, _ in body):
        return "CPU", None                      # only Q4_0 with rows in groups of 8 repacks
    over = (_BuftOverride * 2)(_BuftOverride(files.BODY.encode(), buft), _BuftOverride(None, None))
    mp.tensor_buft_overrides = ctypes.cast(over, ctypes.c_void_p)
    return "CPU_REPACK body, CPU rest (AMX off)", over


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]   # llama_model_tensor_buft_override


def _repack_buffer_type():
    """ggml's CPU_REPACK buffer type, from the CPU device's extra buffer types (None if absent)."""
    if "repack" not in _STATE:
        from llama_cpp._ggml import libggml as g
        vp = ctypes.c_void_p
        for name, res, args in (("ggml_backend_dev_by_type", vp, [ctypes.c_int]),
                                ("ggml_backend_dev_backend_reg", vp, [vp]),
                                ("ggml_backend_reg_get_proc_address", vp, [vp, ctypes.c_char_p]),
                                ("ggml_backend_buft_name", ctypes.c_char_p, [vp])):
            getattr(g, name).restype, getattr(g, name).argtypes = res, args
        dev = g.ggml_backend_dev_by_type(0)     # GGML_BACKEND_DEVICE_TYPE_CPU
        fn = g.ggml_backend_reg_get_proc_address(g.ggml_backend_dev_backend_reg(dev),
                                                 b"ggml_backend_dev_get_extra_bufts") if dev else None
        found = None
        if fn:
            bufts = ctypes.CFUNCTYPE(ctypes.POINTER(vp), vp)(fn)(dev)
            i = 0
            while bufts and bufts[i]:
                if g.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
                    found = bufts[i]
                i += 1
        _STATE["repack"] = found
    return _STATE["repack"]



def _lookup(ctx: list[int], ngram: int, gamma: int) -> list[int]:
    """Prompt lookup, as the lab's engine does it: the tokens after the latest earlier match
    of the context's last n tokens, n from ngram down to 1; none found -> no guesses."""
    for n in range(min(ngram, len(ctx) - 1), 0, -1):
        tail = ctx[-n:]
        for s in range(len(ctx) - n - 1, -1, -1):
            if ctx[s] == tail[0] and ctx[s:s + n] == tail:
                return ctx[s + n:s + n + gamma]
    return []


class LlamaCpp:
    """One llama.cpp model with one context (CPU, n_threads = n_threads_batch = threads),
    quiet; a context manager that frees everything on close."""

    def __init__(self, path, threads: int, n_ctx: int = 4096):
        L = self._L = _lib()
        self.path, self.threads = Path(path), threads
        self.model = self.ctx = self._batch = None
        files.check(self.path)
        _LOG.clear()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        tensors = files.tensors(self.path)
        self.buffers, keep = _placement(mp, tensors)       # keep: C reads it during the load
        self.model = L.llama_model_load_from_file(str(self.path).encode(), mp)
        del keep
        if not self.model:
            raise LlamaCppError(f"llama.cpp cannot load {self.path}: {_last_error()}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_threads, cp.n_threads_batch = n_ctx, threads, threads
        _LOG.clear()
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            self.close()
            raise LlamaCppError(f"llama.cpp cannot make a context of {n_ctx} for {self.path}: {_last_error()}")
        self.n_ctx, self.n_batch = L.llama_n_ctx(self.ctx), L.llama_n_batch(self.ctx)
        self.n_ubatch = L.llama_n_ubatch(self.ctx)
        self.mem = L.llama_get_memory(self.ctx)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_scored = int(self._meta("lab.tokenizer_size") or self.n_vocab)
        eos = self._meta("tokenizer.ggml.eos_token_id")
        self._eos = {int(eos)} if eos is not None and L.llama_vocab_type(self.vocab) == L.LLAMA_VOCAB_TYPE_NONE else set()
        self.model_bytes = int(L.llama_model_size(self.model))
        self.bytes_per_token = files.streamed_bytes(tensors, self.model_bytes)
        self._init_batch()
        self.n_past = 0                         # tokens in the KV cache (sequence 0)

    # -- plumbing ---------------------------------------------------------------------------

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = self._L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def _init_batch(self) -> None:
        """One batch of n_batch slots, every token in sequence 0; numpy views over its
        arrays so filling it costs no per-token ctypes calls."""
        L, n = self._L, self.n_batch
        self._batch = L.llama_batch_init(n, 0, 1)
        b = self._batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(n,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(n,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(n,))[:] = 1
        for i in range(n):
            b.seq_id[i][0] = 0

    def close(self) -> None:
        L = self._L
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            L.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _decode(self, tokens, logits: str = "last") -> None:
        """Appends tokens to the cache in chunks of n_batch; logits 'all', 'last' or 'none'."""
        n_all = len(tokens)
        for start in range(0, n_all, self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            n = len(chunk)
            self._tok[:n] = chunk
            self._pos[:n] = np.arange(self.n_past, self.n_past + n)
            self._out[:n] = logits == "all"
            if logits == "last" and start + n == n_all:
                self._out[n - 1] = 1
            self._batch.n_tokens = n
            _LOG.clear()
            rc = self._L.llama_decode(self.ctx, self._batch)
            if rc != 0:
                raise LlamaCppError(f"llama_decode returned {rc} at position {self.n_past}: {_last_error()}")
            self.n_past += n

    def _argmax(self, i: int) -> int:
        """Greedy pick from row i of the last batch (ties -> the lowest id)."""
        p = self._L.llama_get_logits_ith(self.ctx, i)
        if not p:
            raise LlamaCppError(f"llama.cpp has no logits for row {i}: {_last_error()}")
        return int(np.argmax(np.ctypeslib.as_array(p, shape=(self.n_scored,))))

    def _rollback(self, n: int) -> None:
        """Drops the cache past its first n tokens."""
        if not self._L.llama_memory_seq_rm(self.mem, 0, n, -1):
            raise LlamaCppError(f"llama.cpp could not cut its cache back to {n} tokens")
        self.n_past = n

    def _clear(self) -> None:
        self._L.llama_memory_clear(self.mem, True)
        self.n_past = 0

    def _start(self, ids, budget: int) -> list[int]:
        """An empty cache holding the prompt but its last token (which the first round
        decodes, as every round decodes its pending token)."""
        ids = [int(t) for t in ids]
        if not ids:
            raise LlamaCppError("the prompt is empty")
        if not 0 <= min(ids) <= max(ids) < self.n_vocab:
            raise LlamaCppError(f"the prompt has token ids outside 0..{self.n_vocab - 1}")
        if len(ids) + budget > self.n_ctx:
            raise LlamaCppError(f"{len(ids)} prompt tokens + {budget} more exceed the context of {self.n_ctx}")
        self._clear()
        if len(ids) > 1:
            self._decode(ids[:-1], "none")
        return ids

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """text -> token ids by the model's own tokenizer (special tokens parsed)."""
        L = self._L
        if L.llama_vocab_type(self.vocab) == L.LLAMA_VOCAB_TYPE_NONE:
            raise LlamaCppError(f"{self.path.name} has no tokenizer: give token ids")
        raw = text.encode()
        buf = (L.llama_token * (len(raw) + 8))()
        n = L.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), add_special, True)
        if n < 0:
            raise LlamaCppError(f"llama.cpp could not tokenize {len(raw)} bytes of text")
        return list(buf[:n])

    def is_eog(self, tok: int) -> bool:
        return bool(self._L.llama_vocab_is_eog(self.vocab, tok)) or tok in self._eos

    # -- measurements -----------------------------------------------------------------------

    def fill(self, context: int) -> None:
        """Puts `context` tokens in the cache (random ids: a pass's cost does not read them),
        for pass_seconds to time passes at its end."""
        if not 0 <= context < self.n_ctx:
            raise LlamaCppError(f"context {context}: it must be 0..{self.n_ctx - 1}")
        self._filled = np.random.default_rng(0).integers(0, self.n_scored, context + self.n_ubatch).tolist()
        self._context = context
        self._clear()
        if context:
            self._decode(self._filled[:context], "none")

    def pass_seconds(self, k: int, reps: int) -> list[float]:
        """Seconds of one llama_decode over k tokens (logits for all k, as a verification
        needs) at the end of the filled cache, reps times, the k tokens dropped after each;
        one untimed pass first, which sets up the graph for that shape."""
        context = self._context
        if not 1 <= k <= self.n_ubatch or context + k > self.n_ctx:
            raise LlamaCppError(f"k={k} at context {context}: k must be 1..{self.n_ubatch} and fit in {self.n_ctx}")
        times = []
        for r in range(reps + 1):
            t0 = time.perf_counter()
            self._decode(self._filled[context:context + k], "all")
            self._L.llama_synchronize(self.ctx)
            times.append(time.perf_counter() - t0)
            self._rollback(context)
        return times[1:]

    def forward_seconds(self, context: int, k: int, reps: int) -> list[float]:
        """fill(context), then pass_seconds(k, reps)."""
        self.fill(context)
        return self.pass_seconds(k, reps)

    def logits(self, ids) -> np.ndarray:
        """The scored logits after each of ids, from an empty cache: [len(ids), n_scored]."""
        self._clear()
        self._decode([int(t) for t in ids], "all")
        rows = [self._L.llama_get_logits_ith(self.ctx, i) for i in range(len(ids))]
        return np.stack([np.ctypeslib.as_array(p, shape=(self.n_scored,)).copy() for p in rows])

    def generate(self, ids, max_new_tokens: int) -> Run:
        """Plain greedy decoding; seconds exclude the prompt's prefill."""
        return self._rounds(ids, max_new_tokens, "plain", 0, lambda ctx: [])

    def speculate(self, ids, draft: "LlamaCpp", gamma: int, max_new_tokens: int) -> Run:
        """Greedy speculation as llama.cpp's speculative example: the draft guesses gamma
        tokens greedily, the target checks them in one pass, both caches cut back to what
        was accepted. The tokens equal generate()'s."""
        if draft.n_vocab != self.n_vocab:
            raise LlamaCppError(f"the draft's vocabulary ({draft.n_vocab}) differs from the target's ({self.n_vocab})")
        draft._start(ids, max_new_tokens + gamma)
        return self._rounds(ids, max_new_tokens, "draft", gamma, lambda ctx: draft._guess(ctx, gamma),
                            draft._settle)

    def lookup(self, ids, gamma: int, max_new_tokens: int, ngram: int = 3) -> Run:
        """Prompt lookup decoding: guesses copied from the text so far; no match, a plain step."""
        return self._rounds(ids, max_new_tokens, "lookup", gamma, lambda ctx: _lookup(ctx, ngram, gamma))

    # -- the round loop ---------------------------------------------------------------------

    def _guess(self, ctx: list[int], gamma: int) -> list[int]:
        """(As the draft) catch up on the context, the pending token included, then gamma
        greedy steps; the last guess is never fed back."""
        guess = []
        step = ctx[self.n_past:]
        while len(guess) < gamma:
            self._decode(step, "last")
            guess.append(self._argmax(len(step) - 1))
            step = guess[-1:]
        return guess

    def _settle(self, before: int, accepted: int, guessed: int) -> None:
        """(As the draft) keep what it saw of the accepted guesses."""
        self._rollback(before + min(accepted, guessed - 1))

    def _rounds(self, ids, max_new_tokens: int, kind: str, gamma: int, propose, settle=None) -> Run:
        if gamma < 0 or max_new_tokens < 1:
            raise LlamaCppError(f"gamma >= 0 and max_new_tokens >= 1, please (got {gamma}, {max_new_tokens})")
        t0 = time.perf_counter()
        ctx = self._start(ids, max_new_tokens + gamma)
        out, rounds, drafted, accepted, done = [], 0, 0, 0, False
        t1 = time.perf_counter()
        while not done:
            guess = propose(ctx)
            before = len(ctx)
            self._decode([ctx[-1], *guess], "all")
            n_acc = 0
            for i in range(len(guess) + 1):     # each guess checked, then the target's own token
                tok = self._argmax(i)
                ok = i < len(guess) and tok == guess[i]
                n_acc += ok
                ctx.append(tok)
                out.append(tok)
                done = self.is_eog(tok) or len(out) >= max_new_tokens
                if not ok or done:
                    break
            self._rollback(before + n_acc)      # the pending token and the accepted guesses
            if settle and guess:
                settle(before, n_acc, len(guess))
            rounds, drafted, accepted = rounds + 1, drafted + len(guess), accepted + n_acc
        t2 = time.perf_counter()
        return Run(out, t2 - t1, rounds, drafted, accepted,
                   {"system": "llama.cpp", "kind": kind, "gamma": gamma, "threads": self.threads,
                    "prompt_seconds": t1 - t0, "prompt_tokens": len(ctx) - len(out)})
