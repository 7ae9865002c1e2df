"""The reference against transformers on a model's real weights."""
from __future__ import annotations

import torch

from .load import load
from .reference import Reference

CODE = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"


@torch.no_grad()
def against_transformers(name: str, text: str = CODE, greedy_tokens: int = 24) -> dict:
    """Max |logit difference|, top-1 agreement and greedy agreement on one prompt (one
    model in memory at a time: the reference's logits are kept, then transformers loads)."""
    from transformers import AutoModelForCausalLM
    m = load(name)
    ids = m.tokenizer(text)["input_ids"]
    n = m.config.tokenizer_size
    ref = Reference(m.config, m.weights, max_context=len(ids) + greedy_tokens + 8)
    ours = ref.forward(ids, 0)
    our_greedy = ref.greedy(ids, greedy_tokens)
    del ref
    hf = AutoModelForCausalLM.from_pretrained(str(m.folder), dtype=torch.float32, attn_implementation="eager").eval()
    theirs = hf(torch.tensor([ids])).logits[0]
    gen = hf.generate(torch.tensor([ids]), max_new_tokens=greedy_tokens, do_sample=False, eos_token_id=None,
                      pad_token_id=0, suppress_tokens=list(range(n, m.config.vocab_size)))[0, len(ids):].tolist()
    return {"model": name, "tokens": len(ids), "max_abs_logit_diff": float((ours - theirs).abs().max()),
            "max_abs_logit": float(theirs.abs().max()),
            "top1_equal": bool(torch.equal(ours[:, :n].argmax(-1), theirs[:, :n].argmax(-1))),
            "greedy_equal": our_greedy == gen, "greedy_tokens": greedy_tokens}
