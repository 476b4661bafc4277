"""Claim: muP transfers the learning rate across width (Tensor Programs V, figure 1).

    python examples/claims/mup_lr_transfer.py [--quick] [--seeds 3] [--out claims_out]

An MLP language model (the last 8 characters, each embedded in 12 dims, then two hidden
layers of the given width with ReLU, then the readout over the 97 characters) trains with Adam
on the built-in corpus for a fixed number of steps, at widths 64 to 512 and learning rates
2^-12 to 2^-4 (one grid step: a factor of 2), under two parametrizations:

* SP: PyTorch's default init and one learning rate for every parameter;
* muP: the same model through ``normprobe.mup(model, base_model=<the model at width 64>)``,
  trained with ``normprobe.mup_param_groups``. At width 64 the two are the same model.

The loss of a run is the mean training loss over its last 20 steps; a (width, lr) point is the
mean over seeds. The best learning rate of a width is the grid point with the lowest mean loss
(a point where any seed diverged cannot be best).

Decision rule, fixed before measuring: with the shift of a width as its best lr's distance from
the narrowest width's best, in grid steps,
* reproduced: SP's best lr at the widest width is 2 or more steps from the narrowest's, and
  muP's best lr is within one step of the narrowest's at every width;
* contradicted: muP's best lr moves 2 or more steps at some width, and at least as far as SP's;
* not reproduced at this scale: anything else (SP's best lr does not move 2 steps over this
  range of widths, so there is nothing to transfer; or a best lr on the grid's edge, where the
  optimum may lie outside it; or muP moving, but less than SP).
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

BASE_WIDTH = 64
WINDOW, EMBED = 8, 12  # characters read, dims per character (96 inputs: not a width multiple)
BATCH, CONTEXT = 8, 16  # 128 predicted characters a step
LAST = 20  # the loss of a run: mean over its last steps
PARAMETRIZATIONS = ("SP", "muP")
VOCAB = CharCorpus().vocab_size


@dataclass(frozen=True)
class Sweep:
    widths: tuple[int, ...]
    log2_lrs: tuple[int, ...]  # learning rates 2**k
    steps: int


FULL = Sweep(widths=(64, 128, 256, 512), log2_lrs=tuple(range(-12, -3)), steps=200)
QUICK = Sweep(widths=(64, 128), log2_lrs=(-8, -7, -6), steps=10)

CLAIM = _claims.Claim(
    key="mup_lr_transfer",
    statement="muP transfers the learning rate across width: the best Adam learning rate moves "
    "with width under the standard parametrization and stays put under muP",
    source="Yang et al. 2022, Tensor Programs V, figure 1",
    setting=f"char MLP LM (8 chars x 12 dims -> 2 ReLU layers of width {FULL.widths[0]}-"
    f"{FULL.widths[-1]} -> 97), Adam, lr 2^{FULL.log2_lrs[0]}..2^{FULL.log2_lrs[-1]} in powers "
    f"of 2, {FULL.steps} steps of {BATCH}x{CONTEXT} chars, loss = mean of the last {LAST} "
    f"steps; muP = normprobe.mup(base_model=width {BASE_WIDTH}) + mup_param_groups",
)


class CharMLP(nn.Module):
    """Predicts each character from the ``WINDOW`` before it (zero-padded at the start)."""

    def __init__(self, width: int, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, EMBED)
        self.inp = nn.Linear(WINDOW * EMBED, width)
        self.hidden1 = nn.Linear(width, width)
        self.hidden2 = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        chars = F.pad(self.embed(ids), (0, 0, WINDOW - 1, 0))  # (batch, WINDOW-1 + time, EMBED)
        windows = chars.unfold(1, WINDOW, 1).flatten(2)  # (batch, time, EMBED * WINDOW)
        h = F.relu(self.inp(windows))
        h = F.relu(self.hidden1(h))
        return self.out(F.relu(self.hidden2(h)))


def sp_adam(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=lr)


def mup_adam(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(normprobe.mup_param_groups(model, lr))


def run_loss(parametrization: str, width: int, log2_lr: int, seed: int, steps: int) -> float:
    """The loss after ``steps`` steps of one run (NaN when it diverged)."""
    torch.manual_seed(seed)
    model = CharMLP(width)
    if parametrization == "muP":
        with torch.device("meta"):
            base = CharMLP(BASE_WIDTH)
        normprobe.mup(model, base_model=base)
    run = _claims.train_char_lm(
        model,
        steps=steps,
        lr=2.0**log2_lr,
        seed=seed,
        batch=BATCH,
        context=CONTEXT,
        optimizer=mup_adam if parametrization == "muP" else sp_adam,
    )
    return run.final_loss(LAST)


def mean_or_inf(losses: list[float]) -> float:
    """The mean over seeds; infinite when any seed diverged (such a point cannot be best)."""
    return sum(losses) / len(losses) if all(map(math.isfinite, losses)) else math.inf


def lr_label(log2_lr: int) -> str:
    return f"2^{log2_lr}"


def verdict(
    sweep: Sweep, best: dict[str, dict[int, int]]
) -> tuple[_claims.Verdict, str, dict[str, int]]:
    """The decision rule of the module docstring; also each parametrization's largest move."""
    narrow, wide = sweep.widths[0], sweep.widths[-1]
    moves = {p: max(abs(best[p][w] - best[p][narrow]) for w in sweep.widths) for p in best}
    sp_shift = best["SP"][wide] - best["SP"][narrow]
    edges = {sweep.log2_lrs[0], sweep.log2_lrs[-1]}
    on_edge = [f"{p} width {w}" for p in best for w in sweep.widths if best[p][w] in edges]
    summary = (
        f"SP's best lr moves {sp_shift:+d} grid steps from width {narrow} to {wide} "
        f"({lr_label(best['SP'][narrow])} -> {lr_label(best['SP'][wide])}); muP's moves at most "
        f"{moves['muP']} step(s) at any width ({lr_label(best['muP'][narrow])} at {narrow}, "
        f"{lr_label(best['muP'][wide])} at {wide})"
    )
    if moves["muP"] >= 2 and moves["muP"] >= moves["SP"]:
        return "contradicted", summary + ": muP does not keep the best lr", moves
    if on_edge:
        return (
            "not reproduced at this scale",
            summary + f"; but the best lr lies on the grid's edge for {', '.join(on_edge)}",
            moves,
        )
    if abs(sp_shift) >= 2 and moves["muP"] <= 1:
        return "reproduced", summary, moves
    if abs(sp_shift) < 2:
        why = f"; SP's optimum moves under 2 steps over widths {narrow}-{wide}: too narrow a range"
    else:
        why = "; muP moves less than SP but more than one step"
    return "not reproduced at this scale", summary + why, moves


