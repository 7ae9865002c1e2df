"""Other systems run beside the lab on the same weights, prompts and threads: llama.cpp
(through llama-cpp-python) and transformers. Each answers with a Run, so the baselines
section can pair any two in one run."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Run:
    """One generation by some system: the new tokens and the seconds they took (the
    prompt's prefill excluded), with the speculative bookkeeping when there was any."""
    tokens: list[int]
    seconds: float
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")
