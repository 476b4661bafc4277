"""``grad_norm``: each block's gradient, and how it is spread over depth."""

from __future__ import annotations

import math
import statistics
import warnings

import torch

from .. import tags
from .core.base import (
    MODEL,
    NOTE,
    PROBLEM,
    SUSTAIN,
    Family,
    Flag,
    Out,
    Plan,
    Points,
    Run,
    Series,
    Values,
    block_params,
    placement,
    sustained,
)
from .core.grads import GradSquares, unscaled

# grad_ratio (last / first block), sanity check [d]: Post-LN reads 2.35 at init (top-heavy, the
# reason it needs warmup: Xiong et al. 2020) and DeepNorm 1.02, so 2.0 is a note. A problem when
# it stays past 10 to the end: in benchmarks/calibration.py a Post-LN stack 4x make demo's depth
# without warmup ends at 100-600 (16 blocks, 60 steps) or 3e11 (24 blocks, 300 steps: its first
# block's gradient vanishes), while healthy runs end at 0.14-0.93 (DeepNorm twice as deep
# passes 3.5-14 for a few steps early on, then falls back). A problem only in a stack whose
# blocks share a residual stream (resid_rms logged for it, when it is logged at all): timm's
# ConvNeXt-atto `stages`, four stages of widths 40..320 joined by downsampling, reads 190-2300
# in a healthy run (benchmarks/calibration_unseen.py: its first stage's weights sit behind
# layer scales of 1e-6, the last stage starts with a plain downsampling conv).
TOP_LIMIT = 2.0
TOP_PROBLEM = 10.0
# ... and only in a stack whose first and last blocks hold about as many trainable parameters
# (within SIZE_TOLERANCE; T5's first block alone holds the relative position bias, 256 of its 2M
# weights at t5-small): a gradient norm grows with the block's size, so the ratio of blocks of
# different widths says nothing of Pre-LN or Post-LN. timm's DaViT-tiny `stages` (stages of
# widths 96..768) reads 11 in a healthy run.
SIZE_TOLERANCE = 1.1
# Pre-LN reads 0.40 at init in check [d] (each block's scale shrinks evenly with depth), and
# its healthy runs in the calibration set end at 0.14-0.93: bottom-heavy gradients past 4x are
# a note, never a problem.
BOTTOM_LIMIT = 0.25
# a clip factor below this is a clipped step (clip_grad_norm_ adds 1e-6 to the total: an
# unclipped step reads 1 within float32 rounding)
CLIPPED = 0.999
# gradients at the optimizer step smaller by an exact power of two, at least this one, than at
# the backward's end carried a loss scale (GradScaler starts at 2**16)
SCALED = 16.0
# smaller by at least this much, not a power of two: clipped that much, or clipped and scaled
# by a GradScaler the probe did not see (one that gets there falls below 2**10 only after six
# overflows in a row)
UNSEEN_SCALE = 2.0**10
# what torch.nn.utils.clip_grad_norm_ adds to the total it divides the max norm by
CLIP_EPS = 1e-6


