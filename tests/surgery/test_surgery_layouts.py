"""convert_norms keeps each norm's statistics layout: per head, channels-first, per group.

Numbers checked are bit-identity (a norm converted to its own kind) or normalizations computed
by hand from the input.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

import normprobe
from normprobe.layers import DyT, PerHeadLayerNorm, PerHeadRMSNorm, RMSNorm2d
from normprobe.surgery import convert_norms, convert_norms_with_report

EPS = 1e-5


def _tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor in a model output (a tensor, a tuple, a dict or an HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, list | tuple):
        return [t for v in out for t in _tensors(v)]
    return []


def _run(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    with torch.no_grad():
        return _tensors(model(*args, **kwargs))


def _bit_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------------------------------------
# per-head norms: statistics over head_dim, one gain per head and feature


class HeadLayerNorm(nn.Module):
    """A user's per-head LayerNorm: statistics over head_dim, a (heads, head_dim) gain."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim))
        self.eps = EPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight


def _heads_model() -> nn.Sequential:
    model = nn.Sequential(nn.Unflatten(-1, (2, 4)), HeadLayerNorm(2, 4), nn.Flatten(-2))
    with torch.no_grad():
        model[1].weight.copy_(torch.arange(1.0, 9.0).view(2, 4) / 4)
    return model


# two heads with zero-mean features: mean squares (1+1+4+4)/4 = 2.5 and (9+9+0+0)/4 = 4.5
HEADS_X = torch.tensor([[1.0, -1, 2, -2, 3, -3, 0, 0]])
HEADS_MS = torch.tensor([2.5] * 4 + [4.5] * 4)


@pytest.mark.parametrize("traced", [False, True], ids=["no-inputs", "example-inputs"])
def test_a_per_head_norm_becomes_a_per_head_rmsnorm_over_head_dim(traced: bool) -> None:
    model = _heads_model()
    gain = model[1].weight
    inputs = {"example_inputs": (torch.randn(3, 8),)} if traced else {}
    model = convert_norms(model, "rmsnorm", **inputs)
    norm = model[1]
    assert type(norm) is PerHeadRMSNorm and norm.weight is gain  # the same Parameter object
    assert norm.normalized_shape == (4,) and norm.affine_shape == (2, 4)
    expected = HEADS_X / torch.sqrt(HEADS_MS + EPS) * gain.detach().flatten()
    torch.testing.assert_close(model(HEADS_X), expected)


@pytest.mark.parametrize("traced", [False, True], ids=["no-inputs", "example-inputs"])
def test_a_per_head_norm_to_its_own_kind_is_bit_identical(traced: bool) -> None:
    model = _heads_model()
    x = torch.randn(5, 8) * 3 + 1
    before = model(x)
    inputs = {"example_inputs": (x,)} if traced else {}
    model, report = convert_norms_with_report(model, "layernorm", **inputs)
    assert torch.equal(model(x), before)
    # a PerHeadLayerNorm (F.layer_norm) rounds differently from the hand-written formula
    assert [p for p, _ in report.kept] == ["1"] and "bit-identical" in report.kept[0][1]
    # and a per-head layer of normprobe's own is already what a layernorm target builds
    model = nn.Sequential(PerHeadLayerNorm(4, (2, 4)))
    assert convert_norms(model, "layernorm")[0] is model[0]


def _cohere() -> tuple[nn.Module, torch.Tensor]:
    from transformers import CohereConfig, CohereForCausalLM

    config = CohereConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_qk_norm=True,
        max_position_embeddings=64,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = CohereForCausalLM(config).eval()
    with torch.no_grad():  # gains of ones would hide a gain moved to the wrong head
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model, torch.randint(0, 64, (2, 10))


