"""When the map is unsure, it says so (`ModelMap.doubts`), and the actions it would make wrong
refuse before changing anything.

Each model below is small, written the way the doubt's class of model is written in the wild,
and its map is read by hand: which adds no stack holds, which stacks are one block's sublayers,
which norm-named module is no norm.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
import zoo_hf
from torch import nn

import normprobe
from normprobe.diagnose import diagnose
from normprobe.discovery import Doubt, ModelMap
from normprobe.reinit import branch_scales, insert_branch_scale, reinit

D = 32


class Attn(nn.Module):
    """Pre-LN single-head self-attention; ``out`` writes into the stream."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        return self.out(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1) @ v)


class FF(nn.Module):
    """Pre-LN MLP; ``down`` writes into the stream."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()
        self.ff = FF()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.ff(x)


class Grouped(nn.Module):
    """Blocks grouped in threes, the groups chained with nothing between them: along the
    stream N is 6 blocks, the groups' stack says 2 and each group's stack 3."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = nn.Sequential(
            *(nn.Sequential(*(Block() for _ in range(3))) for _ in range(2))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.groups(x)
        return out


class LoopedStage(nn.Module):
    """One block run three times (a looped, weight-shared stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.block(x)
        return x


class Looped(nn.Module):
    """Two looped stages chained with nothing between them: along the stream N is 6 block
    calls, the stages' stack says 2 and each stage's repeated block 3."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([LoopedStage() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x


class Unrolled(nn.Module):
    """Four Pre-LN residual adds with no container: norm and layer registered in turn."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(4):
            self.add_module(f"ln{i}", nn.LayerNorm(D))
            self.add_module(f"fc{i}", nn.Linear(D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(4):
            x = x + getattr(self, f"fc{i}")(getattr(self, f"ln{i}")(x))
        return x


class WithAdapter(nn.Module):
    """A stack of three blocks, then one more residual add (an adapter) in the root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.adapter = FF()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x + self.adapter(x)


class SigmoidGateNorm(nn.Module):
    """Named like a norm, computes none: ``x * sigmoid(w)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.weight)


class WithGateNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.gate = SigmoidGateNorm()
        self.ln = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.ln(self.gate(x))


class Stack3(nn.Module):
    """A healthy stack of three Pre-LN blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


DEPTH_CASES: dict[str, tuple[Callable[[], nn.Module], str, str, int]] = {
    # model, doubt kind, doubt path, the number of blocks (by hand)
    "grouped": (Grouped, "nested-stacks", "groups", 6),
    "looped": (Looped, "nested-stacks", "stages", 6),
    "unrolled": (Unrolled, "no-stack", "", 4),
    "adapter": (WithAdapter, "add-outside-stack", "", 4),
}
WRITERS = {
    "grouped": [
        f"groups.{i}.{j}.{w}" for i in range(2) for j in range(3) for w in ("attn.out", "ff.down")
    ],
    "looped": [f"stages.{i}.block.{w}" for i in range(2) for w in ("attn.out", "ff.down")],
    "unrolled": [f"fc{i}" for i in range(4)],
    "adapter": [f"blocks.{i}.{s}" for i in range(3) for s in ("attn.out", "ff.down")]
    + ["adapter.down"],
}


def _x() -> torch.Tensor:
    return torch.randn(2, 6, D)


def _map(model: nn.Module, *args: Any) -> ModelMap:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        return normprobe.discover(model, *args)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def _doubts(m: ModelMap) -> set[tuple[str, str]]:
    return {(d.kind, d.path) for d in m.doubts}


@pytest.mark.parametrize("case", DEPTH_CASES)
def test_a_depth_doubt_is_in_the_map(case: str) -> None:
    build, kind, path, _ = DEPTH_CASES[case]
    m = _map(build(), _x())
    assert (kind, path) in _doubts(m), str(m)
    doubt = next(d for d in m.doubts if (d.kind, d.path) == (kind, path))
    assert {"reinit", "insert_branch_scale"} <= set(doubt.affects)
    assert "n_layers=" in doubt.reason
    assert f"Doubt ({kind}, {path or '<root>'})" in str(m)


def test_each_depth_doubt_names_what_it_concerns() -> None:
    grouped = next(d for d in _map(Grouped(), _x()).doubts if d.kind == "nested-stacks")
    assert {"groups", "groups.0.0.attn.out", "groups.1.2.ff.down"} <= set(grouped.modules)
    unrolled = next(d for d in _map(Unrolled(), _x()).doubts if d.kind == "no-stack")
    assert {"fc0", "fc1", "fc2", "fc3"} <= set(unrolled.modules)
    adapter = next(d for d in _map(WithAdapter(), _x()).doubts if d.kind == "add-outside-stack")
    assert adapter.modules == ("", "adapter.down")


