"""Every real architecture of tests/helpers/zoo.py through discovery, a probe, every norm target and
every init scheme: each works or refuses with the documented error, and leaves no hook behind.

Each model is built and discovered once (`_pristine`); every test works on a deep copy.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from checks import (
    FROM_CHANNELS,
    NO_NORMS,
    NOT_POST_LN,
    TO_CHANNELS,
    Snapshot,
    check_conversion,
    check_reinit,
    check_reinit_report,
    placement,
    tensors,
)
from hooks import hook_count, hooks, no_hooks
from torch import nn

import normprobe
from normprobe import ModelMap
from normprobe.reinit import SCHEMES
from normprobe.surgery import TARGETS

pytestmark = pytest.mark.slow

# Models whose norms normalize the last dim of each token (channels-last).
_CHANNELS_LAST = (
    "gpt2",
    "gpt2_eager",
    "llama",
    "bert",
    "t5",
    "gemma2",
    "gemma3",
    "vit",
    "stack_preln",
    "stack_postln",
    "deepnet",
    "control_flow",
    "custom_rmsnorm",
    "qknorm",
)

# (model, target or scheme) -> (error type, words the message must hold), with the reason.
REFUSALS: dict[tuple[str, str], tuple[type[Exception], str]] = {
    # a channels-last norm cannot become a norm over dim 1 (documented refusal)
    **{(m, t): (ValueError, TO_CHANNELS) for m in _CHANNELS_LAST for t in TARGETS[2:5]},
    # BatchNorm normalizes channels over the batch: LayerNorm/RMSNorm need channels_first=True
    ("resnet18", "layernorm"): (ValueError, FROM_CHANNELS),
    ("resnet18", "rmsnorm"): (ValueError, FROM_CHANNELS),
    # convnext_atto's 40/80/160/320 channels: 32 groups divide only 160 and 320
    ("convnext_atto", "groupnorm"): (ValueError, "which num_groups=32 does not divide"),
    # DeepNorm is for Post-LN stacks; every other placement has adds without a norm after them
    **{
        (m, "deepnorm"): (ValueError, NOT_POST_LN)
        for m in zoo.NAMES
        if m not in ("bert", "stack_postln", "deepnet")
    },
    # refine runs twice inside the stack [refine..if_neg]: its depth is 2 blocks or 3 block
    # calls, so the schemes counting N refuse until n_layers= says which
    ("control_flow", "gpt2"): (ValueError, "nested-stacks"),
    ("control_flow", "deepnorm"): (ValueError, "nested-stacks"),
}

# Fixup refuses a model that normalizes unless told to keep the norms (its scalars are what
# this suite checks on every model).
FIXUP_AROUND_NORMS = {"fixup": {"allow_norms": True}}

# Models without a norm layer: convert_norms warns and changes nothing.
NORM_FREE = {"no_norm"}


@functools.cache
def _pristine(name: str) -> tuple[zoo.ZooModel, ModelMap]:
    z = zoo.build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        return z, normprobe.discover(z.model, *z.args, **z.kwargs)


def _fresh(name: str) -> tuple[nn.Module, zoo.ZooModel, ModelMap]:
    z, model_map = _pristine(name)
    return copy.deepcopy(z.model), z, model_map


def _loss(out: Any, z: zoo.ZooModel) -> torch.Tensor:
    """Next-token cross-entropy for language models, class cross-entropy for classifiers, and
    the mean square of the hidden states for encoders (BERT, T5)."""
    y = tensors(out)[0]
    ids = z.args[0]
    if y.ndim == 3 and y.shape[-1] == zoo.VOCAB and isinstance(ids, torch.Tensor):
        return F.cross_entropy(y[:, :-1].reshape(-1, zoo.VOCAB), ids[:, 1:].reshape(-1))
    if y.ndim == 2 and y.shape[-1] == 10:
        return F.cross_entropy(y, torch.arange(y.shape[0]) % 10)
    return y.float().pow(2).mean()


def _train(
    model: nn.Module, z: zoo.ZooModel, opt: torch.optim.Optimizer, steps: int
) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = _loss(model(*z.args, **z.kwargs), z)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_refused(err: Exception, key: tuple[str, str]) -> None:
    kind, words = REFUSALS[key]
    assert type(err) is kind, f"{key}: expected {kind.__name__}, got {err!r}"
    assert words in str(err), f"{key}: the message does not name the problem: {err}"


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", zoo.NAMES)
def test_discover_attach_and_train(name: str, tmp_path: Path) -> None:
    model, z, model_map = _fresh(name)
    e = z.expected
    assert sum(e.norms.values()) == len(model_map.norms)
    assert len(model_map.residual_adds) == e.residual_adds
    assert {s.path: s.depth for s in model_map.stacks if s.path in e.stacks} == {
        p: d for p, (d, _) in e.stacks.items()
    }
    model.train()
    twin = copy.deepcopy(model)
    hooks_before, where, keys = hooks(model), placement(model), list(model.state_dict())

    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with normprobe.attach(model, optimizer=opt, log_dir=str(tmp_path), every=1) as probe:
        losses = _train(model, z, opt, 3)
        assert probe.latest is not None and probe.latest.step == 2
        assert probe.latest.scalars, "a logged step wrote no scalar"
        assert probe.model_map is not None
        assert len(probe.model_map.residual_adds) == e.residual_adds
    assert not probe.attached
    assert all(math.isfinite(v) for v in losses), losses
    assert hooks(model) == hooks_before and hook_count(model) == hook_count(twin)

    # probing changes nothing: the same 3 steps without a probe give the same weights
    torch.manual_seed(1)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    assert _train(twin, z, twin_opt, 3) == losses
    after, expected = model.state_dict(), twin.state_dict()
    assert list(after) == keys == list(expected)
    assert all(torch.equal(after[k], expected[k]) for k in keys)
    assert placement(model) == where

    # an exception inside forward while attached: the with block removes every hook
    target = model.get_submodule(model_map.norms[0].path) if model_map.norms else model

    def fail(*_: object) -> None:
        raise KeyError("boom inside forward")

    handle = target.register_forward_pre_hook(fail)
    fault_dir = str(tmp_path / "fault")
    with (
        pytest.raises(KeyError, match="boom"),
        normprobe.attach(model, optimizer=opt, log_dir=fault_dir, every=1),
    ):
        _train(model, z, opt, 1)
    handle.remove()
    assert hooks(model) == hooks_before, "a hook is left after an exception inside forward"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", zoo.NAMES)
def test_convert_norms(name: str, target: str) -> None:
    model, z, model_map = _fresh(name)
    before = Snapshot.of(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if name in NORM_FREE:
        with pytest.warns(normprobe.ConversionWarning, match=NO_NORMS):
            same = normprobe.convert_norms(model, target, model_map=model_map)
        assert same is model and no_hooks(model)
        before.unchanged(model)
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", normprobe.ConversionWarning)
            model, report = normprobe.convert_norms_with_report(
                model, target, model_map=model_map, optimizer=opt
            )
    except Exception as err:
        assert (name, target) in REFUSALS, f"{name} -> {target} failed: {err!r}"
        _assert_refused(err, (name, target))
        assert "nothing was changed" in str(err)
        before.unchanged(model)
        assert no_hooks(model)
        return
    assert (name, target) not in REFUSALS, f"{name} -> {target} converted; expected a refusal"
    assert len(report.conversions) + len(report.kept) == len(model_map.norms)
    assert all(c.target == target for c in report.conversions)
    check_conversion(model, before, report)
    # the converted model trains, and the optimizer holds exactly its parameters
    model.train()
    assert math.isfinite(_train(model, z, opt, 1)[0])
    opt_params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", zoo.NAMES)
def test_reinit(name: str, scheme: str) -> None:
    model, z, model_map = _fresh(name)
    before = Snapshot.of(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # fixup's tied-head notice
            out, report = normprobe.reinit_with_report(
                model,
                scheme,
                example_inputs=z.args,
                example_kwargs=z.kwargs,
                model_map=model_map,
                **FIXUP_AROUND_NORMS.get(scheme, {}),
            )
    except Exception as err:
        assert (name, scheme) in REFUSALS, f"{name} reinit {scheme} failed: {err!r}"
        _assert_refused(err, (name, scheme))
        before.unchanged(model)
        return
    assert (name, scheme) not in REFUSALS, f"{name} reinit {scheme} worked; expected a refusal"
    assert out is model
    check_reinit(model, before, scheme)
    check_reinit_report(model, report)
    if scheme in ("kaiming", "xavier"):  # documented: embeddings are left alone
        for path, m in z.model.named_modules():
            if isinstance(m, nn.Embedding):
                assert torch.equal(model.get_submodule(path).weight, m.weight), path
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    assert math.isfinite(_train(model, z, opt, 1)[0])
