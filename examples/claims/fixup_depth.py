"""Claim: Fixup trains a deep residual net without normalization (Zhang et al. 2019).

    python examples/claims/fixup_depth.py [--quick] [--seeds 3] [--out claims_out]

A residual MLP language model (the last 8 characters, each embedded in 12 dims, a Linear stem
to width 64, then ``depth`` ResNet basic blocks ``relu(x + bn2(fc2(relu(bn1(fc1(x))))))`` with
Linear layers, then the readout over the 97 characters), He-initialized
(``normprobe.reinit(model, "kaiming")``, as ResNets are), trains on the built-in corpus with
AdamW (lr 1e-3) at depths 8, 32 and 128, in three variants:

* BatchNorm: the model as built;
* no norm: its BatchNorms removed by ``normprobe.convert_norms(model, "identity")``;
* no norm + Fixup: the same, then ``normprobe.reinit(model, "fixup", example_inputs=...)``
  (each branch's last layer and the readout at 0, the first layer of a branch He x L^(-1/2),
  scalar biases and a multiplier around the branch layers).

Measured per run: the loss of the first step, the final loss (mean of the last 20 steps), and,
read by the probe (``metrics=["resid_rms"]``) at step 0, the residual stream's growth over the
stack at init (RMS after the last block / after the first). A run fails when its loss became
non-finite, or its final loss is above its first step's (diverged), or not below the corpus's
unigram entropy (3.10 nats: the loss of predicting character frequencies alone, which a net
whose ReLU stream died still reaches through the readout's bias).

Decision rule, fixed before measuring:
* reproduced: Fixup fails in no seed at any depth; at the deepest depth its mean final loss is
  at most 10% above BatchNorm's; and there the norm-free net without Fixup fails in some seed,
  or ends worse than Fixup by more than both spreads (so removing the norm breaks training, and
  Fixup is what repairs it);
* contradicted: Fixup fails (any seed) at a depth where BatchNorm fails in none;
* not reproduced at this scale: anything else (the plain norm-free net trains as well as Fixup
  at the deepest depth, so this depth needs no fix; or Fixup fails where BatchNorm fails too;
  or Fixup trains, but ends more than 10% above BatchNorm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import _claims
import torch
import torch.nn.functional as F
from torch import nn

import normprobe
from normprobe import plots
from normprobe.corpus import CharCorpus

WIDTH = 64
WINDOW, EMBED = 8, 12  # characters read, dims per character
BATCH, CONTEXT = 8, 16  # 128 predicted characters a step
LR = 1e-3  # AdamW, the claims' default optimizer
LAST = 20  # the final loss of a run: mean over its last steps
TOLERANCE = 0.10  # Fixup's deepest final loss may exceed BatchNorm's by this fraction
VARIANTS = ("BatchNorm", "no norm", "no norm + Fixup")
VOCAB = CharCorpus().vocab_size


UNIGRAM = _claims.unigram_entropy()


@dataclass(frozen=True)
class Sweep:
    depths: tuple[int, ...]
    steps: int


FULL = Sweep(depths=(8, 32, 128), steps=200)
QUICK = Sweep(depths=(2, 8), steps=LAST)

CLAIM = _claims.Claim(
    key="fixup_depth",
    statement="Fixup trains a deep residual net without normalization",
    source="Zhang et al. 2019, Fixup Initialization (ICLR)",
    setting=f"residual MLP char LM, width {WIDTH}, {FULL.depths} basic blocks of 2 Linear "
    f"layers, He init; BatchNorm vs BatchNorm removed (convert_norms 'identity') without and "
    f"with reinit 'fixup'; AdamW lr {LR:g}, {FULL.steps} steps of {BATCH}x{CONTEXT} "
    f"chars; final loss = mean of the last {LAST} steps; fails = diverged or not below the "
    f"unigram entropy {UNIGRAM:.2f}",
)


class Block(nn.Module):
    """ResNet's basic block with Linear layers: ``relu(x + bn2(fc2(relu(bn1(fc1(x))))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.bn1 = nn.BatchNorm1d(width)
        self.fc2 = nn.Linear(width, width)
        self.bn2 = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.fc2(F.relu(self.bn1(self.fc1(x))))))


