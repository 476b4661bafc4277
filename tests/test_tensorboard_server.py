"""A real TensorBoard server shows normprobe's tags, layout and depth view."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import normprobe
from normprobe.models import TinyTransformer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def tensorboard(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A TensorBoard serving ``tmp_path`` on 127.0.0.1; yields its address and the log dir."""
    port = _free_port()
    logs = tmp_path / "runs"
    logs.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logs), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, logs
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _get(url: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_server_lists_tags_layout_and_depth_histograms(tensorboard: tuple[str, Path]) -> None:
    url, logs = tensorboard
    model = TinyTransformer(depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with normprobe.attach(model, opt, log_dir=str(logs / "pre_ln"), every=2):
        for _ in range(4):
            x = torch.randint(0, 96, (4, 32))
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
    deadline = time.monotonic() + 60
    while True:  # the server picks up new event files on its reload interval
        scalars = _get(f"{url}/data/plugin/scalars/tags")
        if "pre_ln" in scalars or time.monotonic() > deadline:
            break
        time.sleep(1)
    tags = scalars["pre_ln"]
    assert "normprobe/grad_ratio/blocks" in tags and "normprobe/resid_rms/blocks/0" in tags
    series = _get(f"{url}/data/plugin/scalars/scalars?run=pre_ln&tag=normprobe/grad_ratio/blocks")
    assert [point[1] for point in series] == [0, 2]
    layout = _get(f"{url}/data/plugin/custom_scalars/layout")
    categories = {c["title"]: c["chart"] for c in layout["category"]}
    chart = categories["normprobe resid_rms"][0]
    assert chart["title"] == "blocks"
    assert chart["multiline"]["tag"] == ["^normprobe/resid_rms/blocks/[^/]+$"]
    histograms = _get(f"{url}/data/plugin/histograms/tags")["pre_ln"]
    assert "normprobe/resid_rms/blocks" in histograms
