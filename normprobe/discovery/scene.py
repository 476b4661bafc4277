"""What the questions of discovery share while a map is built: the model, its traced graph, the
residual adds and stacks found so far, and where a module path sits among the blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..nested import Key
from .graph import Graph
from .residual import FoundAdd
from .stacks import FoundStack

Where = tuple[str | None, int | None]  # (stack, block) of an add or module; (None, None): none
# a boundary event: (node, hook, call, key) of where a value is seen at a module's boundary
Event = tuple[int, str, int, Key]


@dataclass
class Scene:
    """A model and its traced forward (``g``: None when discovery had no inputs), with what
    the builder has found so far; the steps of `normprobe.discovery.builder` fill it in order:
    norms and adds, then stacks and their blocks, then where each add sits."""

    model: nn.Module
    g: Graph | None
    notes: list[str] = field(default_factory=list)
    first_call: dict[str, int] = field(default_factory=dict)  # module path -> its first call
    adds: list[FoundAdd] = field(default_factory=list)
    runs: list[list[int]] = field(default_factory=list)  # the adds along each stream, in order
    weight_layers: set[str] = field(default_factory=set)
    stacks: list[FoundStack] = field(default_factory=list)
    blocks: dict[str, tuple[str, int]] = field(default_factory=dict)  # block path -> (stack, i)
    repeated: dict[str, str] = field(default_factory=dict)  # a repeated block -> its stack
    add_where: list[Where] = field(default_factory=list)  # per add
    _consumers: dict[int, list[int]] | None = None
    _seen_at: dict[int, list[tuple[int, Event]]] | None = None

    @property
    def graph(self) -> Graph:
        """The traced graph, for the questions only a traced forward answers."""
        assert self.g is not None
        return self.g

    def index_blocks(self, stacks: list[FoundStack]) -> None:
        """Take ``stacks`` as the model's: a path's blocks are found among its dotted prefixes."""
        self.stacks = stacks
        self.blocks = {
            b: (s.path, i)
            for s in stacks
            if not s.repeated
            for i, members in enumerate(s.members or [[b] for b in s.blocks])
            for b in members
        }
        self.repeated = {s.blocks[0]: s.path for s in stacks if s.repeated}

    def blocks_of(self, path: str) -> list[tuple[str, int | None]]:
        """(stack, block index) of every block containing ``path``, innermost first; a
        repeated block's index is None (it is every block of its stack)."""
        parts = path.split(".") if path else []
        prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        found: list[tuple[str, int | None]] = []
        for p in prefixes:
            if p in self.repeated:
                found.append((self.repeated[p], None))
            if p in self.blocks:
                found.append(self.blocks[p])
        return found

    def inside(self, path: str, stack: str) -> bool:
        return any(s == stack for s, _ in self.blocks_of(path))

    def stack_blocks(self, stack: str) -> list[str]:
        return next(s.blocks for s in self.stacks if s.path == stack)

    def where(self, path: str) -> Where:
        """The innermost (stack, block) holding ``path``."""
        found = self.blocks_of(path)
        return found[0] if found else (None, None)

    def around(self, path: str) -> set[tuple[str, int | None]]:
        """The blocks (stack, index) holding ``path``."""
        return set(self.blocks_of(path))

    def around_stack(self, stack: str) -> set[tuple[str, int | None]]:
        """The blocks of other stacks holding ``stack``'s blocks."""
        return {b for b in self.around(self.stack_blocks(stack)[0]) if b[0] != stack}

    def readers(self) -> dict[int, list[int]]:
        """Node -> the nodes computed from it."""
        if self._consumers is None:
            self._consumers = {}
            for n, inputs in enumerate(self.graph.inputs):
                for i in inputs:
                    self._consumers.setdefault(i, []).append(n)
        return self._consumers

    def seen_at(self, node: int) -> list[tuple[int, Event]]:
        """The module-boundary events that show the value of ``node``."""
        if self._seen_at is None:  # boundary events by the value they show, in one pass
            self._seen_at = {}
            g = self.graph
            for n, event in g.boundary.items():
                self._seen_at.setdefault(g.exact[n], []).append((n, event))
        return self._seen_at.get(node, [])


def within(path: str, block: str) -> bool:
    """Whether module ``path`` is ``block`` or inside it."""
    return path == block or path.startswith(block + ".")
