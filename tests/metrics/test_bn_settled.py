"""BatchNorm drift early in a healthy run is the running statistics converging from their
initial mean 0 and variance 1. Discounting those initial values as Adam corrects its moments'
bias (`bn_settled_drift`) tells that apart from batches that differ from what the layer has
seen: torchvision's MobileNetV3 at 64 px, whose deep batch variances sit near 1e-3, read a
drift problem after 15 healthy steps."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision
from tb import read_events

import normprobe
from normprobe import tags
from normprobe.metrics import bn_stats


def _train(model: torch.nn.Module, log_dir: Path, batch: int, steps: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    x, y = torch.randn(batch, 3, 64, 64), torch.randint(0, 10, (batch,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, log_dir=str(log_dir), every=1):
            for _ in range(steps):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                warmup.step()


@pytest.mark.slow
def test_mobilenet_v3_converging_running_statistics_are_a_note(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10)
    _train(model, tmp_path, batch=16, steps=15)
    scalars = read_events(str(tmp_path)).scalars
    bn = "features[1..11]/09.block.1.1"  # a depthwise conv's BatchNorm, deep in the net
    raw = dict(scalars[tags.prefix("bn_var_drift") + bn])
    settled = dict(scalars[tags.prefix(bn_stats.SETTLED) + bn])
    assert raw[14] > 5 * bn_stats.LIMITS["var_drift"]  # far past the limit, 15 steps in
    assert settled[14] <= 1.0  # within the limits once the initial values are discounted
    drift = [f for f in normprobe.report_run(tmp_path).flags if f.kind == "batchnorm drift"]
    assert drift and all(f.severity == "note" for f in drift)
    assert all("still converging" in f.message for f in drift)


def test_a_problem_names_the_layer_that_makes_it_one(tmp_path: Path) -> None:
    # features/0.bn: far past its limit but converging (falling since the first step, settled
    # drift under 1); features/3.bn: less far past it, flat and unsettled: the problem
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in range(6):
        writer.add_scalar(tags.format("bn_var_drift", "features", 0, "bn"), 9.0 - step, step)
        writer.add_scalar(tags.format(bn_stats.SETTLED, "features", 0, "bn"), 0.5, step)
        writer.add_scalar(tags.format("bn_var_drift", "features", 3, "bn"), 1.5, step)
        writer.add_scalar(tags.format(bn_stats.SETTLED, "features", 3, "bn"), 2.2, step)
    writer.close()
    (flag,) = [f for f in normprobe.report_run(tmp_path).flags if f.kind == "batchnorm drift"]
    assert flag.severity == "problem"
    assert flag.value == 1.5 and flag.message.startswith("bn_var_drift 1.5 > 0.693 at ")
    assert "3.bn" in flag.message.split(";")[0]
