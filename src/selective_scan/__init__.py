"""selective-scan: Mamba's selective scan as a first-class PyTorch operator.

mamba_ssm-compatible entry points: selective_scan_fn, selective_scan_ref, mamba_inner_fn,
selective_state_update and the Mamba layer (the README lists what differs); a small LM with
mamba_ssm's parameter names; causal_conv1d_fn/update with the causal-conv1d package's
signatures (and causal_conv1d_varlen_fn for packed sequences).
``selective_scan.hf.patch_transformers()`` routes Hugging
Face transformers' Mamba fast path to these functions.
"""

import torch

from .conv import causal_conv1d_fn, causal_conv1d_update, causal_conv1d_varlen_fn
from .interface import selective_scan_fn
from .mamba_inner import mamba_inner_fn
from .models import MambaLMHeadModel
from .modules import Mamba
from .reference import selective_scan_ref
from .state_update import selective_state_update

__all__ = [
    "Mamba",
    "MambaLMHeadModel",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "causal_conv1d_varlen_fn",
    "mamba_inner_fn",
    "selective_scan_fn",
    "selective_scan_ref",
    "selective_state_update",
]
__version__ = "0.1.0"

if torch.distributed.is_available():
    # Registers the ops' DTensor sharding rules, so that the public functions take DTensors
    # (about 30 ms; torch.distributed.tensor is loaded by torch.library already).
    from . import distributed  # noqa: F401
