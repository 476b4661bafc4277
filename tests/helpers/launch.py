"""Runs a helper script as the ranks of one ``torch.distributed`` job on this machine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_ranks(script: Path, out: Path, ranks: int) -> dict[int, dict[str, Any]]:
    """Start ``script OUT RANK PORT`` for each rank (with ``script``'s folder on the path), wait
    for all, and read back what each wrote to ``out/rank<r>.json``."""
    path = os.pathsep.join(p for p in (str(script.parent), os.environ.get("PYTHONPATH")) if p)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(out), str(rank), port],
            cwd=out,
            env={**os.environ, "PYTHONPATH": path},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(ranks)
    ]
    for rank, proc in enumerate(procs):
        try:
            log, _ = proc.communicate(timeout=300)  # a deadlock would hang here
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"rank {rank}:\n{log[-3000:]}"
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)}


def flat(record: dict[str, Any]) -> dict[str, float]:
    """A record's scalars and each profile's values (``tag[i]``) in one dict."""
    values = dict(record["scalars"])
    for tag, profile in record["profiles"].items():
        values |= {f"{tag}[{i}]": v for i, v in enumerate(profile)}
    return values