def main() -> None:
    args = _claims.options(CLAIM).parse_args()
    _claims.torch_threads()
    sweep = QUICK if args.quick else FULL
    seeds = range(args.seeds)
    losses = {
        (p, w, k): [run_loss(p, w, k, seed, sweep.steps) for seed in seeds]
        for p in PARAMETRIZATIONS
        for w in sweep.widths
        for k in sweep.log2_lrs
    }
    mean = {key: mean_or_inf(values) for key, values in losses.items()}
    best = {
        p: {w: min(sweep.log2_lrs, key=lambda k, p=p, w=w: mean[p, w, k]) for w in sweep.widths}
        for p in PARAMETRIZATIONS
    }

    narrow = sweep.widths[0]
    header = [
        "param.",
        "width",
        "best lr",
        "loss at best lr",
        f"loss at width {narrow}'s best lr",
        "grid steps moved",
    ]
    rows = []
    for p in PARAMETRIZATIONS:
        tuned = best[p][narrow]
        for w in sweep.widths:
            rows.append(
                [
                    p,
                    str(w),
                    lr_label(best[p][w]),
                    _claims.fmt(losses[p, w, best[p][w]]),
                    _claims.fmt(losses[p, w, tuned]),
                    f"{best[p][w] - tuned:+d}",
                ]
            )
    outcome, why, moves = verdict(sweep, best)

    panels = [
        plots.Panel(
            title=f"{p}: loss after {sweep.steps} Adam steps",
            lines=[
                plots.Line(
                    f"width {w}",
                    [(2.0**k, mean[p, w, k]) for k in sweep.log2_lrs],
                    plots.ramp(i, len(sweep.widths)),
                )
                for i, w in enumerate(sweep.widths)
            ],
            xlabel="learning rate (muP: at the base width)" if p == "muP" else "learning rate",
            ylabel=f"training loss (mean of the last {LAST} steps)",
            xticks=[(2.0**k, lr_label(k)) for k in sweep.log2_lrs[::2]],
            xlog=True,
        )
        for p in PARAMETRIZATIONS
    ]
    numbers = {
        "widths": list(sweep.widths),
        "log2_lrs": list(sweep.log2_lrs),
        "best_log2_lr": {p: {str(w): best[p][w] for w in sweep.widths} for p in best},
        "grid_steps_moved": moves,
        "mean_loss": {
            p: {
                str(w): [
                    mean[p, w, k] if math.isfinite(mean[p, w, k]) else None for k in sweep.log2_lrs
                ]
                for w in sweep.widths
            }
            for p in PARAMETRIZATIONS
        },
    }
    result = _claims.Result(CLAIM, header, rows, outcome, why, numbers, args.quick)
    _claims.finish(result, args.out, panels)


if __name__ == "__main__":
    main()