@pytest.mark.parametrize("traced", [False, True], ids=["no-inputs", "example-inputs"])
def test_cohere_qk_norms_keep_their_per_head_statistics(traced: bool) -> None:
    # modeling_cohere.py: q_norm = CohereLayerNorm(hidden_size=(num_heads, head_dim)) applied to
    # (batch, seq, heads, head_dim) with mean/variance over the last dim only
    model, ids = _cohere()
    kwargs = {"use_cache": False}
    before = _run(model, (ids,), kwargs)
    inputs: dict[str, Any] = {"example_inputs": (ids,), "example_kwargs": kwargs} if traced else {}
    model = convert_norms(model, "layernorm", **inputs)
    assert _bit_identical(_run(model, (ids,), kwargs), before)

    gain = model.model.layers[0].self_attn.q_norm.weight
    model = convert_norms(model, "rmsnorm", **inputs)
    attn = model.model.layers[0].self_attn
    assert type(attn.q_norm) is PerHeadRMSNorm and attn.q_norm.weight is gain
    assert (attn.q_norm.normalized_shape, attn.q_norm.affine_shape) == ((8,), (4, 8))
    assert (attn.k_norm.normalized_shape, attn.k_norm.affine_shape) == ((8,), (2, 8))
    assert type(model.model.norm) is nn.RMSNorm
    q = torch.randn(2, 3, 4, 8)
    expected = q / q.pow(2).mean(-1, keepdim=True).add(EPS).sqrt() * gain.detach()
    torch.testing.assert_close(attn.q_norm(q), expected)
    after = _run(model, (ids,), kwargs)
    model = convert_norms(model, "rmsnorm", **inputs)  # its own kind again: nothing moves
    assert _bit_identical(_run(model, (ids,), kwargs), after)


# ------------------------------------------------------------------------------------------------
# channels-first norms: known from the module's attributes, or measured


def _convnextv2() -> tuple[nn.Module, torch.Tensor]:
    from transformers import ConvNextV2Config, ConvNextV2Model

    config = ConvNextV2Config(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=48)
    torch.manual_seed(0)
    model = ConvNextV2Model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.3)
    # 48x48 pixels, 4x4 patches: 12x12 positions, so no spatial size equals a channel count
    return model, torch.randn(2, 3, 48, 48)


@pytest.mark.parametrize("traced", [False, True], ids=["no-inputs", "example-inputs"])
def test_hf_channels_first_layernorm_converts_along_its_channels(traced: bool) -> None:
    # modeling_convnextv2.py: ConvNextV2LayerNorm(data_format="channels_first") permutes NCHW to
    # NHWC and back; the embeddings' and downsampling norms use it, the blocks' norms do not.
    # Before the fix, convert_norms without inputs built a channels-last RMSNorm here and the
    # next forward failed ("expected input with shape [*8], but got input of size[2, 8, 12, 12]").
    model, pixels = _convnextv2()
    first = [
        p for p, m in model.named_modules() if getattr(m, "data_format", "") == "channels_first"
    ]
    assert first == ["embeddings.layernorm", "encoder.stages.1.downsampling_layer.0"]
    before = _run(model, (pixels,), {})
    # each layer's GRN (a global response norm of no kind a target computes) is a doubt of the
    # map that makes the conversion refuse unless it is left out (issue 25)
    inputs: dict[str, Any] = {"exclude": "*.grn"}
    if traced:
        inputs["example_inputs"] = (pixels,)
    same = convert_norms(model, "layernorm", **inputs)
    assert _bit_identical(_run(same, (pixels,), {}), before)

    gain = model.embeddings.layernorm.weight
    model = convert_norms(model, "rmsnorm", **inputs)
    modules = dict(model.named_modules())
    assert all(type(modules[p]) is RMSNorm2d for p in first)
    assert type(model.encoder.stages[0].layers[0].layernorm) is nn.RMSNorm  # channels-last
    x = torch.randn(2, 8, 5, 7)
    ms = x.pow(2).mean(1, keepdim=True)  # over the 8 channels at each position
    expected = x / torch.sqrt(ms + 1e-6) * gain.detach().view(-1, 1, 1)
    torch.testing.assert_close(model.embeddings.layernorm(x), expected)
    assert _run(model, (pixels,), {})[0].shape == before[0].shape
    with pytest.warns(normprobe.surgery.ConversionWarning, match="5 new parameters"):
        dyt = convert_norms(_convnextv2()[0], "dyt", **inputs)
    assert [m.channels_first for m in dyt.modules() if isinstance(m, DyT)] == [
        True, False, True, False, False,
    ]  # fmt: skip


