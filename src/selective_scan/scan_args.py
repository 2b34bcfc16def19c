"""The selective scan's arguments as one bundle, below the flat operator schemas."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class ScanArgs(NamedTuple):
    """The scan's inputs in schema order and its option: what the checks, the plans, the
    launchers, the CPU path and the reference take, so that an option is added in one place.

    u, delta, z: (batch, dim, seqlen); A: (dim, dstate); B, C: (dim, dstate),
    (batch, dstate, seqlen) or (batch, groups, dstate, seqlen); D, delta_bias: (dim,);
    initial_state: (batch or num_seqs, dim, dstate); cu_seqlens: (num_seqs + 1,)."""

    u: Tensor
    delta: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    D: Tensor | None = None
    z: Tensor | None = None
    delta_bias: Tensor | None = None
    initial_state: Tensor | None = None
    cu_seqlens: Tensor | None = None
    delta_softplus: bool = False

    @property
    def tensors(self) -> tuple:
        """The ten tensor arguments (u ... cu_seqlens), None for absent ones."""
        return tuple(self)[:10]

    @property
    def floats(self) -> tuple:
        """The floating-point inputs (u ... initial_state), which decide the compute dtype."""
        return tuple(self)[:9]

    @property
    def num_states(self):
        """Sequences whose state the scan carries: batch, or num_seqs of cu_seqlens."""
        if self.cu_seqlens is None:
            return self.u.shape[0]
        return self.cu_seqlens.shape[0] - 1