class GradNorm(Family):
    name = "grad_norm"
    requires = "no trainable parameters"
    description = (
        "L2 norm of each block's parameter gradients where they are complete and not clipped "
        "yet (after accumulation and AMP unscaling, before clip_grad_norm_); per stack the "
        "top/bottom ratio (last block / first block); grad_norm_total over every trainable "
        "parameter and grad_norm_rest over those in no block (the blocks' squares and the "
        "rest's add up to the total's); grad_clip_factor, the total at the optimizer step "
        "over the total before clipping (1: not clipped; from a fixed sample of each large "
        "gradient: exact when clipping scales every gradient alike, as clip_grad_norm_ does)"
    )
    series = (
        Series("grad_norm", "block", "mean"),
        Series("grad_ratio", "stack"),
        Series("grad_norm_total", "model"),
        Series("grad_norm_rest", "model"),
        Series("grad_clip_factor", "model"),
    )

    def plan(self, plan: Plan) -> None:
        grads = GradSquares.of(plan)
        if not grads.params:
            return
        blocks = grads.blocks.blocks
        slots = {
            stack: plan.slot(s.stop - s.start, plan.param_reduce) for stack, s in blocks.items()
        }
        whole = plan.slot(2, plan.param_reduce)  # the rest's and the total's squares
        # the sampled total's squares before clipping and at the optimizer step
        stepped = plan.slot(2, plan.param_reduce)
        total = grads.total_weights()
        read = [False]  # this step's gradients were read
        # ... before clipping: a sample's total (None: the sample reads every gradient whole, so
        # it is the total of the squares taken with it), and the gradients it was taken from
        # with their versions (None: not comparable)
        sampled_before: list[tuple[torch.Tensor | None, list[tuple[torch.Tensor, int]] | None]] = []
        warned = [False]
        sizes = _unequal_sizes(grads, blocks)

        def take() -> None:
            read[0] = True
            visible = plan.clipping_visible
            sampled = None if grads.sample_is_whole else grads.sampled_total()
            sampled_before[:] = [(sampled, grads.versions())] if visible else []

        def at_step() -> None:
            # what `take` saw, put here: a loss scale found at the step is divided out by now
            sums, squares = grads.group_sums(), grads.squares
            if not read[0] or sums is None or squares is None:
                return
            read[0] = False
            for stack, at in blocks.items():
                plan.measured.put(slots[stack], sums[at])
            total_squares = _total(squares, total)
            plan.measured.put(whole, torch.stack([sums[-1], total_squares]))
            if sampled_before:  # else the step sees the gradients `take` saw
                sampled, versions = sampled_before.pop()
                before = total_squares if sampled is None else unscaled(sampled, plan.late_scale)
                # gradients nothing clipped since (none replaced, none changed in place): the
                # same sample, not read again
                unchanged = grads.unchanged(versions) and plan.late_scale is None
                after = before if unchanged else grads.sampled_total()
                plan.measured.put(stepped, torch.stack([before, after]))

        def record(values: Values, out: Out) -> None:
            both = values.get(whole)
            if both is None:
                return
            rest, total_squares = both
            if not _write_clip_factor(plan, out, total_squares, values.get(stepped), warned):
                return  # the values read at the end of the backward carry a loss scale
            out.scalar("grad_norm_total", MODEL, math.sqrt(total_squares))
            out.scalar("grad_norm_rest", MODEL, math.sqrt(rest))
            for stack, slot in slots.items():
                squares = values.get(slot)
                if squares is not None:
                    _write_blocks(plan, out, stack, squares, sizes.pop(stack, None))

        plan.on_gradients(take)
        plan.before_step(at_step)
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        found = _clipping(run.scalars.get(tags.format("grad_clip_factor", MODEL), []))
        streams = {t.stack for t in run.tags if t.parsed.series == "resid_rms"}
        for stack in sorted({t.stack for t in run.tags if t.parsed.series == "grad_ratio"}):
            where = placement(run, stack)
            if where == "no-residual":
                continue  # the skew of Pre-LN and Post-LN is one of residual streams
            points = run.scalars.get(tags.format("grad_ratio", stack), [])
            unlike = _unlike(stack, streams, block_params(run, stack))
            flag = _skew(stack, points, where, unlike)
            if flag is not None:
                found.append(flag)
        return found


def _write_clip_factor(
    plan: Plan, out: Out, total_squares: float, at_step: list[float] | None, warned: list[bool]
) -> bool:
    """Write the clip factor: the total gradient norm at the optimizer step over the one before
    clipping, from a fixed sample of every gradient (``at_step``: the sample's squares before
    and at the step), or clip_grad_norm_'s own factor where the trainer's
    clip norm is known (`Plan.clip_norm`). False (and a warning, once) when the gradients
    read before carried a loss scale: the step's gradient norms are not to be written."""
    if total_squares <= 0:
        return True
    if at_step is not None:
        before, after = at_step
        if before <= 0:
            return True
        factor = math.sqrt(after / before)
        scaled = _loss_scaled(factor)
        if (scaled or factor <= 1 / UNSEEN_SCALE) and out.writes and not warned[0]:
            warned[0] = True
            _warn_scaled(out, factor, scaled)
        if scaled:
            return False
    elif plan.clip_norm is not None:
        factor = plan.clip_norm / (math.sqrt(total_squares) + CLIP_EPS)
    else:
        return True
    out.scalar("grad_clip_factor", MODEL, min(1.0, factor))
    return True


def _write_blocks(
    plan: Plan, out: Out, stack: str, squares: list[float], sizes: tuple[int, int] | None
) -> None:
    """A stack's per-block gradient norms and its top/bottom ratio; ``sizes``, its first and
    last block's parameter counts where they differ (written once: the caller passes them once)."""
    norms = {b: math.sqrt(v) for b, v in enumerate(squares)}
    out.per_block("grad_norm", stack, norms)
    first, last = norms[0], norms[len(norms) - 1]
    name = plan.stack_name(stack)
    if first:
        out.scalar("grad_ratio", name, last / first)
    if sizes is not None:
        out.text("block_params", name, f"{sizes[0]} {sizes[1]}")


def _unequal_sizes(grads: GradSquares, blocks: dict[str, slice]) -> dict[str, tuple[int, int]]:
    """The trainable parameter counts of the first and last block of each stack whose two
    differ by more than `SIZE_TOLERANCE`."""
    counts = [0] * grads.blocks.count
    for p, block in zip(grads.blocks.params, grads.blocks.param_block, strict=True):
        if p.requires_grad:
            counts[block] += p.numel()
    ends = {stack: (counts[s.start], counts[s.stop - 1]) for stack, s in blocks.items()}
    return {
        stack: (first, last)
        for stack, (first, last) in ends.items()
        if max(first, last) > SIZE_TOLERANCE * min(first, last)
    }


