"""Runnable programs built on the library, apart from its operators: the selective-copying main
job (``python -m selective_scan.apps.copying``) and the operator demo
(``python -m selective_scan.apps.demo``)."""

from __future__ import annotations

import sys

import torch


def device_from(name: str | None) -> torch.device:
    """The device a ``--device`` argument names (default: cuda if present, else cpu); exits
    with a one-line message when it names an accelerator this machine does not have."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {name}: no CUDA GPU is available here (torch {torch.__version__})")
    return device
