"""Compile the scan kernels for an H100/H200 (sm_90) on a machine without a GPU.

Triton ships ptxas, so the whole pipeline (TTIR, TTGIR, PTX, cubin) runs on a CPU machine. The
launchers run on CPU tensors while their launches are recorded (launch.recording), so each gets
exactly the specialization it would get on the GPU (dtypes, constexprs, 16-byte divisibility
of pointers and integers). Used by ``bench/inspect_kernels.py`` (registers, SASS) and by the
tests, where a configuration that Triton cannot compile fails on CPU-only CI rather than on the
first GPU that runs it. Reads Triton 3.x internals (``create_function_from_signature``,
``JITFunction._pack_args``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from ..scan_args import ScanArgs
from .launch import recording
from .scan import launch_bwd, launch_fwd
from .tiles import current_policy

SM90 = GPUTarget("cuda", 90, 32)


def record_launches(run: Callable[[], object]) -> list[tuple]:
    """(kernel, grid, kwargs, launcher key) of every launch ``run()`` makes through the
    launchers, which run on CPU tensors but launch nothing."""
    with recording() as launches:
        run()
    return launches


def scan_launches(inputs: dict, delta_softplus: bool) -> list[tuple]:
    """The launches (see record_launches) of a forward and a backward of the scan on these CPU
    inputs (the scan ops' keyword names, u to cu_seqlens), with fast math (MUFU) as the
    launchers choose it for CUDA tensors."""
    args = ScanArgs(**inputs, delta_softplus=delta_softplus)
    policy = current_policy().replace(fast_math=True)

    def both_directions():
        out, _, checkpoints = launch_fwd(args, policy)
        launch_bwd(torch.randn_like(out), None, args, checkpoints, policy)

    return record_launches(both_directions)


def compile_sm90(kernel, kwargs: dict):
    """Compile a JIT kernel for sm_90 with the specialization these arguments would get;
    returns Triton's CompiledKernel (``.asm["cubin"]``, ``.metadata``)."""
    backend = make_backend(SM90)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    src = triton.compiler.ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=SM90, options=options.__dict__)
