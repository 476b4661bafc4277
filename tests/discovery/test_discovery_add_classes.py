"""Residual adds of the shapes issue 25 lists: a learned gain on the skip, gates computed before
the block's first add (adaLN-Zero), zero-padded shortcuts (the CIFAR ResNet's option A), bare
parameters applied by einsum, branches without a weight (PoolFormer), and the doubt raised for a
weight layer writing into the stream that no add names."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normprobe
from normprobe import ModelMap
from normprobe.reinit import FixupScalars

D = 16


def _discover(model: nn.Module, *args: torch.Tensor) -> ModelMap:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normprobe.discover(model.eval(), *args)


def _roles(m: ModelMap) -> dict[str, str]:
    return {n.path: n.role for n in m.norms}


class Mlp(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Tokens(nn.Module):
    """Linear embedding, ``blocks``, a final norm and a head; the blocks get ``*extra``."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 5)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, *extra)
        return self.head(self.norm(h))


# -- 5: a learned gain on the skip ------------------------------------------------------------


class GainBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.mlp = Mlp()
        self.residual_scale = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.residual_scale + self.mlp(self.ln(x))


class InnerSkip(nn.Module):
    """Mamba's ``y + u * D``: a gained skip of a value the module computed itself."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.inp = nn.Linear(D, D)
        self.mix = nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        self.d_skip = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.silu(self.inp(self.ln(x)))
        pooled = F.avg_pool1d(u.transpose(1, 2), 3, 1, 1).transpose(1, 2)
        y = self.mix(u) + u * self.d_skip
        return x + self.out(y + pooled)


def test_a_learned_skip_gain_is_a_residual_add_naming_its_parameter() -> None:
    torch.manual_seed(0)
    model = Tokens([GainBlock() for _ in range(3)])
    m = _discover(model, torch.randn(2, 4, 8))
    adds = m.residual_adds
    assert [(a.module, a.kind, a.writers, a.skip_gain, a.skip_scale) for a in adds] == [
        (f"blocks.{i}", "identity", (f"blocks.{i}.mlp.fc2",), f"blocks.{i}.residual_scale", 1.0)
        for i in range(3)
    ]
    assert _roles(m) == {**{f"blocks.{i}.ln": "pre" for i in range(3)}, "norm": "final"}
    assert [(s.path, s.depth, s.placement) for s in m.stacks] == [("blocks", 3, "pre-ln")]


def test_a_gained_skip_of_a_value_computed_inside_the_module_is_no_residual_add() -> None:
    torch.manual_seed(0)
    m = _discover(Tokens([InnerSkip() for _ in range(2)]), torch.randn(2, 4, 8))
    assert [(a.module, a.writers, a.skip_gain) for a in m.residual_adds] == [
        (f"blocks.{i}", (f"blocks.{i}.out",), None) for i in range(2)
    ]


def test_schemes_take_a_unit_skip_gain_and_refuse_any_other_or_deepnorm() -> None:
    torch.manual_seed(0)
    model = Tokens([GainBlock() for _ in range(3)])
    x = torch.randn(2, 4, 8)
    normprobe.reinit(model, "gpt2", example_inputs=(x,))
    std = model.blocks[1].mlp.fc2.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(6), rel=0.05)
    with pytest.raises(ValueError, match=r"learned gain 'blocks.0.residual_scale'.*alpha"):
        normprobe.reinit(model, "deepnorm", example_inputs=(x,))
    with torch.no_grad():
        model.blocks[2].residual_scale.fill_(0.5)
    before = model.blocks[0].mlp.fc1.weight.clone()
    for scheme in ("gpt2", "fixup"):
        with pytest.raises(ValueError, match=r"'blocks.2.residual_scale' \(not 1 everywhere\)"):
            normprobe.reinit(model, scheme, example_inputs=(x,))
    assert torch.equal(model.blocks[0].mlp.fc1.weight, before)


# -- 6: gates computed before the block's first add (adaLN-Zero) --------------------------------


class Attention(nn.Module):
    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class AdaLNZeroBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False)
        self.attn = Attention()
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False)
        self.mlp = Mlp()
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).unsqueeze(1).chunk(6, dim=-1)
        x = x + gate1 * self.attn(self.norm1(x) * (1 + scale1) + shift1)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class Conditioned(Tokens):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__(blocks)
        self.cond = nn.Linear(4, D)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        return super().forward(x, self.cond(extra[0]))


@pytest.mark.parametrize("tokens", [4, 1])  # one token: gate and branch of one size
def test_adaln_zero_gates_made_before_the_first_add_gate_both_adds(tokens: int) -> None:
    torch.manual_seed(0)
    model = Conditioned([AdaLNZeroBlock() for _ in range(2)])
    m = _discover(model, torch.randn(2, tokens, 8), torch.randn(2, 4))
    got = [(a.module, a.kind, a.writers, a.gates) for a in m.residual_adds]
    assert got == [
        (f"blocks.{i}", "identity", (f"blocks.{i}.{writer}",), (f"blocks.{i}.ada.1",))
        for i in range(2)
        for writer in ("attn.proj", "mlp.fc2")
    ]
    assert _roles(m) == {
        **{f"blocks.{i}.norm{j}": "pre" for i in range(2) for j in (1, 2)},
        "norm": "final",
    }
    assert not m.doubts


def test_diffusers_dit_gates_both_adds_of_each_block() -> None:
    transformers2d = pytest.importorskip("diffusers.models.transformers")
    torch.manual_seed(0)
    model = transformers2d.DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    ).eval()
    inputs = dict(timestep=torch.tensor([3, 5]), class_labels=torch.tensor([1, 2]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = normprobe.discover(model, torch.randn(2, 4, 8, 8), **inputs)
    blocks = "transformer_blocks"
    got = [(a.module, a.writers, a.gates, a.pre_norm) for a in m.residual_adds]
    assert got == [
        (f"{blocks}.{i}", (f"{blocks}.{i}.{writer}",), (f"{blocks}.{i}.norm1.linear",), pre)
        for i in range(2)
        for writer, pre in (
            ("attn1.to_out.0", f"{blocks}.{i}.norm1.norm"),
            ("ff.net.2", f"{blocks}.{i}.norm3"),
        )
    ]
    assert [(s.path, s.placement) for s in m.stacks] == [(blocks, "pre-ln")]
    assert not m.doubts


# -- 8: zero-padded shortcuts (the CIFAR ResNet's option A) -------------------------------------


class BasicBlock(nn.Module):
    """The Fixup paper's CIFAR block without BatchNorm, downsampling by ``shortcut``."""

    def __init__(self, inp: int, planes: int, stride: int, shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inp, planes, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.planes = planes
        self.shortcut = shortcut if stride != 1 or inp != planes else "identity"

    def skip(self, x: torch.Tensor) -> torch.Tensor:
        if self.shortcut == "pad":
            pad = self.planes // 4
            return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, pad, pad))
        pooled = F.avg_pool2d(x, 2)
        if self.shortcut == "zeros_like":
            return torch.cat([pooled, torch.zeros_like(pooled)], 1)
        if self.shortcut == "new_zeros":
            return torch.cat([pooled, pooled.new_zeros(pooled.shape)], 1)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(F.relu(self.conv1(x)))
        return F.relu(out + self.skip(x))


