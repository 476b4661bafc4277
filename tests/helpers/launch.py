"""Runs a helper script as the ranks of one ``torch.distributed`` job on this machine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def free_port() -> str:
    """A TCP port free on this machine now, for a job's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def script_env(script: Path, **extra: str) -> dict[str, str]:
    """The environment of a rank: ``script``'s folder on the path, one torch thread (the ranks
    share the machine's cores), and ``extra``."""
    path = os.pathsep.join(p for p in (str(script.parent), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def start(command: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """Start ``python command`` in ``out``, its output captured."""
    return subprocess.Popen(
        [sys.executable, *command],
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_all(procs: list[subprocess.Popen[str]], names: list[str]) -> None:
    """Wait for every process; kill them all if one hangs, and fail naming one that failed."""
    for name, proc in zip(names, procs, strict=True):
        try:
            log, _ = proc.communicate(timeout=300)  # a deadlock would hang here
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"{name}:\n{log[-3000:]}"


def run_ranks(script: Path, out: Path, ranks: int) -> dict[int, dict[str, Any]]:
    """Start ``script OUT RANK PORT`` for each rank, wait for all, and read back what each wrote
    to ``out/rank<r>.json``."""
    port, env = free_port(), script_env(script)
    procs = [start([str(script), str(out), str(rank), port], out, env) for rank in range(ranks)]
    wait_all(procs, [f"rank {rank}" for rank in range(ranks)])
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)}


def flat(record: dict[str, Any]) -> dict[str, float]:
    """A record's scalars and each profile's values (``tag[i]``) in one dict."""
    values = dict(record["scalars"])
    for tag, profile in record["profiles"].items():
        values |= {f"{tag}[{i}]": v for i, v in enumerate(profile)}
    return values
