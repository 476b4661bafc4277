"""Running a model without leaving a trace: its modes, buffers, parameters and RNG state come
back."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


@contextmanager
def preserved(module: nn.Module, *, grads: bool = False) -> Iterator[None]:
    """Restore ``module``'s train/eval modes, buffers (BatchNorm statistics) and the parameters
    its forward writes in place (EDM2's forced weight normalization) or replaces (``p.data =
    w * mask``) on exit, and with ``grads`` its parameters' gradients (cleared meanwhile);
    random numbers drawn inside come from forked generators (the CPU's and those of the
    module's CUDA devices), and the generators its modules hold get their states back."""
    modes = [(m, m.training) for m in module.modules()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    params = list(module.parameters()) if grads else []
    saved_grads = [p.grad for p in params]
    tensors = [*module.parameters(), *module.buffers()]
    cuda = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
    guard = ParameterWrites(module.parameters())
    # the memory each parameter holds now, kept by reference: a forward that assigns
    # ``p.data = w * mask`` (a masked convolution) gets its old memory back
    memory = [(p, p.data) for p in module.parameters()]
    generators = _own_generators(module)
    states = [g.get_state() for g in generators]
    with torch.random.fork_rng(devices=cuda):
        try:
            for p in params:
                p.grad = None
            with guard:
                yield
        finally:
            for m, mode in modes:
                m.training = mode
            with torch.no_grad():
                for b, value in buffers:
                    b.copy_(value)
                for p, data in memory:
                    if p.data.data_ptr() != data.data_ptr() or p.shape != data.shape:
                        p.data = data
                guard.restore()
            for generator, state in zip(generators, states, strict=True):
                generator.set_state(state)
            for p, g in zip(params, saved_grads, strict=True):
                p.grad = g


def _own_generators(module: nn.Module) -> list[torch.Generator]:
    """The random generators ``module``'s submodules hold as attributes (torchtune's layer
    dropout draws from its own), once each."""
    found: dict[int, torch.Generator] = {}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Generator):
                found.setdefault(id(value), value)
    return list(found.values())


class ParameterWrites(TorchFunctionMode):
    """Copies each of ``params`` an in-place op is about to write (through any tensor sharing
    its memory: ``p.data``, a view), once, so that `restore` can put it back: a copy of only
    the parameters the code run inside changes. Those without plain memory to watch (a
    DTensor's) are listed in ``unwatched``."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        super().__init__()
        self.by_memory: dict[int, list[nn.Parameter]] = {}
        self.unwatched: list[nn.Parameter] = []
        for p in params:
            address = _memory(p)
            if address is not None:
                self.by_memory.setdefault(address, []).append(p)
            else:
                self.unwatched.append(p)
        self.saved: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # the tensor written: ``out=``, else the first argument (``tensor=`` for nn.init's)
        first = args[0] if args else next(iter(kwargs.values()), None)
        target = kwargs.get("out") if "out" in kwargs else first
        in_place = "out" in kwargs or name == "__setitem__" or _in_place_name(name)
        if in_place and isinstance(target, torch.Tensor) and self.by_memory:
            address = _memory(target)
            for p in self.by_memory.get(address, []) if address is not None else []:
                if id(p) not in self.saved:
                    with torch._C.DisableTorchFunction():
                        self.saved[id(p)] = (p, p.detach().clone())
        return func(*args, **kwargs)

    def restore(self) -> list[nn.Parameter]:
        """Put back each parameter written; those whose values had changed."""
        changed = [p for p, value in self.saved.values() if not torch.equal(p, value)]
        for p, value in self.saved.values():
            p.copy_(value)
        self.saved.clear()
        return changed


_AUGMENTED = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or")
) | {"__ixor__", "__ilshift__", "__irshift__"}


def _in_place_name(name: str) -> bool:
    """``copy_``, ``mul_``, ``normal_``; ``__iadd__`` and the other augmented assignments."""
    return name in _AUGMENTED or (name.endswith("_") and not name.startswith("__"))


def _memory(t: torch.Tensor) -> int | None:
    """The address of the memory ``t`` lives in (None for tensors without plain storage)."""
    try:
        address = int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return address or None  # 0: empty or meta memory, which every such tensor shares
