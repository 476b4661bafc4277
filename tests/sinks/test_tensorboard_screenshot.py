"""TensorBoard as a user sees it: headless Chromium renders normprobe's panels.

.ci/run installs Debian's chromium; without it these tests skip and say why.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from chromium import Page
from PIL import Image
from tb import get_json

import normprobe
from normprobe import tags
from normprobe.models import TinyTransformer
from normprobe.sinks import heatmap_tag

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed"),
]


def _screenshot(url: str, out: Path, profile: Path) -> Image.Image:
    assert CHROMIUM is not None
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--window-size=1400,1000",
         "--virtual-time-budget=20000", f"--screenshot={out}", url],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    return Image.open(out).convert("RGB")


def _chart_pixels(image: Image.Image) -> int:
    """Pixels of TensorBoard's orange series color in the content area (right of the sidebar,
    below the header): zero on an empty dashboard."""
    width, height = image.size
    count = 0
    for x in range(360, width, 2):
        for y in range(80, height, 2):
            r, g, b = image.getpixel((x, y))  # type: ignore[misc]
            if r > 200 and 60 < g < 160 and b < 110:
                count += 1
    return count


def _colour_pixels(image: Image.Image) -> int:
    """Strongly coloured pixels (a colour map, not TensorBoard's white and greys)."""
    rgb = image.convert("RGB")
    width, height = rgb.size
    count = 0
    for x in range(0, width, 2):
        for y in range(80, height, 2):
            r, g, b = rgb.getpixel((x, y))  # type: ignore[misc]
            if max(r, g, b) - min(r, g, b) > 80:
                count += 1
    return count


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One short run, trained once for every test here: ``<logs>/demo``."""
    logs = tmp_path_factory.mktemp("runs")
    model = TinyTransformer(depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with normprobe.attach(model, opt, log_dir=str(logs / "demo"), every=2):
        for _ in range(12):
            x = torch.randint(0, 96, (4, 32))
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
    return logs


@pytest.mark.slow
def test_custom_scalars_and_depth_view_render(
    serve: Callable[[Path], str], tmp_path: Path, logs: Path
) -> None:
    url = serve(logs)
    deadline = time.monotonic() + 60
    while "demo" not in get_json(f"{url}/data/plugin/scalars/tags"):
        assert time.monotonic() < deadline, "TensorBoard never loaded the run"
        time.sleep(0.5)
    charts = _screenshot(f"{url}/#custom_scalars", tmp_path / "custom.png", tmp_path / "p1")
    depth = _screenshot(f"{url}/#images", tmp_path / "depth.png", tmp_path / "p2")
    (tmp_path / "nothing").mkdir()
    empty_url = serve(tmp_path / "nothing")  # the same dashboard with no data at all
    get_json(f"{empty_url}/data/runs")  # waits until it answers
    empty = _screenshot(f"{empty_url}/#custom_scalars", tmp_path / "empty.png", tmp_path / "p3")
    assert _chart_pixels(empty) == 0
    assert _chart_pixels(charts) > 500
    assert _colour_pixels(depth) > 2000  # the heatmaps' colour maps


@pytest.mark.slow
def test_dashboard_url_opens_time_series_on_the_summary(
    serve: Callable[[Path], str], tmp_path: Path, logs: Path
) -> None:
    url = serve(logs)
    deadline = time.monotonic() + 60
    while "demo" not in get_json(f"{url}/data/plugin/scalars/tags"):
        assert time.monotonic() < deadline, "TensorBoard never loaded the run"
        time.sleep(0.5)
    port = int(url.rsplit(":", 1)[1])
    link = normprobe.dashboard_url(logs, host="127.0.0.1", port=port)
    assert CHROMIUM is not None
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1000",
         "--virtual-time-budget=20000", "--dump-dom", link],
        capture_output=True, text=True, timeout=120, check=False,
    ).stdout  # fmt: skip
    # the rendered page: the pinned section first, holding the summary cards in order
    found = re.findall(r"Pinned|normprobe/[\w/.]+", dom)
    written = set(get_json(f"{url}/data/plugin/scalars/tags")["demo"])
    shown = [t for t in found if t == "Pinned" or t in written]
    summary = [
        tags.format("grad_ratio", "blocks"),
        tags.format("resid_growth", "blocks"),
    ]
    assert shown[0] == "Pinned", shown[:5]
    assert shown[1:3] == summary, shown[:8]
    assert shown[3].startswith(tags.prefix("attn_logit_max", "blocks"))
    assert shown[4] == tags.format("nonfinite", "modules")


# TensorBoard's own order of the Images tab (its dashboard's categories, as it pages them), and
# the cards it rendered, in the page's order; the dashboard lives in nested shadow roots
IMAGES_ORDER = """
new Promise((resolve) => {
  const deep = (root, name, found) => {
    for (const el of root.querySelectorAll("*")) {
      if (el.tagName === name) found.push(el);
      if (el.shadowRoot) deep(el.shadowRoot, name, found);
    }
    return found;
  };
  const poll = (left) => {
    const [dash] = deep(document, "TF-IMAGE-DASHBOARD", []);
    const groups = ((dash && dash._categories) || []).filter((c) => c.metadata.type === 1);
    const order = groups.flatMap((c) => c.items.map((i) => i.tag));
    const shown = deep(document, "TF-IMAGE-LOADER", []).map((el) => el.tag);
    if ((order.length && shown.length) || left <= 0) resolve({order, shown});
    else setTimeout(() => poll(left - 1), 500);
  };
  poll(120);
})
"""


@pytest.mark.slow
def test_images_tab_shows_the_gradient_heatmap_first_and_per_head_last(
    serve: Callable[[Path], str], tmp_path: Path, logs: Path
) -> None:
    url = serve(logs)
    deadline = time.monotonic() + 60
    while "demo" not in get_json(f"{url}/data/plugin/images/tags"):
        assert time.monotonic() < deadline, "TensorBoard never loaded the images"
        time.sleep(0.5)
    written = set(get_json(f"{url}/data/plugin/images/tags")["demo"])
    page = Page(f"{url}/#images", tmp_path / "profile")
    try:
        seen = page.evaluate(IMAGES_ORDER)
    finally:
        page.close()
    order, shown = seen["order"], seen["shown"]
    assert set(order) == written, order
    grad, resid = heatmap_tag("grad_norm", "blocks"), heatmap_tag("resid_rms", "blocks")
    heads = heatmap_tag("attn_logits_head", "blocks", "attn")
    per_block = [t for t in order if t != heads]
    assert order[0] == grad and order[-1] == heads and resid in per_block, order
    assert shown and shown == order[: len(shown)]  # the first page, in that order
