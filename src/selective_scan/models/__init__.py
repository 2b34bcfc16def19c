"""Models built from the Mamba layer."""

from .mixer_seq_simple import MambaLMHeadModel

__all__ = ["MambaLMHeadModel"]
