"""A norm written as a gain around a parameter-free norm is one norm; behaviour evidence from a
zero (constant) input classifies nothing; a norm of unknown kind is a doubt convert_norms heeds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.moonshine_streaming.configuration_moonshine_streaming import (
    MoonshineStreamingEncoderConfig,
)
from transformers.models.moonshine_streaming.modeling_moonshine_streaming import (
    MoonshineStreamingEncoder,
)

import normprobe
from normprobe.layers import PerHeadLayerNorm

D, HEADS, DH = 16, 4, 4


class WrappedLayerNorm(nn.Module):
    """``LayerNorm(elementwise_affine=False)`` times a gain (plus a bias) of the wrapper's own."""

    def __init__(self, d: int, bias: bool = False) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.gamma = nn.Parameter(torch.ones(d))
        self.beta = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(x) * self.gamma
        return y if self.beta is None else y + self.beta


class WrappedLayerNormBias(WrappedLayerNorm):
    def __init__(self, d: int) -> None:
        super().__init__(d, bias=True)


class SimpleRMSNorm(nn.Module):
    """An RMSNorm without parameters, through ``F.normalize``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = d**0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * self.scale


class MultiheadRMSNorm(nn.Module):
    """A gain per head and feature, ``1 + gamma``, around a parameter-free RMSNorm."""

    def __init__(self, dim_head: int, heads: int) -> None:
        super().__init__()
        self.rmsnorm = SimpleRMSNorm(dim_head)
        self.gamma = nn.Parameter(torch.zeros(heads, 1, dim_head))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rmsnorm(x) * (self.gamma + 1.0)


class ScaledRMSNorm(nn.Module):
    """``F.normalize(x) * scale * g`` in one module."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = d**0.5
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * self.scale * self.g


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.q_norm = MultiheadRMSNorm(DH, HEADS)
        self.k_norm = MultiheadRMSNorm(DH, HEADS)
        self.out = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, DH).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q, k = self.q_norm(q), self.k_norm(k)
        attn = (q @ k.transpose(-1, -2) / math.sqrt(DH)).softmax(-1)
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, D))


class Block(nn.Module):
    def __init__(self, norm: type[nn.Module], attention: bool) -> None:
        super().__init__()
        self.norm1 = norm(D)
        self.mix: nn.Module = Attention() if attention else nn.Linear(D, D)
        self.norm2 = norm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.fc(self.norm2(x))


class Net(nn.Module):
    def __init__(self, norm: type[nn.Module], attention: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(norm, attention) for _ in range(2)])
        self.norm = norm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


X = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0))
PRE = ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2"]


