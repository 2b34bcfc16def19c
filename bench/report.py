"""Helpers the benchmark scripts share."""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import platform
import subprocess
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform reports."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def git_commit() -> str:
    """GIT_COMMIT if set (a copied tree has no .git), else ``git rev-parse HEAD``."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    with contextlib.suppress(OSError):
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=False
        )
        return result.stdout.strip() or "unknown"
    return "unknown"


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


def edited_module(module: ModuleType, edits, name: str, source: Path | None = None) -> ModuleType:
    """A copy of one of the package's kernel modules (or of another version of it, at source)
    with its source edited ((old, new) pairs, each applied once), loaded from a file of its
    own: Triton reads a kernel's source from its file, so experiments on a kernel go through
    such a copy."""
    origin = Path(source or module.__file__)
    src = origin.read_text().replace(
        "from .common import", "from selective_scan.kernels.common import"
    )
    for old, new in edits:
        if old not in src:
            raise SystemExit(f"{origin.name} changed: no {old.strip()!r} to edit")
        src = src.replace(old, new, 1)
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


def capture(fn: Callable) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph of one call of fn, fn's output in the graph's memory). Warms up on a side stream
    first, as CUDA graphs need (Triton compiles, cuBLAS picks its workspace there); a training
    step's backward then allocates its gradients from the graph's pool if fn sets them to None,
    as torch's whole-network capture does."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out
