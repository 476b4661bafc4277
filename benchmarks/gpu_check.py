"""``make gpu-check``: every check that needs CUDA, in one run, summed up in one table.

    python benchmarks/gpu_check.py [--budget 480]

Runs the tests that use CUDA (``tests/runtime/test_cuda.py``), ``benchmarks/overhead.py
--device cuda`` in float32 and under bf16 autocast (each with its host-sync count), and
``benchmarks/norms.py --device cuda``, within ``--budget`` seconds in all; prints each part's
output, then one table. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _run(title: str, args: list[str], timeout: float) -> tuple[int, str, float]:
    print(f"\n=== {title}: {' '.join(args)}", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=max(timeout, 1.0),
        )
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, out = 124, f"{err.stdout or ''}{err.stderr or ''}\ntimed out after {timeout:.0f} s"
    seconds = time.perf_counter() - start
    print(out.rstrip(), flush=True)
    return code, out, seconds


def _overhead_rows(out: str, precision: str) -> list[str]:
    """One table row per model of an ``overhead.py`` run: its ratios and sync counts."""
    rows = []
    for block in re.split(r"\n(?=\S)", out):
        lines = block.strip().splitlines()
        if not lines or not lines[0][:1].isupper() or "blocks" not in lines[0]:
            continue
        ratios = dict(re.findall(r"^\s+(\S+(?: \S+)*?)\s+[\d.]+\s+([\d.]+)$", block, re.M))
        syncs = re.search(r"host syncs.*: (\[.*\])", block)
        rows.append(
            f"| overhead {precision} | {lines[0]} | every=50 {ratios.get('every=50', '?')}x, "
            f"every=1 {ratios.get('every=1', '?')}x, per-module .item() hooks "
            f"{ratios.get('naive hooks', '?')}x | host syncs per step (every=3, steps 3-8): "
            f"{syncs[1] if syncs else '?'} |"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for everything")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; nothing to run.")
        return 0
    deadline = time.perf_counter() + args.budget
    device = torch.cuda.get_device_name()
    parts = [
        (
            "CUDA tests",
            ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/runtime/test_cuda.py"],
            0.25,
        ),
        ("overhead fp32", ["benchmarks/overhead.py", "--device", "cuda", "--rounds", "5"], 0.25),
        (
            "overhead bf16",
            ["benchmarks/overhead.py", "--device", "cuda", "--bf16", "--rounds", "5"],
            0.25,
        ),
        ("norm speed", ["benchmarks/norms.py", "--device", "cuda"], 1.0),
    ]
    table = [f"| check | {device}, torch {torch.__version__} | result | |", "|---|---|---|---|"]
    failed = False
    for title, command, share in parts:
        left = deadline - time.perf_counter()
        code, out, seconds = _run(title, command, left * share)
        failed |= code != 0
        if title == "CUDA tests":
            summary = out.strip().splitlines()[-1] if out.strip() else "no output"
            table.append(f"| {title} | tests/runtime/test_cuda.py | {summary} | {seconds:.0f} s |")
        elif title.startswith("overhead"):
            table += _overhead_rows(out, title.split()[1]) or [f"| {title} | failed ({code}) | | |"]
        else:
            status = "ok" if code == 0 else f"failed ({code})"
            table.append(
                f"| {title} | benchmarks/norms.py (table above) | {status} | {seconds:.0f} s |"
            )
    print("\n" + "\n".join(table))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
