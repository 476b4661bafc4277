"""``resid_rms``: how the residual stream grows with depth."""

from __future__ import annotations

import itertools
import math
import statistics

from .. import probes, tags
from .core.base import (
    NOTE,
    PROBLEM,
    SUSTAIN,
    Family,
    Flag,
    Out,
    Plan,
    Run,
    Series,
    Values,
    block_params,
    sustained,
)
from .core.streams import Streams, stream_rms

# Residual growth needs both a shape and a size. Shape: log RMS against log depth rising with a
# slope of at least 0.3; Pre-LN's sqrt(l) growth (each block adds an O(1) write to the stream's
# variance; Xiong et al. 2020) is 0.5, and the 48-block Pre-LN `ResidualStack` of sanity check
# [d] reads 0.37 at init (its input already has RMS 1, which flattens the start). Size: the last
# block's RMS at least 3x the first one's, so that a deep block's write weighs a third of the
# first block's; that stack reads 3.5, a 4-block Pre-LN model under 2.
SLOPE_LIMIT = 0.3
GROWTH_MIN = 3.0
# Any shape: an unscaled stream of 50 layers grows its std x10 (variance x101, sanity
# check [f]); a stack growing that much is flagged whatever its slope. Residual growth is a
# note: Pre-LN's stream grows with depth by design (a 16-block TinyTransformer, Pre-LN, passes
# 10 within 60 AdamW steps and trains as well as its Post-LN twin; the calibration set's healthy
# runs pass 9.6 in their first steps); a single layer's growth is `JUMP_LIMIT`'s problem.
GROWTH_LIMIT = 10.0
# ... but a problem where the stream compounds: multiplied by at least COMPOUND_LIMIT at the
# typical block (the median over consecutive logged blocks of their RMS ratio, taken per block),
# in a stack of like blocks (grad_norm wrote no `block_params` for it) growing past GROWTH_LIMIT.
# Pre-LN's sqrt(l) growth multiplies the stream by at most 1.41 from one block to the next, and
# the calibration set's healthy runs end at most 1.4x; x-transformers 2.31.10's hyper-connections
# (num_residual_streams=4), whose stream-mixing matrix degenerates to all ones, sum the four
# streams at every sublayer: 16x a block, 4e3 over 4 blocks at init.
COMPOUND_LIMIT = 2.0
# Residual jump, a problem: a block whose stream's RMS is this many times the previous block's.
# One layer writes far more than the others (a layer scaled up, a branch that blew up), and the
# stack's growth is that layer's, not depth's. In benchmarks/calibration.py healthy runs end
# at most 1.4x from one block to the next; a block whose MLP output is scaled by 1e4 reads
# 7e3, one that adds a massive activation to one channel 120-210.
JUMP_LIMIT = 10.0
# ... and only where that block writes more than WRITE_FACTOR times the median write of the blocks
# after it (a write's size: the square root of the rise in the stream's mean square). A jump
# whose block writes as the later ones do says the stream before it was small: the first blocks
# of transformers' OLMo-2 at width 64 write 0.07-0.5 where the rest write 1-1.4, their post norms'
# eps outweighing their branches' tiny outputs at init (12x from block 0 to 1 in a healthy run).
WRITE_FACTOR = 3.0
# `diagnose` checks the slope only on stacks this deep: over fewer blocks it is mostly the first
# block's noise.
MIN_DEPTH = 4