@pytest.mark.parametrize("scheme", ["gpt2", "deepnorm"])
@pytest.mark.parametrize("case", DEPTH_CASES)
def test_a_depth_doubt_makes_depth_schemes_refuse_before_any_change(case: str, scheme: str) -> None:
    build, kind, path, _ = DEPTH_CASES[case]
    model, x = build(), _x()
    before = _state(model)
    with pytest.raises(ValueError, match=rf"refuses.*{kind} at {path or '<root>'}.*n_layers="):
        reinit(model, scheme, example_inputs=(x,))
    assert _unchanged(model, before)


@pytest.mark.parametrize("case", DEPTH_CASES)
def test_n_layers_lifts_a_depth_doubt(case: str) -> None:
    build, _, _, blocks = DEPTH_CASES[case]
    model = build()
    reinit(model, "gpt2", example_inputs=(_x(),), n_layers=blocks)
    params = dict(model.named_parameters())
    writers = torch.cat([params[f"{w}.weight"].detach().flatten() for w in WRITERS[case]])
    want = 0.02 / math.sqrt(2 * blocks)
    assert abs(writers.std().item() / want - 1) < 4 / math.sqrt(2 * writers.numel())


@pytest.mark.parametrize("scheme", ["zero_branch", "fixup", "kaiming", "xavier"])
def test_schemes_that_do_not_count_blocks_ignore_a_depth_doubt(scheme: str) -> None:
    model = Unrolled()
    options = {"allow_norms": True} if scheme == "fixup" else {}  # its pre-norms stay
    reinit(model, scheme, example_inputs=(_x(),), **options)
    if scheme in ("zero_branch", "fixup"):
        assert all(
            float(p.detach().abs().max()) == 0
            for n, p in model.named_parameters()
            if n.startswith("fc") and "weight" in n
        )


def test_insert_branch_scale_refuses_on_a_depth_doubt_only_when_it_counts_blocks() -> None:
    model, x = Unrolled(), _x()
    before = _state(model)
    with pytest.raises(ValueError, match=r"refuses.*no-stack at <root>.*init= a number"):
        insert_branch_scale(model, "layerscale", init="cait", example_inputs=(x,))
    assert _unchanged(model, before) and not branch_scales(model)
    insert_branch_scale(model, "layerscale", init=1e-4, example_inputs=(x,))
    assert sorted(branch_scales(model)) == [f"fc{i}" for i in range(4)]


def _unattached(m: ModelMap) -> ModelMap:
    """The map with the doubt a weight layer writing into the stream through no add raises
    (discovery's rule for it reads the traced graph): here named on a writer that is known."""
    m.doubts.append(
        Doubt(
            "unattached-writer",
            "blocks.1.ff.down",
            "blocks.1.ff.down writes into the residual stream but belongs to no residual add",
            ("reinit", "insert_branch_scale", "metrics"),
        )
    )
    return m


@pytest.mark.parametrize("scheme", ["gpt2", "fixup", "deepnorm", "zero_branch"])
def test_a_doubt_on_the_writers_is_not_lifted_by_n_layers(scheme: str) -> None:
    model, x = Stack3(), _x()
    m = _unattached(_map(model, x))
    before = _state(model)
    options = {"n_layers": 3} if scheme in ("gpt2", "deepnorm") else {}
    with pytest.raises(ValueError, match=r"refuses.*unattached-writer at blocks\.1\.ff\.down"):
        reinit(model, scheme, model_map=m, **options)
    with pytest.raises(ValueError, match=r"refuses.*unattached-writer"):
        insert_branch_scale(model, "rezero", model_map=m)
    assert _unchanged(model, before) and not branch_scales(model)
    reinit(model, "kaiming", model_map=m)  # needs no residual add
    assert not _unchanged(model, before)


def test_a_map_without_the_doubt_is_the_way_out() -> None:
    model, x = Unrolled(), _x()
    m = _map(model, x)
    m.doubts.clear()  # the user checked the map: N = 4 adds, one block each, is right
    reinit(model, "gpt2", model_map=m)
    writers = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if "fc" in n])
    writers = writers[writers != 0]  # the biases are 0
    assert abs(writers.std().item() / (0.02 / math.sqrt(8)) - 1) < 4 / math.sqrt(2 * 4 * D * D)


