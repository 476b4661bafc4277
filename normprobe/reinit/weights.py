"""Weight layers and the tensors they apply: layouts, parametrized weights, in-place overwrites.

What every scheme (and `normprobe.mup`, `normprobe.diagnose`) asks of a layer: whether it is a
weight layer, how its weight is laid out (``(out, in)`` or transposed), which of its parameters
is a bias, and, through `Applied`, the tensor it applies, written back through a weight norm or
any other parametrization.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import cast

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _WeightNorm
from torch.nn.utils.weight_norm import WeightNorm

from ..discovery import preserved

_TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, *_TRANSPOSED_CONVS)
_PACKAGE = os.path.dirname(__file__) + os.sep


def warn_user(message: str) -> None:
    """A UserWarning at the caller's line: the first frame outside this package."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, UserWarning, level)


def is_transposed(module: nn.Module) -> bool:
    """Whether ``module`` stores its weight as ``(in, out, ...)`` rather than ``(out, in, ...)``.

    True for Hugging Face's ``Conv1D`` (GPT-2), transposed convolutions and embeddings (a table
    of ``num_embeddings`` rows: one input per row, ``embedding_dim`` outputs).
    """
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag, *_TRANSPOSED_CONVS)):
        return True
    return any(c.__name__ == "Conv1D" for c in type(module).__mro__)


def out_in_view(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A view of ``weight`` laid out ``(out, in, *kernel)``, as ``torch.nn.init`` assumes."""
    if weight.ndim >= 2 and is_transposed(module):
        return weight.transpose(0, 1)
    return weight


def out_dim(module: nn.Module) -> int:
    """The dim of ``module``'s weight that runs over its outputs."""
    return 1 if is_transposed(module) else 0


def direct_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module``'s own parameters, not its children's."""
    return list(module.named_parameters(recurse=False))


def is_weight_layer(module: nn.Module) -> bool:
    """A leaf module holding a matrix or kernel (Linear, Conv, Conv1D, Embedding), or MHA."""
    if not any(p.ndim >= 2 for _, p in direct_params(module)):
        return False
    return isinstance(module, nn.MultiheadAttention) or not any(True for _ in module.children())


def _weight_norm_hooks(module: nn.Module) -> dict[str, WeightNorm]:
    """Old-style ``torch.nn.utils.weight_norm`` on ``module``: tensor name -> its hook."""
    hooks = module._forward_pre_hooks.values()
    return {h.name: h for h in hooks if isinstance(h, WeightNorm)}


def _chains(module: nn.Module) -> dict[str, parametrize.ParametrizationList]:
    """``torch.nn.utils.parametrize``'s parametrizations of ``module``, by tensor name."""
    if not parametrize.is_parametrized(module):
        return {}
    return dict(cast(nn.ModuleDict, module.parametrizations).items())  # type: ignore[arg-type]


def _parametrized(module: nn.Module) -> list[str]:
    """Names of ``module``'s tensors computed from parameters: by ``torch.nn.utils.parametrize``
    (`_chains`) or by the old ``weight_norm`` hook (from ``weight_g`` and ``weight_v``)."""
    return [*_chains(module), *_weight_norm_hooks(module)]


def is_layer(module: nn.Module) -> bool:
    """`is_weight_layer`, also for a layer whose matrix or kernel is parametrized (new-style
    weight norm): a leaf but for its ``parametrizations``."""
    if not parametrize.is_parametrized(module):
        return is_weight_layer(module)
    leaf = all(name == "parametrizations" for name, _ in module.named_children())
    held = [*module.parameters()]  # its own and its parametrizations' originals
    return any(p.ndim >= 2 for p in held) and (leaf or isinstance(module, nn.MultiheadAttention))


def _set_weight_norm(g: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, dim: int) -> None:
    """``g`` and ``v`` with ``g * v / ||v|| = weight``: ``v = weight``, ``g`` its norms over all
    dims but ``dim``; a zero slice keeps its direction in ``v`` (its ``g`` is 0)."""
    norm = torch.norm_except_dim(weight, 2, dim)
    v.copy_(torch.where(norm > 0, weight, v))
    g.copy_(norm)


def _assign(module: nn.Module, name: str, value: torch.Tensor) -> bool:
    """Make ``module``'s parametrized tensor ``name`` equal ``value``: weight norm's g and v
    in place; any other parametrization through its ``right_inverse``. False (with a warning)
    where the parametrization cannot take it."""
    hooks = _weight_norm_hooks(module)
    if name in hooks:
        with torch.no_grad():
            g, v = getattr(module, f"{name}_g"), getattr(module, f"{name}_v")
            _set_weight_norm(g, v, value, hooks[name].dim)
        setattr(module, name, hooks[name].compute_weight(module))  # as the hook's next call does
        return True
    chain = _chains(module)[name]
    with torch.no_grad():
        if len(chain) == 1 and isinstance(chain[0], _WeightNorm):
            g, v = chain.original0, chain.original1
            _set_weight_norm(cast(torch.Tensor, g), cast(torch.Tensor, v), value, chain[0].dim)
            return True
        try:
            setattr(module, name, value.clone())
        except (RuntimeError, NotImplementedError) as err:
            warn_user(
                f"{type(module).__name__}.{name} keeps its value: its parametrization cannot "
                f"be set to a given tensor ({err})"
            )
            return False
    return True


class Applied:
    """The tensors weight layers apply, to overwrite in place.

    A parametrized tensor (weight norm's ``weight``) is a copy of its value; `commit` writes each
    copy that changed back through its parametrization, so that the layer applies exactly it.
    """

    def __init__(self) -> None:
        self._copies: dict[tuple[int, str], tuple[nn.Module, torch.Tensor, int]] = {}

    def of(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """``module``'s parametrized tensors, then its own parameters but weight norm's g, v."""
        hooks = _weight_norm_hooks(module)
        found = []
        for name in _parametrized(module):
            key = (id(module), name)
            if key not in self._copies:
                # reading leaves buffers as they were (spectral norm updates its own)
                with preserved(module), torch.no_grad():
                    hook = hooks.get(name)
                    value = (hook.compute_weight(module) if hook else getattr(module, name)).clone()
                self._copies[key] = (module, value, value._version)
            found.append((name, self._copies[key][1]))
        sources = {f"{name}_{part}" for name in hooks for part in "gv"}
        return found + [(n, p) for n, p in direct_params(module) if n not in sources]

    def commit(self) -> list[torch.Tensor]:
        """Write the changed copies back; the copies that could not be written."""
        return [
            value
            for (_, name), (module, value, version) in self._copies.items()
            if value._version != version and not _assign(module, name, value)
        ]

    def parametrized(self, model: nn.Module) -> dict[int, tuple[str, tuple[nn.Parameter, ...]]]:
        """id of each copy -> (its path in ``model``, the parameters it is computed from)."""
        paths = {id(m): p for p, m in model.named_modules()}
        found = {}
        for (_, name), (module, value, _) in self._copies.items():
            hooks, chains = _weight_norm_hooks(module), _chains(module)
            if name in hooks:
                sources = tuple(getattr(module, f"{name}_{part}") for part in "gv")
            else:
                sources = tuple(chains[name].parameters())
            path = paths[id(module)]
            found[id(value)] = (f"{path}.{name}" if path else name, sources)
        return found
