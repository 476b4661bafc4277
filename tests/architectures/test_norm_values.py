"""On every architecture of the zoos (real Hugging Face, timm, torchvision, vit-pytorch,
x-transformers, pytorch-cifar-models, diffusers and open_clip models, and the hand-built ones),
each norm layer's logged input and output RMS equal what plain forward hooks compute from a copy
taken as the tensor passes, on the first logged forward and a later one, and every norm has a
tag of its own.

The class of bug this holds off: a value read later than the tensor passed (a BatchNorm's
output after ``ReLU(inplace=True)``), or two norms sharing one tag (the sublayers of one block).
"""

from __future__ import annotations

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
