"""A real TensorBoard server shows normprobe's tags, layout and depth view."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tb import get_json

import normprobe
from normprobe import tags
from normprobe.models import TinyTransformer
from normprobe.sinks import heatmap_tag

pytestmark = pytest.mark.subprocess


@pytest.mark.slow
def test_server_lists_tags_layout_and_depth_heatmaps(
    serve: Callable[[Path], str], tmp_path: Path
) -> None:
    model = TinyTransformer(depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with normprobe.attach(model, opt, log_dir=str(tmp_path / "pre_ln"), every=2):
        for _ in range(8):  # logged at 0, 2, 4, 6: enough steps for a heatmap
            x = torch.randint(0, 96, (4, 32))
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
    url = serve(tmp_path)
    deadline = time.monotonic() + 60
    while True:  # the server loads the event files in the background after it starts
        scalars = get_json(f"{url}/data/plugin/scalars/tags")
        if "pre_ln" in scalars or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    listed = scalars["pre_ln"]
    ratio = tags.format("grad_ratio", "blocks")
    assert ratio in listed and tags.format("resid_rms", "blocks", 0) in listed
    series = get_json(f"{url}/data/plugin/scalars/scalars?run=pre_ln&tag={ratio}")
    assert [point[1] for point in series] == [0, 2, 4, 6]
    layout = get_json(f"{url}/data/plugin/custom_scalars/layout")
    categories = {c["title"]: c["chart"] for c in layout["category"]}
    # the run's health first
    assert layout["category"][0]["title"] == "normprobe summary"
    summary = {c["title"]: c["multiline"]["tag"] for c in layout["category"][0]["chart"]}
    log2 = summary["log2 gradient ratio, last / first block (0: even)"]
    assert log2 == [f"^{re.escape(tags.prefix('summary', 'grad_ratio_log2'))}.*$"]
    nonfinite = [t for t in summary if t.startswith("modules with NaN/Inf outputs")]
    assert sorted(nonfinite) == [  # one tag a chart: lines of one run share its colour
        "modules with NaN/Inf outputs: backward_modules",
        "modules with NaN/Inf outputs: modules",
    ]
    # the log2 companion: 0.5 and 100 read on one axis as -1 and 6.6
    companion = tags.format("summary", "grad_ratio_log2/blocks")
    twin = get_json(f"{url}/data/plugin/scalars/scalars?run=pre_ln&tag={companion}")
    assert [p[2] for p in twin] == pytest.approx([math.log2(p[2]) for p in series], abs=1e-5)
    # one chart per block (all 3 of them), each holding one tag: a line per run
    charts = {c["title"]: c["multiline"]["tag"] for c in categories["normprobe resid_rms"]}
    assert charts == {
        f"blocks/{b}": [f"^{re.escape(tags.format('resid_rms', 'blocks', b))}$"] for b in range(3)
    }
    # the depth view: a heatmap per series and stack in the Images tab, no histograms
    images = get_json(f"{url}/data/plugin/images/tags")["pre_ln"]
    assert heatmap_tag("resid_rms", "blocks") in images
    assert "pre_ln" not in get_json(f"{url}/data/plugin/histograms/tags")