class ResNet20(nn.Module):
    def __init__(self, shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        stages: list[nn.Module] = []
        inp = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            blocks = []
            for i in range(3):
                blocks.append(BasicBlock(inp, planes, stride if i == 0 else 1, shortcut))
                inp = planes
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(F.relu(self.conv1(x)))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


BLOCKS = [f"layer{s}.{i}" for s in (1, 2, 3) for i in range(3)]


@pytest.mark.parametrize("shortcut", ["pad", "zeros_like", "new_zeros"])
def test_option_a_shortcuts_are_residual_adds(shortcut: str) -> None:
    torch.manual_seed(0)
    m = _discover(ResNet20(shortcut), torch.randn(2, 3, 16, 16))
    got = [(a.module, a.kind, a.writers, a.branch_layers) for a in m.residual_adds]
    assert got == [(b, "identity", (f"{b}.conv2",), (f"{b}.conv1", f"{b}.conv2")) for b in BLOCKS]
    assert [(s.path, s.depth) for s in m.stacks if s.path.startswith("layer")] == [
        (f"layer{s}", 3) for s in (1, 2, 3)
    ]


@pytest.mark.parametrize("shortcut", ["pad", "zeros_like"])
def test_fixup_treats_all_nine_blocks_of_an_option_a_resnet20(shortcut: str) -> None:
    torch.manual_seed(0)
    model = ResNet20(shortcut)
    normprobe.reinit(model, "fixup", example_inputs=(torch.randn(2, 3, 16, 16),))
    for path in BLOCKS:
        block = model.get_submodule(path)
        assert isinstance(block.conv1, FixupScalars) and isinstance(block.conv2, FixupScalars)
        first = block.conv1.inner.weight
        kaiming = math.sqrt(2 / (first.shape[0] * 9))  # fan_out of a 3x3 kernel
        # L = 9 branches of m = 2 layers: L^(-1/(2m-2)) = 1/3 of He's std
        assert first.std().item() == pytest.approx(kaiming / 3, rel=0.05), path
        assert torch.count_nonzero(block.conv2.inner.weight) == 0, path
    # both convs of each of the 9 branches, the stem's conv and the classifier
    assert sum(isinstance(m, FixupScalars) for m in model.modules()) == 20


# -- 10: bare parameters applied by einsum ------------------------------------------------------


def test_xlnet_output_projection_by_einsum_is_a_writer_scaled_by_gpt2() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.XLNetConfig(d_model=32, n_layer=2, n_head=2, d_inner=64, vocab_size=100)
    model = transformers.XLNetModel(config).eval()
    ids = torch.randint(0, 100, (2, 7))
    m = _discover(model, ids)
    attention = [a for a in m.residual_adds if a.module.endswith("rel_attn")]
    assert [(a.writers, a.writer_params) for a in attention] == [
        ((f"layer.{i}.rel_attn",), (f"layer.{i}.rel_attn.o",)) for i in range(2)
    ]
    normprobe.reinit(model, "gpt2", example_inputs=(ids,))
    for i in range(2):
        layer = model.layer[i].rel_attn
        assert layer.o.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.05)
        assert layer.q.std().item() == pytest.approx(0.02, rel=0.05)