def test_a_norm_named_module_of_unknown_kind_is_doubted_for_conversion() -> None:
    m = _map(WithGateNorm(), _x())
    assert m.norm("gate").kind == "unknown"
    (doubt,) = [d for d in m.doubts if d.kind == "unknown-norm"]
    assert (doubt.path, doubt.affects) == ("gate", ("convert_norms",))
    assert "exclude='gate'" in doubt.reason
    assert not m.doubts_for("reinit")


def test_convert_norms_refuses_only_when_it_would_convert_the_doubted_norm() -> None:
    model, x = WithGateNorm(), _x()
    before = _state(model)
    with pytest.raises(ValueError, match=r"refuses.*unknown-norm at gate.*exclude=\['gate'\]"):
        normprobe.convert_norms(model, "rmsnorm", example_inputs=(x,))
    assert _unchanged(model, before) and isinstance(model.ln, nn.LayerNorm)
    model = normprobe.convert_norms(model, "rmsnorm", example_inputs=(x,), exclude="gate")
    assert isinstance(model.ln, nn.RMSNorm) and isinstance(model.gate, SigmoidGateNorm)
    other = normprobe.convert_norms(WithGateNorm(), "rmsnorm", example_inputs=(x,), include="ln")
    assert isinstance(other.ln, nn.RMSNorm)


def test_reinit_goes_on_past_a_doubt_about_conversion_and_leaves_that_module_alone() -> None:
    model = WithGateNorm()
    with torch.no_grad():
        model.gate.weight.fill_(-2.0)
    reinit(model, "gpt2", example_inputs=(_x(),))
    assert abs(model.blocks[0].attn.qkv.weight.std().item() / 0.02 - 1) < 0.1
    assert torch.equal(model.gate.weight, torch.full((D,), -2.0))  # no norm gain reset to 1
    assert torch.equal(model.ln.weight, torch.ones(D))


def test_a_global_response_norm_is_doubted_for_conversion_and_left_as_built_by_reinit() -> None:
    # transformers' modeling_convnextv2.py: ConvNextV2GRN computes x * (1 + weight * Nx) + bias
    # with Nx a per-channel L2 norm over positions over its channel mean; weight and bias start
    # at 0 (the layer starts as the identity). No conversion target computes it.
    model, args, _, _ = zoo_hf.BUILDERS["convnextv2"]()
    grns = [p for p, m in model.named_modules() if type(m).__name__ == "ConvNextV2GRN"]
    m = _map(model, *args)
    assert [d.path for d in m.doubts if d.kind == "unknown-norm"] == grns
    before = _state(model)
    with pytest.raises(ValueError, match=rf"refuses.*unknown-norm at {re.escape(grns[0])}"):
        normprobe.convert_norms(model, "layernorm", example_inputs=args)
    assert _unchanged(model, before)
    reinit(model, "gpt2", example_inputs=args)
    params = dict(model.named_parameters())
    assert all(not params[f"{p}.{n}"].any() for p in grns for n in ("weight", "bias"))


def test_diagnose_lists_the_doubts() -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = diagnose(Unrolled(), (_x(),))
    assert ("no-stack", "") in _doubts(found.model_map)
    text = str(found)
    assert "The model's map is unsure" in text
    assert "- no-stack at <root>: 4 residual adds" in text


def test_diagnose_of_a_healthy_model_shows_no_doubt() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = diagnose(Stack3(), (_x(),))
    assert not found.model_map.doubts
    assert "unsure" not in str(found)


def test_attach_warns_once_that_per_block_metrics_may_miss_blocks(tmp_path: Path) -> None:
    model, x = WithAdapter(), _x()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.warns(normprobe.DiscoveryWarning, match=r"unsure.*add-outside-stack") as got:
        probe = normprobe.attach(model, opt, log_dir=str(tmp_path), every=1, example_inputs=(x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", normprobe.DiscoveryWarning)
        model(x).pow(2).mean().backward()
        opt.step()
    probe.remove()
    assert sum("unsure" in str(w.message) for w in got) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "resnet18", "vit", "t5", "convnext_atto"])
def test_healthy_zoo_models_have_no_doubt(name: str) -> None:
    z = zoo.build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = normprobe.discover(z.model, *z.args, **z.kwargs)
    assert not m.doubts, [str(d) for d in m.doubts]
