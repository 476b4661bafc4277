"""A small text corpus that ships with Python itself, for examples that must not download.

The text is the source code of a few standard-library modules, read with `inspect`: the same
on every machine with the same Python, and large enough (about 58,000 characters) to train a
character-level language model for a few hundred steps.
"""

from __future__ import annotations

import bisect
import heapq
import inspect
import string
import textwrap
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset

_MODULES = (textwrap, string, heapq, bisect)


def text() -> str:
    """The corpus as one string."""
    return "\n".join(inspect.getsource(m) for m in _MODULES)


class CharCorpus:
    """The corpus as character ids, with random (input, next-character target) windows.

    Args:
        context: characters per window.
        seed: seed of the window sampler.
    """

    def __init__(self, context: int = 64, seed: int = 0) -> None:
        chars = sorted(set(text()))
        self.vocab = {c: i for i, c in enumerate(chars)}
        self.ids = torch.tensor([self.vocab[c] for c in text()], dtype=torch.long)
        self.context = context
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``size`` random windows: inputs and the same windows shifted by one character."""
        starts = torch.randint(
            0, len(self.ids) - self.context - 1, (size,), generator=self.generator
        )
        window = torch.stack([self.ids[s : s + self.context + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]


class CharBatches(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An endless stream of ``corpus.batch(batch_size)``: a DataLoader with ``batch_size=None``."""

    def __init__(self, corpus: CharCorpus, batch_size: int) -> None:
        self.corpus = corpus
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.corpus.batch(self.batch_size)
