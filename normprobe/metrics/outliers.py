"""``outliers``: massive activations and outlier features in the residual stream."""

from __future__ import annotations

import math

import torch

from .. import probes
from .core.base import PROBLEM, SUSTAIN, Family, Flag, Out, Plan, Run, Series, Values, sustained
from .core.streams import Streams

# Sun et al. 2024 ("Massive Activations in Large Language Models") call an activation massive
# when it is about 1000x the median magnitude of its hidden state, and find 1000x-10000x in
# trained LLMs. A tenth of that flags them while they form: a Gaussian stream of a million
# entries reads about 8, and TinyTransformer, GPT-2 and timm's ResNet-18 at init under 7.
# In benchmarks/calibration.py healthy runs end at 4.7-14, one given 1000x the median in one
# channel at 670-710 (measured with the median of every nonzero entry: leaving the negligible ones
# out, `probes.NEGLIGIBLE`, moves a Gaussian stream's by about 1%).
RATIO_LIMIT = 100.0


class Outliers(Family):
    name = "outliers"
    requires = "no residual adds in a stack of blocks"
    description = (
        "per block, of the residual stream it leaves (as resid_rms reads it): the largest "
        "|activation| over the median non-negligible |activation| (above 1% of the 90th "
        "percentile: a ReLU's zeros and a LeakyReLU's near-zero half left out; massive "
        "activations), the channel "
        "holding that largest one, and the kurtosis of the channels' RMS, mean(s^4) / "
        "mean(s^2)^2 with s_j the RMS of channel j over all positions (outlier features: 1 when "
        "every channel has the same RMS, the number of channels when one holds everything); "
        "over ranks, the largest ratio, the channel when every rank finds it in the same one, "
        "the mean kurtosis"
    )
    series = (
        Series("outlier_ratio", "block", "max"),  # the worst block
        Series("outlier_channel", "block", "none", scale="linear"),  # an index: the flag names it
        Series("outlier_kurtosis", "block", "max"),
    )

    def plan(self, plan: Plan) -> None:
        streams = Streams.of(plan)
        depth = {s.path: s.depth for s in plan.model_map.stacks}
        # per stack: the ratio; the channel's lowest and highest over ranks (equal when every
        # rank found the largest activation in the same channel); the kurtosis
        slots = {
            stack: tuple(
                plan.slot(depth[stack], reduce) for reduce in ("max", "min", "max", "mean")
            )
            for stack in streams.blocks
        }
        # per stack: the blocks reduced together, and their parts (one row per block)
        reads: dict[str, list[tuple[list[int], probes.OutlierParts]]] = {s: [] for s in slots}
        scratch = streams.scratch

        def reduce(
            stack: str, blocks: list[int], streams: list[torch.Tensor], stacked: torch.Tensor | None
        ) -> None:
            if stacked is not None:
                parts = probes.outlier_parts_many(stacked, scratch.like(stacked))
            else:
                (stream,) = streams
                one = probes.outlier_parts(stream, scratch.like(stream))
                parts = (one[0][None], one[1][None], one[2][None])
            reads[stack].append((blocks, parts))

        def clear() -> None:
            # in place: a compiled graph's guards see the same lists at every forward
            for stack_reads in reads.values():
                stack_reads.clear()

        def finish() -> None:
            for stack, stack_reads in reads.items():
                if stack_reads:
                    blocks = [b for chunk, _ in stack_reads for b in chunk]
                    # (blocks, 3), in one call when every block's stream has as many channels
                    stats = _stats([parts for _, parts in stack_reads])
                    positions = [slot.offset + b for slot in slots[stack] for b in blocks]
                    plan.measured.put_at(positions, stats[:, [0, 1, 1, 2]].T.reshape(-1))

        def record(values: Values, out: Out) -> None:
            for stack, (ratio, channel_low, channel_high, kurtosis) in slots.items():
                ratios = values.measured(ratio)
                if not ratios:
                    continue
                out.per_block("outlier_ratio", stack, ratios)
                high = values.measured(channel_high)
                channels = {b: c for b, c in values.measured(channel_low).items() if high[b] == c}
                out.per_block("outlier_channel", stack, channels)
                out.per_block("outlier_kurtosis", stack, values.measured(kurtosis))

        streams.reducers.append(reduce)
        plan.at_forward_start(clear)
        plan.on_clear(clear)
        plan.at_flush(finish)
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        found = []
        ratio_tags = [t for t in run.tags if t.parsed.series == "outlier_ratio"]
        for stack in sorted({t.stack for t in ratio_tags}):
            worst: dict[int, tuple[float, int]] = {}  # per logged step: the largest, its block
            for t in ratio_tags:
                if t.stack != stack:
                    continue
                for step, v in run.scalars[t.tag]:
                    if math.isfinite(v) and (step not in worst or v > worst[step][0]):
                        worst[step] = (v, t.parsed.block or 0)
            points = [(s, worst[s][0]) for s in sorted(worst)]
            hits = sustained(points, lambda v: v > RATIO_LIMIT)
            if len(hits) < SUSTAIN:
                continue
            step, ratio = hits[-1]
            # where it appears first: the stream keeps it in the blocks after
            first = min(
                t.parsed.block or 0
                for t in ratio_tags
                if t.stack == stack and dict(run.scalars[t.tag]).get(step, 0) > RATIO_LIMIT
            )
            channel = _channel(run, stack, first, step)
            where = (
                "a channel that differs across ranks" if channel is None else f"channel {channel}"
            )
            block = worst[step][1]
            kept = f"; the largest, {ratio:.3g}x, in block {block}'s" if block != first else ""
            found.append(
                Flag(
                    "massive activations",
                    stack,
                    step,
                    ratio,
                    RATIO_LIMIT,
                    f"block {first}'s stream, the first past {RATIO_LIMIT:g}, holds an activation "
                    f"over {RATIO_LIMIT:g}x the median non-negligible |activation|, in "
                    f"{where}{kept} "
                    f"({len(hits)} logged steps past it): "
                    f"{_advice(run, stack)}; `normprobe report RUN_DIR --png depth.png` draws "
                    "outlier_ratio and outlier_channel over the blocks",
                    PROBLEM,
                )
            )
        return found