class ResidualMLP(nn.Module):
    """Predicts each character from the ``WINDOW`` before it (zero-padded at the start); the
    blocks see one row per character, so BatchNorm normalizes over the batch's characters."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.stem = nn.Linear(WINDOW * EMBED, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(depth))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, time = ids.shape
        chars = F.pad(self.embed(ids), (0, 0, WINDOW - 1, 0))
        windows = chars.unfold(1, WINDOW, 1).flatten(2).flatten(0, 1)  # (batch*time, inputs)
        x = F.relu(self.stem(windows))
        for block in self.blocks:
            x = block(x)
        return self.head(x).view(batch, time, -1)


def build(variant: str, depth: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = ResidualMLP(depth)
    example = (torch.zeros(2, CONTEXT, dtype=torch.long),)
    normprobe.reinit(model, "kaiming", example_inputs=example)
    if variant != "BatchNorm":
        model = normprobe.convert_norms(model, "identity")
    if variant == "no norm + Fixup":
        normprobe.reinit(model, "fixup", example_inputs=example)
    return model


@dataclass
class Run:
    """One training run, as measured."""

    losses: list[float]
    first: float
    final: float  # NaN when the loss became non-finite
    growth: float  # residual stream RMS, last block / first, at init

    @property
    def diverged(self) -> bool:
        return not math.isfinite(self.final) or self.final > self.first

    @property
    def failed(self) -> bool:
        """Diverged, or learned no more than the characters' frequencies."""
        return self.diverged or self.final >= UNIGRAM


def train(variant: str, depth: int, seed: int, steps: int) -> Run:
    trained = _claims.train_char_lm(
        build(variant, depth, seed),
        steps=steps,
        lr=LR,
        seed=seed,
        batch=BATCH,
        context=CONTEXT,
        probe_every=steps,
        metrics=["resid_rms"],
    )
    growth = trained.series("normprobe/resid_growth/blocks")
    return Run(
        trained.losses,
        trained.losses[0],
        trained.final_loss(LAST),
        growth[0][1] if growth else math.nan,
    )


def growth_text(values: list[float]) -> str:
    """``mean ± spread``, or how many seeds' streams overflowed (a non-finite RMS)."""
    overflowed = sum(not math.isfinite(v) for v in values)
    if overflowed:
        return f"overflow in {overflowed}/{len(values)}"
    return _claims.fmt(values, 3)


def verdict(sweep: Sweep, runs: dict[tuple[str, int], list[Run]]) -> tuple[_claims.Verdict, str]:
    """The decision rule of the module docstring."""
    deepest = sweep.depths[-1]

    def failed(variant: str, depth: int) -> int:
        return sum(r.failed for r in runs[variant, depth])

    def finals(variant: str) -> list[float]:
        return [r.final for r in runs[variant, deepest]]

    n = len(runs["BatchNorm", deepest])
    broken = [d for d in sweep.depths if failed("no norm + Fixup", d)]
    worse_than_bn = [d for d in broken if not failed("BatchNorm", d)]
    if worse_than_bn:
        depth = worse_than_bn[0]
        return "contradicted", (
            f"with Fixup {failed('no norm + Fixup', depth)}/{n} seeds fail at depth {depth}, "
            "where BatchNorm trains in every seed"
        )
    bn, fixup = (_claims.mean_spread(finals(v))[0] for v in ("BatchNorm", "no norm + Fixup"))
    plain = failed("no norm", deepest)
    plain_worse = plain > 0 or (
        _claims.apart(finals("no norm"), finals("no norm + Fixup"))
        and _claims.mean_spread(finals("no norm"))[0] > fixup
    )
    summary = (
        f"at depth {deepest}, without BatchNorm {plain}/{n} seeds fail; with Fixup "
        f"{failed('no norm + Fixup', deepest)}/{n} fail, final loss {fixup:.3f} against "
        f"BatchNorm's {bn:.3f} ({fixup / bn - 1:+.1%}; BatchNorm {failed('BatchNorm', deepest)}"
        f"/{n} fail)"
    )
    if broken:
        return "not reproduced at this scale", (
            summary + f"; but Fixup fails at depth(s) {broken}, where BatchNorm does too"
        )
    if not plain_worse:
        return "not reproduced at this scale", (
            summary + "; the plain norm-free net trains as well: this depth needs no fix"
        )
    if fixup > bn * (1 + TOLERANCE):
        return "not reproduced at this scale", (
            summary + f"; Fixup trains, but ends more than {TOLERANCE:.0%} above BatchNorm"
        )
    return "reproduced", summary + f"; Fixup trains at every depth {list(sweep.depths)}"


