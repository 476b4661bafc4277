"""A logged step's `Record`, the `Sink` protocol that receives records, and `MemorySink`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Protocol

from .. import tags
from ..metrics import SERIES


@dataclass
class Record:
    """Everything one logged step produced, already on the host.

    Attributes:
        step: the training step.
        scalars: tag -> value.
        profiles: tag -> one value per block (the depth view of a metric over a stack).
        texts: tag -> text (the first module with a non-finite output).

    The accessors read it the same way on any model, whatever its stacks are called:
    ``record.grad_ratio()``, ``record.resid_growth()`` (of the only stack, or ``stack=``),
    ``record.series("grad_ratio")`` (``{stack: value}``) and ``record.stacks``.
    """

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    profiles: dict[str, list[float]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)

    @property
    def stacks(self) -> list[str]:
        """The stacks of blocks measured at this step, as tags name them (``blocks``,
        ``model.layers``, ``transformer.h``)."""
        found = {
            t.subject
            for t in map(tags.parse, self.profiles)
            if t is not None and t.series in SERIES and SERIES[t.series].shape == "block"
        }
        return sorted(found)

    def series(self, name: str) -> dict[str, float]:
        """This step's values of the series ``name`` (``grad_ratio``, ``resid_rms``,
        ``norm_in_rms``...), by what follows ``normprobe/<name>/`` in their tags: a stack
        (``{"model.layers": 0.4}``), a block (``"blocks/03"``), a module or a statistic.

        Empty when the family writing it was not measured; ValueError for a name no family
        writes.
        """
        if name not in SERIES:
            close = difflib.get_close_matches(name, SERIES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"no series is called {name!r}{hint}; they are {', '.join(SERIES)}")
        start = tags.prefix(name)
        return {t[len(start) :]: v for t, v in self.scalars.items() if t.startswith(start)}

    def grad_ratio(self, stack: str | None = None) -> float:
        """The gradient norm of ``stack``'s last block over its first's (default: the only
        stack); ValueError names the stacks when there are several or none."""
        return self._of_stack("grad_ratio", stack)

    def resid_growth(self, stack: str | None = None) -> float:
        """The residual stream's RMS after ``stack``'s last block over after its first
        (default: the only stack), as `grad_ratio`."""
        return self._of_stack("resid_growth", stack)

    def _of_stack(self, series: str, stack: str | None) -> float:
        values = self.series(series)
        if stack in values or (stack is None and len(values) == 1):
            return values[stack] if stack is not None else next(iter(values.values()))
        if not values:
            raise ValueError(
                f"no {series} at step {self.step}: its family was not among the metrics, the "
                "model has no stack of blocks (see probe.model_map), or its first block's value "
                "was 0"
            )
        if stack is None:
            raise ValueError(
                f"{len(values)} stacks have a {series} ({', '.join(values)}): pass stack=..."
            )
        raise ValueError(f"no {series} for stack {stack!r}; stacks: {', '.join(values)}")


class Sink(Protocol):
    """Receives the records of a probe's logged steps (on global rank zero only).

    `flush` is called when a forward raises (what was written must reach the disk) and
    `close` when the probe is removed.
    """

    def write(self, record: Record) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps every record in `records`: the probe's output, in memory.

    Example::

        sink = normprobe.MemorySink()
        with normprobe.attach(model, opt, sinks=[sink], every=1):
            train()
        sink.series("normprobe/grad_ratio/blocks")   # [(step, value), ...]
    """

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.closed = False

    def write(self, record: Record) -> None:
        self.records.append(record)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def series(self, tag: str) -> list[tuple[int, float]]:
        """(step, value) of ``tag`` over the records that have it."""
        return [(r.step, r.scalars[tag]) for r in self.records if tag in r.scalars]
