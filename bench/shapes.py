"""Benchmark shapes (the anchor table of ../shared/anchors.md) and their inputs."""

from __future__ import annotations

import torch

# name: (batch, dim, dstate, seqlen, groups, dtype)
SHAPES = {
    "S1": (8, 1536, 16, 2048, 1, torch.bfloat16),
    "S2": (4, 4096, 16, 2048, 1, torch.bfloat16),
    "S3": (1, 1536, 16, 16384, 1, torch.bfloat16),
    "S4": (8, 1536, 16, 2048, 1, torch.float32),
    "S5": (16, 2048, 16, 1024, 4, torch.bfloat16),
    "S6": (1, 5120, 16, 256, 1, torch.bfloat16),
    "S7": (8, 5120, 16, 2048, 1, torch.bfloat16),
    # Ours: 64 states, whose anchor is in ../shared/notes/kernel-design.md (section 1.8).
    "S8": (8, 2048, 64, 2048, 1, torch.bfloat16),
}

# state-spaces/mamba's selective_scan_cuda on an H200, 2026-11-29 (fwd ms, bwd ms); S8's in the
# same build, its launch table reduced to the 128 x 16 configuration that 2048 steps take.
ANCHORS_MS = {
    "S1": (0.449, 1.777),
    "S2": (0.591, 2.310),
    "S3": (0.554, 1.982),
    "S4": (0.877, 2.031),
    "S5": (0.567, 2.314),
    "S6": (0.0315, 0.190),
    "S7": (1.447, 5.709),
    "S8": (1.975, 8.915),
}

# The scan ops' inputs in schema order (make_bench_inputs' keys), then the softplus flag.
SCAN_INPUTS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state", "cu_seqlens")
FWD_ARGS = (*SCAN_INPUTS, "delta_softplus")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_bench_inputs(
    shape: str,
    device: str = "cuda",
    dtype: str | None = None,
    small_seqlen: int | None = None,
    seed: int = 0,
) -> dict:
    """The anchors' inputs: u, z, B, C ~ N(0,1); delta ~ 0.5 U(0,1); A = -(0.5 U(0,1) + 0.1);
    D ~ N(0,1); delta_bias ~ 0.5 U(0,1); variable (grouped) B/C; softplus on. Keyword names
    are those of the scan ops."""
    batch, dim, dstate, seqlen, groups, dt = SHAPES[shape]
    dt = _DTYPES[dtype] if dtype else dt
    seqlen = small_seqlen or seqlen
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*s, dtype=dt):
        return torch.randn(s, generator=gen, device=device, dtype=dtype)

    def uniform(*s):
        return torch.rand(s, generator=gen, device=device, dtype=torch.float32)

    bc_shape = (batch, dstate, seqlen) if groups == 1 else (batch, groups, dstate, seqlen)
    return {
        "u": normal(batch, dim, seqlen),
        "delta": (0.5 * uniform(batch, dim, seqlen)).to(dt),
        "A": -(0.5 * uniform(dim, dstate) + 0.1),
        "B": normal(*bc_shape),
        "C": normal(*bc_shape),
        "D": normal(dim, dtype=torch.float32),
        "z": normal(batch, dim, seqlen),
        "delta_bias": 0.5 * uniform(dim),
        "initial_state": None,
        "cu_seqlens": None,
        "delta_softplus": True,
    }
