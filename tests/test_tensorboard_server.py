"""A real TensorBoard server shows normprobe's tags, layout and depth view."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
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
def serve() -> Iterator[Callable[[Path], str]]:
    """Start a TensorBoard on 127.0.0.1 over a finished log dir; returns its address."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(logs: Path) -> str:
        port = _free_port()
        command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logs)]
        command += ["--host", "127.0.0.1", "--port", str(port)]
        procs.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
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


def test_server_lists_tags_layout_and_depth_histograms(
    serve: Callable[[Path], str], tmp_path: Path
) -> None:
    model = TinyTransformer(depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with normprobe.attach(model, opt, log_dir=str(tmp_path / "pre_ln"), every=2):
        for _ in range(4):
            x = torch.randint(0, 96, (4, 32))
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
    url = serve(tmp_path)
    deadline = time.monotonic() + 60
    while True:  # the server loads the event files in the background after it starts
        scalars = _get(f"{url}/data/plugin/scalars/tags")
        if "pre_ln" in scalars or time.monotonic() > deadline:
            break
        time.sleep(0.5)
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