def _randomize(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


# ---------------------------------------------------------------------------------------------
# one normalization is one norm


@pytest.mark.parametrize(
    ("norm", "affine"), [(WrappedLayerNorm, ("gamma",)), (WrappedLayerNormBias, ("gamma", "beta"))]
)
def test_a_gain_around_a_parameter_free_layernorm_is_one_norm(
    norm: type[nn.Module], affine: tuple[str, ...]
) -> None:
    m = normprobe.discover(Net(norm), X)
    assert [(n.path, n.kind, n.role) for n in m.norms] == [
        *((p, "layernorm", "pre") for p in PRE),
        ("norm", "layernorm", "final"),
    ]
    for n in m.norms:
        assert n.class_name == norm.__name__ and n.affine == affine
        assert (n.eps, n.eps_attr, n.eps_placement) == (1e-6, "ln.eps", "inside-sqrt")
        assert (n.dims, n.layout, n.gain_offset, n.wraps) == (
            (D,),
            "channels-last",
            0.0,
            n.path + ".ln",
        )
    assert [a.pre_norm for a in m.residual_adds] == PRE
    assert not m.doubts


def test_a_wrapper_registered_under_two_names_is_one_norm() -> None:
    """A block also kept under a second attribute (``self.first = blocks[0]``): its wrappers'
    gains are read under both names, and each wrapper is still one norm, its inner norm not
    listed besides it."""
    model = Net(WrappedLayerNorm)
    model.first = model.blocks[0]
    m = normprobe.discover(model, X)
    assert [(n.path, n.role, n.wraps) for n in m.norms] == [
        *((p, "pre", p + ".ln") for p in PRE),
        ("norm", "final", "norm.ln"),
    ]
    converted = normprobe.convert_norms(model, "rmsnorm", example_inputs=(X,))
    assert converted.first is converted.blocks[0]
    assert type(converted.first.norm1) is nn.RMSNorm


class TiedGainNet(Net):
    """`Net` whose first wrapper's gain is the final wrapper's (tied)."""

    def __init__(self) -> None:
        super().__init__(WrappedLayerNorm)
        self.blocks[0].norm1.gamma = self.norm.gamma


def test_wrappers_sharing_a_gain_are_not_folded() -> None:
    """A gain tied across two wrappers is neither's alone (unlike one wrapper under two
    names): each parameter-free LayerNorm inside is the norm; the others stay folded."""
    m = normprobe.discover(TiedGainNet(), X)
    paths = [n.path for n in m.norms]
    assert "blocks.0.norm1.ln" in paths and "norm.ln" in paths
    assert "blocks.0.norm1" not in paths and "norm" not in paths
    assert "blocks.1.norm1" in paths


def test_a_per_head_gain_around_a_parameter_free_rmsnorm_is_one_qk_norm() -> None:
    m = normprobe.discover(Net(WrappedLayerNorm, attention=True), X)
    qk = [n for n in m.norms if n.role == "qk"]
    assert [n.path for n in qk] == [f"blocks.{i}.mix.{w}_norm" for i in range(2) for w in "qk"]
    assert len(m.norms) == 9  # 5 layer norms and 4 qk norms, none of them listed twice
    for n in qk:
        assert (n.kind, n.class_name, n.affine, n.dims) == (
            "rmsnorm",
            "MultiheadRMSNorm",
            ("gamma",),
            (DH,),
        )
        assert n.gain_offset == 1.0  # rmsnorm(x) * (gamma + 1)
        assert n.wraps == n.path + ".rmsnorm" and n.eps is None


def test_normalize_times_scale_times_gain_is_one_rmsnorm() -> None:
    m = normprobe.discover(Net(ScaledRMSNorm), X)
    assert [(n.path, n.kind, n.affine, n.wraps) for n in m.norms] == [
        (p, "rmsnorm", ("g",), None) for p in [*PRE, "norm"]
    ]


class ModulatedNorm(nn.Module):
    """A parameter-free LayerNorm whose scale comes from a Linear: a norm and a layer, not a
    norm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d, elementwise_affine=False)
        self.scale = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x) * (1 + self.scale(x))


class NormThenGelu(nn.Module):
    """A gain and an activation after a parameter-free LayerNorm: a fused norm and activation."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d, elementwise_affine=False)
        self.gamma = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.ln(x) * self.gamma)


class NotAGainAndBias(nn.Module):
    """A parameter-free LayerNorm inside something other than a gain then a bias."""

    def __init__(self, d: int, how: str) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d, elementwise_affine=False)
        self.gamma = nn.Parameter(torch.linspace(0.5, 2, d))
        self.beta = nn.Parameter(torch.linspace(-1, 1, d))
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "bias-then-gain":
            return (self.ln(x) + self.beta) * self.gamma
        if self.how == "divided":
            return self.ln(x) / self.gamma
        if self.how == "two-gains":
            return self.ln(x) * self.gamma * self.beta
        # over the first feature dim: a permute around a channels-last norm
        return self.ln(x.transpose(-1, -2)).transpose(-1, -2) * self.gamma[: x.shape[-1]]


@pytest.mark.parametrize("how", ["bias-then-gain", "divided", "two-gains", "permuted"])
def test_a_norm_inside_more_than_a_gain_and_bias_is_not_folded(how: str) -> None:
    x = torch.randn(2, D, D)  # square, so the permuted norm keeps its input's shape
    m = normprobe.discover(nn.Sequential(NotAGainAndBias(D, how), nn.Linear(D, D)), x)
    # the module behaves like a norm, but around one: the norm inside is listed, once
    assert [(n.path, n.wraps) for n in m.norms] == [("0.ln", None)]


