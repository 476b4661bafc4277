"""DeepNet scale: a 1000-block Pre-LN stack is mapped, probed and logged, and what a logged step
writes is bounded by ``max_block_tags``, not by depth. (Times: ``benchmarks/scale.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hooks import hook_count
from tb import Events, read_events

import normprobe
from normprobe import tags
from normprobe.metrics import SERIES
from normprobe.models import ResidualStack, TinyTransformer
from normprobe.runtime import tagged_paths

CAP = 64  # attach's default max_block_tags
# series with a tag per block of a stack (resid_rms, grad_norm, outliers' three, ...), and per
# stack (resid_growth, grad_ratio, ...)
PER_BLOCK = sum(s.shape == "block" for s in SERIES.values())
PER_STACK = sum(s.shape == "stack" for s in SERIES.values())
PER_NORM = 4  # norm_in_rms, norm_out_rms, norm_gain_mean, norm_gain_std (no BatchNorm here)
MODEL_WIDE = 5  # logits max_abs, rms, z; nonfinite/modules, backward_modules


def one_logged_step(depth: int, log_dir: Path) -> tuple[normprobe.Probe, Events, int]:
    model = ResidualStack(depth, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64)
    with normprobe.attach(model, opt, log_dir=str(log_dir), example_inputs=(x,)) as probe:
        model(x).pow(2).mean().backward()
        opt.step()
    assert hook_count(model) == 0
    size = sum(f.stat().st_size for f in log_dir.iterdir())
    return probe, read_events(str(log_dir)), size


@pytest.mark.slow
def test_a_1000_block_stack_is_mapped_logged_and_its_event_file_stays_small(
    tmp_path: Path,
) -> None:
    depth = 1000
    probe, events, size = one_logged_step(depth, tmp_path / "deep")
    model_map = probe.model_map
    assert model_map is not None and probe.latest is not None and probe.latest.step == 0
    assert [(s.path, s.depth) for s in model_map.stacks] == [("lns", depth), ("lins", depth)]
    assert len(model_map.norms) == depth and len(model_map.residual_adds) == depth
    assert [a.block for a in model_map.residual_adds] == list(range(depth))
    # every block was measured: the depth view holds all of them
    assert events.profiles and all(
        len(buckets) == depth for series in events.profiles.values() for _, buckets in series
    )
    resid = events.profiles[tags.format("resid_rms", "lins")][0][1]
    assert all(v > 0 for v in resid)

    # scalar tags: per stack and per group of alike norms, at most CAP blocks each
    norm_groups = {n.path.split(".")[0] for n in model_map.norms}
    assert norm_groups == {"lns"}
    stacks = len(model_map.stacks)
    bound = stacks * (PER_BLOCK * CAP + PER_STACK) + len(norm_groups) * PER_NORM * CAP + MODEL_WIDE
    assert len(events.scalars) <= bound  # 4391 tags before norm tags were capped
    norm_tags = [t for t in events.scalars if t.startswith(tags.prefix("norm_in_rms"))]
    assert len(norm_tags) == CAP
    assert {tags.format("norm_in_rms", "lns.0"), tags.format("norm_in_rms", "lns.999")} <= set(
        norm_tags
    )

    # bytes: each scalar is its tag and a float32 (+ ~16 bytes of framing); each depth
    # histogram 8 + 8 bytes per block (bucket limit and count); the layout one chart per
    # family and stack at most, each a title and a regex no longer than a tag; events framed
    longest = max(len(t) for t in events.scalars)
    charts = sum(len(c.chart) for layout in events.layouts for c in layout.category)
    bound_bytes = (
        len(events.scalars) * (longest + 16)
        + len(events.profiles) * (16 * depth + 256)
        + charts * (2 * longest + 64)
        + 4096
    )
    assert size <= bound_bytes

    # and none of it grows with depth once past the cap
    _, shallow, _ = one_logged_step(2 * CAP, tmp_path / "shallow")
    assert len(events.scalars) == len(shallow.scalars)
    assert len(events.layouts[0].category) == len(shallow.layouts[0].category)


def test_norm_and_attention_tags_are_capped_like_blocks(tmp_path: Path) -> None:
    depth, cap = 12, 5
    model = TinyTransformer(width=16, depth=depth, heads=2, context=16)
    x = torch.randint(0, 96, (2, 16))
    options = {"metrics": ["norm_rms", "attn_logits", "resid_rms"], "max_block_tags": cap}
    with normprobe.attach(model, log_dir=str(tmp_path), example_inputs=(x,), **options) as probe:
        model(x)
        probe.step()
    assert probe.latest is not None
    scalars = probe.latest.scalars

    def blocks(series: str, layer: str | None) -> list[int]:
        parsed = [tags.parse(t) for t in scalars if t.startswith(tags.prefix(series, "blocks"))]
        return sorted(
            tag.block
            for tag in parsed
            if tag is not None and tag.block is not None and (layer is None or tag.layer == layer)
        )

    spread = [0, 3, 6, 8, 11]  # tagged_blocks(12, 5)
    assert blocks("resid_rms", None) == spread
    assert blocks("norm_in_rms", "ln_1") == spread
    assert blocks("norm_out_rms", "ln_2") == spread
    assert blocks("attn_logit_max", "attn") == spread
    assert tags.format("norm_in_rms", "ln_f") in scalars  # a group of one keeps its tag
    written = set(read_events(str(tmp_path)).scalars)
    # and the dashboard's summary tags the sink adds (log2 ratios, each stack's largest logit)
    assert {t for t in written if not t.startswith(tags.prefix("summary"))} == set(scalars)


def test_tagged_paths_groups_by_template() -> None:
    paths = [f"enc.{i}.ln" for i in range(10)] + [
        f"enc.{i}.sub.{j}.ln" for i in range(3) for j in range(3)
    ]
    kept = tagged_paths([*paths, "final"], 3)
    assert kept == {
        "enc.0.ln",
        "enc.4.ln",
        "enc.9.ln",
        "enc.0.sub.0.ln",
        "enc.1.sub.1.ln",
        "enc.2.sub.2.ln",
        "final",
    }
