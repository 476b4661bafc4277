"""What the runtime hands an attention reader (`Plan.read_attention`) for each attention product
a module forms on a logged step: `AttentionInputs`.

Fused attention (``scaled_dot_product_attention``) and ``nn.MultiheadAttention`` hand over the
queries and keys, the scale and the mask; eager attention hands over the scores its softmax
takes (masks, biases and soft-capping already in them). A family computes what it needs from
these, on the device; the per-head max |logit| the logit families read is computed once per
product and shared (`AttentionInputs.logit_max`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import torch

from ... import probes


class AttentionInputs:
    """One attention product of a module with ``heads`` query heads.

    Attributes:
        heads: the module's query heads (`Attention.heads`); leading dims of ``query`` and
            ``scores`` flatten so that their index modulo ``heads`` is the head.
        query: fused and ``nn.MultiheadAttention``: the queries, (..., heads, queries, head_dim)
            (or (queries, head_dim)), as the model has them; eager attention: None.
        key: likewise the keys, (..., key heads, keys, head_dim): fewer heads than ``query``
            under grouped-query attention (each key head serves ``heads / key heads`` query
            heads in a row).
        scale: the factor of q.k (None: ``1 / sqrt(head_dim)``).
        is_causal: query i attends the keys 0..i alone (top-left aligned, as
            ``scaled_dot_product_attention`` has it), besides ``mask``.
        scores: eager attention: what the softmax takes (..., queries, keys), the logits with
            masks, biases and soft-capping applied, the softmax's axis last; else None. Soft-
            capping exists only here: the fused paths have no soft-cap.
    """

    def __init__(
        self,
        heads: int,
        *,
        query: torch.Tensor | None = None,
        key: torch.Tensor | None = None,
        scale: float | None = None,
        mask: torch.Tensor | Callable[[], torch.Tensor | None] | None = None,
        is_causal: bool = False,
        scores: torch.Tensor | None = None,
        logit_max: torch.Tensor | Callable[[], torch.Tensor] | None = None,
    ) -> None:
        self.heads = heads
        self.query = query
        self.key = key
        self.scale = scale
        self.is_causal = is_causal
        self.scores = scores
        self._mask = mask
        self._logit_max = logit_max

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """The attention mask as ``scaled_dot_product_attention`` takes it, broadcastable to
        (..., queries, keys): boolean (True: the key is attended) or added to the logits.
        Fused and ``nn.MultiheadAttention`` only (eager masks are in ``scores``); made on first
        use."""
        return self._mask() if callable(self._mask) else self._mask

    @cached_property
    def logit_max(self) -> torch.Tensor:
        """max |q.k| * scale of each head (a float32 vector of ``heads`` values), masks and biases
        left out: eager, taken as the logits form (asked for with
        ``read_attention(..., logit_max=True)``); fused and ``nn.MultiheadAttention``, over a
        sample of the products (`probes.sdpa_logit_max`). Computed once, on first use."""
        made = self._logit_max
        if isinstance(made, torch.Tensor):
            return made
        if made is not None:
            return made()
        if self.query is None or self.key is None:
            raise ValueError(
                "eager attention's max logit is taken as the logits form: read_attention(..., "
                "logit_max=True)"
            )
        return probes.sdpa_logit_max(self.query, self.key, scale=self.scale, heads=self.heads)
