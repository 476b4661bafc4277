"""``spikes``: loss and gradient-norm spikes, as the always-on detector found them.

The detector (`normprobe.runtime.spikes`, ``attach(spikes=...)``) checks every step, not only
the logged ones; each spike it finds is written at the spike's step as a `SpikeEvent`: the
z-score of each series that spiked (``normprobe/spike/loss_z``, ``normprobe/spike/grad_z``) and
a text naming the step, the z-scores and the blocks whose gradient norm rose most against
their own history (``normprobe/spike/blocks``). The family reads nothing on logged steps; it
turns those events into `report` flags.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .. import tags
from .core.base import MODEL, NOTE, PROBLEM, Family, Flag, Plan, Run, Series

SERIES = "spike"
# A spike is a note: healthy runs have some (benchmarks/calibration.py: a GPT-2 gradient spike
# at z 7.5; a ResNet whose loss, memorized down to 1e-4, jumps to 2e-3 at z 6.9). It is a
# problem when spikes recur, RECUR of them within RECUR_STEPS steps: a loss that stays up
# after a jump (the loss following the spike) is a spike again at the next steps, until its
# history catches up.
RECUR = 3
RECUR_STEPS = 200
# how the event's text states the rule, which `flags` reads the threshold back from
_RULE = re.compile(r"above mean \+ (\S+) std")


@dataclass(frozen=True)
class Watched:
    """A watched series (the loss, the total gradient norm) at a spike's step.

    Attributes:
        value: its value at the step.
        mean: its mean over the history (the steps before, at most the detector's window).
        z: ``(value - mean) / std`` over that history.
        history: how many steps the history held.
        spiked: whether ``z`` was above the detector's sigma.
    """

    value: float
    mean: float
    z: float
    history: int
    spiked: bool


@dataclass(frozen=True)
class BlockRise:
    """A block's gradient norm at a spike's step, against its own history."""

    block: str  # ``<stack>/<block>``, as the grad_norm tags name it
    z: float
    ratio: float  # its gradient norm / its mean over the history


@dataclass(frozen=True)
class SpikeEvent:
    """A spike of the loss or of the total gradient norm at ``step``."""

    step: int
    sigma: float
    loss: Watched | None  # None when the step had no loss to watch
    grad: Watched
    blocks: tuple[BlockRise, ...]  # the blocks whose gradient norm rose most, first the most

    @property
    def kind(self) -> str:
        return "loss spike" if self.loss is not None and self.loss.spiked else "gradient spike"

    @property
    def z(self) -> float:
        """The z-score of the series the event is named after."""
        return self.loss.z if self.loss is not None and self.loss.spiked else self.grad.z

    def scalars(self) -> dict[str, float]:
        """The z-score of each series that spiked, by tag."""
        found = {}
        for subject, watched in (("loss_z", self.loss), ("grad_z", self.grad)):
            if watched is not None and watched.spiked:
                found[tags.format(SERIES, subject)] = watched.z
        return found

    def texts(self) -> dict[str, str]:
        """`text`, by tag."""
        return {tags.format(SERIES, "blocks"): self.text()}

    def text(self) -> str:
        """``step <n>: `` then each watched series against its history, the rule, and the
        blocks whose gradient norm rose most."""
        series = [
            f"{name} {w.value:.4g}, z {w.z:.3g} against its mean {w.mean:.4g}"
            + (" (a spike)" if w.spiked else "")
            for name, w in (("loss", self.loss), ("gradient norm", self.grad))
            if w is not None
        ]
        text = (
            f"step {self.step}: {'; '.join(series)}; over the last {self.grad.history} steps, "
            f"a spike is above mean + {self.sigma:g} std."
        )
        if self.blocks:
            rises = ", ".join(
                f"{b.block} (z {b.z:.3g}, {b.ratio:.3g}x its mean)" for b in self.blocks
            )
            text += f" Gradient norms that rose most against their own history: {rises}."
        return text


class Spikes(Family):
    name = "spikes"
    description = (
        "spikes of the loss or of the total gradient norm (above mean + sigma std of the last "
        "steps), found on every step by the detector `attach(spikes=...)` configures: their "
        "z-scores and the blocks whose gradient norm rose most; written at the spike's step, "
        "whatever `every` and `metrics` say"
    )
    series = (Series(SERIES, "model"),)

    def plan(self, plan: Plan) -> None:
        """Nothing to read on logged steps: the probe's detector writes these tags."""

    def flags(self, run: Run) -> list[Flag]:
        """One flag per spike, named after the loss when it spiked (its gradient, which
        mostly spikes with it, is in the message), else after the gradient norm; a problem
        when spikes recur, else a note."""
        texts = dict(run.texts.get(tags.format(SERIES, "blocks"), []))
        loss = dict(run.scalars.get(tags.format(SERIES, "loss_z"), []))
        grad = dict(run.scalars.get(tags.format(SERIES, "grad_z"), []))
        found = []
        steps = sorted(loss.keys() | grad.keys())
        for step in steps:
            kind, z = ("loss spike", loss[step]) if step in loss else ("gradient spike", grad[step])
            text = texts.get(step, f"step {step}: z {z:.3g}.").partition(": ")[2]
            rule = _RULE.search(text)
            near = [s for s in steps if abs(s - step) <= RECUR_STEPS]
            recurs = len(near) >= RECUR
            again = f" {len(near)} spikes within {RECUR_STEPS} steps of it." if recurs else ""
            found.append(
                Flag(
                    kind,
                    MODEL,
                    step,
                    z,
                    float(rule[1]) if rule else math.nan,
                    f"{text}{again} The steps after it are logged in full: look at that step's "
                    "batch and at the blocks whose gradient rose",
                    PROBLEM if recurs else NOTE,
                )
            )
        return found
