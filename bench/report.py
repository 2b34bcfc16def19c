"""Helpers the GPU benchmark scripts share."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import traceback
from collections.abc import Callable

import torch


def environment(device: str) -> dict:
    """Where and with what a result was measured: device, date, versions, scan backend."""
    info = {
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": os.environ.get("SELECTIVE_SCAN_BACKEND", "auto"),
    }
    with contextlib.suppress(ImportError):
        import triton

        info["triton"] = triton.__version__
    return info


def guarded(fn: Callable, *args) -> dict:
    """fn(*args), or {"error", "traceback"} if it raises, so that one failure keeps the rest of
    a benchmark's results."""
    try:
        return fn(*args)
    except Exception as e:
        return {"error": repr(e), "traceback": traceback.format_exc()[-3000:]}
