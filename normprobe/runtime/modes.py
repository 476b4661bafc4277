"""Torch function modes a probe enters inside one module call on logged steps: reading the n-th
residual add of a forward, and the attention logits a module forms."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import (
    TorchFunctionMode,
    _get_current_function_mode_stack,
    _pop_mode,
    _push_mode,
)

from .. import probes
from ..discovery import (
    ADD_OPS,
    FIRST_ONLY_OPS,
    LOGIT_MASK_OPS,
    LOGIT_SCALE_OPS,
    MATMUL_OPS,
    SDPA_OPS,
    SOFTMAX_OPS,
    WEIGHT_OPS,
    carries_logits,
    mixes_heads,
    scripted_functions_as_python,
)
from ..metrics.core.attention import AttentionInputs
from ..metrics.core.base import AttentionReader
from ..nested import iter_tensors


class AddCounter(TorchFunctionMode):
    """Active inside one module call on logged steps: reads the n-th tensor add it sees."""

    def __init__(self, targets: dict[int, Callable[[torch.Tensor], None]]) -> None:
        super().__init__()
        self.targets = targets
        self.count = 0

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if (
            name in ADD_OPS
            and len(args) >= 2
            and isinstance(args[0], torch.Tensor)
            and isinstance(args[1], torch.Tensor)
        ):
            action = self.targets.get(self.count)
            if action is not None and isinstance(out, torch.Tensor):
                action(out)
            self.count += 1
        return out


# (the q·k product or what it became, its max |logit| once a mask or bias met it (`_MET` when
# no reader asks for the max), the constant factor applied since)
_Logits = tuple["weakref.ref[torch.Tensor]", torch.Tensor | None, torch.Tensor | float]
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_SDPA_SIGNATURE = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_MET = torch.zeros(())  # the logits met a mask; their max was not asked for


class AttentionLogits(TorchFunctionMode):
    """Active inside one attention module on logged steps: hands each action the
    `AttentionInputs` of every attention product the module forms, read when its softmax (or the
    fused attention) takes it.

    Eager attention: each product of a matmul of two tensors is followed through the ops that
    carry logits (`carries_logits`) or mix heads (`mixes_heads`), TorchScript functions run as
    their Python source; the softmax's input is handed over as ``scores``. With ``logit_max``,
    its max |.| per head is taken where another tensor (a mask, a bias, a sink, a head-mixing
    weight) first meets it (at the softmax if none does), times the constant factors applied
    after that: what the model computes from the logits alone before that (soft-capping,
    clamping, nan_to_num, casts) is part of forming them. Fused attention: its q, k, scale and
    mask; ``nn.MultiheadAttention``: q and k projected from its input and in-projection weights
    (`probes.mha_qk`), and its masks as one additive mask.
    """

    def __init__(
        self, actions: Sequence[AttentionReader], heads: int, logit_max: bool = False
    ) -> None:
        super().__init__()
        self.actions = actions
        self.heads = heads
        self.logit_max = logit_max
        self.logits: dict[int, _Logits] = {}  # by id of the tensor
        self.scripts = ExitStack()

    def __enter__(self) -> AttentionLogits:
        self.scripts.enter_context(scripted_functions_as_python())
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            self.scripts.close()

    def found(self, inputs: AttentionInputs) -> None:
        for action in self.actions:
            action(inputs)

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SDPA_OPS and len(args) >= 2:
            self.found(_sdpa_inputs(args, kwargs, self.heads))
        elif name == "multi_head_attention_forward":
            self.found(_mha_inputs(args, kwargs))
        found = self._find(args, kwargs) if self.logits else None
        best: torch.Tensor | None = None
        factor: torch.Tensor | float = 1.0
        if found is not None:
            t, best, factor = found
            if best is None and (name in SOFTMAX_OPS or _meets(name, args, kwargs, t)):
                # before the op: an in-place mask overwrites t
                best = probes.head_abs_max(t, self.heads) if self.logit_max else _MET
            if best is not None and name in SOFTMAX_OPS:
                most = best * factor if self.logit_max else None
                self.found(self._eager_inputs(t, most, args, kwargs))
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        if name in MATMUL_OPS and _operands(args) >= 2:
            self.logits[id(out)] = (weakref.ref(out), None, 1.0)
        elif found is not None and _carries(name, found[0], out, args):
            if best is not None and name in LOGIT_SCALE_OPS:
                factor = _scaled(factor, name, args, found[0])
            self.logits[id(out)] = (weakref.ref(out), best, factor)
        elif found is not None and out is found[0]:  # changed in place into something else
            del self.logits[id(out)]
        return out

    def _eager_inputs(
        self,
        scores: torch.Tensor,
        logit_max: torch.Tensor | None,
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> AttentionInputs:
        """What a softmax taking ``scores`` hands the readers: its input, its axis last."""
        dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
        if isinstance(dim, int) and dim % max(1, scores.ndim) != scores.ndim - 1:
            scores = scores.movedim(dim, -1)
        return AttentionInputs(self.heads, scores=scores.detach(), logit_max=logit_max)

    def _find(
        self, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | float] | None:
        """The first argument on its way from a q·k product, with its state."""
        for _, t in iter_tensors((args, kwargs)):
            entry = self.logits.get(id(t))
            if entry is not None and entry[0]() is t:
                return t, entry[1], entry[2]
        return None


def _operands(args: Sequence[Any]) -> int:
    """How many tensors other than parameters ``args`` holds."""
    return sum(not isinstance(t, nn.Parameter) for _, t in iter_tensors(args))


def _meets(name: str, args: Sequence[Any], kwargs: dict[str, Any], logits: torch.Tensor) -> bool:
    """Whether the op brings another tensor into the logits (a mask, a bias, a sink): one of
    `LOGIT_MASK_OPS`, or any op but a scale reading another tensor of more than one element."""
    if name in LOGIT_MASK_OPS:
        return True
    if name in LOGIT_SCALE_OPS or name in FIRST_ONLY_OPS:
        return False
    return any(t is not logits and t.numel() > 1 for _, t in iter_tensors((args, kwargs)))


def _carries(name: str, logits: torch.Tensor, out: torch.Tensor, args: Sequence[Any]) -> bool:
    """Whether ``out`` carries the logits on toward a softmax, as discovery decides: a view,
    slice or extension of them, an elementwise op on them (`carries_logits`), or a map of
    their heads (`mixes_heads`)."""
    if name in WEIGHT_OPS:
        weights = [tuple(t.shape) for _, t in iter_tensors(args) if isinstance(t, nn.Parameter)]
        return mixes_heads(tuple(out.shape), tuple(logits.shape), weights)
    if name in SOFTMAX_OPS:
        return False
    return carries_logits(name, tuple(out.shape), [tuple(logits.shape)], broadcast=True)


def _scaled(
    factor: torch.Tensor | float, name: str, args: Sequence[Any], logits: torch.Tensor
) -> torch.Tensor | float:
    """``factor`` times |c| for ``logits * c`` (divided for ``logits / c``), c a number or a
    one-element tensor; unchanged for other operands."""
    others = [a for a in args if a is not logits]
    if len(others) != 1:
        return factor
    c = others[0]
    if isinstance(c, torch.Tensor) and c.numel() == 1:
        c = c.detach().float().abs().reshape(())  # stays on the device: no host sync
    elif isinstance(c, int | float) and not isinstance(c, bool):
        c = abs(c)
    else:
        return factor
    return factor / c if name.startswith(("div", "__truediv__", "__itruediv__")) else factor * c


def _sdpa_inputs(args: Sequence[Any], kwargs: dict[str, Any], heads: int) -> AttentionInputs:
    """The `AttentionInputs` of a ``scaled_dot_product_attention`` call."""
    a = dict(zip(_SDPA_SIGNATURE, args, strict=False)) | kwargs
    return AttentionInputs(
        heads,
        query=a["query"],
        key=a["key"],
        scale=a.get("scale"),
        mask=a.get("attn_mask"),
        is_causal=bool(a.get("is_causal", False)),
    )


def _mha_inputs(args: Sequence[Any], kwargs: dict[str, Any]) -> AttentionInputs:
    """The `AttentionInputs` of an ``F.multi_head_attention_forward`` call: q and k as
    `probes.mha_qk` projects them; the masks (made on first use) as one additive mask, with
    ``add_zero_attn``'s zero key among the keys (the max logit leaves it out: it is 0)."""
    bound = _MHA_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    e = a["query"].shape[-1]
    if a["use_separate_proj_weight"]:
        w_q, w_k = a["q_proj_weight"], a["k_proj_weight"]
    else:
        w_q, w_k = a["in_proj_weight"][:e], a["in_proj_weight"][e : 2 * e]
    b = a["in_proj_bias"]
    b_q, b_k = (None, None) if b is None else (b[:e], b[e : 2 * e])
    heads = a["num_heads"]
    q, k = probes.mha_qk(
        a["query"], a["key"], heads, w_q, b_q, w_k, b_k, a["bias_k"], a["static_k"]
    )
    keys = k
    if a["add_zero_attn"]:
        keys = torch.cat([k, k.new_zeros((*k.shape[:-2], 1, k.shape[-1]))], dim=-2)
    padded = keys.shape[-2] - (a["key"].shape[0] if a["static_k"] is None else k.shape[-2])

    def mask() -> torch.Tensor | None:
        return _mha_mask(a["attn_mask"], a["key_padding_mask"], q.shape[:3], padded)

    def logit_max() -> torch.Tensor:
        return probes.sdpa_logit_max(q, k, heads=heads)

    return AttentionInputs(
        heads,
        query=q,
        key=keys,
        mask=mask,
        is_causal=bool(a["is_causal"]) and a["attn_mask"] is None,
        logit_max=logit_max,
    )


