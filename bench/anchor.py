"""The anchor, state-spaces/mamba's CUDA selective scan: built in this process, timed beside ours.

The sources are not part of this repository. Put mamba's ``csrc/selective_scan`` under
``bench/anchor_src/csrc/selective_scan`` (git-ignored), for instance from a checkout of
state-spaces/mamba: ``git archive HEAD csrc/selective_scan | tar -x -C bench/anchor_src``. The
build uses the nvcc flags of mamba's setup.py for sm_90 (../shared/anchors.md), about 130 s on 12
cores; ``build`` returns None when the sources, nvcc or a GPU are missing, and the benchmarks then
fall back to the recorded anchor figures, labelled as such.

``forward``, ``backward`` and ``forward_backward`` call the extension's ``fwd`` and ``bwd``
directly, without mamba's Python autograd wrapper: the anchor's own host time is left out, which
flatters it. ``AnchorScan`` is such a wrapper (written here, not mamba's): a training step through
it pays what ours pays around the kernels, autograd's engine included.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

SOURCES = Path(__file__).resolve().parent / "anchor_src" / "csrc" / "selective_scan"
BUILD_DIR = Path(__file__).resolve().parent.parent / "build" / "anchor"  # git-ignored
# setup.py's nvcc flags (append_nvcc_threads adds --threads 4), for sm_90 only.
NVCC_FLAGS = [
    "-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", "-lineinfo",
    "--threads", "4", "-gencode", "arch=compute_90,code=sm_90",
]  # fmt: skip


def build(build_dir: str | os.PathLike = BUILD_DIR, jobs: int = 12):
    """The compiled ``selective_scan_cuda`` module (built into build_dir, reused when already
    built there), or None where it cannot be built here. Prints the build's seconds."""
    if not SOURCES.is_dir() or shutil.which("nvcc") is None or not torch.cuda.is_available():
        return None
    from torch.utils.cpp_extension import load

    os.environ.setdefault("MAX_JOBS", str(jobs))
    Path(build_dir).mkdir(parents=True, exist_ok=True)
    sources = [str(SOURCES / "selective_scan.cpp"), *map(str, sorted(SOURCES.glob("*.cu")))]
    t0 = time.perf_counter()
    module = load(
        name="selective_scan_cuda", sources=sources, build_directory=str(build_dir),
        extra_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=NVCC_FLAGS,
        extra_include_paths=[str(SOURCES)], verbose=False,
    )  # fmt: skip
    print(f"  anchor built or loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    return module


def anchor_inputs(x: dict) -> tuple:
    """The extension's forward arguments from bench inputs (shapes.make_bench_inputs): B and C
    with their groups axis, as mamba's wrapper passes them."""
    B, C = (t if t.dim() == 4 else t.unsqueeze(1) for t in (x["B"], x["C"]))
    return (x["u"], x["delta"], x["A"], B, C, x["D"], x["z"], x["delta_bias"],
            x["delta_softplus"])  # fmt: skip


def forward(module, args: tuple):
    """(out_z, x, out): the extension's forward, with z (bench inputs always have z)."""
    out, saved, out_z = module.fwd(*args)
    return out_z, saved, out


def backward(module, args: tuple, saved: tuple, dout: torch.Tensor) -> tuple:
    """The extension's backward given dout and what ``forward`` returned for args."""
    u, delta, A, B, C, D, z, bias, softplus = args
    _, x, out = saved
    return module.bwd(u, delta, A, B, C, D, z, bias, dout, x, out, None, softplus, False)


class AnchorScan(torch.autograd.Function):
    """The extension through autograd, as mamba's ``selective_scan_fn`` runs it for a training
    step: ``AnchorScan.apply(module, u, delta, A, B, C, D, z, delta_bias, delta_softplus)`` with
    the public function's arguments (B and C with or without their groups axis; z and
    delta_bias given and every tensor contiguous, as the bench inputs have them) -> out."""

    @staticmethod
    def forward(ctx, module, u, delta, A, B, C, D, z, delta_bias, delta_softplus):
        ctx.squeeze = (B.dim() == 3, C.dim() == 3)
        B, C = (t.unsqueeze(1) if t.dim() == 3 else t for t in (B, C))
        args = (u, delta, A, B, C, D, z, delta_bias, delta_softplus)
        out_z, x, out = forward(module, args)
        ctx.module, ctx.delta_softplus = module, delta_softplus
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, x, out)
        return out_z

    @staticmethod
    def backward(ctx, dout):
        u, delta, A, B, C, D, z, delta_bias, x, out = ctx.saved_tensors
        args = (u, delta, A, B, C, D, z, delta_bias, ctx.delta_softplus)
        # bwd returns du, ddelta, dA, dB, dC, dD, ddelta_bias, dz
        du, ddelta, dA, dB, dC, dD, dbias, dz = backward(ctx.module, args, (None, x, out),
                                                         dout.contiguous())  # fmt: skip
        dB, dC = (g.squeeze(1) if sq else g for g, sq in zip((dB, dC), ctx.squeeze, strict=True))
        return None, du, ddelta, dA, dB, dC, dD, dz, dbias, None


def forward_backward(module, args: tuple, dout: torch.Tensor) -> tuple:
    """The extension's forward then its backward given dout: what a training step runs."""
    return backward(module, args, forward(module, args), dout)