def test_a_norm_with_a_layer_or_an_activation_around_it_is_not_folded() -> None:
    m = normprobe.discover(Net(ModulatedNorm), X)
    assert [n.path for n in m.norms] == [f"{p}.ln" for p in [*PRE, "norm"]]
    assert all(n.wraps is None for n in m.norms)
    model = Net(NormThenGelu)
    _randomize(model)
    m = normprobe.discover(model, X)
    # the norm inside is the normalization, listed once: the module around it is no norm
    assert [n.path for n in m.norms] == [f"{p}.ln" for p in [*PRE, "norm"]]
    assert all(n.wraps is None for n in m.norms)
    # converting swaps the norm inside, the gain and the activation around it stay
    model = normprobe.convert_norms(model, "rmsnorm", model_map=m)
    fused = model.blocks[0].norm1
    assert type(fused) is NormThenGelu and type(fused.ln) is nn.RMSNorm
    hand = F.gelu(X / torch.sqrt(X.pow(2).mean(-1, keepdim=True) + 1e-5) * fused.gamma)
    torch.testing.assert_close(fused(X), hand)


class ConvNormActBlock(nn.Module):
    def __init__(self) -> None:
        from timm.layers import BatchNormAct2d

        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = BatchNormAct2d(4)  # a BatchNorm2d subclass that also runs its ``act`` (ReLU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.conv(x))


def test_a_norm_class_that_also_runs_an_activation_is_refused() -> None:
    """timm's BatchNormAct2d is a norm (a BatchNorm2d subclass) that also applies a ReLU:
    converting it would drop the ReLU, so conversion refuses and changes nothing."""
    model = nn.Sequential(ConvNormActBlock(), ConvNormActBlock())
    x = torch.randn(2, 4, 5, 5)
    assert [n.path for n in normprobe.discover(model, x).norms] == ["0.bn", "1.bn"]
    with pytest.raises(ValueError, match=r"0\.bn .*also runs \['act'\].*nothing was changed"):
        normprobe.convert_norms(model, "groupnorm", example_inputs=(x,))
    assert type(model[0].bn).__name__ == "BatchNormAct2d"


# ---------------------------------------------------------------------------------------------
# conversion and re-initialization act on the wrapper


def test_converting_a_wrapped_layernorm_to_rmsnorm_carries_its_gain() -> None:
    model = Net(WrappedLayerNorm).double()
    _randomize(model)
    model.blocks[0].norm1.gamma.requires_grad_(False)
    gains = {p: model.get_submodule(p).gamma for p in [*PRE, "norm"]}
    model = normprobe.convert_norms(model, "rmsnorm", example_inputs=(X.double(),))
    x = X.double()
    for path, gain in gains.items():
        new = model.get_submodule(path)
        assert type(new) is nn.RMSNorm and new.weight is gain and new.eps == 1e-6
        assert new.weight.dtype == torch.float64
        hand = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain
        torch.testing.assert_close(new(x), hand, rtol=1e-12, atol=1e-12)
    assert (
        not model.blocks[0].norm1.weight.requires_grad
        and model.blocks[0].norm2.weight.requires_grad
    )
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())


def test_without_inputs_a_wrapper_is_refused_with_the_way_out() -> None:
    model = Net(WrappedLayerNorm)
    with pytest.raises(
        ValueError,
        match=r"blocks\.0\.norm1 \(WrappedLayerNorm\) holds the norm 'ln'.*example_inputs",
    ):
        normprobe.convert_norms(model, "rmsnorm")
    assert isinstance(model.blocks[0].norm1.ln, nn.LayerNorm)


@pytest.mark.parametrize("norm", [WrappedLayerNorm, WrappedLayerNormBias])
def test_same_kind_conversion_of_a_wrapped_layernorm_is_bit_identical(
    norm: type[nn.Module],
) -> None:
    model = Net(norm)
    _randomize(model)
    before = model(X)
    model, report = normprobe.convert_norms_with_report(model, "layernorm", example_inputs=(X,))
    assert len(report.conversions) + len(report.kept) == 5
    assert torch.equal(model(X), before)
    converted = model.blocks[1].norm2
    if report.conversions:  # a new LayerNorm holding the wrapper's gain and bias
        assert isinstance(converted, nn.LayerNorm) and converted.eps == 1e-6
        x = X
        hand = (x - x.mean(-1, keepdim=True)) / torch.sqrt(
            x.var(-1, unbiased=False, keepdim=True) + 1e-6
        )
        hand = hand * converted.weight + (converted.bias if converted.bias is not None else 0)
        torch.testing.assert_close(converted(x), hand)


