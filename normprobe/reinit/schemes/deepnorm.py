"""The ``deepnorm`` scheme (Wang et al. 2022) for Post-LN stacks, and its constants.

Xavier-normal draws with gain beta on the feed-forward, value and output projections (gain 1 on
queries and keys), the residual's alpha as a fixed 1/alpha `BranchScale` on each branch. Which
projection is a value and which stack is a decoder are told by behaviour (`deepnorm_probes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from ...discovery import ResidualAdd, inside
from ...layers.branch_scale import BranchScale
from ..branches import (
    branch_ends,
    channels_of,
    check_skip_gains,
    parent_wrapper,
    replace_module,
    scale_value,
)
from ..report import constant, normal, xavier
from ..scheme import Scheme, block_count, positive_number
from ..target import Target
from ..weights import out_in_view
from .deepnorm_probes import EncoderReads, ValueProbe


def deepnorm_constants(n_layers: int) -> tuple[float, float]:
    """DeepNorm's constants for an encoder-only or decoder-only stack (Wang et al. 2022).

    Args:
        n_layers: N, the number of blocks (each with an attention and a feed-forward branch).

    Returns:
        ``(alpha, beta) = ((2N)^(1/4), (8N)^(-1/4))``, as the paper and Microsoft's torchscale
        (``Encoder``/``Decoder`` without ``is_encoder_decoder``) compute them.

    Raises:
        ValueError: ``n_layers`` is not a positive integer.

    Example::

        >>> from normprobe.reinit import deepnorm_constants
        >>> deepnorm_constants(12)   # (2.2134, 0.3195)
    """
    n = block_count("n_layers", n_layers)
    if n is None:
        raise ValueError("n_layers must be a positive integer (number of blocks), got None")
    return (2 * n) ** 0.25, (8 * n) ** -0.25


def deepnorm_encoder_decoder_constants(
    encoder_layers: int, decoder_layers: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """DeepNorm's constants for an encoder-decoder (Wang et al. 2022, Sec. 4).

    With N encoder and M decoder blocks: ``alpha_enc = 0.81 (N^4 M)^(1/16)``,
    ``beta_enc = 0.87 (N^4 M)^(-1/16)``, ``alpha_dec = (3M)^(1/4)``, ``beta_dec = (12M)^(-1/4)``.

    Microsoft's torchscale (0.3.0, ``architecture/encoder.py`` and ``decoder.py``) has the same
    alphas and decoder beta, but its encoder divides the scaled weights by
    ``(N^4 M)^(1/16) / 1.15``, which is ``beta_enc = 1.15 (N^4 M)^(-1/16)`` (1/0.87, not the
    paper's 0.87). It also multiplies beta into PyTorch's default ``nn.Linear`` init (std
    1/sqrt(3 fan_in); its attention's Xavier ``reset_parameters`` is not called; N(0, 0.02) with
    ``bert_init=True``) on every parameter named ``fc1``, ``fc2``, ``v_proj`` or ``out_proj``,
    biases included, and leaves queries and keys at that init, where the paper (and normprobe)
    draw Xavier-normal with gain beta on the value, output and feed-forward projections, gain 1
    on queries and keys, and zero the biases.

    Args:
        encoder_layers: N, the encoder's blocks.
        decoder_layers: M, the decoder's blocks.

    Returns:
        ``((alpha_enc, beta_enc), (alpha_dec, beta_dec))``.

    Raises:
        ValueError: a count that is not a positive integer.

    Example::

        >>> from normprobe.reinit import deepnorm_encoder_decoder_constants
        >>> deepnorm_encoder_decoder_constants(6, 6)
        ((1.4179, 0.4970), (2.0598, 0.3433))
    """
    n = block_count("encoder_layers", encoder_layers)
    m = block_count("decoder_layers", decoder_layers)
    if n is None or m is None:
        raise ValueError("encoder_layers and decoder_layers must be positive integers")
    depth = n**4 * m
    encoder = 0.81 * depth ** (1 / 16), 0.87 * depth ** (-1 / 16)
    return encoder, ((3 * m) ** 0.25, (12 * m) ** -0.25)


class _Constants(NamedTuple):
    """DeepNorm's alpha and beta for one stack, and the formulas they come from."""

    alpha: float
    beta: float
    alpha_from: str
    beta_from: str


def _single(n: int) -> _Constants:
    alpha, beta = deepnorm_constants(n)
    return _Constants(alpha, beta, f"(2N)^(1/4), N={n}", f"(8N)^(-1/4), N={n}")


def _deepnorm_defaults(
    t: Target, adds: Sequence[ResidualAdd], n_layers: int | None, derive: bool
) -> dict[str | None, _Constants]:
    """DeepNorm's (alpha, beta) for the adds of each stack (None: outside any stack).

    ``n_layers`` given: the single-stack formulas with that N everywhere. Otherwise a stack
    whose first block reads an earlier stack's output through an input of its own (the memory of
    a cross-attention) while its stream does not come from that stack is a decoder, the earlier
    one its encoder (`EncoderReads`); two such stacks get the encoder-decoder formulas, any other
    stack the single-stack ones with its own depth. Refuses where it cannot tell which formulas
    hold (``derive``: some constant is not given).
    """
    if n_layers is not None:
        return {a.stack: _single(n_layers) for a in adds}
    found = {a.stack: _single(t.depth(a)) for a in adds}
    stacks = [s for s in dict.fromkeys(a.stack for a in adds) if s is not None]
    if not derive or len(stacks) < 2:
        return found
    pairs = EncoderReads(t).pairs(stacks)
    if not pairs:
        return found
    if len(stacks) > 2 or None in found:
        outside = [a.module for a in adds if a.stack is None][:1]
        raise ValueError(
            f"{t.what}: stack {pairs[0][1]!r} reads the output of {pairs[0][0]!r} as an "
            f"encoder-decoder does, but the model has {len(stacks)} stacks"
            + (f" and residual adds outside any ({outside[0]!r})" if outside else "")
            + ", so it is not clear which of DeepNorm's formulas hold; pass n_layers= (the "
            "single-stack formulas with that N everywhere) or alpha= and beta="
        )
    encoder, decoder = pairs[0]
    n, m = t.map.stack(encoder).depth, t.map.stack(decoder).depth
    (a_enc, b_enc), (a_dec, b_dec) = deepnorm_encoder_decoder_constants(n, m)
    sizes = f"N={n}, M={m}"
    found[encoder] = _Constants(
        a_enc, b_enc, f"0.81(N^4 M)^(1/16), {sizes}", f"0.87(N^4 M)^(-1/16), {sizes}"
    )
    found[decoder] = _Constants(a_dec, b_dec, f"(3M)^(1/4), M={m}", f"(12M)^(-1/4), M={m}")
    return found


def deepnorm(t: Target, *, n_layers: Any = None, alpha: Any = None, beta: Any = None) -> None:
    """Wang et al. 2022, for Post-LN stacks. Feed-forward layers, value projections (the value
    slice of a fused QKV layer) and output projections Xavier-normal with gain
    beta = (8N)^(-1/4), queries and keys gain 1, biases 0; the residual's alpha = (2N)^(1/4) is
    realized as a fixed 1/alpha `BranchScale` on each branch, since the LayerNorm after the add
    is scale-invariant (up to its eps). A skip already scaled by ``s`` gets ``s/alpha``; one
    multiplied by a learned gain (a map's ``skip_gain``) is refused (``gpt2`` and ``fixup``
    take it when it is 1). An encoder-decoder gets the paper's encoder-decoder constants
    (`deepnorm_encoder_decoder_constants`): a stack is the decoder of an earlier one when its
    first block takes that stack's output as an input of its own (the memory of
    cross-attention) while its stream does not derive from it (told by perturbing the earlier
    stack's output in one more forward). Where that leaves the formulas unclear (more than two
    stacks, or adds outside any, with such a reader), it refuses; ``n_layers=`` (the
    single-stack formulas with that N everywhere) or ``alpha=`` and ``beta=`` decide instead.
    """
    n_fixed = block_count("n_layers", n_layers)
    alpha_fixed = None if alpha is None else positive_number("alpha", alpha)
    beta_fixed = None if beta is None else positive_number("beta", beta)
    adds = t.adds()
    m = t.map
    check_skip_gains(t, adds, unit_ok=False)
    for a in adds:
        if a.post_norm is None:
            placement = m.stack(a.stack).placement if a.stack else "no stack"
            raise ValueError(
                f"deepnorm is for Post-LN stacks (x = LN(alpha*x + f(x))), but the residual add "
                f"in {a.module or '<root>'!r} has no norm after it (stack {a.stack!r}, "
                f"placement {placement!r}); use 'gpt2' or insert_branch_scale for Pre-LN models"
            )
    defaults = _deepnorm_defaults(t, adds, n_fixed, alpha_fixed is None or beta_fixed is None)
    attention = [att.path for att in m.attention]
    values = ValueProbe(t)
    ends = branch_ends(t, adds)
    scalers: list[tuple[str, float, str]] = []
    with torch.no_grad():
        for i, a in enumerate(adds):
            c = defaults[a.stack]
            alpha_i = alpha_fixed or c.alpha
            given = "beta given" if beta_fixed else f"beta={c.beta_from}"
            beta = _Beta(beta_fixed or c.beta, given)
            layers = [p for p in a.branch_layers if not isinstance(t.module(p), nn.Embedding)]
            scopes = _attention_scopes(t, attention, layers)
            in_attention = [
                p for p in layers if p not in a.writers and any(inside(p, q) for q in scopes)
            ]
            value_slices = values.find(a, in_attention) if in_attention else {}
            for path in layers:
                layer = t.module(path)
                for name, p in t.applied.of(layer):
                    if not t.drawn(name, p):
                        t.set_vector(name, p, "deepnorm")
                    elif path in value_slices:
                        _xavier_slices(t, layer, p, value_slices[path], beta)
                    else:
                        gain = _QUERY_KEY if path in in_attention else beta
                        _xavier_draw(t, p, out_in_view(layer, p), gain)
            _xavier_mha_inputs(t, layers, beta)
            skip = "1" if a.skip_scale == 1 else f"{a.skip_scale:g}"
            why = f"{skip}/alpha, alpha=" + ("given" if alpha_fixed else c.alpha_from)
            scalers += [(end, a.skip_scale / alpha_i, why) for end in ends.get(i, [])]
    _set_fixed_scalers(t, scalers, "deepnorm")


def _attention_scopes(t: Target, attention: list[str], layers: list[str]) -> list[str]:
    """Where a branch's query, key and value projections live: each attention module holding
    some of the branch's ``layers``, or the module around one that holds none (the
    Informer/iTransformer ``AttentionLayer``, whose projections are siblings of the softmax's
    ``inner_attention``) where every weight layer of it is on this branch."""
    scopes = []
    for att in attention:
        if any(inside(p, att) for p in layers):
            scopes.append(att)
            continue
        parent = att.rpartition(".")[0]
        held = [p for p, _ in t.weight_layers() if inside(p, parent)]
        if held and all(p in layers for p in held):
            scopes.append(parent)
    return scopes


class _Beta(NamedTuple):
    """A Xavier gain of DeepNorm and where it comes from."""

    gain: float
    why: str


_QUERY_KEY = _Beta(1.0, "")


def _xavier_draw(
    t: Target,
    p: torch.Tensor,
    view: torch.Tensor,
    beta: _Beta,
    rows: tuple[int, int] | None = None,
) -> None:
    """Xavier-normal on ``view`` (of ``p``, or its output ``rows``), with DeepNorm's gain."""
    nn.init.xavier_normal_(view, gain=beta.gain)
    drawn = xavier(view, beta.gain, "normal", "beta" if beta.why else "1")
    why = f"{drawn.formula}, {beta.why}" if beta.why else f"{drawn.formula} (query, key)"
    t.rec.record(p, normal(drawn.std or 0.0, why), rows)


def _xavier_mha_inputs(t: Target, layers: list[str], beta: _Beta) -> None:
    """torch's ``nn.MultiheadAttention`` applies its q, k, v projections as parameters of its
    own (the map lists its ``out_proj``): q and k Xavier gain 1, v gain beta, their bias 0."""
    for path in sorted({p.rpartition(".")[0] for p in layers if p.endswith(".out_proj")}):
        mha = t.module(path)
        if not isinstance(mha, nn.MultiheadAttention):
            continue
        for name, p in t.applied.of(mha):
            if name == "in_proj_weight":
                _xavier_slices(t, mha, p, [2], beta)
            elif name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                _xavier_draw(t, p, p, beta if name.startswith("v") else _QUERY_KEY)
            elif name == "in_proj_bias":
                p.zero_()
                t.rec.record(p, constant(0.0, "bias"))


def _xavier_slices(
    t: Target, layer: nn.Module, p: torch.Tensor, value_parts: list[int], beta: _Beta
) -> None:
    """Xavier per q|k|v part of a fused projection: gain beta on value parts, 1 on the rest."""
    view = out_in_view(layer, p)
    if value_parts == [-1]:
        _xavier_draw(t, p, view, beta)
        return
    size = view.shape[0] // 3
    for k in range(3):
        rows = (k * size, (k + 1) * size)
        _xavier_draw(t, p, view[rows[0] : rows[1]], beta if k in value_parts else _QUERY_KEY, rows)


def _set_fixed_scalers(t: Target, scalers: list[tuple[str, float, str]], kind: str) -> None:
    swaps = []
    for path, value, why in scalers:
        wrapper = parent_wrapper(t.model, path)
        if isinstance(wrapper, BranchScale) and wrapper.kind == kind:
            wrapper.scale.fill_(value)  # ran before: update the factor in place
            t.rec.record(wrapper.scale, constant(value, why))
            continue
        if abs(value - 1.0) < 1e-6:
            t.rec.notes.append(f"{path}: the skip already carries alpha, no scaler added")
            continue
        like = next(t.module(path).parameters())
        _, channel_dim, offset = channels_of(t, path)
        new = BranchScale(
            t.module(path),
            kind,
            scale_value(like, value, None),
            channel_dim,
            learnable=False,
            gain_offset=offset,
        )
        t.rec.record(new.scale, constant(value, why))
        swaps.append((path, new))
    for path, new in swaps:
        replace_module(t.model, path, new)


def _counts_depth(options: Any) -> bool:
    """N is counted unless given, or unused (alpha and beta both given)."""
    given = options["alpha"] is not None and options["beta"] is not None
    return options["n_layers"] is None and not given


SCHEME = Scheme(
    "deepnorm",
    deepnorm,
    branches=True,
    counts_depth=_counts_depth,
    leaves_layers="not on a residual branch",
)
