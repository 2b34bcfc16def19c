"""The Mamba layer: mamba_ssm's ``Mamba`` (mamba_simple) on this package's operators.

Same constructor, parameter names and shapes (state_dict keys: in_proj, conv1d, x_proj,
dt_proj, A_log, D, out_proj), initialization, forward and decoding API, so Mamba-1 checkpoints
load unchanged with ``strict=True``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_non_empty, check_shape, check_tensor
from ..conv import causal_conv1d_fn, causal_conv1d_update, causal_conv1d_varlen_fn
from ..interface import selective_scan_fn
from ..mamba_inner import mamba_inner_fn
from ..state_update import selective_state_update


class Mamba(nn.Module):
    """Mamba (S6) mixer layer: (batch, seqlen, d_model) -> (batch, seqlen, d_model).

    in_proj -> (x, z); x <- silu(causal depthwise conv1d(x)); (dt, B, C) <- x_proj(x);
    delta <- dt_proj(dt); y <- selective_scan(x, delta, A = -exp(A_log), B, C, D, z);
    out_proj(y). d_inner = expand * d_model, dt_rank = ceil(d_model / 16) when "auto".

    States: conv_state (rows, d_inner, d_conv), the last d_conv inputs of the conv (oldest
    first, zeros before the start), and ssm_state (rows, d_inner, d_state), one row per batch row
    or, for packed input, per sequence. ``forward`` takes packed sequences (``cu_seqlens``),
    starts from given states (``initial_states``) and returns the states it ends in
    (``return_final_states``): running chunks one after another, carrying the states, equals one
    forward over the whole sequence (chunked prefill, truncated backpropagation through time).

    Decoding: ``allocate_inference_cache`` gives zero states; ``prefill`` runs a prompt and
    returns the states it ends in; ``step`` advances one token, updating the states in place.
    ``forward`` also takes mamba_ssm's ``inference_params`` (an object with
    ``key_value_memory_dict`` and ``seqlen_offset``; the layer needs a ``layer_idx``).
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        conv_bias: bool = True,
        bias: bool = False,
        use_fast_path: bool = True,
        layer_idx: int | None = None,
        device=None,
        dtype=None,
    ):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        rank = math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank
        for name, value in (("d_model", d_model), ("d_state", d_state), ("d_conv", d_conv),
                            ("d_inner = expand * d_model", int(expand * d_model)),
                            ("dt_rank", rank)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Mamba: {name} must be a positive integer, got {value!r}")
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = rank
        self.use_fast_path = use_fast_path
        self.layer_idx = layer_idx
        self.activation = "silu"

        self.in_proj = nn.Linear(d_model, self.d_inner * 2, bias=bias, **factory_kwargs)
        self.conv1d = nn.Conv1d(
            self.d_inner, self.d_inner, kernel_size=d_conv, groups=self.d_inner,
            padding=d_conv - 1, bias=conv_bias, **factory_kwargs,
        )  # fmt: skip
        self.x_proj = nn.Linear(
            self.d_inner, self.dt_rank + 2 * d_state, bias=False, **factory_kwargs
        )
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **factory_kwargs)
        self._init_dt_proj(dt_init, dt_scale, dt_min, dt_max, dt_init_floor)

        # S4D-real initialization: A = -(1, 2, ..., d_state) for every channel; A_log and D
        # stay float32 whatever the layer's dtype.
        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device)
        self.A_log = nn.Parameter(torch.log(A).repeat(self.d_inner, 1))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))
        self.D._no_weight_decay = True

        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory_kwargs)

    @torch.no_grad()
    def _init_dt_proj(self, dt_init, dt_scale, dt_min, dt_max, dt_init_floor) -> None:
        """dt_proj.weight keeps the variance of dt_rank inputs; dt_proj.bias is set so that
        softplus(bias) is log-uniform in [dt_min, dt_max] (floored at dt_init_floor)."""
        std = self.dt_rank**-0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, std)
        elif dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        else:
            raise ValueError(f"Mamba: dt_init must be 'random' or 'constant', got {dt_init!r}")
        bias = self.dt_proj.bias
        log_min, log_max = math.log(dt_min), math.log(dt_max)
        log_dt = log_min + torch.rand(self.d_inner, device=bias.device) * (log_max - log_min)
        dt = torch.exp(log_dt).clamp(min=dt_init_floor)
        bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        bias._no_reinit = True  # model-level init must not zero this bias

    def _conv_weight(self) -> Tensor:
        return self._param(self.conv1d.weight)[:, 0]  # (d_inner, d_conv)

    def _A(self) -> Tensor:
        return -torch.exp(self._param(self.A_log).float())

    # What the state-carrying paths (prefill, forward with states, step) compute with; a
    # tensor-parallel layer (distributed/tensor_parallel.py) replaces these with its shards'.

    def _param(self, t: Tensor | None) -> Tensor | None:
        """The tensor a parameter contributes to this layer's computation: itself."""
        return t

    def _in_proj(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        """(..., d_model) -> (x, z), (..., d_inner) each."""
        return self.in_proj(hidden_states).chunk(2, dim=-1)

    def _x_proj(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (..., d_inner) -> (dt (..., dt_rank), B, C (..., d_state))."""
        return self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)

    def _out_proj(self, y: Tensor) -> Tensor:
        """(..., d_inner) -> (..., d_model)."""
        return self.out_proj(y)

    def forward(
        self,
        hidden_states: Tensor,
        inference_params=None,
        *,
        cu_seqlens: Tensor | None = None,
        initial_states: tuple[Tensor, Tensor] | None = None,
        return_final_states: bool = False,
    ) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor]]:
        """hidden_states: (batch, seqlen, d_model) -> (batch, seqlen, d_model).

        cu_seqlens: (num_seqs + 1,) int32/int64, sequences packed along seqlen (batch must be
        1), 0 = c_0 <= ... <= c_num_seqs = seqlen: the conv and the scan restart at each
        boundary. initial_states: (conv_state, ssm_state) to continue from (see the class
        docstring), one row per batch row or per packed sequence; zeros when None. With
        return_final_states, returns (out, (conv_state, ssm_state)), the states after each
        row's or sequence's last token in allocate_inference_cache's dtypes. Gradients flow
        into initial_states and out of the final states.
        """
        self._check_hidden_states("Mamba.forward", hidden_states, seqlen=None)
        if inference_params is not None:
            if cu_seqlens is not None or initial_states is not None or return_final_states:
                raise ValueError(
                    "Mamba.forward: inference_params keeps the states in its own cache; it "
                    "cannot be combined with cu_seqlens, initial_states or return_final_states"
                )
            return self._forward_with_cache(hidden_states, inference_params)
        plain = cu_seqlens is None and initial_states is None and not return_final_states
        if plain and self.use_fast_path:
            return self._fast_forward(hidden_states)
        out, final_states = self._forward_with_states(hidden_states, cu_seqlens, initial_states)
        return (out, final_states) if return_final_states else out

    def _check_hidden_states(self, fn: str, hidden_states: Tensor, seqlen: int | None) -> None:
        """(batch, seqlen, d_model) on the layer's device, in its dtype outside autocast (the
        projections would fail with torch's own messages)."""
        weight = self.in_proj.weight
        check_tensor("hidden_states", hidden_states, (3,), device=weight.device, ref="the layer",
                     fn=fn)  # fmt: skip
        labels = "(batch, seqlen, d_model)" if seqlen is None else "(batch, 1, d_model)"
        check_shape(fn, "hidden_states", hidden_states, (None, seqlen, self.d_model), labels)
        check_non_empty(fn, "hidden_states", hidden_states, labels)
        autocast = torch.is_autocast_enabled(hidden_states.device.type)
        if hidden_states.dtype != weight.dtype and not autocast:
            raise TypeError(
                f"{fn}: hidden_states must have the layer's dtype {weight.dtype} outside "
                f"autocast, got {hidden_states.dtype}"
            )

    def _fast_forward(self, hidden_states: Tensor) -> Tensor:
        """One mamba_inner_fn call, which recomputes the conv in the backward (no states)."""
        return mamba_inner_fn(
            self.in_proj(hidden_states).transpose(1, 2),
            self.conv1d.weight,
            self.conv1d.bias,
            self.x_proj.weight,
            self.dt_proj.weight,
            self.out_proj.weight,
            self.out_proj.bias,
            self._A(),
            None,  # input-dependent B
            None,  # input-dependent C
            self.D.float(),
            delta_bias=self.dt_proj.bias.float(),
            delta_softplus=True,
        )

    def _forward_with_cache(self, hidden_states: Tensor, inference_params) -> Tensor:
        """mamba_ssm's protocol: prefill at seqlen_offset 0, then one step per call."""
        conv_state, ssm_state = self._states_from_cache(inference_params, hidden_states)
        if inference_params.seqlen_offset > 0:
            return self.step(hidden_states, conv_state, ssm_state)[0]
        out, new_conv_state, new_ssm_state = self.prefill(hidden_states)
        conv_state.copy_(new_conv_state)
        ssm_state.copy_(new_ssm_state)
        return out

    def prefill(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Run a prompt from zero states and return the states it ends in.

        hidden_states: (batch, seqlen, d_model) -> (out (batch, seqlen, d_model),
        conv_state (batch, d_inner, d_conv), ssm_state (batch, d_inner, d_state)), the states
        in allocate_inference_cache's dtypes.
        """
        out, (conv_state, ssm_state) = self._forward_with_states(hidden_states, None, None)
        return out, conv_state, ssm_state

    def _forward_with_states(
        self,
        hidden_states: Tensor,
        cu_seqlens: Tensor | None,
        initial_states: tuple[Tensor, Tensor] | None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """The conv and the scan as separate ops, from given states (zeros when None)."""
        conv_state, ssm_state = self._initial_states(hidden_states, cu_seqlens, initial_states)
        x, z = self._in_proj(hidden_states)  # (batch, seqlen, d_inner) each
        x, conv_state = self._conv(x.transpose(1, 2), conv_state, cu_seqlens)
        dt, B, C = self._x_proj(x.transpose(1, 2))
        y, ssm_state = selective_scan_fn(
            x,
            F.linear(dt, self._param(self.dt_proj.weight)).transpose(1, 2),
            self._A(),
            B.transpose(1, 2),
            C.transpose(1, 2),
            self._param(self.D).float(),
            z.transpose(1, 2),
            self._param(self.dt_proj.bias).float(),
            delta_softplus=True,
            return_last_state=True,
            initial_state=ssm_state,
            cu_seqlens=cu_seqlens,
        )
        out = self._out_proj(y.transpose(1, 2))
        final_states = (
            conv_state.to(self.conv1d.weight.dtype),
            ssm_state.to(self.dt_proj.weight.dtype),
        )
        return out, final_states

    def _conv(
        self, x: Tensor, conv_state: Tensor, cu_seqlens: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """x: (batch, d_inner, seqlen) after conv_state (rows, d_inner, d_conv) ->
        (silu(conv1d(x)), the conv_state after x)."""
        weight, bias = self._conv_weight(), self._param(self.conv1d.bias)
        if cu_seqlens is not None:
            return causal_conv1d_varlen_fn(
                x, weight, bias, cu_seqlens=cu_seqlens, initial_states=conv_state,
                return_final_states=True, activation=self.activation,
            )  # fmt: skip
        # The conv reads the last d_conv - 1 inputs before x; the state keeps d_conv of them.
        out = causal_conv1d_fn(
            x, weight, bias, initial_states=conv_state[..., 1:], activation=self.activation
        )
        x_hist = torch.cat([conv_state.to(x.dtype), x], dim=-1)
        return out, x_hist[..., x_hist.shape[-1] - self.d_conv :]

    def _initial_states(
        self,
        hidden_states: Tensor,
        cu_seqlens: Tensor | None,
        initial_states: tuple[Tensor, Tensor] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Check the arguments of forward; returns (conv_state, ssm_state), a zero conv_state
        and no ssm_state (the scan starts from zeros) when initial_states is None."""
        fn = "Mamba.forward"
        check_tensor("hidden_states", hidden_states, (3,), fn=fn)
        rows, rows_label = hidden_states.shape[0], "batch"
        if cu_seqlens is not None:
            if hidden_states.shape[0] != 1:
                raise ValueError(
                    f"{fn}: with cu_seqlens the sequences are packed along seqlen and "
                    "hidden_states must have shape (1, total_len, d_model), got "
                    f"{tuple(hidden_states.shape)}"
                )
            check_tensor("cu_seqlens", cu_seqlens, (1,), dtypes=(torch.int32, torch.int64), fn=fn)
            rows, rows_label = cu_seqlens.shape[0] - 1, "num_seqs"
        if initial_states is None:
            conv_state = hidden_states.new_zeros(rows, self.d_inner, self.d_conv)
            return conv_state, None
        if not isinstance(initial_states, tuple | list) or len(initial_states) != 2:
            raise TypeError(
                f"{fn}: initial_states must be a pair (conv_state, ssm_state), got "
                f"{type(initial_states).__name__}"
            )
        conv_state, ssm_state = initial_states
        for name, state, size, size_label in (
            ("conv_state", conv_state, self.d_conv, "d_conv"),
            ("ssm_state", ssm_state, self.d_state, "d_state"),
        ):
            check_tensor(name, state, (3,), fn=fn)
            shape_label = f"({rows_label}, d_inner, {size_label})"
            expected = (rows, self.d_inner, size)
            check_shape(fn, f"initial_states' {name}", state, expected, shape_label)
        return conv_state, ssm_state

    def step(
        self, hidden_states: Tensor, conv_state: Tensor, ssm_state: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Advance one token: hidden_states (batch, 1, d_model) -> (out (batch, 1, d_model),
        conv_state, ssm_state), the states updated in place."""
        fn = "Mamba.step"
        self._check_hidden_states(fn, hidden_states, seqlen=1)
        check_tensor("ssm_state", ssm_state, (3,), device=hidden_states.device,
                     ref="hidden_states", fn=fn)  # fmt: skip
        rows = (hidden_states.shape[0], self.d_inner, self.d_state)
        check_shape(fn, "ssm_state", ssm_state, rows, "(batch, d_inner, d_state)")
        x, z = self._in_proj(hidden_states[:, 0])  # (batch, d_inner) each
        x = causal_conv1d_update(
            x, conv_state, self._conv_weight(), self._param(self.conv1d.bias), self.activation
        )
        dt, B, C = self._x_proj(x)
        y = selective_state_update(
            ssm_state, x, F.linear(dt, self._param(self.dt_proj.weight)), self._A(), B, C,
            self._param(self.D), z, dt_bias=self._param(self.dt_proj.bias), dt_softplus=True,
        )  # fmt: skip
        return self._out_proj(y).unsqueeze(1), conv_state, ssm_state

    def allocate_inference_cache(
        self, batch_size: int, max_seqlen: int, dtype: torch.dtype | None = None, **kwargs
    ) -> tuple[Tensor, Tensor]:
        """Zero states (conv_state (batch_size, d_inner, d_conv), ssm_state (batch_size,
        d_inner, d_state)), in the conv1d and dt_proj weights' dtypes unless dtype is given.
        max_seqlen is unused (the states do not grow), kept for mamba_ssm's signature."""
        device = self.out_proj.weight.device
        conv_state = torch.zeros(
            batch_size, self.d_inner, self.d_conv, device=device,
            dtype=dtype or self.conv1d.weight.dtype,
        )  # fmt: skip
        ssm_state = torch.zeros(
            batch_size, self.d_inner, self.d_state, device=device,
            dtype=dtype or self.dt_proj.weight.dtype,
        )  # fmt: skip
        return conv_state, ssm_state

    def _states_from_cache(self, inference_params, hidden_states: Tensor):
        """This layer's (conv_state, ssm_state) in inference_params.key_value_memory_dict,
        allocated on first use."""
        if self.layer_idx is None:
            raise ValueError("Mamba: forward with inference_params needs the layer's layer_idx")
        cache = inference_params.key_value_memory_dict
        if self.layer_idx not in cache:
            cache[self.layer_idx] = self.allocate_inference_cache(hidden_states.shape[0], 0)
        return cache[self.layer_idx]