def _stats(chunks: list[probes.OutlierParts]) -> torch.Tensor:
    """`probes.outlier_stats_many` of the parts of every block, read in chunks: in one call
    where they are alike in shape."""
    if len(chunks) == 1:
        return probes.outlier_stats_many(*chunks[0])
    if len({tuple(p.shape[1:] for p in parts) for parts in chunks}) == 1:
        return probes.outlier_stats_many(
            *(torch.cat(column) for column in zip(*chunks, strict=True))
        )
    return torch.cat([probes.outlier_stats_many(*parts) for parts in chunks])


def _channel(run: Run, stack: str, block: int, step: int) -> int | None:
    """The channel the stack's block logged at ``step``, if it did."""
    for t in run.tags:
        if t.parsed.series == "outlier_channel" and t.stack == stack and t.parsed.block == block:
            value = dict(run.scalars[t.tag]).get(step)
            return None if value is None or not math.isfinite(value) else int(value)
    return None


def _advice(run: Run, stack: str) -> str:
    """What massive activations are and the way out, for a stack with attention (whose logits
    were logged) or without."""
    if any(t.parsed.series == "attn_logit_max" and t.stack == stack for t in run.tags):
        grown = "which models grow as an attention sink or an implicit bias"
        way_out = (
            "Give attention an explicit sink or bias (a learned sink token, attention biases), "
            "normalize queries and keys (QK-norm)"
        )
    else:
        grown = "an implicit bias"
        way_out = (
            "Look at what writes that channel (a bias, a gate, a global-context or "
            "squeeze-excitation term)"
        )
    return (
        f"a few huge values kept in fixed channels, {grown}; they take up the range of int8/fp8 "
        f"quantization, leaving every other value little precision. {way_out}, or lower the "
        "learning rate"
    )
