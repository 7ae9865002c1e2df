"""Models: where weights come from, the from-scratch reference, the twin, the engine's file."""
from .config import ModelConfig
from .reference import Reference
from .tiny import TINY, tiny_weights

__all__ = ["ModelConfig", "Reference", "TINY", "tiny_weights"]