def _unlike(stack: str, streams: set[str], sizes: tuple[int, int] | None) -> str | None:
    """Why ``stack``'s first and last gradients are not those of one residual stream's blocks
    (``streams``: the stacks resid_rms was logged for, if any; ``sizes``: the two blocks'
    parameter counts where they differ), or None when they are."""
    if streams and stack not in streams:
        return "its blocks share no residual stream: they may differ in width"
    if sizes is not None:
        first, last = sizes
        return (
            f"its first and last blocks hold {first:,} and {last:,} trainable parameters, "
            "and a gradient norm grows with the block's size"
        )
    return None


def _skew(
    stack: str, points: list[tuple[int, float]], where: str | None, unlike: str | None
) -> Flag | None:
    """The skew flag of ``stack``'s ``grad_ratio`` points; a problem only when the blocks are
    alike (``unlike``: why they are not)."""
    top = sustained(points, lambda v: v >= TOP_LIMIT)
    bottom = sustained(points, lambda v: 0 < v <= BOTTOM_LIMIT)
    for hits, kind, limit in ((top, "top", TOP_LIMIT), (bottom, "bottom", BOTTOM_LIMIT)):
        if len(hits) < SUSTAIN:
            continue
        ratio = statistics.median(v for _, v in hits)
        when = f"(median of the {len(hits)} logged steps at which it is past {limit:g})"
        if unlike is not None:
            advice = f"{unlike}, so this need not be a skew over depth"
        elif kind == "top":
            like = ", as in Post-LN (2.35 over 48 blocks at init)" if where == "post-ln" else ""
            advice = (
                f"gradients pile up near the output{like}; warm the learning rate up, or "
                "re-initialize a Post-LN stack for DeepNorm (normprobe.reinit(model, 'deepnorm'))"
            )
        else:
            like = (
                " (the direction of Pre-LN's skew, 2.5x over 48 blocks at init)"
                if where == "pre-ln"
                else ""
            )
            advice = (
                f"the first block's gradient is {1 / ratio:.3g}x the last one's{like}; deep blocks "
                "learn slowly: scale the residual branches (normprobe.reinit(model, 'gpt2'), "
                "normprobe.insert_branch_scale(model, 'layerscale')) or give deep blocks a larger "
                "learning rate"
            )
        problem = (
            kind == "top"
            and unlike is None
            and len(sustained(points, lambda v: v >= TOP_PROBLEM)) >= SUSTAIN
        )
        return Flag(
            f"{kind}-heavy gradients",
            stack,
            hits[-1][0],
            ratio,
            TOP_PROBLEM if problem else limit,
            f"grad_ratio (last / first block) {ratio:.3g} {when}: {advice}",
            PROBLEM if problem else NOTE,
        )
    return None


def _total(squares: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The sum of every parameter's squares, each counted once (``weights``: 0 on repeats)."""
    return squares.sum() if weights is None else squares @ weights.to(squares)


def _loss_scaled(factor: float) -> bool:
    """Whether the gradients at the optimizer step are those at the backward's end divided by
    a power of two of at least `SCALED`: a loss scale (GradScaler) the probe was not handed."""
    if not 0 < factor <= 1 / SCALED:
        return False
    power = -math.log2(factor)
    return abs(power - round(power)) < 1e-4


def _warn_scaled(out: Out, factor: float, scaled: bool) -> None:
    """Warn that the gradients read before the step may carry a loss scale: they do when
    ``scaled`` (not written), else they may (written)."""
    seen = f"{1 / factor:.4g}x those at the optimizer step"
    why = (
        f"{seen}, a power of two: a loss scale (fp16 GradScaler) normprobe does not know; "
        "grad_norm is not written on such steps"
        if scaled
        else f"{seen}: clipped that much, or clipped and loss-scaled by a GradScaler that "
        "normprobe did not see; grad_norm is written as read before clipping"
    )
    warnings.warn(
        f"normprobe: at step {out.step} the gradients at the end of the backward were {why}. "
        "normprobe finds a GradScaler when scaler.step(opt) steps the optimizer; one that "
        "unscales and steps it otherwise must be passed: "
        "normprobe.attach(model, optimizer=opt, scaler=scaler)",
        RuntimeWarning,
        stacklevel=2,
    )


def _clipping(points: Points) -> list[Flag]:
    """A note when the gradients were clipped on most logged steps."""
    finite = [(s, v) for s, v in points if math.isfinite(v)]
    clipped = [(s, v) for s, v in finite if v < CLIPPED]
    if len(clipped) < SUSTAIN or len(clipped) * 2 <= len(finite):
        return []
    factor = statistics.median(v for _, v in clipped)
    return [
        Flag(
            "clipped gradients",
            MODEL,
            clipped[-1][0],
            len(clipped) / len(finite),
            0.5,
            f"gradients clipped on {len(clipped)} of {len(finite)} logged steps (median clip "
            f"factor {factor:.3g}): clipping sets the step size instead of the learning rate; "
            "raise max_grad_norm, lower the learning rate or warm it up",
            NOTE,
        )
    ]