def test_converting_a_per_head_gain_folds_its_one_plus_gamma() -> None:
    model = Net(WrappedLayerNorm, attention=True)
    _randomize(model)
    old = model.blocks[0].mix.q_norm.gamma.detach().clone()
    model, report = normprobe.convert_norms_with_report(
        model, {"qk": "layernorm"}, example_inputs=(X,)
    )
    assert len(report.conversions) == 4
    new = model.blocks[0].mix.q_norm
    assert isinstance(new, PerHeadLayerNorm) and new.weight.shape == (HEADS, 1, DH)
    torch.testing.assert_close(new.weight.detach(), old + 1)
    q = torch.randn(2, HEADS, 5, DH, generator=torch.Generator().manual_seed(2))
    centered = q - q.mean(-1, keepdim=True)
    hand = centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5) * (old + 1)
    torch.testing.assert_close(new(q), hand)


def test_reinit_resets_the_wrappers_gain_and_bias() -> None:
    model = Net(WrappedLayerNormBias, attention=True)
    _randomize(model)
    model = normprobe.reinit(model, "gpt2", example_inputs=(X,))
    for p in [*PRE, "norm"]:
        wrapper = model.get_submodule(p)
        assert torch.equal(wrapper.gamma, torch.ones(D)) and torch.equal(
            wrapper.beta, torch.zeros(D)
        )
    for i in range(2):  # 1 + gamma: a gain of 1 is gamma 0
        assert torch.equal(model.blocks[i].mix.k_norm.gamma, torch.zeros(HEADS, 1, DH))


class WrappedBatchNorm(nn.Module):
    """``BatchNorm2d(affine=False)`` times a per-channel gain plus a bias, both (C, 1, 1)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(c, affine=False)
        self.gamma = nn.Parameter(torch.linspace(0.5, 2, c).view(c, 1, 1))
        self.beta = nn.Parameter(torch.linspace(-1, 1, c).view(c, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x) * self.gamma + self.beta


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.norm = WrappedBatchNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.conv(x))


def test_a_wrapped_batchnorm_converts_with_its_running_statistics() -> None:
    model = nn.Sequential(ConvBlock(), ConvBlock())
    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(3))
    model(x)  # running statistics away from 0 and 1
    model.eval()
    m = normprobe.discover(model, x)
    assert [(n.path, n.kind, n.layout, n.affine, n.wraps) for n in m.norms] == [
        (f"{i}.norm", "batchnorm", "batch", ("gamma", "beta"), f"{i}.norm.bn") for i in range(2)
    ]
    bn = model[0].norm.bn
    mean, var, gamma, beta = (
        bn.running_mean,
        bn.running_var,
        model[0].norm.gamma,
        model[0].norm.beta,
    )
    before = model(x)
    model = normprobe.convert_norms(model, "batchnorm", model_map=m)
    new = model[0].norm
    assert isinstance(new, nn.modules.batchnorm._BatchNorm)
    assert new.running_mean is mean and new.running_var is var and new.momentum == bn.momentum
    y = model[0].conv(x)
    hand = (y - mean.view(4, 1, 1)) / torch.sqrt(var.view(4, 1, 1) + 1e-5) * gamma + beta
    torch.testing.assert_close(new(y), hand)
    torch.testing.assert_close(model(x), before)


def _moonshine() -> MoonshineStreamingEncoder:
    config = MoonshineStreamingEncoderConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        sliding_windows=((16, 4), (16, 0)),
    )
    return MoonshineStreamingEncoder(config).eval()


def test_moonshine_streaming_layernorm_is_one_norm() -> None:
    # modeling_moonshine_streaming.py: MoonshineStreamingLayerNorm (L121-131) is
    # `self.ln(x) * (self.gamma + 1)` around nn.LayerNorm(dim, elementwise_affine=False), with
    # gamma initialized to 0 (L344-345); two per encoder layer (L249-250) and final_norm (L379).
    # MoonshineStreamingFrameCMVN (L71) normalizes each 80-sample frame: a layernorm by behaviour.
    model = _moonshine()
    audio = torch.randn(2, 1280, generator=torch.Generator().manual_seed(0))
    m = normprobe.discover(model, audio)
    wrapped = [
        f"layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")
    ]
    assert [n.path for n in m.norms] == ["embedder.cmvn", *wrapped, "final_norm"]
    for n in m.norms[1:]:
        assert (n.kind, n.affine, n.gain_offset, n.eps, n.wraps) == (
            "layernorm",
            ("gamma",),
            1.0,
            1e-5,
            n.path + ".ln",
        )
    before = model(audio).last_hidden_state
    policy = {p: "layernorm" for p in [*wrapped, "final_norm"]}
    same = normprobe.convert_norms(model, policy, model_map=m)
    assert torch.equal(same(audio).last_hidden_state, before)


# ---------------------------------------------------------------------------------------------
# a zero branch proves nothing


class Residual(nn.Module):
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return x + residual


class LayerScale(nn.Module):
    def __init__(self, d: int, init: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Shift(nn.Module):
    """Its input plus a constant."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("offset", torch.linspace(-1, 1, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


