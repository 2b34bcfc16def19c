"""selective-scan: Mamba's selective scan as a first-class PyTorch operator."""

from .interface import selective_scan_fn
from .reference import selective_scan_ref

__all__ = ["selective_scan_fn", "selective_scan_ref"]
__version__ = "0.1.0"
