"""Regenerate the README's TensorBoard pictures from `make demo`'s runs, as a user sees them.

    python docs/make_pictures.py [--root runs]   # after `make demo`; needs chromium

Starts a TensorBoard on the demo's runs and has headless Chromium render the Custom Scalars
dashboard (the runs' health summary first) and the Images tab (the depth heatmaps) into
``docs/custom_scalars.png`` and ``docs/heatmaps.png``.
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _screenshot(chromium: str, url: str, out: Path, profile: str) -> None:
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--window-size=1400,1100",
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
        with tempfile.TemporaryDirectory() as profile:
            _screenshot(chromium, f"{url}/#custom_scalars", DOCS / "custom_scalars.png", profile)
        with tempfile.TemporaryDirectory() as profile:
            _screenshot(chromium, f"{url}/#images", DOCS / "heatmaps.png", profile)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"wrote {DOCS / 'custom_scalars.png'} and {DOCS / 'heatmaps.png'}")


if __name__ == "__main__":
    main()
