"""Stacks are runs of residual adds along one stream: blocks of one class whose adds stand on
separate streams, a list of bare layers with no add between them, and blocks taken from two
lists are no stack; a block that ran none of its layers (per-sample layer dropout) makes
discovery trace again in eval mode.

Each model is a small pure-torch copy of the structure of the library named in its docstring;
every expected number is counted from the model's code.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import normprobe
from normprobe import ModelMap

WIDTH = 16


def _discover(model: nn.Module, *args: torch.Tensor) -> ModelMap:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        return normprobe.discover(model, *args)


def _stacks(m: ModelMap) -> dict[str, tuple[str, ...]]:
    return {s.path: s.blocks for s in m.stacks}


# --- blocks of one class on separate streams ---------------------------------------------------


class Bottleneck(nn.Module):
    """ultralytics/nn/modules/block.py `Bottleneck` (shortcut=True): ``x + cv2(cv1(x))``."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.cv1 = nn.Conv2d(c, c, 3, padding=1)
        self.cv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.cv2(F.silu(self.cv1(x)))


class C2f(nn.Module):
    """ultralytics `C2f` (the base of `C3k2`): cv1, a ModuleList ``m`` of Bottlenecks each
    reading the previous one's output, then cv2 over the concatenation of every output."""

    def __init__(self, c1: int, c2: int, n: int = 1) -> None:
        super().__init__()
        self.cv1 = nn.Conv2d(c1, 2 * c2, 1)
        self.m = nn.ModuleList(Bottleneck(c2) for _ in range(n))
        self.cv2 = nn.Conv2d((2 + n) * c2, c2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(m(y[-1]) for m in self.m)
        out: torch.Tensor = self.cv2(torch.cat(y, 1))
        return out


def test_blocks_whose_adds_stand_on_separate_streams_are_no_stack() -> None:
    # YOLO11's neck (ultralytics/cfg/models/11/yolo11.yaml, model[13..16]): two C3k2 modules
    # of one class joined only by parameter-free modules; each adds inside its Bottleneck, and
    # the first one's cv2 and the second one's cv1 stand between the two adds: 2 adds, 2
    # streams, no stack (the run [1..3] was taken for one, even across a change of width)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), C2f(8, 8), nn.Upsample(scale_factor=2))
    model.append(C2f(8, 16))
    m = _discover(model, torch.randn(2, 3, 8, 8))
    assert [a.module for a in m.residual_adds] == ["1.m.0", "3.m.0"]
    assert _stacks(m) == {}
    assert all(a.stack is None for a in m.residual_adds)


def test_bottlenecks_along_one_stream_stay_a_stack() -> None:
    # YOLOv8's C2f with n=2 (ultralytics/nn/modules/block.py): m.1 reads m.0's sum, a stack of 2
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), C2f(8, 8, n=2), nn.Conv2d(8, 4, 1))
    m = _discover(model, torch.randn(2, 3, 8, 8))
    assert _stacks(m) == {"1.m": ("1.m.0", "1.m.1")}
    assert [(a.stack, a.block) for a in m.residual_adds] == [("1.m", 0), ("1.m", 1)]