# -- 12: branches without a weight (PoolFormer) -------------------------------------------------


class Pooling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AvgPool2d(3, 1, 1, count_include_pad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x) - x


class TanhGelu(nn.Module):
    """GELU's tanh form written out: its ``x + 0.044715 x**3`` is no residual add."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


class GlobalResponseNorm(nn.Module):
    """ConvNeXt-V2's global response norm, with its own ``+ x``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, d, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, d, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gx = x.norm(p=2, dim=(2, 3), keepdim=True)
        nx = gx / (gx.mean(dim=1, keepdim=True) + 1e-6)
        return self.gamma * (x * nx) + self.beta + x


class PoolBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(1, D)
        self.token_mixer = Pooling()
        self.norm2 = nn.GroupNorm(1, D)
        self.fc1 = nn.Conv2d(D, 2 * D, 1)
        self.act = TanhGelu()
        self.grn = GlobalResponseNorm(2 * D)
        self.fc2 = nn.Conv2d(2 * D, D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mixer(self.norm1(x))
        return x + self.fc2(self.grn(self.act(self.fc1(self.norm2(x)))))


class PoolNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, D, 3, 1, 1)
        self.blocks = nn.Sequential(*[PoolBlock() for _ in range(3)])
        self.norm = nn.GroupNorm(1, D)
        self.act = TanhGelu()  # on the stream itself: its sum feeds no residual add
        self.head = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.norm(self.blocks(self.stem(x)))).mean((2, 3)))


