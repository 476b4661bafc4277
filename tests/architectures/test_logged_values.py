"""On every architecture of the zoos (real Hugging Face, timm, torchvision, vit-pytorch,
x-transformers, pytorch-cifar-models, diffusers and open_clip models, and the hand-built ones),
what the probe logs equals what is computed by hand from the model:

* each norm layer's input and output RMS, against plain forward hooks that copy the tensor as
  it passes, on the first logged forward and a later one; every norm has a tag of its own;
* each block's gradient norm (the parameters of the block's modules) and the total gradient
  norm, against the parameters' ``.grad``.

The classes of bug this holds off: a value read later than the tensor passed (a BatchNorm's
output after ``ReLU(inplace=True)``), two norms sharing one tag (the sublayers of one block), a
block's parameters grouped wrong (blocks of several entries, tied or shared weights).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zoo
import zoo_hf
import zoo_unseen
import zoo_vision
from torch import nn

import normprobe

Built = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]
BUILDERS: dict[str, Callable[[], Built]] = {
    **{n: (lambda b=b: b()[:3]) for n, b in zoo_hf.BUILDERS.items()},
    **{n: (lambda b=b: b()[:3]) for n, b in zoo_vision.BUILDERS.items()},
    **{n: (lambda b=b: b()[:3]) for n, b in zoo_unseen.BUILDERS.items()},
    **{
        f"zoo_{n}": (lambda n=n: (lambda z: (z.model, z.args, z.kwargs))(zoo.build(n)))
        for n in zoo.NAMES
        if n != "no_norm"
    },
}

pytestmark = pytest.mark.slow


def _first_float(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_float, value) if t is not None), None)
    if isinstance(value, dict):
        return next((t for t in map(_first_float, value.values()) if t is not None), None)
    return None


def _by_hand(model: nn.Module, paths: list[str], args: Any, kwargs: Any) -> dict[str, list[float]]:
    """Each norm's input and output RMS on its first call, in float64, from forward hooks."""
    seen: dict[tuple[str, str], float] = {}

    def rms(t: torch.Tensor) -> float:
        return t.detach().double().pow(2).mean().sqrt().item()

    handles = []
    for path in paths:
        module = model.get_submodule(path)

        def pre(m: nn.Module, a: Any, kw: Any, path: str = path) -> None:
            t = _first_float((a, kw))
            if t is not None:
                seen.setdefault((path, "in"), rms(t))

        def post(m: nn.Module, a: Any, out: Any, path: str = path) -> None:
            t = _first_float(out)
            if t is not None:
                seen.setdefault((path, "out"), rms(t))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return {side: sorted(v for (_, s), v in seen.items() if s == side) for side in ("in", "out")}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_each_norm_is_logged_as_it_passed(name: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs = BUILDERS[name]()
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paths = [n.path for n in normprobe.discover(model, *args, **kwargs).norms]
        expected = _by_hand(model, paths, args, kwargs)
        assert len(expected["out"]) == len(paths), "a norm of the map never ran"
        with normprobe.attach(
            model, every=1, sinks=[normprobe.MemorySink()], metrics=["norm_rms"]
        ) as probe:
            for _ in range(2):  # the first logged forward, and one after it
                with torch.no_grad():
                    model(*args, **kwargs)
                probe.step()
                assert probe.latest is not None
                for side in ("in", "out"):
                    logged = sorted(
                        v for tag, v in probe.latest.scalars.items() if f"/norm_{side}_rms/" in tag
                    )
                    assert len(logged) == len(paths), f"{side}: norms sharing a tag"
                    assert logged == pytest.approx(expected[side], rel=1e-4), side


@pytest.mark.parametrize("name", list(BUILDERS))
def test_each_block_gradient_norm_is_its_parameters(name: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs = BUILDERS[name]()
    model.eval()  # no dropout: the gradients are those of the forward probed
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with normprobe.attach(
            model, opt, every=1, sinks=[normprobe.MemorySink()], metrics=["grad_norm"]
        ) as probe:
            out = _first_float(model(*args, **kwargs))
            assert out is not None
            out.float().pow(2).mean().backward()
            squares = {
                id(p): p.grad.double().pow(2).sum().item()
                for p in model.parameters()
                if p.grad is not None
            }
            opt.step()
    record, model_map = probe.latest, probe.model_map
    assert record is not None and model_map is not None
    total = math.sqrt(sum(squares.values()))
    assert record.scalars["normprobe/grad_norm_total/model"] == pytest.approx(total, rel=1e-4)
    profiles = {k: v for k, v in record.profiles.items() if k.startswith("normprobe/grad_norm/")}
    for stack in model_map.stacks:
        if stack.repeated:  # one module's parameters: every block holds them
            continue
        by_hand = [
            math.sqrt(
                sum(
                    squares.get(id(p), 0.0)
                    for path in members
                    for p in model.get_submodule(path).parameters()
                )
            )
            for members in stack.members or tuple((b,) for b in stack.blocks)
        ]
        assert any(
            len(logged) == len(by_hand)
            and all(
                (math.isnan(a) and b == 0) or a == pytest.approx(b, rel=1e-4, abs=1e-12)
                for a, b in zip(logged, by_hand, strict=True)
            )
            for logged in profiles.values()
        ), (stack.path, by_hand, profiles)
