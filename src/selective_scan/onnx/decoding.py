"""A language model's decoding in ONNX Runtime: prefill and decode-step files, greedy generation.

``export_decoder(model, directory)`` writes two files: ``prefill.onnx`` (input_ids ->
logits and every layer's states) and ``step.onnx`` (one token per row and the states -> logits
and the next states), both with dynamic batch (and prompt length). Inputs are named
input_ids, conv_state_0, ssm_state_0, conv_state_1, ...; outputs logits, next_conv_state_0,
next_ssm_state_0, ... ``OrtDecoder`` loads them
into ONNX Runtime sessions and generates greedily as ``MambaLMHeadModel.generate`` does,
without torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..models import MambaLMHeadModel


def _flat(cache: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, ...]:
    return tuple(t for pair in cache for t in pair)


def state_names(n_layer: int, prefix: str = "") -> list[str]:
    """Names of the states, in the files' order: conv_state_0, ssm_state_0, conv_state_1, ...
    (inputs), each with ``prefix`` (outputs: "next_"; ONNX names must be unique)."""
    kinds = ("conv_state", "ssm_state")
    return [f"{prefix}{kind}_{i}" for i in range(n_layer) for kind in kinds]


class Prefill(nn.Module):
    """input_ids (batch, seqlen) -> (logits (batch, seqlen, vocab), conv_state_0,
    ssm_state_0, ...): ``MambaLMHeadModel.prefill`` with the cache flattened."""

    def __init__(self, model: MambaLMHeadModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> tuple[Tensor, ...]:
        logits, cache = self.model.prefill(input_ids)
        return (logits, *_flat(cache))


class Step(nn.Module):
    """(input_ids (batch, 1), conv_state_0, ssm_state_0, ...) -> (logits (batch, 1, vocab),
    the next states): ``MambaLMHeadModel.step`` with the cache flattened; conv states
    (batch, d_inner, d_conv), ssm states (batch, d_inner, d_state)."""

    def __init__(self, model: MambaLMHeadModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, *states: Tensor) -> tuple[Tensor, ...]:
        cache = list(zip(states[0::2], states[1::2], strict=True))
        logits, new_cache = self.model.step(input_ids, cache)
        return (logits, *_flat(new_cache))


def export_decoder(
    model: MambaLMHeadModel, directory: str | os.PathLike, example_seqlen: int = 16
) -> tuple[Path, Path]:
    """Write ``prefill.onnx`` and ``step.onnx`` for ``model`` into ``directory``; returns their
    paths. Batch is dynamic in both, the prompt length in prefill (traced at batch 2 and
    ``example_seqlen`` tokens: sizes 0 and 1 would be specialized)."""
    from . import export

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    device = model.lm_head.weight.device
    names = state_names(len(model.backbone.layers))
    next_names = state_names(len(model.backbone.layers), "next_")
    batch = torch.export.Dim("batch", min=2)
    ids = torch.zeros((2, example_seqlen), dtype=torch.long, device=device)
    prefill_path, step_path = directory / "prefill.onnx", directory / "step.onnx"
    with torch.no_grad():
        export(
            Prefill(model), (ids,), prefill_path,
            dynamic_shapes={"input_ids": {0: batch, 1: torch.export.Dim("seqlen", min=2)}},
            input_names=["input_ids"], output_names=["logits", *next_names],
        )  # fmt: skip
        states = _flat(model.allocate_inference_cache(2))
        export(
            Step(model), (ids[:, :1], *states), step_path,
            dynamic_shapes=({0: batch}, tuple({0: batch} for _ in states)),
            input_names=["input_ids", *names], output_names=["logits", *next_names],
        )  # fmt: skip
    return prefill_path, step_path


class OrtDecoder:
    """Greedy decoding in ONNX Runtime from the files of ``export_decoder``."""

    def __init__(
        self,
        prefill_path: str | os.PathLike,
        step_path: str | os.PathLike,
        providers: tuple[str, ...] = ("CPUExecutionProvider",),
        session_options=None,
    ):
        import onnxruntime

        def session(path):
            return onnxruntime.InferenceSession(
                str(path), sess_options=session_options, providers=list(providers)
            )

        self.prefill_session = session(prefill_path)
        self.step_session = session(step_path)
        self.state_names = [i.name for i in self.step_session.get_inputs()][1:]

    def prefill(self, input_ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """input_ids (batch, seqlen) int64 -> (logits (batch, seqlen, vocab), states)."""
        logits, *states = self.prefill_session.run(None, {"input_ids": input_ids})
        return logits, states

    def step(
        self, input_ids: np.ndarray, states: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """input_ids (batch, 1) int64 and the states -> (logits (batch, 1, vocab), next states)."""
        feed = {"input_ids": input_ids, **dict(zip(self.state_names, states, strict=True))}
        logits, *states = self.step_session.run(None, feed)
        return logits, states

    def generate(self, input_ids: np.ndarray | Tensor, max_new_tokens: int) -> np.ndarray:
        """Greedy decoding as ``MambaLMHeadModel.generate``: input_ids (batch, seqlen) ->
        (batch, seqlen + max_new_tokens) int64, the prompt then the argmax token at each step."""
        if isinstance(input_ids, Tensor):
            input_ids = input_ids.cpu().numpy()
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        logits, states = self.prefill(input_ids)
        tokens = [input_ids]
        for i in range(max_new_tokens):
            tokens.append(logits[:, -1:].argmax(-1).astype(np.int64))
            if i + 1 < max_new_tokens:
                logits, states = self.step(tokens[-1], states)
        return np.concatenate(tokens, axis=1)