class RankLayerNorm(nn.Module):
    """Over the channels of a 4-D (N, C, H, W) input, over the last dim of any other input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(1.0, channels + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.weight.shape
        if x.ndim == 4:
            y = F.layer_norm(x.permute(0, 2, 3, 1), shape, self.weight, None, EPS)
            return y.permute(0, 3, 1, 2)
        return F.layer_norm(x, shape, self.weight, None, EPS)


def test_a_layout_that_cannot_be_known_without_inputs_is_refused_and_nothing_changes() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), RankLayerNorm(4))
    norm, state = model[1], {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^1 \(RankLayerNorm\).*example_inputs=.*nothing was"):
        convert_norms(model, "rmsnorm")
    assert model[1] is norm and all(torch.equal(v, state[k]) for k, v in model.state_dict().items())

    x = torch.randn(2, 3, 5, 7)
    model = convert_norms(model, "rmsnorm", example_inputs=(x,))
    assert type(model[1]) is RMSNorm2d and model[1].weight is norm.weight
    h = torch.tensor([3.0, -3.0, 3.0, -3.0]).view(1, 4, 1, 1)  # one position: RMS 3
    torch.testing.assert_close(model[1](h).flatten(), torch.tensor([1.0, -2.0, 3.0, -4.0]))


# ------------------------------------------------------------------------------------------------
# per-group norms


class MyGroupNorm(nn.Module):
    """A user's group norm: ``F.group_norm`` with 2 groups, under a class torch does not know."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 2.0, channels))
        self.bias = nn.Parameter(torch.linspace(-1.0, 1.0, channels))
        self.eps = EPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, 2, self.weight, self.bias, self.eps)


@pytest.mark.parametrize("traced", [False, True], ids=["no-inputs", "example-inputs"])
def test_group_norms_keep_their_groups(traced: bool) -> None:
    x = torch.randn(2, 8, 5, 7) * 2 + 1
    model = nn.Sequential(nn.GroupNorm(2, 8), MyGroupNorm(8))
    before = model(x)
    inputs = {"example_inputs": (x,)} if traced else {}
    model = convert_norms(model, "groupnorm", **inputs)
    assert [type(m) for m in model] == [nn.GroupNorm, nn.GroupNorm]
    assert [m.num_groups for m in model] == [2, 2] and torch.equal(model(x), before)
    model = convert_norms(model, "groupnorm", num_groups=4)  # an explicit count still wins
    assert [m.num_groups for m in model] == [4, 4]
    one = torch.tensor([1.0, -1.0]).repeat(4).view(1, 8, 1, 1)  # each group of 2: mean 0, var 1
    y = model[0](one) * model[0].weight.view(1, 8, 1, 1)  # weight 1, bias 0
    torch.testing.assert_close(y.flatten(), one.flatten() / math.sqrt(1 + EPS))


# ------------------------------------------------------------------------------------------------
# every zoo model: converting each norm to its own kind leaves every output bit-identical


def _zoo_builders() -> dict[str, Callable[[], tuple[Any, ...]]]:
    """Builders of zoo models that ``zoo.NAMES`` does not list yet (other zoo files, if present)."""
    found: dict[str, Callable[[], tuple[Any, ...]]] = {}
    for module in ("zoo_hf", "zoo_vision"):  # written by other work; used when present
        try:
            found |= getattr(importlib.import_module(module), "BUILDERS", {})
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
    return {n: b for n, b in found.items() if n not in zoo.NAMES}


EXTRA = _zoo_builders()
ZOO_CASES = [*zoo.NAMES, *EXTRA]


def _build(name: str) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    if name in zoo.NAMES:
        z = zoo.build(name)
        return z.model, z.args, z.kwargs
    torch.manual_seed(0)  # as zoo.build does
    model, args, kwargs, *_ = EXTRA[name]()
    return model.eval(), args, kwargs


_OWN_KIND = {k: k for k in ("layernorm", "rmsnorm", "groupnorm", "batchnorm", "dyt")}


def _glob(path: str) -> str:
    return "".join(f"[{c}]" if c in "[]*?" else c for c in path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO_CASES)
def test_same_kind_conversion_is_bit_identical_on_every_zoo_model(name: str) -> None:
    model, args, kwargs = _build(name)
    before = _run(model, args, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        found = normprobe.discover(model, *args, **kwargs)
    policy = {_glob(n.path): _OWN_KIND.get(n.kind) for n in found.norms}
    if not policy:
        pytest.skip(f"{name} has no norm layers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.surgery.ConversionWarning)  # unused keys
        model = convert_norms(model, policy, example_inputs=args, example_kwargs=kwargs)
    assert _bit_identical(_run(model, args, kwargs), before)
