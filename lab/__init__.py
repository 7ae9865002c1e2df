"""lab — what speculative decoding of Qwen-family models costs and buys on a CPU."""

__version__ = "0.1.0"
