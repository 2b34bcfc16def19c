"""Compile the scan kernels for an H100/H200 (sm_90) on a machine without a GPU.

Triton ships ptxas, so the whole pipeline (TTIR, TTGIR, PTX, cubin) runs on a CPU machine. The
launchers run on CPU tensors with ``wrap_triton`` swapped for a recorder, so each kernel gets
exactly the specialization it would get on the GPU (dtypes, constexprs, 16-byte divisibility
of pointers and integers). Used by ``bench/inspect_kernels.py`` (registers, SASS) and by the
tests, where a configuration that Triton cannot compile fails on CPU-only CI rather than on the
first GPU that runs it. Reads Triton 3.x internals (``create_function_from_signature``,
``JITFunction._pack_args``).
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from . import scan

SM90 = GPUTarget("cuda", 90, 32)


def record_launches(run: Callable[[], object]) -> list[tuple]:
    """(kernel, grid, args, kwargs) of every launch ``run()`` makes through the scan
    launchers, which run on CPU tensors but launch nothing."""
    launches = []

    def wrap(kernel):
        class _Launch:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: launches.append((kernel, grid, args, kwargs))

        return _Launch()

    # FAST: MUFU approximations, as the launchers choose them for CUDA tensors.
    # An empty plan cache: cached plans may hold another FAST flag (interpreter runs).
    with (
        mock.patch.object(scan, "_PLANS", {}),
        mock.patch.object(scan, "wrap_triton", wrap),
        mock.patch.object(scan, "_fast_math", lambda u, cdt: cdt == torch.float32),
    ):
        run()
    return launches


def scan_launches(inputs: dict, delta_softplus: bool) -> list[tuple]:
    """The launches (see record_launches) of a forward and a backward of the scan on these CPU
    inputs (the scan ops' keyword names, u to cu_seqlens)."""

    def both_directions():
        out, _, checkpoints = scan.scan_fwd(**inputs, delta_softplus=delta_softplus)
        scan.scan_bwd(torch.randn_like(out), None, **inputs, checkpoints=checkpoints,
                      delta_softplus=delta_softplus)  # fmt: skip

    return record_launches(both_directions)


def compile_sm90(kernel, args: tuple, kwargs: dict):
    """Compile a JIT kernel for sm_90 with the specialization these arguments would get;
    returns Triton's CompiledKernel (``.asm["cubin"]``, ``.metadata``)."""
    backend = make_backend(SM90)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    src = triton.compiler.ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=SM90, options=options.__dict__)