class ResidRms(Family):
    name = "resid_rms"
    requires = "no residual adds in a stack of blocks"
    description = (
        "RMS of the residual stream after each block (the output of the block's last "
        "residual add, or of the norm right after it in Post-LN); per stack also its growth "
        "(last block / first) and the slope of log RMS against log depth (0.5 for sqrt(l) growth)"
    )
    series = (
        Series("resid_rms", "block", "last"),  # the stream leaving the stack
        Series("resid_growth", "stack"),
        Series("resid_slope", "stack"),
    )

    def plan(self, plan: Plan) -> None:
        streams = Streams.of(plan)
        depth = {s.path: s.depth for s in plan.model_map.stacks}
        slots = {stack: plan.slot(depth[stack], "rms") for stack in streams.blocks}

        def finish() -> None:
            for stack, reads in streams.reads.items():
                if reads and stack in slots:
                    positions = [slots[stack].offset + r.block for r in reads]
                    plan.measured.put_at(positions, stream_rms(reads))

        def record(values: Values, out: Out) -> None:
            for stack, slot in slots.items():
                blocks = values.measured(slot)
                if not blocks:
                    continue
                out.per_block("resid_rms", stack, blocks)
                first, last = blocks.get(0), blocks.get(depth[stack] - 1)
                if first and last is not None:
                    name = plan.stack_name(stack)
                    out.scalar("resid_growth", name, last / first)
                    slope = probes.loglog_slope([blocks[b] for b in sorted(blocks)])
                    out.scalar("resid_slope", name, slope)

        plan.at_flush(finish)
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        return _growth_flags(run) + _jump_flags(run)


def _growth_flags(run: Run) -> list[Flag]:
    found = []
    for stack in sorted({t.stack for t in run.tags if t.parsed.series == "resid_growth"}):
        growth = run.scalars.get(tags.format("resid_growth", stack), [])
        slopes = dict(run.scalars.get(tags.format("resid_slope", stack), []))

        # growth past the limit, or past the minimum with a rising slope (-1: neither)
        marked = [
            (
                s,
                g
                if g >= GROWTH_LIMIT or (g >= GROWTH_MIN and slopes.get(s, 0) >= SLOPE_LIMIT)
                else -1,
            )
            for s, g in growth
        ]
        hits = sustained(marked, lambda g: g >= 0)
        if len(hits) < SUSTAIN:
            continue
        step, g = hits[-1]
        compounding = _compounding(run, stack, growth)
        if compounding:
            found.append(_compounding_flag(stack, compounding))
            continue
        s = slopes.get(step, math.nan)
        if g >= GROWTH_LIMIT:
            why = f"resid_growth {g:.3g} >= {GROWTH_LIMIT:g}"
        else:
            why = (
                f"resid_growth {g:.3g} >= {GROWTH_MIN:g} and resid_slope {s:.3g} >= "
                f"{SLOPE_LIMIT} (0.5 is Pre-LN's sqrt(l) growth)"
            )
        found.append(
            Flag(
                "residual growth",
                stack,
                step,
                g,
                GROWTH_LIMIT if g >= GROWTH_LIMIT else GROWTH_MIN,
                f"{why} at {len(hits)} logged steps: the last block's stream has {g:.3g}x the "
                "RMS of the first block's, so deep blocks' writes are diluted; keep a final "
                "norm before the head, or scale the residual branches "
                "(normprobe.reinit(model, 'gpt2'), "
                "normprobe.insert_branch_scale(model, 'layerscale'))",
                NOTE,
            )
        )
    return found