def test_a_weightless_branch_holding_a_norm_is_a_residual_add_without_writer() -> None:
    torch.manual_seed(0)
    m = _discover(PoolNet(), torch.randn(2, 3, 8, 8))
    got = [(a.module, a.writers, a.branch_layers, a.open_path) for a in m.residual_adds]
    assert got == [
        add
        for i in range(3)
        for add in (
            (f"blocks.{i}", (), (), True),
            (f"blocks.{i}", (f"blocks.{i}.fc2",), (f"blocks.{i}.fc1", f"blocks.{i}.fc2"), False),
        )
    ]
    roles = {path: role for path, role in _roles(m).items() if not path.endswith("grn")}
    assert roles == {
        **{f"blocks.{i}.norm{j}": "pre" for i in range(3) for j in (1, 2)},
        "norm": "final",
    }
    assert [(s.path, s.depth, s.placement) for s in m.stacks] == [("blocks", 3, "pre-ln")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a branch with nothing to scale
        normprobe.reinit(PoolNet(), "gpt2", example_inputs=(torch.randn(2, 3, 8, 8),))


def test_hf_poolformer_pooling_adds_have_pre_norms() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.PoolFormerConfig(
        depths=[2, 2],
        hidden_sizes=[16, 32],
        num_encoder_blocks=2,
        patch_sizes=[7, 3],
        strides=[4, 2],
        padding=[2, 1],
        mlp_ratio=2.0,
        num_labels=5,
    )
    model = transformers.PoolFormerForImageClassification(config)
    m = _discover(model, torch.randn(1, 3, 64, 64))
    blocks = [f"poolformer.encoder.block.{s}.{i}" for s in (0, 1) for i in (0, 1)]
    assert [(a.module, a.writers, a.pre_norm) for a in m.residual_adds] == [
        add
        for b in blocks
        for add in ((b, (), f"{b}.before_norm"), (b, (f"{b}.output.conv2",), f"{b}.after_norm"))
    ]
    assert all(_roles(m)[f"{b}.{n}_norm"] == "pre" for b in blocks for n in ("before", "after"))


def test_fnet_fourier_branch_is_a_post_ln_residual_add() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.FNetConfig(
        hidden_size=32, num_hidden_layers=2, intermediate_size=64, vocab_size=100
    )
    m = _discover(transformers.FNetModel(config), torch.randint(0, 100, (2, 12)))
    layers = [f"encoder.layer.{i}" for i in range(2)]
    assert [(a.module, a.writers, a.open_path, a.post_norm) for a in m.residual_adds] == [
        add
        for x in layers
        for add in (
            (f"{x}.fourier.output", (), True, f"{x}.fourier.output.LayerNorm"),
            (f"{x}.output", (f"{x}.output.dense",), False, f"{x}.output.LayerNorm"),
        )
    ]
    assert [(s.path, s.placement) for s in m.stacks] == [("encoder.layer", "post-ln")]


def test_timm_poolformer_s12_has_two_adds_a_block() -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("poolformer_s12", pretrained=False, num_classes=10)
    m = _discover(model, torch.randn(1, 3, 64, 64))
    depths = (2, 2, 6, 2)
    blocks = [f"stages.{s}.blocks.{i}" for s, n in enumerate(depths) for i in range(n)]
    assert [(a.module, a.writers) for a in m.residual_adds] == [
        add for b in blocks for add in ((b, ()), (b, (f"{b}.mlp.fc2",)))
    ]
    roles = _roles(m)
    assert all(roles[f"{b}.norm{j}"] == "pre" for b in blocks for j in (1, 2))


# -- the unattached-writer doubt ----------------------------------------------------------------


class ConditionedBlock(nn.Module):
    """A conditioning projection added into the stream before a Pre-LN branch."""

    def __init__(self) -> None:
        super().__init__()
        self.cond = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        x = x + self.cond(c).unsqueeze(1)
        return x + self.mlp(self.ln(x))


def test_a_layer_writing_into_the_stream_through_no_add_is_a_doubt_for_reinit() -> None:
    torch.manual_seed(0)
    model = Conditioned([ConditionedBlock() for _ in range(3)])
    m = _discover(model, torch.randn(2, 4, 8), torch.randn(2, 4))
    assert [a.writers for a in m.residual_adds] == [(f"blocks.{i}.mlp.fc2",) for i in range(3)]
    assert [(d.kind, d.path, d.affects) for d in m.doubts] == [
        ("unattached-writer", f"blocks.{i}.cond", ("reinit",)) for i in range(3)
    ]
    assert [d.path for d in m.doubts_for("reinit")] == [f"blocks.{i}.cond" for i in range(3)]


@pytest.mark.parametrize(
    "build",
    [
        lambda: (Tokens([GainBlock() for _ in range(2)]), (torch.randn(2, 4, 8),)),
        lambda: (ResNet20("pad"), (torch.randn(2, 3, 16, 16),)),
        lambda: (PoolNet(), (torch.randn(2, 3, 8, 8),)),
    ],
    ids=["skip-gain", "option-a", "poolformer"],
)
def test_no_doubt_where_every_stream_writer_belongs_to_an_add(build: object) -> None:
    torch.manual_seed(0)
    model, args = build()  # type: ignore[operator]
    m = _discover(model, *args)
    assert not [d for d in m.doubts if d.kind == "unattached-writer"]
