"""One forward of a probed model: whether it is recorded, and what starts and ends with it."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn

from ..discovery import ModelMap
from ..metrics.core.base import Family, Holdings, Reduce
from .hooks import Armed, Hooks, ProbeHook
from .modes import exit_modes
from .packing import Measurements
from .plan import ProbePlan


class Forwards:
    """Records the forwards a probe asks for.

    Between recorded forwards the reading hooks are removed (`Armed`), unless ``persistent``
    (compiled models, whose graph must not change): then they stay registered, every forward is
    recorded alike and only the logged steps' values are read back.
    """

    def __init__(self, persistent: bool) -> None:
        self.persistent = persistent
        # each forward of a step is a micro-batch: what it measured is published at its end
        # and kept apart, to be combined with the others' (a pipeline stage)
        self.micro_batches = False
        self.size = 1.0  # the running forward's input elements, its weight among micro-batches
        self.recording = False
        self.measured = Measurements()
        self.hooks = Hooks(lambda: self.recording)
        self.armed = Armed()
        self.plan: ProbePlan | None = None

    def install(
        self,
        model: nn.Module,
        model_map: ModelMap,
        families: Iterable[Family],
        root_post: Callable[..., None],
        *,
        max_block_tags: int,
        param_reduce: Reduce,
        holdings: Holdings,
        name_prefix: str,
        blocks: Mapping[str, tuple[int, int]] | None,
        pipeline: tuple[int, int] | None,
    ) -> ProbePlan:
        """Plan what ``families`` read on the mapped model (`ProbePlan`), and read it;
        ``root_post`` ends each forward (registered last: it runs after every read of the
        model's output; `Armed.arm` registers them)."""
        plan = ProbePlan(
            model,
            model_map,
            hooks=self.hooks,
            measured=self.measured,
            max_block_tags=max_block_tags,
            param_reduce=param_reduce,
            holdings=holdings,
            compiled=self.persistent,
            name_prefix=name_prefix,
            blocks=blocks,
            pipeline=pipeline,
        )
        plan.install(families)
        self.armed.use(
            lambda: [
                *plan.registrations(),
                lambda: model.register_forward_hook(ProbeHook(root_post), always_call=True),
            ],
            self.hooks.reselected,
        )
        self.plan = plan
        return plan

    def start(self, wanted: bool) -> None:
        """A forward starts; ``wanted``: the probe records it (a logged step, a validation
        forward; with ``persistent``, any forward of an attached probe)."""
        if self.recording or self.persistent:
            # the last recorded forward never reached its end (a KeyboardInterrupt skips even
            # always_call hooks): drop what it measured and the modes it left entered
            self.clear()
        self.recording = wanted and self.plan is not None
        if self.recording and self.plan is not None:
            # of several forwards in a step (accumulation), the last counts
            self.hooks.start()
            self.plan.run("forward_start")
            if not self.persistent:
                self.armed.arm()

    def end(self, out: Any, keep_armed: bool) -> bool:
        """The forward ended with ``out`` (None when it raised); ``keep_armed``: the next step is
        logged too. True when it raised and what it measured was dropped."""
        if self.plan is not None and self.recording:
            self.plan.run("forward_end")
        raised = out is None and sys.exc_info()[0] is not None and not self.persistent
        if raised:
            # what it measured must not mix with a retried forward's
            self.clear()
        elif self.micro_batches and self.plan is not None and self.recording:
            self.plan.run("flush")
            self.measured.end_forward(self.size)
        if not self.persistent:
            self.recording = False
            exit_modes(self.hooks.entered())
            if not keep_armed and not self.micro_batches:  # micro-batches: at the step's end
                self.armed.disarm()
        return raised

    def clear(self) -> None:
        """Drop what the step measured so far, and leave the modes still entered."""
        self.measured.clear()
        exit_modes(self.hooks.entered())
        if self.plan is not None:
            self.plan.run("clear")

    def stop(self) -> None:
        """The probe is removed: nothing more is recorded, no hook stays."""
        self.recording = False
        exit_modes(self.hooks.entered())
        self.armed.disarm()
