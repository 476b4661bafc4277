"""Discovery on real architectures: counts derived from each model's source (see
tests/helpers/zoo.py)."""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
import zoo
from hooks import hook_count

import normprobe


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.NAMES)
def test_discovery_matches_the_source(name: str) -> None:
    z = zoo.build(name)
    state = copy.deepcopy(z.model.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = normprobe.discover(z.model, *z.args, **z.kwargs)
    e = z.expected
    warned = [str(w.message) for w in caught if w.category is normprobe.DiscoveryWarning]
    assert len(warned) == (not e.norms) + (not e.residual_adds), warned
    assert dict(Counter(n.kind for n in m.norms)) == e.norms
    assert dict(Counter(n.role for n in m.norms)) == e.roles
    stacks = {s.path: (s.depth, s.placement) for s in m.stacks}
    assert stacks == e.stacks
    assert {p: len(m.adds_in(p)) for p in e.adds_per_stack} == e.adds_per_stack
    assert len(m.residual_adds) == e.residual_adds
    assert sum(a.kind == "projection" for a in m.residual_adds) == e.projection_adds
    found = {f"{a.module}#{a.ordinal}": a.branch_out for a in m.residual_adds if a.call == 0}
    assert {k: found.get(k) for k in e.branch_out} == e.branch_out
    writers = {f"{a.module}#{a.ordinal}": a.writers for a in m.residual_adds if a.call == 0}
    assert {k: writers.get(k) for k in e.writers} == e.writers
    assert len(m.attention) == e.attention
    assert m.head == e.head
    # read-only: the same state, no hook left
    after = z.model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], state[k]) for k in state)
    assert hook_count(z.model) == 0
    assert str(m).startswith(f"ModelMap of {type(z.model).__name__}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "gemma2", "control_flow"])
def test_fx_symbolic_trace_fails_where_discovery_works(name: str) -> None:
    # The runtime trace exists because symbolic tracing cannot follow these forwards.
    z = zoo.build(name)
    with pytest.raises(Exception):  # noqa: B017 - each fails differently inside torch.fx
        torch.fx.symbolic_trace(z.model)
    assert normprobe.discover(z.model, *z.args, **z.kwargs).residual_adds
