"""The hooks a probe registers: callbacks that turn inert in a copy of the model, and the
per-module reads that metric families asked for, one pre-hook and one hook per module."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ..metrics.core.base import AttentionReader
from ..nested import first_float, get_by_key, iter_tensors
from ..probes.shards import local_part
from .backward import Gradients
from .modes import AddCounter, AttentionLogits

Reader = Callable[[torch.Tensor], None]
Registration = Callable[[], RemovableHandle]


class InertHook:
    """What a probe's hook becomes in a copy of the model: does nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class ProbeHook:
    """A probe callback registered on a module or optimizer.

    Pickling, deep-copying or ``torch.save``-ing the model turns it into an `InertHook`: a
    copy of a probed model does not carry the probe (or its event writer) along.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return InertHook, ()


@dataclass
class Read:
    """Read one tensor at a module boundary on a given call and hand it to ``action``."""

    call: int | None  # None: every call
    key: tuple[str | int, ...] | None  # None: the first floating-point tensor
    action: Reader

    def __call__(self, container: Any) -> None:
        t = first_float(container) if self.key is None else get_by_key(container, self.key)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            self.action(local_part(t))  # a DTensor: this rank's part (sequence parallelism)


@dataclass
class Site:
    """Everything read at one module."""

    pre: list[Read] = field(default_factory=list)
    post: list[Read] = field(default_factory=list)
    inside: dict[int, dict[int, Reader]] = field(default_factory=dict)  # call -> add -> reader
    attention: list[AttentionReader] = field(default_factory=list)  # get `AttentionInputs`
    heads: int = 1  # of the attention module here
    logit_max: bool = False  # a reader asks for the max logit


class Hooks:
    """The reads of every site, the output and gradient readers of every module (or of the
    `select`-ed ones), and what registers them (`registrations`): one forward pre-hook and one
    forward hook per module at most.

    ``recording()`` says whether the current forward is logged; a module's calls are counted
    from the start of each recorded forward (`start`).
    """

    def __init__(self, recording: Callable[[], bool]) -> None:
        self.recording = recording
        self.sites: dict[str, Site] = {}
        self.outputs: list[Callable[[int, Any], None]] = []  # get (module index, output)
        self.gradients = Gradients()
        self.calls: dict[str, int] = {}
        self.modes: dict[str, list[TorchFunctionMode]] = {}  # entered, by module
        # indices in ``model.modules()`` of the modules whose outputs and gradients the readers
        # get (None: all); `reselected` says once that it changed
        self.selected: frozenset[int] | None = None
        self._reselected = False

    def select(self, indices: frozenset[int] | None) -> None:
        """Hand the output and gradient readers these modules' alone from the next arming on."""
        if indices != self.selected:
            self.selected, self._reselected = indices, True

    def reselected(self) -> bool:
        """Whether `select` changed the modules since the last call."""
        changed, self._reselected = self._reselected, False
        return changed

    def at(self, path: str) -> Site:
        return self.sites.setdefault(path, Site())

    def start(self) -> None:
        self.calls.clear()

    def entered(self) -> list[TorchFunctionMode]:
        """The modes still entered (a forward that raised midway), forgotten here."""
        modes = [mode for modes in self.modes.values() for mode in modes]
        self.modes.clear()
        return modes

    def registrations(
        self, model: nn.Module, modules: Mapping[str, nn.Module], compiled: bool
    ) -> list[Registration]:
        """The hooks of every module of ``model`` that reads something; ``modules`` maps the
        sites' paths to modules."""
        if compiled:
            # torch function modes would break a compiled graph: no attention logits, and no
            # residual read from inside a forward, on compiled models
            for site in self.sites.values():
                site.attention, site.inside = [], {}
        everyone = bool(self.outputs or self.gradients.actions)
        # by module: the module, its index in ``model.modules()``, its sites
        found: dict[int, tuple[nn.Module, int | None, list[tuple[str, Site]]]] = {}
        if everyone:
            selected = self.selected
            found = {
                id(m): (m, i, [])
                for i, m in enumerate(model.modules())
                if selected is None or i in selected
            }
        for path, site in self.sites.items():
            module = modules[path]
            found.setdefault(id(module), (module, None, []))[2].append((path, site))
        return [r for m, i, sites in found.values() for r in self._module(m, i, sites)]

    def _module(
        self, module: nn.Module, index: int | None, sites: list[tuple[str, Site]]
    ) -> list[Registration]:
        recording = self.recording
        watch = index is not None and bool(self.gradients.actions)

        def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if recording():
                self._call_starts(index if watch else None, sites, (args, kwargs))

        def post(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            for path, _ in sites:
                for mode in reversed(self.modes.pop(path, [])):
                    mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            if recording():
                self._call_ends(index, watch, sites, out)

        registrations: list[Registration] = []
        if watch or sites:
            registrations.append(
                partial(module.register_forward_pre_hook, ProbeHook(pre), with_kwargs=True)
            )
        registrations.append(
            partial(
                module.register_forward_hook, ProbeHook(post), with_kwargs=True, always_call=True
            )
        )
        return registrations

    def _call_starts(
        self, watched: int | None, sites: list[tuple[str, Site]], inputs: tuple[Any, Any]
    ) -> None:
        """A recorded module call starts: its inputs' gradients watched (module ``watched``),
        its sites' inputs read, and the modes that read inside it entered."""
        # the reads go around the modes a parent module entered: they are not the model's
        # operations, and would cost a Python call each
        with torch._C.DisableTorchFunction():
            if _without_data(inputs):  # a call on meta tensors for their shapes: counted only
                for path, _ in sites:
                    self.calls[path] = self.calls.get(path, -1) + 1
                return
            if watched is not None:  # before the module runs: its inputs as they are called
                self.gradients.watch(watched, "input", inputs)
            calls = [self._read_inputs(path, site, inputs) for path, site in sites]
        for (path, site), call in zip(sites, calls, strict=True):
            self._enter_modes(path, site, call)

    def _call_ends(
        self, index: int | None, watch: bool, sites: list[tuple[str, Site]], out: Any
    ) -> None:
        """A recorded call of module ``index`` returned ``out``: its sites' outputs read, and
        the output readers and gradient watch handed it."""
        with torch._C.DisableTorchFunction():
            if _without_data(out):
                return
            for path, site in sites:
                call = self.calls.get(path, 0)
                for read in site.post:
                    if read.call is None or read.call == call:
                        read(out)
            if index is not None:
                for action in self.outputs:
                    action(index, out)
                if watch:
                    self.gradients.watch(index, "output", out)

    def _read_inputs(self, path: str, site: Site, inputs: Any) -> int:
        """A recorded call of the module at ``path`` starts: count it and read its inputs; the
        number of the call."""
        call = self.calls[path] = self.calls.get(path, -1) + 1
        for read in site.pre:
            if read.call is None or read.call == call:
                read(inputs)
        return call

    def _enter_modes(self, path: str, site: Site, call: int) -> None:
        """Enter the modes that read inside the module's call number ``call``."""
        modes: list[TorchFunctionMode] = []
        if site.inside.get(call):
            modes.append(AddCounter(site.inside[call]))
        if site.attention:
            modes.append(AttentionLogits(site.attention, site.heads, site.logit_max))
        for mode in modes:
            mode.__enter__()  # type: ignore[no-untyped-call]
        if modes:
            self.modes[path] = modes


def _without_data(value: Any) -> bool:
    """Whether ``value``'s first tensor has no data (on the meta device: a model calling a
    layer for the shape of its output, as compressai's checkerboard context does)."""
    first = next(iter_tensors(value), None)
    return first is not None and first[1].is_meta


class Armed:
    """The reading hooks: registered by `arm` (once; a no-op while armed, unless ``changed()``
    says which hooks to register changed: then made and registered anew), removed by
    `disarm`. ``registrations()`` is called again only after such a change."""

    def __init__(self) -> None:
        self.registrations: Callable[[], list[Registration]] = list
        self.changed: Callable[[], bool] = lambda: False
        self.handles: list[RemovableHandle] = []
        self._made: list[Registration] | None = None

    def use(
        self, registrations: Callable[[], list[Registration]], changed: Callable[[], bool]
    ) -> None:
        """Register what ``registrations()`` makes from now on, made anew when ``changed()``."""
        self.disarm()
        self.registrations, self.changed, self._made = registrations, changed, None

    def arm(self) -> None:
        if self.changed():
            self.disarm()
            self._made = None
        if not self.handles:
            if self._made is None:
                self._made = self.registrations()
            self.handles = [register() for register in self._made]

    def disarm(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class OptimizerSteps:
    """Calls ``before`` and ``after`` around each step of ``optimizer``, once per step.

    An optimizer subclass whose step() calls super().step() runs the step hooks twice, nested
    (torch wraps every class's step): only the outermost pair is one training step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        before: Callable[[], None],
        after: Callable[[], None],
    ) -> None:
        self.depth = 0  # step hooks entered, not yet left
        self.before, self.after = before, after
        self.handles = [
            optimizer.register_step_pre_hook(ProbeHook(self._pre)),
            optimizer.register_step_post_hook(ProbeHook(self._post)),
        ]

    def forward_started(self) -> None:
        # no forward runs inside an optimizer step's hooks but a closure's (LBFGS): a count
        # left by a step that raised must not swallow the next step
        self.depth = 0

    def _pre(self, *_: Any) -> None:
        self.depth += 1
        if self.depth == 1:
            self.before()

    def _post(self, *_: Any) -> None:
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0:
            self.after()


def unwrapped_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside a wrapper (Accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``): the object whose ``step`` the probe hooks."""
    if optimizer is None:
        return None
    inner = optimizer
    while True:  # a wrapper may subclass Optimizer without being the one that steps
        held = getattr(inner, "optimizer", None) or getattr(inner, "_optimizer", None)
        if not isinstance(held, torch.optim.Optimizer) or held is inner:
            break
        inner = held
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (or a wrapper holding one as "
            f"`.optimizer`), got {type(optimizer).__qualname__}"
        )
    return inner


def warn_unlogged(
    model: nn.Module, forwards: int, steps: int, mapped: bool, has_optimizer: bool
) -> None:
    """At removal: say why nothing was logged, where forwards ran without a training step or
    steps ended without a forward of the model."""
    name = type(model).__name__
    if forwards and not steps:
        how = (
            "its optimizer never stepped"
            if has_optimizer
            else "no optimizer was passed to attach() and probe.step() was never called"
        )
        message = (
            f"the probe saw {forwards} forward(s) of {name} but no training step ({how}), so "
            "nothing was logged: steps advance with attach(model, optimizer=opt) and "
            "opt.step(), or with probe.step() after each step"
        )
    elif steps and not mapped:
        message = (
            f"the probe saw {steps} training step(s) but no forward of {name}, so nothing was "
            "logged: the loop runs the model some other way (model.forward(x) or a method that "
            "calls it, such as ultralytics' model.loss(batch)); call model(x), or attach the "
            "probe to the module the loop calls"
        )
    else:
        return
    warnings.warn(f"normprobe: {message}", RuntimeWarning, stacklevel=3)  # remove()'s caller