def _mha_mask(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    shape: tuple[int, ...],
    padded: int,
) -> torch.Tensor | None:
    """``nn.MultiheadAttention``'s masks as one mask added to the logits, broadcastable to
    (batch, heads, queries, keys) (``shape``: the first three): boolean masks (True: not
    attended) as -inf, ``padded`` keys appended after the masks' own (``bias_k``,
    ``add_zero_attn``) attended."""
    batch, heads, queries = shape
    total: torch.Tensor | None = None
    if attn_mask is not None:
        m = _additive(attn_mask)
        total = m.reshape(batch, heads, queries, -1) if m.ndim == 3 else m
    if key_padding_mask is not None:
        m = _additive(key_padding_mask).reshape(batch, 1, 1, -1)
        total = m if total is None else total + m
    if total is not None and padded:
        total = F.pad(total, (0, padded))
    return total


def _additive(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.detach().float()


def exit_modes(modes: Iterable[TorchFunctionMode]) -> None:
    """Take the modes a forward that raised midway left entered off torch's mode stack.

    By identity, wherever they sit: after a KeyboardInterrupt other modes may have been
    entered above them (or theirs left), so popping the top could remove someone else's.
    """
    stale = {id(mode) for mode in modes}
    if not stale:
        return
    stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    if not any(id(mode) in stale for mode in stack):
        return
    popped = [_pop_mode() for _ in stack]  # type: ignore[no-untyped-call]
    for mode in reversed(popped):
        if id(mode) not in stale:
            _push_mode(mode)  # type: ignore[no-untyped-call]