class ZeroBranchBlock(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.how = how
        self.scale = LayerScale(D, 0.0 if how == "layer-scale" else 1.0)
        self.shift = Shift(D)
        self.residual = Residual()
        if how != "layer-scale":
            nn.init.zeros_(self.fc.weight)
            nn.init.zeros_(self.fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.scale(self.fc(self.norm(x)))
        if self.how == "shift":
            return x + self.shift(branch)
        return self.residual(branch, x)


class ZeroBranchNet(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(ZeroBranchBlock(how) for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@pytest.mark.parametrize("how", ["layer-scale", "out-projection", "shift"])
def test_a_module_fed_a_zero_branch_is_no_norm(how: str) -> None:
    # the branch is all zeros at init: Residual computes 0 + x, Shift 0 + offset; both look
    # scale invariant on zeros but are not norms
    m = normprobe.discover(ZeroBranchNet(how), X)
    assert [(n.path, n.kind, n.role) for n in m.norms] == [
        (f"blocks.{i}.norm", "layernorm", "pre") for i in range(3)
    ]
    assert not m.doubts


class CenterOverBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


class BroadcastNet(nn.Module):
    """A learned table broadcast over the batch: every sample is alike."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(5, D))
        self.center = CenterOverBatch()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pos.expand(x.shape[0], -1, -1)
        h = self.center(h)  # zeros: every sample equals the mean
        return h + self.fc(self.norm(h + x))


def test_a_module_whose_output_is_zero_on_a_rank_deficient_input_is_no_norm() -> None:
    m = normprobe.discover(BroadcastNet(), X)
    assert [n.path for n in m.norms] == ["norm"]


class WholeTensorScale(nn.Module):
    """Divides by the RMS of the whole batch: scale invariant, but no per-channel batch norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.pow(2).mean().sqrt()


def test_statistics_over_samples_and_channels_are_no_batchnorm() -> None:
    model = nn.Sequential(nn.Linear(D, D), WholeTensorScale(), nn.Linear(D, D))
    m = normprobe.discover(model, X)
    assert [(n.path, n.kind) for n in m.norms] == [("1", "unknown")]
    assert [d.kind for d in m.doubts] == ["unknown-norm"]


# ---------------------------------------------------------------------------------------------
# a norm-like module of unknown kind


class GRN(nn.Module):
    """A global response norm (ConvNeXt V2): named like a norm, computes no known norm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(d))
        self.beta = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gx = x.norm(dim=1, keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * nx) + self.beta + x


class GRNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, D)
        self.grn = GRN(D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.grn(F.gelu(self.fc1(self.norm(x)))))


def test_a_norm_of_unknown_kind_is_a_doubt_that_convert_norms_heeds() -> None:
    model = nn.Sequential(GRNBlock(), GRNBlock())
    m = normprobe.discover(model, X)
    assert [(n.path, n.kind) for n in m.norms] == [
        ("0.norm", "layernorm"),
        ("0.grn", "unknown"),
        ("1.norm", "layernorm"),
        ("1.grn", "unknown"),
    ]
    assert [(d.kind, d.path, d.affects) for d in m.doubts] == [
        ("unknown-norm", "0.grn", ("convert_norms",)),
        ("unknown-norm", "1.grn", ("convert_norms",)),
    ]
    assert m.doubts_for("convert_norms") == m.doubts and not m.doubts_for("reinit")
    assert "Doubt (unknown-norm, 0.grn)" in str(m)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"nothing was changed.*0\.grn \(GRN\).*exclude='\*\.grn'"):
        normprobe.convert_norms(model, "rmsnorm", model_map=m)
    assert all(isinstance(b.norm, nn.LayerNorm) for b in model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model = normprobe.convert_norms(model, "rmsnorm", model_map=m, exclude="*.grn")
    assert [type(b.norm) for b in model] == [nn.RMSNorm, nn.RMSNorm]
    assert all(isinstance(b.grn, GRN) for b in model)
