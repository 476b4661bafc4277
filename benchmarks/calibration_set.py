"""The calibration set's runs: 8 healthy trainings and 8 broken one way each, what each
broken run's flag must name, and how a run is trained and judged. ``benchmarks/calibration.py``
trains them all and prints the table; ``tests/diagnose/test_calibration.py`` trains them at `SMALL`.
"""

from __future__ import annotations

import math
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import normprobe
from normprobe.corpus import CharCorpus
from normprobe.metrics.core.base import Flag
from normprobe.models import TinyTransformer
from normprobe.report import RunReport, report

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Size:
    """How big the runs are: the script's `FULL` set, the test's `SMALL` one."""

    steps: int
    width: int
    depth: int
    batch: int
    context: int
    every: int
    image: int  # side of the synthetic images


FULL = Size(steps=300, width=64, depth=6, batch=32, context=64, every=10, image=32)
SMALL = Size(steps=60, width=32, depth=4, batch=16, context=32, every=5, image=16)
LR = 3e-3  # AdamW's learning rate, `make demo`'s
HEADS = 4


@dataclass
class Training:
    """A model, its data and its optimizer's settings; ``at_step`` may change it each step."""

    model: nn.Module
    batch: Callable[[], Batch]
    lr: float = LR
    groups: list[dict[str, Any]] | None = None  # parameter groups (muP), else every parameter
    at_step: Callable[[int], None] | None = None


@dataclass(frozen=True)
class Fault:
    """What a broken run was broken by, the flag made for it, and where it must point.

    Attributes:
        what: the fault, in words.
        kind: the flag that must catch it, as a problem.
        where: texts the flag's stack or message must contain (the block, module, head...).
    """

    what: str
    kind: str
    where: tuple[str, ...] = ()


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Size], Training]
    fault: Fault | None = None  # None: a healthy run
    about: str = ""

    @property
    def healthy(self) -> bool:
        return self.fault is None


# --- data --------------------------------------------------------------------------------------
def _chars(size: Size, batch: int | None = None) -> tuple[int, Callable[[], Batch]]:
    corpus = CharCorpus(context=size.context, seed=0)
    return corpus.vocab_size, lambda: corpus.batch(batch or size.batch)


def images(side: int, batch: int, noise: float = 0.5, seed: int = 0) -> Callable[[], Batch]:
    """Ten classes, each a fixed random picture, seen through noise of std ``noise``."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 3, side, side, generator=g)

    def draw() -> Batch:
        y = torch.randint(0, 10, (batch,), generator=g)
        return templates[y] + noise * torch.randn(batch, 3, side, side, generator=g), y

    return draw


# --- models ------------------------------------------------------------------------------------
def _tiny(size: Size, vocab: int, placement: str = "pre", depth: int | None = None) -> nn.Module:
    return TinyTransformer(
        vocab,
        size.width,
        depth or size.depth,
        HEADS,
        size.context,
        placement=placement,  # type: ignore[arg-type]
    )


def _lm(
    placement: str = "pre", depth: Callable[[Size], int] | None = None
) -> Callable[[Size], Training]:
    def build(size: Size) -> Training:
        vocab, batch = _chars(size)
        return Training(_tiny(size, vocab, placement, depth(size) if depth else None), batch)

    return build


def _rmsnorm(size: Size) -> Training:
    t = _lm()(size)
    t.model = normprobe.convert_norms(t.model, "rmsnorm")
    return t


def _deepnorm(size: Size) -> Training:
    t = _lm("post", lambda s: 2 * s.depth)(size)
    example = (torch.zeros(2, size.context, dtype=torch.long),)
    normprobe.reinit(t.model, "deepnorm", example_inputs=example)
    return t


def _mup(size: Size) -> Training:
    vocab, batch = _chars(size)
    base = size.width
    model = TinyTransformer(vocab, 2 * base, size.depth, HEADS, size.context)
    normprobe.reinit(
        model, "kaiming", example_inputs=(torch.zeros(2, size.context, dtype=torch.long),)
    )
    normprobe.mup(model, base_width=base)
    return Training(model, batch, groups=normprobe.mup_param_groups(model, LR))


def _llama(size: Size) -> Training:
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, batch = _chars(size)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=size.width,
        intermediate_size=2 * size.width,
        num_hidden_layers=size.depth,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        max_position_embeddings=size.context,
    )
    return Training(LlamaForCausalLM(config), batch)


def _gpt2(size: Size) -> Training:
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, batch = _chars(size)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=size.context,
        n_embd=size.width,
        n_layer=size.depth,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return Training(GPT2LMHeadModel(config), batch)


def _vit(size: Size) -> Training:
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(
        img_size=size.image,
        patch_size=4,
        embed_dim=size.width,
        depth=size.depth,
        num_heads=HEADS,
        num_classes=10,
    )
    return Training(model, images(size.image, size.batch), lr=1e-3)


def _resnet(batch: int | None = None) -> Callable[[Size], Training]:
    def build(size: Size) -> Training:
        from torchvision.models.resnet import BasicBlock, ResNet

        model = ResNet(BasicBlock, [2, 2, 2, 2] if size is FULL else [1, 1, 1, 1], num_classes=10)
        return Training(model, images(size.image, batch or size.batch), lr=1e-3)

    return build


# --- faults ------------------------------------------------------------------------------------
def _lr_10x(size: Size) -> Training:
    t = _lm()(size)
    t.lr = 10 * LR
    return t


def _scaled_layer(size: Size) -> Training:
    t = _lm()(size)
    t.model.blocks[2].mlp.register_forward_hook(lambda m, i, out: out * 1e4)  # type: ignore[index]
    return t


class _NaNGrad(torch.autograd.Function):
    """The identity forward, a NaN gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.nan


