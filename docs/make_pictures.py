"""Regenerate the TensorBoard pictures of the README and docs/ from `make demo`'s runs, as a user
sees them.

    python docs/make_pictures.py [--root runs]   # after `make demo`; needs chromium

Starts a TensorBoard on the demo's runs and has headless Chromium render the Custom Scalars
dashboard (the runs' health summary first) and the Images tab (the depth heatmaps, gradient
norms first) into ``docs/custom_scalars.png`` and ``docs/heatmaps.png``; and copies the Post-LN
and Pre-LN runs' gradient-norm heatmaps, as the event files hold them, to
``docs/heatmap_post_ln.png`` and ``docs/heatmap_pre_ln.png``.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

DOCS = Path(__file__).parent
# the Images tab shows images 350 pixels wide, two a row beside the sidebar: four heatmaps
WINDOW = {"custom_scalars": "1400,1100", "images": "1080,1160"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _screenshot(chromium: str, url: str, out: Path, profile: str, window: str) -> None:
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", f"--window-size={window}",
         "--virtual-time-budget=30000", f"--screenshot={out}", url],
        capture_output=True, timeout=180, check=True,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="runs", help="the demo's TensorBoard root")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("make_pictures: chromium is not installed")
    logs = Path(args.root) / "demo"
    if not logs.is_dir():
        raise SystemExit(f"make_pictures: no demo runs in {logs}: run `make demo` first")
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logs), "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):  # until the server has loaded the runs
            try:
                with urllib.request.urlopen(f"{url}/data/plugin/images/tags", timeout=5) as r:
                    if len(r.read()) > 10:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        for tab, name in (("custom_scalars", "custom_scalars"), ("images", "heatmaps")):
            with tempfile.TemporaryDirectory() as profile:
                _screenshot(chromium, f"{url}/#{tab}", DOCS / f"{name}.png", profile, WINDOW[tab])
    finally:
        server.terminate()
        server.wait(timeout=30)
    for run in ("post-ln", "pre-ln"):
        _copy_heatmap(logs / run, DOCS / f"heatmap_{run.replace('-', '_')}.png")
    print(
        f"wrote custom_scalars.png, heatmaps.png, heatmap_post_ln.png, heatmap_pre_ln.png in {DOCS}"
    )


def _copy_heatmap(run: Path, out: Path) -> None:
    """The run's last gradient-norm heatmap, the PNG its event file holds."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    from normprobe.sinks import heatmap_tag

    acc = ea.EventAccumulator(str(run), size_guidance={ea.IMAGES: 0})
    acc.Reload()
    tag = heatmap_tag("grad_norm", "model.blocks")
    if tag not in acc.Tags()[ea.IMAGES]:
        raise SystemExit(f"make_pictures: no {tag} in {run}: run `make demo` again")
    out.write_bytes(acc.Images(tag)[-1].encoded_image_string)


if __name__ == "__main__":
    main()
