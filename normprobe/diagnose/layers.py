"""Per-layer gains for `diagnose`: each weight layer's, read during the step, and the jumps.

A jump is a weight layer or a block whose output or gradient stands out from its peers'; the
``layer-jump`` check reports them (`normprobe.diagnose.checks.layer_jump`), and the residual
checks discount them.

Each weight layer's forward gain (output RMS / input RMS) and backward gain (RMS of the gradient
reaching its input / of the gradient at its output) are compared with the median over its peers:
the layers of the same role in the other blocks (same path with block indices as ``*``, same
weight shape). Gains are local, so a scale put into one layer shows at that layer only, not at
every layer after it. Each block's step of the residual stream (RMS after block b / after block
b-1) is compared with the median step of the stack's other blocks, which catches a scale applied
in a block's forward code rather than in a module. (Blocks' gradient norms are not compared step
by step: a Post-LN stack's first block legitimately gets ~9x the gradient of the next, because
its norm divides by the small RMS of the embeddings.)
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..discovery import ModelMap
from ..nested import first_float

# A healthy model's gains stay near their peers' median: at init the peers draw their weights
# from one distribution. The largest factor measured at init on TinyTransformer (Pre-LN, Post-LN,
# sandwich), the 48-block `ResidualStack`s, HF GPT-2 and Llama, timm ViT, ConvNeXt, ResNet-34/50
# and the 51 architectures of the real-architecture tests is 2.4 (the README's table); a bug's
# scale is orders larger (1e4 in the tests). 10x keeps a margin of 4 above healthy.
JUMP_MIN = 10.0
# peers needed to call one layer or block the odd one out
MIN_PEERS = 2

_TINY = 1e-30


@dataclass
class LayerStats:
    """RMS of one weight layer's input and output (its first call), and of their gradients."""

    path: str
    x_rms: float = math.nan
    y_rms: float = math.nan
    gx_rms: float = math.nan
    gy_rms: float = math.nan

    @property
    def forward_gain(self) -> float:
        return self.y_rms / self.x_rms if self.x_rms > _TINY else math.nan

    @property
    def backward_gain(self) -> float:
        return self.gx_rms / self.gy_rms if self.gy_rms > _TINY else math.nan


@dataclass
class LayerCapture:
    """The layers' stats, filled by `capture_layers` during one forward and backward."""

    stats: dict[str, LayerStats] = field(default_factory=dict)
    handles: list[RemovableHandle] = field(default_factory=list)

    def release(self) -> None:
        """Remove the gradient hooks left on the forward's tensors."""
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().float().pow(2).mean().sqrt())


def _grad_hook(stats: LayerStats, name: str) -> Any:
    def hook(g: torch.Tensor) -> None:
        setattr(stats, name, _rms(g))

    return hook


