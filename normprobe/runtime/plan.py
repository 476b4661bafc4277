"""What the families asked for on one model (`normprobe.metrics.core.base.Plan`), and how a step's
host values become a `Record` (`normprobe.metrics.core.base.Out`)."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .. import probes, tags
from ..common import is_writer, spread
from ..discovery import Attention, DiscoveryWarning, ModelMap, NormLayer, Stack
from ..metrics.core.base import (
    AttentionReader,
    Family,
    GradientReader,
    Holdings,
    Measured,
    Out,
    Reader,
    Reduce,
    Side,
    Slot,
    Values,
)
from ..sinks import Record
from . import tensor_parallel
from .hooks import Hooks, Read, Registration
from .packing import Layout

Callback = Callable[[], None]
Recorder = Callable[[Values, Out], None]
EVENTS = (
    "forward_start",
    "forward_end",
    "gradients",
    "before_step",
    "after_step",
    "flush",
    "clear",
)


def tagged_paths(paths: Iterable[str], cap: int) -> set[str]:
    """Module paths that get their own scalar tags, at most ``cap`` per group of paths that
    differ only in their indices (``blocks.{0..999}.ln_1``), spread evenly like blocks."""
    groups: dict[tuple[str, ...], list[tuple[tuple[int, ...], str]]] = {}
    for path in paths:
        parts = path.split(".")
        template = tuple("#" if part.isdigit() else part for part in parts)
        index = tuple(int(part) for part in parts if part.isdigit())
        groups.setdefault(template, []).append((index, path))
    kept: set[str] = set()
    for members in groups.values():
        members.sort()
        kept.update(members[i][1] for i in spread(len(members), cap))
    return kept


class ProbePlan:
    """The reads, slots and callbacks of every chosen family on one mapped model."""

    def __init__(
        self,
        model: nn.Module,
        model_map: ModelMap,
        *,
        hooks: Hooks,
        measured: Measured,
        max_block_tags: int,
        param_reduce: Reduce,
        holdings: Holdings,
        compiled: bool,
        name_prefix: str,
        blocks: Mapping[str, tuple[int, int]] | None = None,
        pipeline: tuple[int, int] | None = None,
    ) -> None:
        self.model = model
        self.pipeline = pipeline
        self.model_map = model_map
        self.modules: Mapping[str, nn.Module] = dict(model.named_modules(remove_duplicate=False))
        self.modules_in_order: Sequence[str] = [path for path, _ in model.named_modules()]
        # norm and attention statistics of deep models: scalar tags for at most
        # max_block_tags layers of each kind (blocks.*.ln_1), the rest is not read
        kept = tagged_paths([n.path for n in model_map.norms], max_block_tags)
        self.norms: Sequence[NormLayer] = [n for n in model_map.norms if n.path in kept]
        kept = tagged_paths([a.path for a in model_map.attention], max_block_tags)
        self.attention: Sequence[Attention] = [a for a in model_map.attention if a.path in kept]
        self._heads = {a.path: a.heads for a in model_map.attention}  # this rank's
        self._head_splits = tensor_parallel.head_splits(model, list(self._heads))
        # FSDP and DeepSpeed ZeRO: each rank holds a shard of the parameters (or of their
        # gradients), whose statistics add up
        self.holdings = holdings
        sharded = param_reduce == "mean" and (holdings.partitioned or probes.is_sharded(model))
        self.param_reduce: Reduce = "sum" if sharded else param_reduce
        self.compiled = compiled
        self.measured = measured
        self.grad_scale: torch.Tensor | None = None
        self.grad_squares_read: tuple[Mapping[int, int], torch.Tensor] | None = None
        self.late_scale: torch.Tensor | None = None
        self.clipping_visible = False
        self.clip_norm: float | None = None
        self.capture_until = -1  # the last step a family asked to log (`capture`)
        self.hooks = hooks
        self.layout = Layout()
        self.name_prefix = name_prefix
        self.max_block_tags = max_block_tags
        self.callbacks: dict[str, list[tuple[Family, Callback]]] = {e: [] for e in EVENTS}
        self.recorders: list[tuple[Family, Recorder]] = []
        self.empty: list[Family] = []  # families that found nothing to read
        self._placements_written = False
        self._block_tags: dict[tuple[str, str], tuple[str, list[tuple[int, str]]]] = {}
        self._shared: dict[str, Any] = {}
        self._family: Family | None = None
        # a pipeline stage's stacks: the global number of their first block here, and their
        # depth over every stage (tags and profiles number blocks globally)
        firsts = {s.path: 0 for s in model_map.stacks}
        self.depth = {s.path: s.depth for s in model_map.stacks}
        for path, (first, depth) in (blocks or {}).items():
            firsts[path], self.depth[path] = first, depth
        self.first: Mapping[str, int] = firsts
        self._blocks = self._block_names()
        self._full_names = self._sharing_a_tag()

    def _block_names(self) -> dict[str, str]:
        """How tags name each block of a stack with weights of its own; where a block is several
        entries of a list (x-transformers' attention and feed-forward layers), each entry by its
        place in the block, so that their modules' tags stay apart."""
        return {
            block: f"{self.stack_name(s.path)}/"
            f"{tags.block_label(self.first[s.path] + b, self.depth[s.path])}"
            + (f".{k}" if len(members) > 1 else "")
            for s in self.stacks()
            for b, members in enumerate(s.members or tuple((blk,) for blk in s.blocks))
            for k, block in enumerate(members)
        }

    def _sharing_a_tag(self) -> set[str]:
        """The measured norm and attention modules whose short tag another one has too."""
        by_tag: dict[str, list[str]] = {}
        for path in [*(n.path for n in self.norms), *(a.path for a in self.attention)]:
            by_tag.setdefault(self._short_tag(path), []).append(path)
        return {p for paths in by_tag.values() if len(paths) > 1 for p in paths}

    def install(self, families: Iterable[Family]) -> None:
        for family in families:
            self._family, size = family, self.layout.size
            family.plan(self)
            if self.layout.size == size:
                self.empty.append(family)
        self._family = None

    # what families call ------------------------------------------------------------------------
    def slot(self, size: int, reduce: Reduce) -> Slot:
        return self.layout.slot(size, reduce)

    def read(
        self,
        module: str,
        hook: Literal["pre", "post"],
        action: Reader,
        *,
        call: int | None = 0,
        key: tuple[str | int, ...] | None = None,
    ) -> None:
        site = self.hooks.at(module)
        (site.pre if hook == "pre" else site.post).append(Read(call, key, action))

    def read_add(self, module: str, call: int, index: int, action: Reader) -> None:
        self.hooks.at(module).inside.setdefault(call, {})[index] = action

    def read_attention(
        self, module: str, action: AttentionReader, *, logit_max: bool = False
    ) -> None:
        site = self.hooks.at(module)
        site.attention.append(action)
        site.heads = self._heads[module]
        site.logit_max |= logit_max

    def head_slots(self, module: str, reduce: Reduce) -> tuple[Slot, Slot]:
        heads = self._heads[module]
        ranks, place = self._head_splits.get(module, (1, 0))
        slot = self.slot(heads * ranks, reduce)
        return slot, Slot(slot.offset + heads * place, heads, reduce)

    def read_outputs(self, action: Callable[[int, Any], None]) -> None:
        self.hooks.outputs.append(action)

    def read_gradients(self, action: GradientReader) -> None:
        if self.compiled:
            return  # a tensor hook registered inside a compiled graph breaks it
        gradients = self.hooks.gradients
        if not gradients.actions:
            self._on("forward_start", gradients.start)
            self._on("clear", gradients.stop)
        gradients.actions.append(action)

    def watch_gradient(self, index: int, side: Side, tensor: torch.Tensor) -> None:
        if not self.compiled:
            self.hooks.gradients.watch(index, side, tensor)

    def select_modules(self, indices: frozenset[int] | None) -> None:
        if not self.compiled:
            self.hooks.select(indices)

    def capture(self, step: int) -> None:
        self.capture_until = max(self.capture_until, step)

    def at_forward_start(self, fn: Callback) -> None:
        self._on("forward_start", fn)

    def at_forward_end(self, fn: Callback) -> None:
        self._on("forward_end", fn)

    def on_gradients(self, fn: Callback) -> None:
        self._on("gradients", fn)

    def before_step(self, fn: Callback) -> None:
        self._on("before_step", fn)

    def after_step(self, fn: Callback) -> None:
        self._on("after_step", fn)

    def at_flush(self, fn: Callback) -> None:
        self._on("flush", fn)

    def on_clear(self, fn: Callback) -> None:
        self._on("clear", fn)

    def on_record(self, fn: Recorder) -> None:
        assert self._family is not None, "on_record is called from a family's plan"
        self.recorders.append((self._family, fn))

    def shared(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def made(self, key: str) -> Any:
        return self._shared.get(key)

    def stacks(self) -> Sequence[Stack]:
        # a repeated block (one module run N times) has one set of weights: no per-block value
        return [s for s in self.model_map.stacks if not s.repeated]

    def module_tag(self, path: str) -> str:
        if path in self._full_names:  # a module whose short tag another one has too
            return self._name(path)
        return self._short_tag(path)

    def _short_tag(self, path: str) -> str:
        parts = path.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the innermost block holding the module
            block = self._blocks.get(".".join(parts[:i]))
            if block is not None:
                return f"{block}.{_unwrapped('.'.join(parts[i:]))}"
        return self._name(path)

    def stack_name(self, path: str) -> str:
        return self._name(path)

    # what the probe calls -----------------------------------------------------------------------
    def run(self, event: str, validation: bool = False) -> None:
        for family, fn in self.callbacks[event]:
            if family.validation or not validation:
                fn()

    def registrations(self) -> list[Registration]:
        return self.hooks.registrations(self.model, self.modules, self.compiled)

    def record(self, values: Values, step: int, writes: bool) -> Record:
        out = RecordOut(Record(step), writes, self)
        if not self._placements_written and not values.validation:
            # once per run: each stack's placement, which `report` words its flags by
            self._placements_written = True
            for s in self.model_map.stacks:
                out.text("placement", self.stack_name(s.path), s.placement)
                gains = self._branch_gains(s.path)
                if gains is not None:
                    out.text("branch_gains", self.stack_name(s.path), gains)
        for family, fn in self.recorders:
            if family.validation or not values.validation:
                fn(values, out)
        return out.record

    def _branch_gains(self, stack: str) -> str | None:
        """What every branch of ``stack`` writes through last, when each has a learned gain
        there (``layer scale``, ``norm gain``, ``condition gate``, or several joined by
        ``and``), else None."""
        adds = self.model_map.adds_in(stack)
        kinds = {self.model_map.branch_gain_kind(a) for a in adds}
        if not adds or None in kinds:
            return None
        return " and ".join(sorted(k for k in kinds if k is not None))

    def warn_missing(self, every_family: bool) -> None:
        """Warn (on the writing rank) about chosen families that found nothing to read; of
        ``every_family`` (no names chosen), not about the optional ones."""
        missing: dict[str, list[str]] = {}
        for family in self.empty:
            if family.requires is not None and not (every_family and family.optional):
                missing.setdefault(family.requires, []).append(family.name)
        if missing and is_writer():
            listed = "; ".join(f"{why} ({', '.join(names)})" for why, names in missing.items())
            warnings.warn(
                f"normprobe: {self.model_map.model_type} has {listed}: logging the other metrics",
                DiscoveryWarning,
                stacklevel=5,  # attach's caller (through discover_now and _install)
            )

    def warn_doubts(self) -> None:
        """Warn (on the writing rank) that per-block metrics may miss blocks where the map
        doubts its stacks."""
        doubts = self.model_map.doubts_for("metrics")
        if doubts and is_writer():
            named = "; ".join(f"{d.kind} at {d.path or '<root>'}: {d.reason}" for d in doubts[:3])
            more = f" (and {len(doubts) - 3} more)" if len(doubts) > 3 else ""
            warnings.warn(
                f"normprobe: the map of {self.model_map.model_type} is unsure of its blocks, so "
                f"per-block metrics may miss some: {named}{more}",
                DiscoveryWarning,
                stacklevel=5,  # attach's caller (through discover_now and _install)
            )

    def block_tags(self, series: str, stack: str) -> tuple[str, list[tuple[int, str]]]:
        """The profile tag of a per-block series of a stack, and its blocks' scalar tags (at
        most ``max_block_tags``, evenly spread), made once."""
        key = (series, stack)
        if key not in self._block_tags:
            depth, name = self.depth[stack], self.stack_name(stack)
            blocks = [
                (b, tags.format(series, name, b, depth=depth))
                for b in spread(depth, self.max_block_tags)
            ]
            self._block_tags[key] = (tags.format(series, name), blocks)
        return self._block_tags[key]

    def _on(self, event: str, fn: Callback) -> None:
        assert self._family is not None, "callbacks are registered from a family's plan"
        self.callbacks[event].append((self._family, fn))

    def _name(self, path: str) -> str:
        """A module path as tags show it: under ``name_prefix``, ``root`` for the model."""
        return _unwrapped(self.name_prefix + path) or "root"


class RecordOut:
    """Writes a family's values into a `Record` (`normprobe.metrics.core.base.Out`)."""

    def __init__(self, record: Record, writes: bool, plan: ProbePlan) -> None:
        self.record = record
        self.step = record.step
        self.writes = writes
        self._plan = plan

    def scalar(self, series: str, subject: str, value: float) -> None:
        self.record.scalars[f"{tags.PREFIX}/{series}/{subject}"] = value

    def text(self, series: str, subject: str, text: str) -> None:
        self.record.texts[f"{tags.PREFIX}/{series}/{subject}"] = text

    def per_block(self, series: str, stack: str, values: Mapping[int, float]) -> None:
        profile, blocks = self._plan.block_tags(series, stack)
        first = self._plan.first[stack]
        values = {first + b: v for b, v in values.items()}
        scalars = self.record.scalars
        for b, tag in blocks:
            if b in values:
                scalars[tag] = values[b]
        depth = self._plan.depth[stack]
        self.record.profiles[profile] = [values.get(b, math.nan) for b in range(depth)]

    def vector(self, series: str, subject: str, values: Sequence[float]) -> None:
        self.record.profiles[f"{tags.PREFIX}/{series}/{subject}"] = list(values)


def _unwrapped(path: str) -> str:
    """A module path without the wrappers FSDP1 and activation checkpointing insert."""
    return _WRAPPERS.sub("", path).rstrip(".")


_WRAPPERS = re.compile(r"(?<![^.])(?:_fsdp_wrapped_module|_checkpoint_wrapped_module)(?:\.|$)")
