"""The probe runtime: hooks at the places discovery found, a logging schedule, and statistics
kept on the device until one transfer per logged step.

On a step that is not logged every hook returns at once: no statistic is computed, no tensor is
kept, nothing is read back. Only the spike detector (`spikes`) runs on every step: a few
operations on the device and a copy to the host that nothing waits for. On a logged step, hooks
reduce what they see to float32 scalars on the device; after the optimizer step those are
concatenated and copied to the host in one go. What is measured is declared by the metric
families (`normprobe.metrics`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..common import EVERY, MAX_BLOCK_TAGS, example_call, is_writer
from ..metrics import FAMILIES, METRICS
from ..sinks import Sink, TensorBoardSink
from .hooks import InertHook, ProbeHook
from .plan import tagged_paths
from .probe import Probe, attached_probe
from .spikes import DEFAULT_SPIKES, Spikes


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    log_dir: str | None = None,
    writer: Any = None,
    sinks: Sequence[Sink] = (),
    every: int = EVERY,
    metrics: Iterable[str] | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    max_block_tags: int = MAX_BLOCK_TAGS,
    spikes: Spikes | None = DEFAULT_SPIKES,
    scaler: Any = None,
    pipeline: Any = None,
) -> Probe:
    """Attach a probe that logs the model's norm, residual and gradient statistics.

    The model is mapped with `normprobe.discover` on ``example_inputs`` if given, else on its
    first forward. Every ``every``-th step (the first included) is logged to TensorBoard under
    ``normprobe/<metric family>/...``, with a custom-scalars layout and depth histograms.

    Metrics (all but the opt-in ones by default; choose with ``metrics=[...]``):

    {metrics}

    Args:
        model: the model to watch.
        optimizer: its optimizer; steps advance with ``optimizer.step()``. Gradients are read
            at the end of each backward through the model's output, before any clipping
            (the step's last backward counts), else just before the optimizer step. Without
            one, call ``probe.step()`` after each step.
        log_dir: where to write TensorBoard event files.
        writer: an existing ``SummaryWriter`` to write to instead (left open on removal).
        sinks: where else records go (`normprobe.Sink`, e.g. `normprobe.MemorySink`). Given
            without ``log_dir`` or ``writer``, no TensorBoard files are written.
        every: log every this many steps.
        metrics: names from ``normprobe.METRICS``.
        example_inputs: positional inputs to map the model now instead of on its first
            forward.
        example_kwargs: keyword inputs to map the model with, as ``example_inputs``.
        max_block_tags: deeper stacks get scalar tags for this many evenly spread blocks only
            (depth histograms always hold every block); norm and attention layers repeated
            more often (``blocks.*.ln_1``) are measured at this many evenly spread ones.
        spikes: the spike detector (`Spikes`; None: off). On every step it compares the loss
            and the total gradient norm with their last ``window`` steps; on a spike (above
            mean + ``sigma`` std) it writes ``normprobe/spike/*`` and logs every metric for
            the next ``capture`` steps. The loss comes from the model's output (``.loss``,
            ``["loss"]``) or from ``probe.observe_loss(loss)``; without one only the gradient
            norm is watched. Off under ``torch.distributed``.
        scaler: the ``torch.amp.GradScaler`` of fp16 training, whose loss scale the gradients
            carry at the end of the backward (divided out on the device); Accelerate's
            optimizer hands over its own, and one whose ``scaler.step(opt)`` steps the
            optimizer is found there. Needed only when the scaler unscales and the optimizer
            steps otherwise (a warning says so).
        pipeline: the ``torch.distributed.pipelining`` stage (``PipelineStage``) that runs
            ``model``, one stage a rank: each stage probes its blocks under their global
            numbers and combines its micro-batches, and the stages' records are gathered into
            the whole stack's once per logged step (rank 0 writes). Needs ``example_inputs``
            (the stage's input): the stages learn their place in the stacks at attach.

    Returns:
        A `Probe`, also a context manager; ``probe.remove()`` is idempotent.

    Raises:
        ValueError: unknown metric names (the closest one suggested), a bad ``every``, a
            family the model's tensor-parallel or pipeline layout keeps from being read, named
            with the reason (with the default metrics: a warning, the family left out), or
            ``pipeline`` without ``example_inputs``.
        RuntimeError: a probe is already attached to the model, the model is a pipeline
            stage not given as ``pipeline``, or a pipeline layout normprobe cannot combine
            (several stages a rank, pipeline with data parallelism, DeepSpeed's
            ``PipelineModule``), named with the reason.
        OSError: ``log_dir`` cannot be created or written to (named, with the reason).

    Example::

        with normprobe.attach(model, optimizer=opt, log_dir="runs/a", every=50):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                loss.backward(); opt.step(); opt.zero_grad()
    """
    probe = Probe(  # checks the arguments before any file is created
        model,
        optimizer=optimizer,
        every=every,
        metrics=metrics,
        max_block_tags=max_block_tags,
        sinks=sinks,
        spikes=spikes,
        scaler=scaler,
        pipeline=pipeline,
    )
    try:
        if pipeline is not None and example_inputs is None and example_kwargs is None:
            raise ValueError(
                "attach(..., pipeline=stage) maps the stage at attach: pass example_inputs= "
                "(the stage's input: token ids on the first stage, hidden states on the others)"
            )
        # under torch.distributed, rank 0 alone opens event files
        if is_writer() and (not sinks or log_dir is not None or writer is not None):
            probe.sinks.insert(0, TensorBoardSink(writer=writer, log_dir=log_dir))
        if example_inputs is not None or example_kwargs is not None:
            args, kwargs = example_call(model, example_inputs, example_kwargs, own=False)
            probe.discover_now(*args, **kwargs)
        else:
            probe.discover_lazily()
    except BaseException:
        probe.remove()
        raise
    return probe


if attach.__doc__:
    attach.__doc__ = attach.__doc__.replace(
        "{metrics}",
        "\n    ".join(
            f"* ``{f.name}``{' (opt-in)' if f.opt_in else ''}: {f.description}." for f in FAMILIES
        ),
    )


__all__ = [
    "METRICS",
    "InertHook",
    "Probe",
    "ProbeHook",
    "Spikes",
    "attach",
    "attached_probe",
    "tagged_paths",
]
