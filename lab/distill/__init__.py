"""Distillation: a draft taught to agree with its target (data, losses, training loop)."""