def main() -> None:
    args = _claims.options(CLAIM).parse_args()
    _claims.torch_threads()
    sweep = QUICK if args.quick else FULL
    runs = {
        (v, d): [train(v, d, seed, sweep.steps) for seed in range(args.seeds)]
        for d in sweep.depths
        for v in VARIANTS
    }
    header = [
        "depth",
        "variant",
        "first-step loss",
        "final loss",
        "diverged",
        f"failed (diverged or >= {UNIGRAM:.2f})",
        "resid growth at init",
    ]
    rows = [
        [
            str(d),
            v,
            _claims.fmt([r.first for r in runs[v, d]], 3),
            _claims.fmt([r.final for r in runs[v, d]]),
            f"{sum(r.diverged for r in runs[v, d])}/{args.seeds}",
            f"{sum(r.failed for r in runs[v, d])}/{args.seeds}",
            growth_text([r.growth for r in runs[v, d]]),
        ]
        for d in sweep.depths
        for v in VARIANTS
    ]
    outcome, why = verdict(sweep, runs)

    grey = plots.PALETTE[7]
    curves = [
        plots.Panel(
            title=f"{d} blocks: training loss",
            lines=[
                *_claims.curve_lines({v: [r.losses for r in runs[v, d]] for v in VARIANTS}),
                plots.Line("unigram entropy", [(0.0, UNIGRAM), (sweep.steps - 1.0, UNIGRAM)], grey),
            ],
            xlabel="step",
            ylabel="loss (mean over seeds)",
        )
        for d in sweep.depths
    ]
    # the plain norm-free net's losses span many decades and would flatten the other two lines
    by_depth = plots.Panel(
        title="final loss against depth, with a norm or Fixup",
        lines=[
            plots.Line(
                v,
                [
                    (float(d), _claims.mean_spread([r.final for r in runs[v, d]])[0])
                    for d in sweep.depths
                ],
                plots.PALETTE[i],
            )
            for i, v in enumerate(VARIANTS)
            if v != "no norm"
        ]
        + [plots.Line("unigram entropy", [(float(d), UNIGRAM) for d in sweep.depths], grey)],
        xlabel="residual blocks",
        ylabel=f"final loss (mean of the last {LAST} steps)",
        xticks=[(float(d), str(d)) for d in sweep.depths],
        xlog=True,
    )
    numbers = {
        "depths": list(sweep.depths),
        "final_loss": {
            v: {str(d): _claims.fmt([r.final for r in runs[v, d]]) for d in sweep.depths}
            for v in VARIANTS
        },
        "diverged": {
            v: {str(d): sum(r.diverged for r in runs[v, d]) for d in sweep.depths} for v in VARIANTS
        },
        "failed": {
            v: {str(d): sum(r.failed for r in runs[v, d]) for d in sweep.depths} for v in VARIANTS
        },
        "unigram_entropy": round(UNIGRAM, 4),
        "resid_growth_at_init": {
            v: {str(d): growth_text([r.growth for r in runs[v, d]]) for d in sweep.depths}
            for v in VARIANTS
        },
    }
    result = _claims.Result(CLAIM, header, rows, outcome, why, numbers, args.quick)
    _claims.finish(result, args.out, [*curves, by_depth])


if __name__ == "__main__":
    main()
