"""Model layers built on the selective-scan operators."""

from .mamba_simple import Mamba

__all__ = ["Mamba"]
