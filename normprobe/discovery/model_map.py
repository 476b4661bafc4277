"""The typed, printable result of `normprobe.discover`: what a model contains."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from ..tables import table

NormKind = Literal[
    "batchnorm", "layernorm", "rmsnorm", "groupnorm", "instancenorm", "dyt", "unknown"
]
NormRole = Literal["pre", "post", "sandwich-post", "qk", "final", "branch", "other"]
NormPlacement = Literal[
    "pre-ln", "post-ln", "sandwich", "deepnorm", "in-branch", "no-norm", "mixed", "no-residual"
]
Placement = Literal[
    "pre-ln",
    "post-ln",
    "sandwich",
    "deepnorm",
    "in-branch",
    "no-norm",
    "mixed",
    "no-residual",
    "parallel",
]
AttentionImpl = Literal["sdpa", "eager", "mha"]
# What a doubt can make wrong: a re-initialization's depth or targets, a branch scale's
# placement, a norm conversion, the per-block metrics.
Action = Literal["reinit", "insert_branch_scale", "convert_norms", "metrics"]
EpsPlacement = Literal["inside-sqrt", "outside-sqrt", "unknown"]


@dataclass(frozen=True)
class NormLayer:
    """One normalization layer.

    Attributes:
        path: name in ``model.named_modules()``.
        kind: what it computes, by class where known and by behaviour otherwise; ``dyt`` is
            Dynamic Tanh, which takes a norm's place without computing statistics.
        role: where it sits relative to the residual stream: ``pre`` feeds a residual branch,
            ``post`` normalizes the sum after a residual add, ``sandwich-post`` normalizes a
            branch output before the add (with a ``pre`` norm on the same branch), ``qk`` sits on
            queries/keys inside attention, ``final`` follows the last block of a stack, ``branch``
            is elsewhere inside a residual branch, ``other`` is anything else (embeddings, stems).
        class_name: the module's class.
        dims: normalized feature dims (LayerNorm/RMSNorm) or channels (BatchNorm/GroupNorm).
        layout: ``channels-last`` when statistics run over the last dim, ``channels-first``
            over dim 1 of a channels-first tensor, ``batch`` over the batch, ``""`` if unknown.
        affine: names of the layer's own learnable parameters (``weight``, ``bias``).
        eps: the epsilon value, if the layer has one.
        eps_attr: the attribute holding eps (``eps``, ``variance_epsilon``, ...).
        eps_placement: ``inside-sqrt`` for sqrt(var + eps), ``outside-sqrt`` for sqrt(var) + eps.
        gain_offset: 1.0 when the output scale is ``1 + weight`` (Gemma), 0.0 for ``weight``,
            None without a gain.
        recognized_by: how normprobe knew it is a norm and what kind.
        stack, block: the stack and block index it belongs to, if any.
        wraps: the parameter-free norm inside this module that computes its statistics, when
            this module only applies a gain and bias of its own to that norm's output
            (``self.ln(x) * self.gamma``); the two are one norm, listed here.
    """

    path: str
    kind: NormKind
    role: NormRole
    class_name: str
    dims: tuple[int, ...]
    layout: str
    affine: tuple[str, ...]
    eps: float | None
    eps_attr: str | None
    eps_placement: EpsPlacement
    gain_offset: float | None
    recognized_by: str
    stack: str | None = None
    block: int | None = None
    wraps: str | None = None


@dataclass(frozen=True)
class Stack:
    """Repeated blocks along the depth axis, in execution order.

    Attributes:
        path: the container (ModuleList/Sequential) holding the blocks.
        blocks: the blocks' paths, in execution order.
        block_type: the blocks' class name.
        placement: how norms sit around the residual adds of these blocks, or ``parallel``
            when each block adds several branches computed side by side into the stream at once
            (``x + attn(ln(x)) + mlp(ln(x))``, GPT-J); ``norm_placement`` then says how the
            norms sit. ``no-residual``: the blocks make no residual add (ShuffleNetV2's stages,
            GoogLeNet's branches), norms or not.
        qk_norm: whether the blocks normalize queries/keys.
        parent: the enclosing stack's path when stacks are nested.
        norm_placement: how norms sit, for every stack (equal to ``placement`` unless that is
            ``parallel``).
        repeated: the blocks are one module run several times (ALBERT's shared layer);
            ``blocks`` then holds its path once per run.
        members: each block's modules where a block is several modules side by side rather
            than one (x-transformers' attention and feed-forward entries alternating in one
            list): ``blocks[i]`` is ``members[i][0]``; empty otherwise.
    """

    path: str
    blocks: tuple[str, ...]
    block_type: str
    placement: Placement
    qk_norm: bool = False
    parent: str | None = None
    norm_placement: NormPlacement = "no-norm"
    repeated: bool = False
    members: tuple[tuple[str, ...], ...] = ()

    @property
    def depth(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class Anchor:
    """Where a residual add's output can be read on every step.

    ``hook`` is ``pre`` (the tensor enters ``module``), ``post`` (``module`` returns it) or
    ``inside`` (no module boundary sees it: it is the ``key[0]``-th tensor add run while
    ``module`` executes). ``call`` counts the module's calls within one forward; ``key`` locates
    the tensor in ``(args, kwargs)`` for ``pre`` and in the output for ``post``.
    """

    hook: Literal["pre", "post", "inside"]
    module: str
    call: int
    key: tuple[str | int, ...]


@dataclass(frozen=True)
class ResidualAdd:
    """One ``y = x + F(x)`` performed inside some module's forward.

    Attributes:
        module: path of the module whose forward performs the add.
        call: which call of that module (0 unless the module runs several times per forward).
        ordinal: index among the residual adds of that call.
        kind: ``identity`` for ``x + F(x)``, ``projection`` when the skip has its own layer
            (ResNet's 1x1-conv downsample).
        stack, block: the stack and block the add belongs to.
        branch_out: the branch's single writer when it has exactly one, else None. Kept for
            one release; read ``writers``.
        branch_layers: the branch's weight layers (Linear/Conv/...), in execution order.
        skip_scale: constant factor on the skip operand (DeepNorm's alpha), 1.0 if none.
        skip_gain: the learned parameter the skip is multiplied by (``x * residual_scale +
            f(x)``), by qualified name (the first, if several), or None; ``skip_scale`` leaves
            it out. The skip may also be a weightless transform of the stream (a slice, pool,
            zero padding: the CIFAR ResNet's "option A" shortcut), still of kind ``identity``.
        pre_norm, post_norm, sandwich_norm: paths of the norms around this add, if any.
        end_norm: the norm whose output is the branch's output, if one is: a sandwich's post
            norm, or a norm ending a branch that has no pre norm (ResNet's last BatchNorm,
            SwinV2's post norms).
        anchor: where the add's output can be read on every step.
        writers: every weight layer that writes into the stream through this add: the last
            weight layer on each path from the branch's input to the add, in execution order
            (attention's output projection and the MLP's down projection of a parallel block;
            every expert of a mixture). Gates and routers are never writers.
        writer_params: the parameters those writers apply as weights (``experts.down_proj``
            of fused experts that also hold ``experts.gate_up_proj``).
        gates: weight layers whose output multiplies a writer's output on its way to the add
            (a router, a sigmoid gate): they scale what is written, they do not write it.
        condition_gates: those of ``gates`` computing their factor from no residual stream,
            from a condition instead: adaLN-Zero's gates, from the timestep and class embedding
            (DiT, Flux), which start at zero there.
        scales: parameters multiplied elementwise into a writer's output on its way to the add
            (a layer scale of shape (C), (C, 1, 1) or (1, 1, C)).
        parallel: the branch sums several ungated sub-branches (a parallel block).
        open_path: some path from the branch's input reaches the add without a weight layer,
            so no layer's init or scale controls all that the branch writes. A branch with no
            weight layer at all (PoolFormer's ``pool(x) - x``) has empty ``writers`` and
            ``branch_layers`` and ``open_path`` True.
    """

    module: str
    call: int
    ordinal: int
    kind: Literal["identity", "projection"]
    stack: str | None
    block: int | None
    branch_out: str | None
    branch_layers: tuple[str, ...]
    skip_scale: float = 1.0
    skip_gain: str | None = None
    pre_norm: str | None = None
    post_norm: str | None = None
    sandwich_norm: str | None = None
    end_norm: str | None = None
    anchor: Anchor | None = None
    writers: tuple[str, ...] = ()
    writer_params: tuple[str, ...] = ()
    gates: tuple[str, ...] = ()
    condition_gates: tuple[str, ...] = ()
    scales: tuple[str, ...] = ()
    parallel: bool = False
    open_path: bool = False


@dataclass(frozen=True)
class Attention:
    """A module computing softmax(QK^T): itself (``eager``), by fused ``sdpa``, or as torch's
    ``nn.MultiheadAttention`` (``mha``), with ``heads`` query heads (1 where the logits' layout
    does not show them)."""

    path: str
    impl: AttentionImpl
    stack: str | None = None
    block: int | None = None
    heads: int = 1


@dataclass(frozen=True)
class Doubt:
    """Something discovery is not sure of, and which actions it can make wrong.

    Attributes:
        kind: a short, stable name for the class of doubt (``add-outside-stack``,
            ``no-stack``, ``unattached-writer``, ``fused-skip``, ``nested-stacks``,
            ``unknown-norm``, ...).
        path: the module it concerns (``""`` for the root).
        reason: one sentence a user can act on.
        affects: the actions that refuse while this doubt stands (`Action`).
        paths: every module it concerns, for an action to tell whether it would touch one;
            ``(path,)`` when left empty.
    """

    kind: str
    path: str
    reason: str
    affects: tuple[Action, ...]
    paths: tuple[str, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        return self.paths or (self.path,)


@dataclass
class ModelMap:
    """What `normprobe.discover` found in a model.

    Attributes:
        model_type: the root module's class name.
        norms: every normalization layer, in module order.
        stacks: the depth axes, in execution order.
        residual_adds: every residual add, in execution order (empty unless traced).
        attention: attention modules, in execution order.
        head: the layer producing the model's output logits, if one was found.
        traced: whether a forward pass was observed (residual adds, roles and behaviour need it).
        trace_ms: how long the observed forward took, in milliseconds.
        notes: things a reader should know (disagreements, missing sections).
        weight_layers: modules whose parameters the traced forward applied as weights
            (matrices, kernels, tables), in module order; empty unless traced.
        doubts: where the map may be incomplete in a way that changes what an action does;
            the actions named in each refuse while it stands.
    """

    model_type: str
    norms: list[NormLayer] = field(default_factory=list)
    stacks: list[Stack] = field(default_factory=list)
    residual_adds: list[ResidualAdd] = field(default_factory=list)
    attention: list[Attention] = field(default_factory=list)
    head: str | None = None
    traced: bool = False
    trace_ms: float = 0.0
    notes: list[str] = field(default_factory=list)
    weight_layers: tuple[str, ...] = ()
    doubts: list[Doubt] = field(default_factory=list)

    def doubts_for(self, action: Action) -> list[Doubt]:
        """The doubts that make ``action`` refuse."""
        return [d for d in self.doubts if action in d.affects]

    def norm(self, path: str) -> NormLayer:
        """The norm at ``path``; KeyError lists the known ones."""
        for n in self.norms:
            if n.path == path:
                return n
        raise KeyError(f"no norm layer at {path!r}; known: {[n.path for n in self.norms][:20]}")

    def stack(self, path: str) -> Stack:
        """The stack at ``path``; KeyError lists the known ones."""
        for s in self.stacks:
            if s.path == path:
                return s
        raise KeyError(f"no stack at {path!r}; known: {[s.path for s in self.stacks]}")

    def adds_in(self, stack: str) -> list[ResidualAdd]:
        """Residual adds belonging to the stack at ``stack``."""
        return [a for a in self.residual_adds if a.stack == stack]

    def branch_gains(self, add: ResidualAdd) -> tuple[str, ...]:
        """The learned gains that scale what ``add``'s branch writes, last on its way to the
        add: its layer scales (parameters), else the gain of the norm ending it (parameters),
        else its condition gates (the layers computing them); empty: none."""
        return self._branch_gains(add)[1]

    def branch_gain_kind(self, add: ResidualAdd) -> str | None:
        """What `branch_gains` found for ``add``: ``layer scale``, ``norm gain`` or
        ``condition gate``; None when it found none."""
        return self._branch_gains(add)[0]

    def _branch_gains(self, add: ResidualAdd) -> tuple[str | None, tuple[str, ...]]:
        if add.scales:
            return "layer scale", add.scales
        if add.end_norm is not None:
            norm = self.norm(add.end_norm)
            gains = tuple(
                f"{norm.path}.{p}" if norm.path else p for p in norm.affine if not is_bias_name(p)
            )
            if gains:
                return "norm gain", gains
        if add.condition_gates:
            return "condition gate", add.condition_gates
        return None, ()

    def __str__(self) -> str:
        return render(self)


def inside(path: str, container: str) -> bool:
    """Whether module ``path`` is ``container`` or lies within it (anything lies within the
    root, ``""``)."""
    return container == "" or path == container or path.startswith(container + ".")


def is_bias_name(name: str) -> bool:
    """Whether a parameter of this name is an additive offset (a bias, a norm's beta)."""
    low = name.lower()
    return "bias" in low or low in ("beta", "shift", "offset")


def _name(path: str | None) -> str:
    if path is None:
        return "-"
    return path or "<root>"


def _eps(n: NormLayer) -> str:
    if n.eps is None:
        return "-"
    where = {"inside-sqrt": "in √", "outside-sqrt": "OUT of √", "unknown": "?"}[n.eps_placement]
    return f"{n.eps:.0e} {where}"


def _gain(n: NormLayer) -> str:
    if not n.affine:
        return "none"
    text = "+".join(n.affine)
    return f"1+{text}" if n.gain_offset == 1.0 else text


def render(m: ModelMap) -> str:
    """The compact table `print(model_map)` shows."""
    how = f"traced one forward in {m.trace_ms:.0f} ms" if m.traced else "not traced (no inputs)"
    lines = [f"ModelMap of {m.model_type}: {how}"]
    lines += _stack_lines(m) + _norm_lines(m) + _add_lines(m)
    if m.attention:
        lines.append(f"Attention ({len(m.attention)})")
        rows = [(_name(a.path), a.impl, str(a.heads)) for a in m.attention]
        lines += table(("path", "impl", "heads"), rows)
    lines.append(f"Head: {_name(m.head)}")
    lines += [f"Note: {note}" for note in m.notes]
    lines += [
        f"Doubt ({d.kind}, {_name(d.path)}): {d.reason} [refuses: {', '.join(d.affects)}]"
        for d in m.doubts
    ]
    return "\n".join(lines)


def _stack_lines(m: ModelMap) -> list[str]:
    lines = [f"Stacks ({len(m.stacks)})"]
    if not m.stacks:
        return [*lines, "  (none)"]
    rows: list[tuple[str, ...]] = []
    for s in m.stacks:
        adds = m.adds_in(s.path)
        per_block = f"{len(adds) / s.depth:g}" if m.traced else "?"
        place = s.placement + ("+qk-norm" if s.qk_norm else "")
        rows.append((_name(s.path), str(s.depth), s.block_type, place, per_block))
    return lines + table(("path", "blocks", "block", "placement", "adds/block"), rows, ())


def _norm_lines(m: ModelMap) -> list[str]:
    lines = [f"Norms ({len(m.norms)}: {_counts(n.kind for n in m.norms)})"]
    if not m.norms:
        return [*lines, "  (none)"]
    rows = [
        (
            _name(n.path),
            n.kind,
            n.role,
            "x".join(map(str, n.dims)) + (" cf" if n.layout == "channels-first" else ""),
            _eps(n),
            _gain(n),
            n.recognized_by,
        )
        for n in m.norms
    ]
    return lines + table(("path", "kind", "role", "dims", "eps", "gain", "recognized by"), rows)


def _add_lines(m: ModelMap) -> list[str]:
    lines = [f"Residual adds ({len(m.residual_adds)})"]
    if not m.residual_adds:
        return [*lines, "  (none)" if m.traced else "  (unknown: pass example inputs to discover)"]
    rows = [
        (
            f"{_name(a.module)}#{a.ordinal}" + (f"@{a.call}" if a.call else ""),
            a.kind
            + (f" x{a.skip_scale:.3g}" if a.skip_scale != 1.0 else "")
            + (f" x{a.skip_gain.rpartition('.')[2]}" if a.skip_gain else ""),
            _name(a.branch_out),
            str(len(a.branch_layers)),
            f"{a.anchor.hook} {_name(a.anchor.module)}" if a.anchor else "-",
        )
        for a in m.residual_adds
    ]
    return lines + table(("add", "kind", "branch out", "layers", "read at"), rows, (0, 2, 4))


def _counts(items: Iterable[str]) -> str:
    c = Counter(items)
    return ", ".join(f"{v} {k}" for k, v in c.most_common()) or "none"
