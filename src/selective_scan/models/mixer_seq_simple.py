"""A Mamba language model: embedding, residual Mamba blocks with RMSNorm, tied LM head.

Module and parameter names follow mamba_ssm's ``MambaLMHeadModel`` (backbone.embedding,
backbone.layers.{i}.norm / .mixer, backbone.norm_f, lm_head), so its checkpoints of Mamba-1
models with RMSNorm and no MLP load with ``strict=True``.

Decoding keeps a cache: one (conv_state, ssm_state) pair per layer (see ``Mamba``). ``prefill``
runs a prompt, or the next chunk of one from a given cache, and returns the cache it ends in;
``step`` maps (token, cache) to (logits, new cache) without touching its inputs, so it exports
with the cache as plain inputs and outputs. ``forward`` and ``prefill`` also take documents
packed along seqlen (``cu_seqlens``), each starting afresh.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..modules.mamba_simple import Mamba

Cache = list[tuple[Tensor, Tensor]]


def add_norm(
    norm: nn.RMSNorm, hidden_states: Tensor, residual: Tensor | None, residual_in_fp32: bool
) -> tuple[Tensor, Tensor]:
    """residual <- residual + hidden_states (hidden_states alone for the first block);
    returns (norm(residual) in the norm's dtype, residual, float32 if residual_in_fp32)."""
    residual = hidden_states if residual is None else residual + hidden_states
    normed = norm(residual.to(norm.weight.dtype))
    return normed, residual.float() if residual_in_fp32 else residual


# mix(mixer, normed input) -> mixer output: how a block calls its mixer (prefill, step).
Mix = Callable[[Mamba, Tensor], Tensor]


class Block(nn.Module):
    """Pre-norm residual block: (hidden_states, residual) -> (mixer(norm(residual')), residual')
    where residual' = residual + hidden_states."""

    def __init__(
        self,
        d_model: int,
        mixer: Mamba,
        norm_epsilon: float,
        residual_in_fp32: bool,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.mixer = mixer
        self.norm = nn.RMSNorm(d_model, eps=norm_epsilon, device=device, dtype=dtype)

    def forward(
        self, hidden_states: Tensor, residual: Tensor | None = None, mix: Mix | None = None
    ) -> tuple[Tensor, Tensor]:
        normed, residual = add_norm(self.norm, hidden_states, residual, self.residual_in_fp32)
        return (self.mixer(normed) if mix is None else mix(self.mixer, normed)), residual


class MixerModel(nn.Module):
    """Embedding, n_layer Blocks and the final RMSNorm: input_ids (batch, seqlen) ->
    normalized hidden states (batch, seqlen, d_model)."""

    def __init__(
        self,
        d_model: int,
        n_layer: int,
        vocab_size: int,
        ssm_cfg: dict,
        norm_epsilon: float,
        residual_in_fp32: bool,
        device=None,
        dtype=None,
    ):
        super().__init__()
        factory_kwargs = {"device": device, "dtype": dtype}
        self.residual_in_fp32 = residual_in_fp32
        self.embedding = nn.Embedding(vocab_size, d_model, **factory_kwargs)
        self.layers = nn.ModuleList(
            Block(
                d_model,
                Mamba(d_model, layer_idx=i, **ssm_cfg, **factory_kwargs),
                norm_epsilon,
                residual_in_fp32,
                **factory_kwargs,
            )
            for i in range(n_layer)
        )
        self.norm_f = nn.RMSNorm(d_model, eps=norm_epsilon, **factory_kwargs)

    def forward(self, input_ids: Tensor, mix: Mix | None = None) -> Tensor:
        """mix, when given, replaces every block's plain mixer call."""
        hidden_states, residual = self.embedding(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, mix)
        return add_norm(self.norm_f, hidden_states, residual, self.residual_in_fp32)[0]


class MambaLMHeadModel(nn.Module):
    """Mamba language model: input_ids (batch, seqlen) -> logits (batch, seqlen, vocab).

    ssm_cfg: keyword arguments of every ``Mamba`` layer (d_state, d_conv, expand, ...). The
    vocabulary is padded up to a multiple of pad_vocab_size_multiple, as in mamba_ssm.
    Initialization follows mamba_ssm: embedding N(0, 0.02), Linear biases zero (except
    dt_proj's), out_proj weights scaled by 1 / sqrt(n_layer).
    """

    def __init__(
        self,
        d_model: int,
        n_layer: int,
        vocab_size: int,
        ssm_cfg: dict | None = None,
        norm_epsilon: float = 1e-5,
        residual_in_fp32: bool = True,
        pad_vocab_size_multiple: int = 1,
        tie_embeddings: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        vocab_size = math.ceil(vocab_size / pad_vocab_size_multiple) * pad_vocab_size_multiple
        self.backbone = MixerModel(
            d_model, n_layer, vocab_size, ssm_cfg or {}, norm_epsilon, residual_in_fp32,
            device=device, dtype=dtype,
        )  # fmt: skip
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False, device=device, dtype=dtype)
        self._init_weights(n_layer)
        if tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    @torch.no_grad()
    def _init_weights(self, n_layer: int) -> None:
        nn.init.normal_(self.backbone.embedding.weight, std=0.02)
        for name, module in self.named_modules():
            has_bias = isinstance(module, nn.Linear) and module.bias is not None
            if has_bias and not getattr(module.bias, "_no_reinit", False):
                nn.init.zeros_(module.bias)
            # Each block adds its out_proj output to the residual stream: keep the sum's
            # variance independent of depth (GPT-2's scheme).
            if name.endswith("mixer.out_proj"):
                module.weight /= math.sqrt(n_layer)

    def forward(self, input_ids: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        """input_ids (batch, seqlen) -> logits (batch, seqlen, vocab).

        cu_seqlens: (num_docs + 1,) int32/int64, documents packed along seqlen (batch must be
        1): every layer restarts at each boundary, so each document's logits are those of its
        own forward.
        """
        if cu_seqlens is None:
            return self.lm_head(self.backbone(input_ids))

        def mix(mixer, hidden_states):
            return mixer(hidden_states, cu_seqlens=cu_seqlens)

        return self.lm_head(self.backbone(input_ids, mix))

    def allocate_inference_cache(
        self, batch_size: int, max_seqlen: int = 0, dtype: torch.dtype | None = None
    ) -> Cache:
        """Zero states, one (conv_state, ssm_state) pair per layer (see Mamba)."""
        return [
            layer.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype)
            for layer in self.backbone.layers
        ]

    def prefill(
        self, input_ids: Tensor, cache: Cache | None = None, cu_seqlens: Tensor | None = None
    ) -> tuple[Tensor, Cache]:
        """input_ids (batch, seqlen) -> (logits (batch, seqlen, vocab), the cache after the
        last token).

        cache: the cache to continue from (zeros when None), so that a long prompt can be
        prefilled in chunks; it is left unchanged. cu_seqlens: (num_docs + 1,), prompts packed
        along seqlen (batch 1); the cache then has one row per prompt, as for a batch of
        num_docs rows, and ``step`` continues every prompt at once.
        """
        if cache is not None and len(cache) != len(self.backbone.layers):
            raise ValueError(
                f"MambaLMHeadModel.prefill: cache must hold one (conv_state, ssm_state) pair per "
                f"layer, {len(self.backbone.layers)}, got {len(cache)}"
            )
        new_cache = []

        def mix(mixer, hidden_states):
            initial_states = None if cache is None else cache[mixer.layer_idx]
            out, states = mixer(
                hidden_states, cu_seqlens=cu_seqlens, initial_states=initial_states,
                return_final_states=True,
            )  # fmt: skip
            new_cache.append(states)
            return out

        return self.lm_head(self.backbone(input_ids, mix)), new_cache

    def step(self, input_ids: Tensor, cache: Cache) -> tuple[Tensor, Cache]:
        """One token per row: input_ids (batch, 1) and a cache -> (logits (batch, 1, vocab),
        the next cache). The given cache is left unchanged."""
        new_cache = [(conv.clone(), ssm.clone()) for conv, ssm in cache]

        def mix(mixer, hidden_states):
            return mixer.step(hidden_states, *new_cache[mixer.layer_idx])[0]

        return self.lm_head(self.backbone(input_ids, mix)), new_cache

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int) -> Tensor:
        """Greedy decoding: input_ids (batch, seqlen) -> (batch, seqlen + max_new_tokens), the
        prompt then the argmax token at each step (prompt through prefill, then step)."""
        logits, cache = self.prefill(input_ids)
        tokens = [input_ids]
        for i in range(max_new_tokens):
            tokens.append(logits[:, -1:].argmax(-1))
            if i + 1 < max_new_tokens:
                logits, cache = self.step(tokens[-1], cache)
        return torch.cat(tokens, dim=1)