@contextmanager
def capture_layers(model: nn.Module, paths: list[str], cap: LayerCapture) -> Iterator[None]:
    """Hook ``paths``' modules for one forward; gradient hooks stay until ``cap.release()``.

    The input is read in a forward pre-hook, before a backward hook of the user's wraps it, so
    that its gradient is the one the layer's backward (hooks included) hands on; the layer is
    handed a view of it, whose gradient is the layer's own contribution alone.
    """
    modules = dict(model.named_modules())
    handles = []
    for path in paths:

        def pre(mod: nn.Module, args: tuple[Any, ...], path: str = path) -> Any:
            x = first_float(args)
            if path in cap.stats or x is None:
                return None
            stats = cap.stats[path] = LayerStats(path, x_rms=_rms(x))
            if x.grad_fn is None:  # the user's batch, which outlives the step
                return None
            # the layer's own view of its input: its gradient is this layer's alone, not the
            # sum over every layer reading x (a time embedding read by ten blocks)
            at = next((i for i, a in enumerate(args) if a is x), None)
            if at is not None:
                x = x.view_as(x)
                args = (*args[:at], x, *args[at + 1 :])
            hook = x.register_hook(_grad_hook(stats, "gx_rms"))  # type: ignore[no-untyped-call]
            cap.handles.append(hook)
            return args if at is not None else None

        def post(mod: nn.Module, args: tuple[Any, ...], out: Any, path: str = path) -> None:
            stats, y = cap.stats.get(path), first_float(out)
            if stats is None or y is None or not math.isnan(stats.y_rms):
                return
            stats.y_rms = _rms(y)
            if y.requires_grad:
                hook = y.register_hook(_grad_hook(stats, "gy_rms"))  # type: ignore[no-untyped-call]
                cap.handles.append(hook)

        handles.append(modules[path].register_forward_pre_hook(pre))
        handles.append(modules[path].register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class Jump:
    """One layer or block whose gain stands out from its peers'.

    Attributes:
        kind: ``output`` (forward) or ``gradient`` (backward).
        path: the weight layer, or the block whose stream step jumps.
        block: (stack path, block index) holding ``path``, if any.
        factor: ``value / typical``.
        value: the gain of ``path`` (a block's step for blocks).
        typical: the median over ``peers``.
        peers: the layers (blocks) compared with.
        layer: a weight layer's gain, not a block's step.
    """

    kind: str
    path: str
    block: tuple[str, int] | None
    factor: float
    value: float
    typical: float
    peers: tuple[str, ...]
    layer: bool


def role(path: str) -> str:
    """``blocks.2.mlp.fc2`` -> ``blocks.*.mlp.fc2``: the same layer in every block."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def block_of(path: str, model_map: ModelMap) -> tuple[str, int] | None:
    """The innermost (stack path, block index) whose block holds ``path``."""
    best: tuple[int, tuple[str, int]] | None = None
    for s in model_map.stacks:
        for i, b in enumerate(s.blocks):
            if (path == b or path.startswith(b + ".")) and (best is None or len(b) > best[0]):
                best = (len(b), (s.path, i))
    return best[1] if best else None


def _factors(values: dict[str, float]) -> Iterator[tuple[str, float, float, tuple[str, ...]]]:
    """(key, value / the others' median, that median, the others) for each key with peers."""
    finite = {k: v for k, v in values.items() if math.isfinite(v) and v >= 0}
    if len(finite) <= MIN_PEERS:
        return
    for key, v in finite.items():
        peers = tuple(k for k in finite if k != key)
        typical = statistics.median(finite[k] for k in peers)
        if typical > _TINY:
            yield key, v / typical, typical, peers


def _note_max(extra: dict[str, float], tag: str, factor: float) -> None:
    extra[tag] = max(extra.get(tag, 0.0), factor)


def layer_jumps(
    model: nn.Module, cap: LayerCapture, model_map: ModelMap, extra: dict[str, float]
) -> list[Jump]:
    """Weight layers whose forward or backward gain is JUMP_MIN x their peers' median."""
    modules = dict(model.named_modules())
    groups: dict[tuple[str, tuple[int, ...]], list[LayerStats]] = {}
    for st in cap.stats.values():
        w = getattr(modules[st.path], "weight", None)
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else ()
        groups.setdefault((role(st.path), shape), []).append(st)
    jumps = []
    for members in groups.values():
        for kind, gain in (("output", "forward_gain"), ("gradient", "backward_gain")):
            values = {st.path: getattr(st, gain) for st in members}
            for path, factor, typical, peers in _factors(values):
                _note_max(extra, f"diagnose/jump_max/{kind}/layers", factor)
                if factor <= JUMP_MIN:
                    continue
                extra[f"diagnose/{kind}_jump/{path}"] = factor
                jumps.append(
                    Jump(
                        kind,
                        path,
                        block_of(path, model_map),
                        factor,
                        values[path],
                        typical,
                        peers,
                        True,
                    )
                )
    return jumps


def stream_jumps(
    stack: str, blocks: tuple[str, ...], profile: list[float | None], extra: dict[str, float]
) -> list[Jump]:
    """Blocks whose step of the stream (RMS after block b / after block b-1) is JUMP_MIN x the
    median step of the stack's other blocks."""
    steps = {
        str(b): v / w
        for b, (w, v) in enumerate(itertools.pairwise(profile), 1)
        if v is not None and w is not None and w > _TINY
    }
    found = []
    for b, factor, typical, others in _factors(steps):
        _note_max(extra, "diagnose/jump_max/output/blocks", factor)
        if factor > JUMP_MIN:
            peers = tuple(blocks[int(k)] for k in others)
            i = int(b)
            found.append(
                Jump("output", blocks[i], (stack, i), factor, steps[b], typical, peers, False)
            )
    return found


def without_jumps(profile: list[float | None], jumps: list[Jump]) -> list[float]:
    """``profile`` (the stream's RMS per block) with each jump's excess over the typical step
    divided out from its block on."""
    excess = {j.block[1]: j.factor for j in jumps if j.block}
    out, scale = [], 1.0
    for b, v in enumerate(profile):
        scale *= excess.get(b, 1.0)
        out.append(math.nan if v is None else v / scale)
    return out
