"""A loop that never calls the model (``model.forward(x)``, or ultralytics' ``model.loss(batch)``,
which calls ``self.forward`` itself) runs no module hook: the probe maps nothing and logs
nothing, and says so when it is removed instead of passing in silence."""

from __future__ import annotations

import warnings

import pytest
import torch

import normprobe
from normprobe.models import ResidualStack


def test_steps_without_a_forward_warn() -> None:
    model = ResidualStack(4, 16, pre_ln=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    said = pytest.warns(RuntimeWarning, match="3 training step.*no forward of ResidualStack")
    probe = normprobe.attach(model, opt, every=1, sinks=[normprobe.MemorySink()])
    with said, probe:
        for _ in range(3):
            model.forward(torch.randn(4, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert probe.latest is None


def test_a_called_model_does_not_warn() -> None:
    model = ResidualStack(4, 16, pre_ln=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    probe = normprobe.attach(model, opt, every=1, sinks=[normprobe.MemorySink()])
    with warnings.catch_warnings(), probe:
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(3):
            model(torch.randn(4, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert probe.latest is not None