class Block(nn.Module):
    """``x + fc2(gelu(fc1(ln(x))))``, with a projection shortcut where the width changes."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(c_in)
        self.fc1, self.fc2 = nn.Linear(c_in, 2 * c_in), nn.Linear(2 * c_in, c_out)
        self.proj = nn.Linear(c_in, c_out) if c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.proj is None else self.proj(x)
        out: torch.Tensor = skip + self.fc2(F.gelu(self.fc1(self.ln(x))))
        return out


def test_a_flat_list_of_blocks_with_projections_at_its_stages_stays_a_stack() -> None:
    # timm's DPN (dpn.py): `features` holds the stem, 16 DualPathBlocks, then a norm; the first
    # block of each stage makes a projection shortcut, starting a new run of adds. Here: a stem,
    # blocks 16->16, 16->16, 16->32 (projection), 32->32, a head. Two steps of the four go along
    # the stream (1->2 and 3->4): the 4 blocks stay one stack.
    model = nn.Sequential(
        nn.Linear(4, WIDTH),
        Block(WIDTH, WIDTH),
        Block(WIDTH, WIDTH),
        Block(WIDTH, 2 * WIDTH),
        Block(2 * WIDTH, 2 * WIDTH),
        nn.LayerNorm(2 * WIDTH),
    )
    m = _discover(model, torch.randn(2, 4))
    assert _stacks(m) == {"[1..4]": ("1", "2", "3", "4")}
    assert [a.kind for a in m.residual_adds] == ["identity", "identity", "projection", "identity"]


# --- a list of bare layers -----------------------------------------------------------------------


class MLP(nn.Module):
    """DETR's box head (detr/models/detr.py `MLP`, ultralytics' RT-DETR `enc_bbox_head`): a
    ModuleList of Linears, ReLU between them."""

    def __init__(self, n: int, residual: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(n))
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            if self.residual:
                x = x + layer(x)
            else:
                x = F.relu(layer(x)) if k < len(self.layers) - 1 else layer(x)
        return x


def test_a_list_of_bare_layers_without_adds_is_one_mlp_not_a_stack() -> None:
    # 3 Linears, no residual add: one MLP (it was the 3-block 'no-residual' stack `box.layers`,
    # and its zero-initialized last layer set off an 'update too large' flag)
    model = nn.Sequential(nn.Linear(4, WIDTH), nn.LayerNorm(WIDTH), nn.GELU(), MLP(3))
    m = _discover(model, torch.randn(8, 4))
    assert not m.residual_adds
    assert _stacks(m) == {}


def test_a_list_of_bare_layers_the_parent_adds_around_stays_a_stack() -> None:
    model = nn.Sequential(nn.Linear(4, WIDTH), MLP(3, residual=True))
    m = _discover(model, torch.randn(8, 4))
    assert _stacks(m) == {"1.layers": ("1.layers.0", "1.layers.1", "1.layers.2")}
    assert [a.block for a in m.residual_adds] == [0, 1, 2]


# --- blocks of two lists ---------------------------------------------------------------------


class GRN(nn.Module):
    """neuralforecast/models/tft.py `GRN`: ``layer_norm(skip + glu(lin_c(elu(lin_a(x)))))``,
    the skip a Linear where the widths differ."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.lin_a = nn.Linear(c_in, WIDTH)
        self.lin_c = nn.Linear(WIDTH, WIDTH)
        self.glu = nn.Linear(WIDTH, 2 * c_out)
        self.out_proj = nn.Linear(c_in, c_out) if c_in != c_out else None
        self.layer_norm = nn.LayerNorm(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.out_proj is None else self.out_proj(x)
        out: torch.Tensor = self.layer_norm(
            skip + F.glu(self.glu(self.lin_c(F.elu(self.lin_a(x)))))
        )
        return out


class StaticEncoder(nn.Module):
    """TFT's `StaticCovariateEncoder` with one static variable (tft.py): the variable selection
    network's `joint_grn` weighs the `var_grns` outputs, and 4 `context_grns` each read the
    weighed sum."""

    def __init__(self) -> None:
        super().__init__()
        self.joint_grn = GRN(WIDTH, 1)
        self.var_grns = nn.ModuleList([GRN(WIDTH, WIDTH)])
        self.context_grns = nn.ModuleList(GRN(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = torch.softmax(self.joint_grn(x), dim=-1)  # one variable: weight 1
        embedded = torch.stack([grn(x) for grn in self.var_grns], dim=-1)
        ctx = (embedded @ weights.unsqueeze(-1)).squeeze(-1)
        return tuple(grn(ctx) for grn in self.context_grns)


def test_blocks_taken_from_two_lists_are_no_stack() -> None:
    # 6 adds: joint_grn (projection), var_grns.0, context_grns.0..3; the run of adds goes from
    # var_grns.0 into context_grns.0 (the first of the four reading its sum), which was made the
    # stack `<root>` of those two blocks, one of each list. context_grns' four read one input.
    m = _discover(StaticEncoder(), torch.randn(4, WIDTH))
    modules = ["joint_grn", "var_grns.0", *(f"context_grns.{i}" for i in range(4))]
    assert [a.module for a in m.residual_adds] == modules
    assert _stacks(m) == {}


# --- per-sample layer dropout ------------------------------------------------------------------


class RowDropout(nn.Module):
    """torchtune/modules/layer_dropout.py `ModuleLayerDropoutWrapper` + `LayerDropout`: in
    training, run ``module`` on the batch rows kept (here fixed, ``keep``) and pass the others
    through; every row in eval mode."""

    def __init__(self, module: nn.Module, keep: list[int]) -> None:
        super().__init__()
        self.module = module
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            out: torch.Tensor = self.module(x)
            return out
        rows = torch.tensor(self.keep, dtype=torch.long)
        out = x.clone()
        if rows.numel():
            out[rows] = self.module(x[rows])
        return out


class PreLNLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sa_norm, self.attn = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp_norm, self.mlp = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.sa_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class DroppedLayers(nn.Module):
    def __init__(self, keep: list[list[int]]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(RowDropout(PreLNLayer(), k) for k in keep)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.norm(x)
        return out


def test_a_block_that_ran_none_of_its_layers_makes_discovery_trace_in_eval_mode() -> None:
    # the last block keeps no row of 4 (torchtune's adds per block were [2, 2, 2, 0]), or no
    # block keeps any (0 adds, a 'no-residual' stack): traced again in eval mode, 4 blocks
    # make 2 adds each, 8 in all, Pre-LN; the model stays in training mode
    for keep in ([[0, 1], [1], [0, 1, 2], []], [[], [], [], []]):
        model = DroppedLayers(keep).train()
        m = _discover(model, torch.randn(4, 3, WIDTH))
        assert [(s.path, s.depth, s.placement) for s in m.stacks] == [("layers", 4, "pre-ln")]
        assert [a.block for a in m.residual_adds] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert model.training and all(layer.training for layer in model.layers)
