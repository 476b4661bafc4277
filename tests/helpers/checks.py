"""Checks shared by the hardening suites (tests/architectures/test_zoo_suite.py,
tests/architectures/test_generated_models.py): what `convert_norms` and `reinit` may change in
a model, and what they must leave alone."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hooks import no_hooks
from torch import nn

from normprobe import BranchScale, ConversionReport, FixupScalars, ReinitReport, TensorInit
from normprobe.reinit import out_in_view

# The documented refusals, by the words their messages must hold.
TO_CHANNELS = "normalizes dim 1 of an (N, C, *) input, which here is not the channel dim"
FROM_CHANNELS = "pass channels_first=True"
NOT_POST_LN = "deepnorm is for Post-LN stacks"
NO_ADDS = "discovery found no residual adds"
NO_NORMS = "found no normalization layers"


def placement(model: nn.Module) -> dict[str, tuple[torch.dtype, torch.device]]:
    return {n: (p.dtype, p.device) for n, p in model.named_parameters()}


def tensors(out: Any) -> list[torch.Tensor]:
    """Every floating tensor in a model's output (tensor, tuple, dict or HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        return [t for item in out.values() for t in tensors(item)]
    if isinstance(out, tuple | list):
        return [t for item in out for t in tensors(item)]
    return []


@dataclass
class Snapshot:
    """A model's state before surgery: values, parameter names/objects, dtypes and devices."""

    state: dict[str, torch.Tensor]
    params: dict[str, nn.Parameter]
    buffers: dict[str, torch.Tensor]
    placement: dict[str, tuple[torch.dtype, torch.device]]

    @classmethod
    def of(cls, model: nn.Module) -> Snapshot:
        return cls(
            {k: v.detach().clone() for k, v in model.state_dict().items()},
            dict(model.named_parameters()),
            {n: b.detach().clone() for n, b in model.named_buffers()},
            placement(model),
        )

    def unchanged(self, model: nn.Module) -> None:
        after = model.state_dict()
        assert list(after) == list(self.state)
        for k, v in self.state.items():
            assert torch.equal(after[k], v), f"{k} changed"


def check_conversion(
    model: nn.Module,
    before: Snapshot,
    report: ConversionReport,
    own_hooks: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """The state_dict keeps every key but the documented ones (removed, added, renamed) and every
    value but Gemma's shifted ``1 + weight`` gains; old parameters keep dtype and device, new
    ones take the model's."""
    after = model.state_dict()
    renamed = report.renamed_keys
    expected = {renamed.get(k, k) for k in before.state if k not in report.removed_keys}
    assert set(after) == expected | set(report.added_keys)
    assert not set(report.added_keys) & expected
    shifted = {
        f"{c.path}.weight" for c in report.conversions if any("1 + weight" in n for n in c.notes)
    }
    for k, old in before.state.items():
        if k not in report.removed_keys:
            new = after[renamed.get(k, k)]
            assert torch.equal(new, old + 1 if k in shifted else old), f"{k} changed"
    for k in report.added_keys:
        assert after[k].isfinite().all(), k
    now = placement(model)
    dtype, device = next(iter(before.placement.values()))
    old_name = {new: old for old, new in renamed.items()}
    for n, where in now.items():
        assert where == before.placement.get(old_name.get(n, n), (dtype, device)), n
    kept = {id(p) for p in model.parameters()}
    gone = {n for n, p in before.params.items() if id(p) not in kept}
    assert set(report.removed_parameters) == gone
    assert {n for n in now if old_name.get(n, n) not in before.placement} <= set(
        report.new_parameters
    )
    assert no_hooks(model, own_hooks)


def wrappers(model: nn.Module) -> dict[str, nn.Module]:
    """Every scaler by every name it has (a block registered twice holds it under both)."""
    return {
        p: m
        for p, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, BranchScale | FixupScalars)
    }


def check_reinit(
    model: nn.Module,
    before: Snapshot,
    scheme: str,
    own_hooks: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """The same Parameter objects with their dtype and device (under ``.inner`` where a scaler
    wraps their layer), finite values, the same buffers, and only the scalers' keys added."""
    wrapped = wrappers(model)

    def inside(modules: list[str]) -> list[str]:
        """The module path with ``.inner`` after every wrapper on its way (wrappers nest when a
        wrapped layer holds another wrapped layer)."""
        path: list[str] = []
        for part in modules:
            path.append(part)
            while ".".join(path) in wrapped:
                path.append("inner")
        return path

    def moved(key: str) -> str:
        *modules, name = key.split(".")
        return ".".join([*inside(modules), name])

    now = dict(model.named_parameters())
    for n, p in before.params.items():
        assert now[moved(n)] is p, n
        assert (p.dtype, p.device) == before.placement[n], n
        assert p.isfinite().all(), n
    own = {f"{w}.{k}" for w, m in wrapped.items() for k, _ in m.named_parameters(recurse=False)}
    own |= {f"{w}.{k}" for w, m in wrapped.items() for k, _ in m.named_buffers(recurse=False)}
    assert set(model.state_dict()) == {moved(k) for k in before.state} | own
    if scheme == "fixup":
        assert wrapped, "fixup inserted no scalars"
    elif scheme != "deepnorm":  # deepnorm skips a scaler whose factor is already 1
        assert not wrapped
    for w in wrapped.values():
        for t in (*w.parameters(recurse=False), *w.buffers(recurse=False)):
            like = next(w.inner.parameters())
            assert (t.dtype, t.device) == (like.dtype, like.device)
    now_buffers = dict(model.named_buffers())
    for n, b in before.buffers.items():
        assert torch.equal(now_buffers[moved(n)], b), n
    # a wrapped layer keeps its own hooks, now under ``.inner``
    own = {".".join(inside(p.split("."))): c for p, c in (own_hooks or {}).items()}
    assert no_hooks(model, own)


def reported_tensor(model: nn.Module, change: TensorInit) -> torch.Tensor:
    """The tensor a change names (a parametrized weight as the layer applies it), laid out
    (out, in, ...) and cut to the change's output rows."""
    owner, _, name = change.path.rpartition(".")
    module = model.get_submodule(owner)
    tensor = getattr(module, name).detach()
    if change.outputs is None:
        return tensor
    start, stop = change.outputs
    return out_in_view(module, tensor)[start:stop]


def check_reinit_report(model: nn.Module, report: ReinitReport) -> None:
    """Every number a `reinit_with_report` report gives is the one the tensor holds (a draw's
    root mean square within 4 standard errors of its std); every parameter is named once."""
    for change in report.changed + report.scalers:
        got = reported_tensor(model, change)
        t = change.treatment
        if t.how == "constant":
            value = torch.tensor(t.value, dtype=got.dtype, device=got.device)
            assert torch.all(got == value), f"{change.path}: not all {t.value}"
            continue
        assert t.std is not None
        rms = got.float().pow(2).mean().sqrt().item()
        tolerance = 4 / math.sqrt(2 * got.numel())
        assert abs(rms / t.std - 1) < tolerance, f"{change.path}: rms {rms:.5f}, reported {t}"
        if t.how == "uniform":
            assert got.abs().max().item() <= t.std * math.sqrt(3) * (1 + 1e-6)
    named: list[str] = []
    for path in dict.fromkeys(c.path for c in report.changed):
        change = next(c for c in report.changed if c.path == path)
        named += change.parameters or [path]
    named += [path for path, _ in report.left]
    assert sorted(named) == sorted(n for n, _ in model.named_parameters())
