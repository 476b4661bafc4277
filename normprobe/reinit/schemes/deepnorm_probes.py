"""What ``deepnorm`` tells by behaviour, in extra read-only forwards: which stack is the decoder
of which (`EncoderReads`) and which projections are values (`ValueProbe`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...discovery import ResidualAdd
from ...nested import first_float, iter_tensors, replace_at
from ..target import Target, removing
from ..weights import out_dim


class EncoderReads:
    """Finds decoders by behaviour: the earlier stack's last block output is perturbed, and the
    floating-point inputs of each later stack's first block are compared with a plain run.

    A later stack reads the earlier one as a decoder reads its encoder when some input changes
    (the encoder's output, passed to cross-attention) while an input of the stream's shape (the
    block's own output shape) does not (the decoder's stream, which starts from its own
    embeddings). Where every stream-shaped input changes, the later stack continues the earlier
    one's stream (stages of one network); where none changes, the two are independent.
    """

    def __init__(self, t: Target) -> None:
        self.t = t

    def pairs(self, stacks: list[str]) -> list[tuple[str, str]]:
        """(encoder, decoder) stack pairs, in execution order."""
        self.t.require_inputs("tell an encoder-decoder from other stacks")
        firsts = {s: self.t.map.stack(s).blocks[0] for s in stacks}
        base = self._run(firsts, None)
        found = []
        for i, earlier in enumerate(stacks[:-1]):
            moved = self._run(firsts, self.t.map.stack(earlier).blocks[-1])
            for later in stacks[i + 1 :]:
                if self._reads_aside(base[later], moved[later]):
                    found.append((earlier, later))
        return found

    @staticmethod
    def _reads_aside(
        base: tuple[list[torch.Tensor], tuple[int, ...]],
        moved: tuple[list[torch.Tensor], tuple[int, ...]],
    ) -> bool:
        (before, stream), (after, _) = base, moved
        if len(before) != len(after):
            return False
        changed = [not torch.equal(b, a) for b, a in zip(before, after, strict=True)]
        kept_stream = any(b.shape == stream and not c for b, c in zip(before, changed, strict=True))
        return any(changed) and kept_stream

    def _run(
        self, firsts: dict[str, str], perturb: str | None
    ) -> dict[str, tuple[list[torch.Tensor], tuple[int, ...]]]:
        """Each stack's first block's floating inputs and output shape, in one forward with
        the output of the block at ``perturb`` (if any) shifted by noise."""
        t = self.t
        seen: dict[str, tuple[list[torch.Tensor], tuple[int, ...]]] = {}

        def read_in(stack: str) -> Any:
            def hook(_m: nn.Module, args: Any, kwargs: Any) -> None:
                if stack not in seen:  # its first call
                    inputs = [x for _, x in iter_tensors((args, kwargs)) if x.is_floating_point()]
                    seen[stack] = ([x.detach().clone() for x in inputs], ())

            return hook

        def read_out(stack: str) -> Any:
            def hook(_m: nn.Module, _args: Any, out: Any) -> None:
                found = first_float(out)
                if not seen[stack][1] and found is not None:
                    seen[stack] = (seen[stack][0], tuple(found.shape))

            return hook

        with removing() as handles:
            for stack, block in firsts.items():
                module = t.module(block)
                handles.append(module.register_forward_pre_hook(read_in(stack), with_kwargs=True))
                handles.append(module.register_forward_hook(read_out(stack)))
            if perturb is not None:
                handles.append(t.module(perturb).register_forward_hook(shift_output))
            t.observe()
        missing = [s for s in firsts if s not in seen]
        if missing:
            raise ValueError(
                f"{t.what}: the first block of stack {missing[0]!r} did not run in the forward "
                "with the given inputs; pass n_layers= or alpha= and beta="
            )
        return seen


def shift_output(_m: nn.Module, _args: Any, out: Any) -> Any:
    """The module's output with noise added to its first floating-point tensor."""
    for key, x in iter_tensors(out):
        if x.is_floating_point():
            noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
            return replace_at(out, key, x + noise.to(x.device, x.dtype) * (1 + x.abs().mean()))
    return out


class ValueProbe:
    """Tells value projections from query/key ones by behaviour.

    Doubling a value projection's output doubles the attention output exactly (attention is
    linear in V); doubling a query or key changes the softmax. Each candidate (and each third of a
    fused QKV output) is doubled in turn while the input of the branch's last layer is read.
    Blocks of one class share the answer, keyed by the layer's path inside its block.
    """

    def __init__(self, t: Target) -> None:
        self.t = t
        self.cache: dict[tuple[type, str], list[int]] = {}

    def find(self, add: ResidualAdd, candidates: list[str]) -> dict[str, list[int]]:
        """Layer path -> value parts: ``[-1]`` whole layer, ``[2]`` its last third, ``[]`` none."""
        found: dict[str, list[int]] = {}
        todo = []
        for path in candidates:
            key = self._key(add, path)
            if key is not None and key in self.cache:
                found[path] = self.cache[key]
            else:
                todo.append(path)
        if todo:
            self.t.require_inputs("tell value projections from query/key projections")
            out = self._writer_after(add, todo)
            base = self._read(out, None, None)
            for path in todo:
                parts = self._probe(out, path, base)
                found[path] = parts
                key = self._key(add, path)
                if key is not None:
                    self.cache[key] = parts
        if not any(found.values()):
            raise ValueError(
                f"deepnorm could not find the value projection among {candidates} (doubling "
                "none of them, nor any third of a fused q|k|v output, doubled the attention "
                f"output read at {list(add.writers)}); pass beta=1.0 to skip the value scaling, "
                "or re-initialize those layers yourself"
            )
        return {p: v for p, v in found.items() if v}

    def _writer_after(self, add: ResidualAdd, candidates: list[str]) -> str:
        """The writer the attention's projections feed: the one sharing their module (the
        attention of a parallel block), else the last."""
        for w in add.writers:
            parent = w.rpartition(".")[0]
            if any(c.startswith(parent + ".") for c in candidates):
                return w
        return add.writers[-1]

    def _key(self, add: ResidualAdd, path: str) -> tuple[type, str] | None:
        if add.stack is None or add.block is None:
            return None
        block = self.t.map.stack(add.stack).blocks[add.block]
        if not path.startswith(block + "."):
            return None
        return type(self.t.module(block)), path[len(block) :]

    def _probe(self, out_path: str, path: str, base: torch.Tensor) -> list[int]:
        if self._linear(self._read(out_path, path, None), base):
            return [-1]
        size = self._width(path)
        if size % 3:
            return []
        return [k for k in range(3) if self._linear(self._read(out_path, path, k), base)]

    def _width(self, path: str) -> int:
        layer = self.t.module(path)
        weight = next(p for _, p in self.t.applied.of(layer) if p.ndim >= 2)
        return weight.shape[out_dim(layer)]

    @staticmethod
    def _linear(doubled: torch.Tensor, base: torch.Tensor) -> bool:
        # doubling is exact in floating point, so a linear path gives 2 * base up to rounding
        return bool(
            torch.allclose(doubled, 2 * base, rtol=1e-4, atol=1e-6 * float(base.abs().max()))
        )

    def _read(self, out_path: str, double: str | None, part: int | None) -> torch.Tensor:
        t = self.t
        seen: list[torch.Tensor] = []

        def capture(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not seen:
                seen.append(args[0].detach().clone())

        def scale(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            if part is None:
                return out * 2
            size = out.shape[-1] // 3
            out = out.clone()
            out[..., part * size : (part + 1) * size] *= 2
            return out

        with removing() as handles:
            handles.append(t.module(out_path).register_forward_pre_hook(capture))
            if double is not None:
                handles.append(t.module(double).register_forward_hook(scale))
            t.observe()
        return seen[0]
