"""Shared fixtures: torch on one thread; fail any test that leaves global hooks or torch function
modes behind; a TensorBoard server. Shared helper modules live in tests/helpers/ (on the path
through pyproject's ``pythonpath``)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.nn.modules import module as module_globals
from torch.overrides import _get_current_function_mode_stack

_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> Iterator[None]:
    """Torch on one thread in the test process (subprocesses keep their own setting): the tests'
    models are tiny, a second thread gains nothing on them, and OpenMP threads that spin waiting
    for each other on a busy machine made training tests up to 30x slower. A test that needs
    more sets them and puts them back (tests/project/test_demo.py)."""
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
