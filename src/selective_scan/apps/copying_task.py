"""The selective-copying task of the Mamba paper (Gu and Dao, 2023, section 4.1.1) as tokens.

A row is ``context_len`` tokens, ``num_data`` of them data symbols at random positions and the
rest BLANK, then MARKER, then the data symbols again in their order (the answer). A language
model reads the context and the marker and must emit the answer: which tokens to keep depends on
what they are, not where they are, so a time-invariant recurrence cannot solve it and a selective
one can.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

BLANK, MARKER = 0, 1
FIRST_SYMBOL = 2  # data symbols are FIRST_SYMBOL ... FIRST_SYMBOL + num_symbols - 1


@dataclass(frozen=True)
class SelectiveCopying:
    """Sizes of the task: rows are (context_len + 1 + num_data) tokens from vocab_size."""

    context_len: int
    num_data: int
    num_symbols: int

    def __post_init__(self):
        if not 1 <= self.num_data <= self.context_len:
            raise ValueError(
                f"SelectiveCopying: num_data must be in [1, context_len={self.context_len}], "
                f"got {self.num_data}"
            )
        if self.num_symbols < 1:
            raise ValueError(f"SelectiveCopying: num_symbols must be >= 1, got {self.num_symbols}")

    @property
    def vocab_size(self) -> int:
        return FIRST_SYMBOL + self.num_symbols

    @property
    def seqlen(self) -> int:
        """Tokens in a whole row: context, marker, answer."""
        return self.context_len + 1 + self.num_data

    def sample(self, batch: int, generator: torch.Generator) -> Tensor:
        """Fresh rows (batch, seqlen) int64 on the CPU, a function of the generator's state."""
        # Distinct positions: the first num_data of a random permutation, in increasing order.
        positions = torch.rand(batch, self.context_len, generator=generator).argsort(dim=1)
        positions = positions[:, : self.num_data].sort(dim=1).values
        data = torch.randint(
            FIRST_SYMBOL, self.vocab_size, (batch, self.num_data), generator=generator
        )
        context = torch.full((batch, self.context_len), BLANK).scatter_(1, positions, data)
        return torch.cat([context, torch.full((batch, 1), MARKER), data], dim=1)

    def prompt(self, rows: Tensor) -> Tensor:
        """The context and the marker: rows (batch, seqlen) -> (batch, context_len + 1)."""
        return rows[:, : self.context_len + 1]

    def answer(self, rows: Tensor) -> Tensor:
        """The data symbols in order: rows (batch, seqlen) -> (batch, num_data)."""
        return rows[:, self.context_len + 1 :]

    def answer_logits(self, logits: Tensor) -> Tensor:
        """The logits that predict the answer: (batch, >= context_len + num_data, vocab), the
        model's output on a row without its last token (or with it), -> (batch, num_data,
        vocab). Position context_len holds the marker, which predicts the first symbol."""
        return logits[:, self.context_len : self.context_len + self.num_data]

    def loss_and_accuracy(self, logits: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-entropy and fraction of correct argmax predictions over the answer tokens only
        (the rest is noise no model can predict): two scalar tensors."""
        logits = self.answer_logits(logits)
        answer = self.answer(rows)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), answer.flatten())
        accuracy = (logits.argmax(-1) == answer).float().mean()
        return loss, accuracy


def as_text(tokens: Tensor) -> str:
    """One row of tokens (n,) as text: '.' for BLANK, '|' for MARKER, data symbols as letters
    A, B, ... (or as numbers, space-separated, past 26 symbols)."""
    values = tokens.tolist()
    if max(values, default=0) - FIRST_SYMBOL >= 26:
        return " ".join(str(v) for v in values)
    special = {BLANK: ".", MARKER: "|"}
    return "".join(special.get(v) or chr(ord("A") + v - FIRST_SYMBOL) for v in values)
