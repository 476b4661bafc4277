"""Stacks found from the residual stream (issue 25, classes 2, 3 and 11): blocks a parent unpacks
instead of calling, lists of norms, a block's sublayers in a mixed container, and the doubts a
map carries when its stacks do not account for the stream's adds.

Every expected number is derived from the models below: a model of N layers makes 2N residual
adds (attention and feed-forward), and ``reinit("gpt2")`` gives their writers std
0.02/sqrt(2N).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normprobe
from normprobe import ModelMap, tags

WIDTH = 64
DEPTH = 3
GPT2_STD = 0.02


class SelfAttention(nn.Module):
    """Single-head softmax attention: ``to_out(softmax(q k^T / sqrt(d)) v)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.to_qkv = nn.Linear(width, 3 * width)
        self.to_out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        out: torch.Tensor = self.to_out(weights @ v)
        return out


class FeedForward(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


class PreNorm(nn.Module):
    """``fn(norm(x))``, as vit-pytorch wraps each sublayer."""

    def __init__(self, width: int, fn: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fn(self.norm(x))
        return out


class Residual(nn.Module):
    """A parameter-free module adding the skip, as x-transformers' ``Residual``."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return x + residual


class SublayerList(nn.Module):
    """x-transformers' layout: one ``ModuleList([norms, sublayer, Residual()])`` per sublayer,
    attention and feed-forward alternating in one list the parent iterates."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__()
        entries = []
        for _ in range(depth):
            for sublayer in (SelfAttention(width), FeedForward(width)):
                norms = nn.ModuleList([nn.LayerNorm(width)])
                entries.append(nn.ModuleList([norms, sublayer, Residual()]))
        self.layers = nn.ModuleList(entries)
        self.final_norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norms, sublayer, residual in self.layers:
            x = residual(sublayer(norms[0](x)), x)
        out: torch.Tensor = self.final_norm(x)
        return out


class PairList(nn.Module):
    """vit-pytorch's layout: ``ModuleList([attn, ff])`` per layer, unpacked by the parent."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList(
                [PreNorm(width, SelfAttention(width)), PreNorm(width, FeedForward(width))]
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        out: torch.Tensor = self.norm(x)
        return out


class ParallelLists(nn.Module):
    """No container per layer: the parent zips two lists, ``attns`` and ``ffs``."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__()
        self.attns = nn.ModuleList(PreNorm(width, SelfAttention(width)) for _ in range(depth))
        self.ffs = nn.ModuleList(PreNorm(width, FeedForward(width)) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, ff in zip(self.attns, self.ffs, strict=True):
            x = x + attn(x)
            x = x + ff(x)
        out: torch.Tensor = self.norm(x)
        return out


class SandwichBlock(nn.Module):
    """Pre and post norm of each sublayer kept in one ``ModuleList([pre, post])``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = SelfAttention(width)
        self.attn_norms = nn.ModuleList([nn.LayerNorm(width), nn.LayerNorm(width)])
        self.ff = FeedForward(width)
        self.ff_norms = nn.ModuleList([nn.LayerNorm(width), nn.LayerNorm(width)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_norms[1](self.attn(self.attn_norms[0](x)))
        out: torch.Tensor = x + self.ff_norms[1](self.ff(self.ff_norms[0](x)))
        return out


class Sandwich(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SandwichBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.norm(x)
        return out


class ConvBlock(nn.Module):
    """MaxViT's MBConv stand-in: ``x + conv(norm(x))`` on channels-last tokens."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.conv = nn.Conv1d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.norm(x).transpose(1, 2)).transpose(1, 2)
        return x + h


class MlpPreNorm(PreNorm):
    """The feed-forward sublayer, a class of its own as torchvision's and timm's MLP is."""


class PartitionAttention(nn.Module):
    """MaxViT's window or grid attention layer: attention then feed-forward, each residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = PreNorm(width, SelfAttention(width))
        self.mlp = MlpPreNorm(width, FeedForward(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class MaxVitLayer(nn.Module):
    """torchvision's MaxVitLayer: ``Sequential(MBConv, window attention, grid attention)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            ConvBlock(width), PartitionAttention(width), PartitionAttention(width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


class MaxVitLike(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MaxVitLayer(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.norm(x)
        return out


def _tokens() -> torch.Tensor:
    return torch.randn(2, 8, WIDTH)


def _discover(model: nn.Module, *args: torch.Tensor) -> ModelMap:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        return normprobe.discover(model, *args)


def _stacks(m: ModelMap) -> dict[str, tuple[int, str, int]]:
    return {s.path: (s.depth, s.placement, len(m.adds_in(s.path))) for s in m.stacks}


def _gpt2_stds(
    model: nn.Module, m: ModelMap, *args: torch.Tensor, n_layers: int | None = None
) -> dict[str, float]:
    torch.manual_seed(0)
    normprobe.reinit(model, "gpt2", example_inputs=args, model_map=m, n_layers=n_layers)
    writers = {w for a in m.residual_adds for w in a.writers}
    return {w: model.get_submodule(w).weight.std().item() for w in writers}


@pytest.mark.parametrize(
    ("build", "stack", "block_type"),
    [
        (SublayerList, "layers", "ModuleList+ModuleList"),
        (PairList, "layers", "ModuleList"),
    ],
)
def test_blocks_the_parent_unpacks_are_one_stack_of_layers(
    build: type[nn.Module], stack: str, block_type: str
) -> None:
    torch.manual_seed(0)
    model, x = build(), _tokens()
    m = _discover(model, x)
    assert _stacks(m) == {stack: (DEPTH, "pre-ln", 2 * DEPTH)}
    assert m.stack(stack).block_type == block_type
    assert [a.block for a in m.adds_in(stack)] == [0, 0, 1, 1, 2, 2]
    roles = {n.path: n.role for n in m.norms}
    assert roles.pop("final_norm" if build is SublayerList else "norm") == "final"
    assert set(roles.values()) == {"pre"}
    assert not m.doubts
    stds = _gpt2_stds(model, m, x)
    assert len(stds) == 2 * DEPTH
    for w, std in stds.items():
        assert std == pytest.approx(GPT2_STD / math.sqrt(2 * DEPTH), rel=0.05), w


class ParallelPairs(nn.Module):
    """No container per layer and no entry called: the parent zips two lists of
    ``ModuleList([norm, sublayer])``, ``attns`` and ``ffs``."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__()
        self.attns = nn.ModuleList(
            nn.ModuleList([nn.LayerNorm(width), SelfAttention(width)]) for _ in range(depth)
        )
        self.ffs = nn.ModuleList(
            nn.ModuleList([nn.LayerNorm(width), FeedForward(width)]) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for (attn_norm, attn), (ff_norm, ff) in zip(self.attns, self.ffs, strict=True):
            x = x + attn(attn_norm(x))
            x = x + ff(ff_norm(x))
        out: torch.Tensor = self.norm(x)
        return out


def test_lists_zipped_by_the_parent_make_one_stack_of_their_pairs() -> None:
    torch.manual_seed(0)
    model, x = ParallelPairs(), _tokens()
    m = _discover(model, x)
    assert _stacks(m) == {"": (DEPTH, "pre-ln", 2 * DEPTH)}
    stack = m.stack("")
    assert stack.blocks == ("attns.0", "attns.1", "attns.2")
    assert stack.members == tuple((f"attns.{i}", f"ffs.{i}") for i in range(DEPTH))
    assert [a.block for a in m.residual_adds] == [0, 0, 1, 1, 2, 2]
    assert m.norm("norm").role == "final"
    assert not m.doubts
    for w, std in _gpt2_stds(model, m, x).items():
        assert std == pytest.approx(GPT2_STD / math.sqrt(2 * DEPTH), rel=0.05), w


def test_lists_of_called_blocks_zipped_by_the_parent_stay_a_stack_each() -> None:
    # each list's blocks run chained along the stream: two stacks of N, as ResidualStack's lns/lins
    torch.manual_seed(0)
    model, x = ParallelLists(), _tokens()
    m = _discover(model, x)
    assert _stacks(m) == {"attns": (DEPTH, "pre-ln", DEPTH), "ffs": (DEPTH, "pre-ln", DEPTH)}
    assert m.norm("norm").role == "final"
    assert not m.doubts
    for w, std in _gpt2_stds(model, m, x).items():
        assert std == pytest.approx(GPT2_STD / math.sqrt(2 * DEPTH), rel=0.05), w


def test_xlm_lists_zipped_by_its_forward_are_a_stack_each_with_the_models_n() -> None:
    """transformers' XLM keeps its layers' attentions, norms and feed-forwards in four lists
    that its forward zips: a stack per list (the known gap of lists zipped by the parent),
    each of the model's N, so GPT-2's init still scales the writers by 1/sqrt(2N)."""
    from transformers import XLMConfig, XLMModel

    torch.manual_seed(0)
    config = XLMConfig(
        vocab_size=64,
        emb_dim=WIDTH,
        n_layers=DEPTH,
        n_heads=4,
        max_position_embeddings=32,
        use_lang_emb=False,
        n_langs=1,
    )
    model, ids = XLMModel(config), torch.randint(0, 64, (2, 16))
    m = _discover(model, ids)
    assert _stacks(m) == {
        "attentions": (DEPTH, "post-ln", DEPTH),
        "layer_norm1": (DEPTH, "post-ln", 0),
        "ffns": (DEPTH, "post-ln", DEPTH),
        "layer_norm2": (DEPTH, "post-ln", 0),
    }
    stds = _gpt2_stds(model, m, ids)
    writers = {f"attentions.{i}.out_lin" for i in range(DEPTH)}
    assert set(stds) == writers | {f"ffns.{i}.lin2" for i in range(DEPTH)}
    for w, std in stds.items():
        assert std == pytest.approx(GPT2_STD / math.sqrt(2 * DEPTH), rel=0.05), w


def test_a_list_of_a_sublayers_pre_and_post_norm_is_no_stack() -> None:
    torch.manual_seed(0)
    model, x = Sandwich(), _tokens()
    m = _discover(model, x)
    assert _stacks(m) == {"blocks": (DEPTH, "sandwich", 2 * DEPTH)}
    roles = {n.path: n.role for n in m.norms}
    assert roles["blocks.1.attn_norms.0"] == "pre"
    assert roles["blocks.1.attn_norms.1"] == "sandwich-post"
    assert roles["norm"] == "final"
    assert not m.doubts


def test_mbconv_window_and_grid_attention_are_sublayers_of_one_block() -> None:
    torch.manual_seed(0)
    model, x = MaxVitLike(), _tokens()
    m = _discover(model, x)
    # per layer: the conv block's add, then attention and feed-forward of each partition layer
    assert _stacks(m) == {"blocks": (DEPTH, "pre-ln", 5 * DEPTH)}
    assert [a.block for a in m.residual_adds] == [i for i in range(DEPTH) for _ in range(5)]
    assert m.norm("norm").role == "final"
    assert not m.doubts
    stds = _gpt2_stds(model, m, x)
    assert len(stds) == 5 * DEPTH
    for w, std in stds.items():
        assert std == pytest.approx(GPT2_STD / math.sqrt(2 * DEPTH), rel=0.05), w


def _torchvision_maxvit(layers: list[int]) -> nn.Module:
    from torchvision.models.maxvit import MaxVit  # type: ignore[import-untyped]

    torch.manual_seed(0)
    model: nn.Module = MaxVit(
        input_size=(64, 64),
        stem_channels=8,
        partition_size=2,
        block_channels=[16, 32],
        block_layers=layers,
        head_dim=8,
        stochastic_depth_prob=0.0,
        num_classes=10,
    )
    return model.eval()


def test_torchvision_maxvit_stacks_its_layers_not_their_sublayers() -> None:
    # torchvision/models/maxvit.py: MaxVit.blocks holds a MaxVitBlock per stage, whose
    # `layers` holds MaxVitLayers; a MaxVitLayer's `layers` is Sequential(MBConv,
    # PartitionAttentionLayer (window), PartitionAttentionLayer (grid)): 1 + 2 + 2 adds
    model = _torchvision_maxvit([2, 2])
    m = _discover(model, torch.randn(1, 3, 64, 64))
    assert _stacks(m) == {
        "blocks": (2, "pre-ln", 0),
        "blocks.0.layers": (2, "pre-ln", 10),
        "blocks.1.layers": (2, "pre-ln", 10),
    }
    assert not m.doubts
    # a stage of one layer: its sublayers are no stack; its adds are the stage's, so their N
    # would be the number of stages: a doubt, which n_layers= answers
    model = _torchvision_maxvit([1, 2])
    m = _discover(model, torch.randn(1, 3, 64, 64))
    assert _stacks(m) == {"blocks": (2, "pre-ln", 5), "blocks.1.layers": (2, "pre-ln", 10)}
    assert [(d.kind, d.path) for d in m.doubts] == [("nested-stacks", "blocks")]
    with pytest.raises(ValueError, match="nested-stacks"):
        _gpt2_stds(model, m, torch.randn(1, 3, 64, 64))
    stds = _gpt2_stds(model, m, torch.randn(1, 3, 64, 64), n_layers=2)
    for a in m.adds_in("blocks.1.layers"):
        for w in a.writers:
            if model.get_submodule(w).weight.numel() >= 1024:
                assert stds[w] == pytest.approx(GPT2_STD / math.sqrt(2 * 2), rel=0.05), w


@pytest.mark.slow
def test_torchvision_maxvit_t() -> None:
    from torchvision.models import maxvit_t  # type: ignore[import-untyped]

    torch.manual_seed(0)
    m = _discover(maxvit_t().eval(), torch.randn(1, 3, 224, 224))
    depths = (2, 2, 5, 2)  # maxvit_t's block_layers
    assert _stacks(m) == {
        "blocks": (4, "pre-ln", 0),
        **{f"blocks.{i}.layers": (d, "pre-ln", 5 * d) for i, d in enumerate(depths)},
    }
    assert not m.doubts


@pytest.mark.slow
def test_timm_maxvit_stacks_its_blocks_not_window_and_grid_attention() -> None:
    # timm/models/maxxvit.py: MaxxVitBlock holds conv (MbConvBlock), attn_block and attn_grid
    # (PartitionAttentionCl, attention and MLP adds each) as attributes
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, MaxxVitTransformerCfg

    for depths in ((2, 2), (1, 2)):
        torch.manual_seed(0)
        cfg = MaxxVitCfg(
            embed_dim=(16, 32),
            depths=depths,
            block_type=("M", "M"),
            stem_width=16,
            transformer_cfg=MaxxVitTransformerCfg(dim_head=8),
        )
        model = MaxxVit(cfg, img_size=64, num_classes=10).eval()
        m = _discover(model, torch.randn(1, 3, 64, 64))
        expected = {"stages": 2, "stages.1.blocks": 2}
        if depths[0] == 2:
            expected["stages.0.blocks"] = 2
        assert {s.path: s.depth for s in m.stacks} == expected
        assert len(m.adds_in("stages.1.blocks")) == 10
        # a stage of one block makes its adds in `stages`, beside a stage holding a stack
        one_block = [("nested-stacks", "stages")] if depths[0] == 1 else []
        assert [(d.kind, d.path) for d in m.doubts] == one_block


def test_vit_pytorch_vit() -> None:
    vit_pytorch = pytest.importorskip("vit_pytorch")
    torch.manual_seed(0)
    model = vit_pytorch.ViT(
        image_size=32, patch_size=8, num_classes=10, dim=WIDTH, depth=DEPTH, heads=2, mlp_dim=128
    ).eval()
    x = torch.randn(2, 3, 32, 32)
    m = _discover(model, x)
    # vit_pytorch/vit.py: Transformer.layers = ModuleList([ModuleList([Attention, FeedForward])])
    # with `for attn, ff in self.layers: x = attn(x) + x; x = ff(x) + x`, then self.norm
    assert _stacks(m) == {"transformer.layers": (DEPTH, "pre-ln", 2 * DEPTH)}
    assert m.norm("transformer.norm").role == "final"
    assert not m.doubts
    for w, std in _gpt2_stds(model, m, x).items():
        assert std == pytest.approx(GPT2_STD / math.sqrt(2 * DEPTH), rel=0.05), w


@pytest.mark.parametrize("sandwich", [False, True])
def test_x_transformers_decoder(sandwich: bool) -> None:
    x_transformers = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = x_transformers.TransformerWrapper(
        num_tokens=100,
        max_seq_len=16,
        attn_layers=x_transformers.Decoder(dim=WIDTH, depth=DEPTH, heads=2, sandwich_norm=sandwich),
    ).eval()
    ids = torch.randint(0, 100, (2, 16))
    m = _discover(model, ids)
    # x_transformers.py: AttentionLayers.layers holds ModuleList([norms, block, Residual]) per
    # sublayer, attention and feed-forward alternating; `final_norm` after the loop
    placement = "sandwich" if sandwich else "pre-ln"
    assert _stacks(m) == {"attn_layers.layers": (DEPTH, placement, 2 * DEPTH)}
    stack = m.stack("attn_layers.layers")
    assert stack.members[1] == ("attn_layers.layers.2", "attn_layers.layers.3")
    assert m.norm("attn_layers.final_norm").role == "final"
    assert not m.doubts
    for w, std in _gpt2_stds(model, m, ids).items():
        assert std == pytest.approx(GPT2_STD / math.sqrt(2 * DEPTH), rel=0.05), w


def test_a_block_of_several_entries_is_probed_as_one(tmp_path: Path) -> None:
    # block b of SublayerList is layers.{2b} (attention) and layers.{2b+1} (feed-forward): its
    # gradient norm covers the parameters of both, and the stream is read after the second
    torch.manual_seed(0)
    model, x = SublayerList(), _tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = ["grad_norm", "resid_rms"]
    with normprobe.attach(model, opt, log_dir=str(tmp_path), metrics=metrics) as probe:
        model(x).pow(2).mean().backward()
        grads = [
            torch.cat(
                [p.grad.flatten() for e in (2 * b, 2 * b + 1) for p in model.layers[e].parameters()]
            )
            for b in range(DEPTH)
        ]
        opt.step()
    assert probe.latest is not None
    scalars = probe.latest.scalars
    for b in range(DEPTH):
        got = scalars[tags.format("grad_norm", "layers", b, depth=DEPTH)]
        assert got == pytest.approx(float(grads[b].norm()), rel=1e-5)
        assert tags.format("resid_rms", "layers", b, depth=DEPTH) in scalars
    assert tags.format("grad_norm", "layers", DEPTH, depth=DEPTH) not in scalars


# doubts ---------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc(self.norm(x))
        return out


class ExtraAdd(nn.Module):
    """A stack of blocks, then one more residual add the root makes itself."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(DEPTH)))
        self.extra = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(x)
        out: torch.Tensor = x + self.extra(x)
        return out


class Unrolled(nn.Module):
    """Four residual adds by four attributes of the root: no container, no repeating block."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)
        self.fc3, self.fc4 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in (self.fc1, self.fc2, self.fc3, self.fc4):
            x = x + fc(x)
        return x


class Grouped(nn.Module):
    """Blocks grouped in pairs, the groups chained with nothing between them: the stream's N
    is 6 blocks, the groups' stack says 3 and each group's stack 2."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.groups = nn.Sequential(
            *(nn.Sequential(Block(width), Block(width)) for _ in range(DEPTH))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.groups(x)
        return out


class Stage(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width), Block(width)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class GroupedStages(nn.Module):
    """`Grouped` with the groups called from the parent's loop over a ModuleList."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.groups = nn.ModuleList(Stage(width) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.groups:
            x = stage(x)
        return x


def test_an_add_outside_the_stack_is_a_doubt() -> None:
    m = _discover(ExtraAdd(), _tokens())
    assert _stacks(m) == {"blocks": (DEPTH, "pre-ln", DEPTH)}
    (doubt,) = m.doubts
    assert doubt.kind == "add-outside-stack" and doubt.path == ""
    assert doubt.affects == ("reinit", "insert_branch_scale", "metrics")
    assert "extra" in doubt.modules
    assert "belong to no stack" in str(m)


def test_four_adds_and_no_stack_is_a_doubt() -> None:
    m = _discover(Unrolled(), _tokens())
    assert not m.stacks and len(m.residual_adds) == 4
    (doubt,) = m.doubts
    assert doubt.kind == "no-stack"
    assert doubt.affects == ("reinit", "insert_branch_scale", "metrics")
    assert {"fc1", "fc4"} <= set(doubt.modules)


@pytest.mark.parametrize("build", [Grouped, GroupedStages])
def test_stacks_nested_along_one_run_are_a_doubt(build: type[nn.Module]) -> None:
    m = _discover(build(), _tokens())
    inner = "groups.{}" if build is Grouped else "groups.{}.blocks"
    assert {s.path: s.depth for s in m.stacks} == {
        "groups": DEPTH,
        **{inner.format(i): 2 for i in range(DEPTH)},
    }
    (doubt,) = m.doubts
    assert doubt.kind == "nested-stacks" and doubt.path == "groups"
    assert doubt.affects == ("reinit", "insert_branch_scale")


def test_stages_apart_on_the_stream_are_no_nested_doubt() -> None:
    # ConvNeXt's stages hold stacks of blocks, and a downsampling layer stands between them
    import zoo

    z = zoo.build("convnext_atto")
    m = _discover(z.model, *z.args)
    assert m.stack("stages.0.blocks").parent == "stages"
    assert not m.doubts
