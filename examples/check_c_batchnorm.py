"""Sanity check [c]: BatchNorm computes a different function in train and eval mode, read
through the probe's `bn_stats` metric.

    python examples/check_c_batchnorm.py [--expect NAME=VALUE ...]

A fresh BatchNorm1d (running mean 0, running variance 1) sees one training batch x = mu + s*z
(mu = 3, s = 2, z standard normal, 256 rows, 16 features). On that batch the probe measures,
against the running statistics from before the update:

* ``bn_mean_drift``: mean over features of |batch mean - running mean| / sqrt(running var): mu;
* ``bn_var_drift``: mean over features of |log(batch var / running var)|: log(s^2);
* ``bn_gap``: RMS(y_train - y_eval) / RMS(y_train), where train mode normalizes with the batch's
  statistics and eval mode with the running ones: sqrt((s - 1)^2 + mu^2).

Train mode's output has per-feature mean 0; the update moves the running mean from 0 to
momentum * batch mean (about 0.3); eval mode on the same batch then gives another output.
Tolerances: 5% on the three probe values, 1e-5 on the mean, 0.02 on the running mean.
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections import OrderedDict

import torch
from _sanity import Checks, Expect
from torch import nn

import normprobe
from normprobe import tags

MU, S = 3.0, 2.0

CHECKS = Checks(
    "c",
    "BatchNorm train != eval through the probe's bn_stats",
    {
        "bn_mean_drift": Expect(MU, tol=0.05 * MU),
        "bn_var_drift": Expect(math.log(S**2), tol=0.05 * math.log(S**2)),
        "bn_gap": Expect(math.hypot(S - 1, MU), tol=0.05 * math.hypot(S - 1, MU)),
        "train_feature_mean": Expect(1e-5, op="<"),
        "running_mean": Expect(0.1 * MU, tol=0.02),
        "train_eval_diff": Expect(1.0, op=">"),
    },
)


def main() -> int:
    CHECKS.parse()
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(bn=nn.BatchNorm1d(16)))
    x = MU + S * torch.randn(256, 16)
    with (
        tempfile.TemporaryDirectory() as log_dir,
        normprobe.attach(model, metrics=["bn_stats"], log_dir=log_dir) as probe,
    ):
        y_train = model(x)  # a training forward: batch statistics, running ones updated
        probe.step()
    assert probe.latest is not None
    scalars = probe.latest.scalars
    for name in ("bn_mean_drift", "bn_var_drift", "bn_gap"):
        tag = tags.format(name, "bn")
        CHECKS.check(name, tag, scalars[tag])

    model.eval()
    with torch.no_grad():
        y_eval = model(x)
    bn = model.bn
    assert bn.running_mean is not None
    feature_mean = y_train.mean(dim=0).abs().max().item()
    CHECKS.check("train_feature_mean", "max over features |mean(y_train)|", feature_mean)
    CHECKS.check("running_mean", "mean of the running mean (was 0)", bn.running_mean.mean().item())
    CHECKS.check("train_eval_diff", "max|y_train - y_eval|", (y_train - y_eval).abs().max().item())
    return CHECKS.verdict()


if __name__ == "__main__":
    sys.exit(main())