def _nan_backward(size: Size) -> Training:
    """From the middle of the run on, block 1's MLP makes a NaN in its backward (between its
    two linear layers), from a finite gradient at its output."""
    t = _lm()(size)
    armed = [False]
    onset = (size.steps // 2 // size.every) * size.every  # a logged step

    def pre(m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        return (_NaNGrad.apply(args[0]),) if armed[0] else None

    def at_step(step: int) -> None:
        armed[0] = step >= onset

    t.model.blocks[1].mlp.proj.register_forward_pre_hook(pre)  # type: ignore[index]
    t.at_step = at_step
    return t


def _massive(size: Size) -> Training:
    """Block 2's MLP writes into channel 7 of the stream, at every position, 1000x the median
    |activation| of the stream it reads (the size Sun et al. 2024 find in trained LLMs)."""
    t = _lm()(size)
    block = t.model.blocks[2]  # type: ignore[index]
    scale: list[torch.Tensor] = []

    def read(m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        scale[:] = [1000.0 * args[0].detach().abs().median()]

    def write(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        bump = torch.zeros(out.shape[-1])
        bump[7] = scale[0]
        return out + bump

    block.ln_2.register_forward_pre_hook(read)
    block.mlp.register_forward_hook(write)
    return t


def _sharp_head(size: Size) -> Training:
    """Block 1's head 2 has queries equal to its keys, large: logits |q|^2 / sqrt(d) past 100."""
    t = _lm()(size)
    qkv = t.model.blocks[1].attn.qkv  # type: ignore[index]
    width, d = size.width, size.width // HEADS
    with torch.no_grad():
        rows = torch.randn(d, width) * 2.0
        qkv.weight[2 * d : 3 * d] = rows
        qkv.weight[width + 2 * d : width + 3 * d] = rows
    return t


def _small_write(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    """A branch's output RMS-normalized with a fixed gain of 1e-3 (per position)."""
    return out * (1e-3 / out.detach().pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12))


def _collapse(size: Size) -> Training:
    """A Pre-LN stack 3x as deep whose stream dwarfs its blocks' writes for good: frozen
    embeddings 10x larger, every branch's output normalized with a fixed gain of 1e-3, so
    consecutive blocks' streams stay parallel. (Trained embeddings shrink within a few steps,
    and Adam grows a branch scaled by a constant 1e-3 back within 40: both escape collapse.)"""
    t = _lm("pre", lambda s: 3 * s.depth)(size)
    model = t.model
    for table in (model.tok, model.pos):  # type: ignore[union-attr]
        table.weight.requires_grad_(False).mul_(10)
    for block in model.blocks:  # type: ignore[union-attr]
        block.attn.register_forward_hook(_small_write)
        block.mlp.register_forward_hook(_small_write)
    return t


HEALTHY = [
    Case("pre-ln", _lm(), about="TinyTransformer, Pre-LN (make demo's)"),
    Case("rmsnorm", _rmsnorm, about="the Pre-LN model through convert_norms(..., 'rmsnorm')"),
    Case("hf-llama", _llama, about="transformers' LlamaForCausalLM from a small config"),
    Case("hf-gpt2", _gpt2, about="transformers' GPT2LMHeadModel from a small config"),
    Case("vit", _vit, about="timm VisionTransformer, patch 4, on synthetic images"),
    Case("resnet-bn", _resnet(), about="torchvision ResNet (BasicBlock, BatchNorm)"),
    Case("deepnorm", _deepnorm, about="a Post-LN stack twice as deep, reinit 'deepnorm'"),
    Case("mup", _mup, about="TinyTransformer at 2x width, normprobe.mup + mup_param_groups"),
]
BROKEN = [
    Case(
        "post-ln-deep",
        _lm("post", lambda s: 4 * s.depth),
        Fault("Post-LN 4x as deep, no warmup", "top-heavy gradients", ("blocks",)),
    ),
    Case(
        "lr-10x",
        _lr_10x,
        Fault("the learning rate 10x make demo's", "update too large", ("blocks",)),
    ),
    Case(
        "scaled-layer",
        _scaled_layer,
        Fault("block 2's MLP output scaled by 1e4", "residual jump", ("blocks", "block 2")),
    ),
    Case(
        "nan-backward",
        _nan_backward,
        Fault("a NaN made in block 1's MLP backward", "nan onset in backward", ("blocks.1.mlp",)),
    ),
    Case(
        "massive-activation",
        _massive,
        Fault(
            "block 2's MLP adds 1000x the median to channel 7",
            "massive activations",
            ("block 2", "channel 7"),
        ),
    ),
    Case(
        "sharp-head",
        _sharp_head,
        Fault("block 1's head 2 with q = k, large", "logit blow-up", ("blocks/1.attn", "head 2")),
    ),
    Case(
        "collapse",
        _collapse,
        Fault(
            "deep Pre-LN, frozen 10x embeddings, writes of RMS 1e-3",
            "representation collapse",
            ("blocks",),
        ),
    ),
    Case(
        "bn-batch-2",
        _resnet(batch=2),
        Fault("the ResNet fed batches of 2", "batchnorm drift", ("layer",)),
    ),
]
CASES = HEALTHY + BROKEN


# --- training ----------------------------------------------------------------------------------
def train(case: Case, size: Size, log_dir: str | Path) -> RunReport:
    """Train ``case`` at ``size`` with a probe writing to ``log_dir``, and report the run."""
    torch.manual_seed(0)
    t = case.build(size)
    model = t.model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(t.groups or params, lr=t.lr, weight_decay=0.0)
    shutil.rmtree(log_dir, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN onsets: the flags say it
        with normprobe.attach(model, optimizer=opt, log_dir=str(log_dir), every=size.every) as p:
            for step in range(size.steps):
                if t.at_step is not None:
                    t.at_step(step)
                x, y = t.batch()
                out = model(x)
                out = getattr(out, "logits", out)
                loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
                p.observe_loss(loss)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    return report(log_dir)


@dataclass
class Outcome:
    """A run of the set: its report, and whether its flags are what they must be."""

    case: Case
    report: RunReport
    problems: list[str] = field(default_factory=list)  # the kinds raised as problems

    @property
    def caught(self) -> bool:
        """Healthy: no problem. Broken: its fault's flag raised as a problem, naming where."""
        if self.case.fault is None:
            return not self.problems
        return self.found is not None

    @property
    def found(self) -> Flag | None:
        """The flag made for the fault, raised as a problem and naming where it was put."""
        fault = self.case.fault
        assert fault is not None
        for f in self.report.flags:
            text = f"{f.stack} {f.message}"
            if (
                f.severity == "problem"
                and f.kind == fault.kind
                and all(w in text for w in fault.where)
            ):
                return f
        return None


def run_case(case: Case, size: Size, root: Path, reuse: bool = False) -> Outcome:
    """Train ``case`` into ``root/<name>`` (with ``reuse``, read the run already there)."""
    run = root / case.name
    rep = (
        report(run) if reuse and any(run.glob("events.out.tfevents.*")) else train(case, size, run)
    )
    kinds = sorted({f.kind for f in rep.flags if f.severity == "problem"})
    return Outcome(case, rep, kinds)