def _compounding(run: Run, stack: str, growth: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The logged steps (sustained to the end) at which ``stack``'s stream grows past
    `GROWTH_LIMIT` while compounding, with the typical block's factor; empty when it does not,
    or when its blocks differ in size."""
    if block_params(run, stack) is not None:
        return []
    series = _stream_rms(run, stack)
    factors = [(s, _block_factor(series, s) if g >= GROWTH_LIMIT else 0.0) for s, g in growth]
    hits = sustained(factors, lambda f: f >= COMPOUND_LIMIT)
    return hits if len(hits) >= SUSTAIN else []


def _block_factor(series: list[tuple[int, dict[int, float]]], step: int) -> float:
    """The median over consecutive logged blocks after the first of their stream RMS ratio at
    ``step``, per block between them (NaN under four blocks logged). The first ratio is left
    out: it says how small the first block's write was (OLMo-2's and EXAONE-4's post norms at
    init: streams of 0.08, 0.6, 1.4 over three blocks, ratios 7.2 and 2.4), not what each
    block does to the stream."""
    rms = [(b, v) for b, values in series if (v := values.get(step, math.nan)) > 0]
    factors = [(v / u) ** (1 / (b - a)) for (a, u), (b, v) in itertools.pairwise(rms)][1:]
    factors = [f for f in factors if math.isfinite(f)]
    return statistics.median(factors) if len(factors) >= 2 else math.nan


def _compounding_flag(stack: str, hits: list[tuple[int, float]]) -> Flag:
    step, factor = hits[-1]
    return Flag(
        "residual growth",
        stack,
        step,
        factor,
        COMPOUND_LIMIT,
        f"the residual stream is multiplied by {factor:.3g} at the typical block (median over "
        f"the stack, >= {COMPOUND_LIMIT:g} with its growth past {GROWTH_LIMIT:g} at "
        f"{len(hits)} logged steps): it compounds, where Pre-LN's sqrt(l) growth adds; look at "
        "what the skip path does to the stream (a skip scaled above 1, streams summed rather "
        "than mixed) before the branches' scale",
        PROBLEM,
    )


def _stream_rms(run: Run, stack: str) -> list[tuple[int, dict[int, float]]]:
    """Each block's stream RMS by logged step, in block order."""
    blocks = sorted(
        (t.parsed.block, t.tag)
        for t in run.tags
        if t.parsed.series == "resid_rms" and t.stack == stack and t.parsed.block is not None
    )
    return [(b, dict(run.scalars[tag])) for b, tag in blocks]


def _jumps(
    series: list[tuple[int, dict[int, float]]],
) -> dict[int, tuple[float, tuple[int, int]]]:
    """Per logged step: the largest ratio of a block's stream RMS to that of the block logged
    before it, and the two blocks."""
    found: dict[int, tuple[float, tuple[int, int]]] = {}
    for (a, before), (b, after) in itertools.pairwise(series):
        for step, v in after.items():
            u = before.get(step)
            if u is None or not (u > 0 and math.isfinite(v)):
                continue
            if step not in found or v / u > found[step][0]:
                found[step] = (v / u, (a, b))
    return dict(sorted(found.items()))


def _writes_more(series: list[tuple[int, dict[int, float]]], block: int, step: int) -> bool:
    """Whether ``block`` writes more than `WRITE_FACTOR` times the median write of the blocks
    after it at ``step``; false when none after it was logged: a last block writing more than
    the ones before may be one whose peers write little by design (OLMo-hybrid's last layer,
    full attention after linear attention), and no later write tells which."""
    rms = [(b, values[step]) for b, values in series if math.isfinite(values.get(step, math.nan))]
    writes = {b: math.sqrt(max(v * v - u * u, 0.0)) for (_, u), (b, v) in itertools.pairwise(rms)}
    later = [w for b, w in writes.items() if b > block]
    return bool(later) and writes.get(block, 0.0) > WRITE_FACTOR * statistics.median(later)


def _jump_flags(run: Run) -> list[Flag]:
    found = []
    for stack in sorted({t.stack for t in run.tags if t.parsed.series == "resid_rms"}):
        series = _stream_rms(run, stack)
        jumps = _jumps(series)
        hits = sustained([(s, r) for s, (r, _) in jumps.items()], lambda r: r >= JUMP_LIMIT)
        if len(hits) < SUSTAIN:
            continue
        step, ratio = hits[-1]
        a, b = jumps[step][1]
        if not _writes_more(series, b, step):
            continue  # the stream before block b was small: no one layer's doing
        found.append(
            Flag(
                "residual jump",
                stack,
                step,
                ratio,
                JUMP_LIMIT,
                f"the stream leaving block {b} has {ratio:.3g}x the RMS of the one leaving block "
                f"{a} (>= {JUMP_LIMIT:g} at {len(hits)} logged steps): one layer of block {b} "
                "writes far more than the rest of the stack; look at that block's output "
                "(a scale, a branch that blew up, its init) rather than re-initializing the "
                "whole model",
                PROBLEM,
            )
        )
    return found
