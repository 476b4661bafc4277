"""Shared fixtures: fail any test that leaves global hooks or torch function modes behind."""

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
from torch import nn
from torch.nn.modules import module as module_globals
from torch.overrides import _get_current_function_mode_stack

_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def hook_count(model: nn.Module) -> int:
    """Every forward and backward hook registered on any module of ``model``."""
    total = 0
    for m in model.modules():
        total += len(m._forward_pre_hooks) + len(m._forward_hooks)
        total += len(m._backward_pre_hooks) + len(m._backward_hooks)
    return total


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread for the test: tiny models gain nothing from a second one, and OpenMP
    threads that wait for each other on a busy machine made training tests 30x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_global_hooks_left() -> Iterator[None]:
    before = {name: len(getattr(module_globals, name)) for name in _GLOBAL_HOOKS}
    yield
    after = {name: len(getattr(module_globals, name)) for name in _GLOBAL_HOOKS}
    assert after == before, f"global module hooks left behind: {after} (before {before})"
    assert not _get_current_function_mode_stack(), "a TorchFunctionMode is still active"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


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


def get_json(url: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
