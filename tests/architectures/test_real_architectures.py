"""Every architecture of tests/helpers/zoo_hf.py, tests/helpers/zoo_vision.py and
tests/helpers/zoo_unseen.py (real Hugging Face, timm, torchvision, vit-pytorch, x-transformers,
pytorchcv and diffusers models: tiny configs, random weights) through what issues 12, 17 and 25
ask of them:

1. the map matches the ``Expected`` derived from the model's source, and discovery leaves the
   state and the model's own hooks (transformers installs some) exactly as they were;
2. ``reinit("gpt2")`` gives every parameter a stream writer applies std 0.02/sqrt(2N) and every
   other weight-layer matrix or kernel std 0.02;
3. converting every norm to its own kind leaves every output bit-identical;
4. a probe runs 3 training steps and leaves no hook;
5. ``diagnose`` on the model at init reports no large attention logits;
6. (tests/helpers/zoo_unseen.py) ``reinit("gpt2")`` either refuses or gives every writer the map of
   the source names std 0.02/sqrt(2N), N the depth of its stack in that map;
7. every action a doubt of the map names refuses and changes nothing;

and the "Tested on" section of docs/discovery.md lists every architecture whose map is right
(`discovery_page_rows`; ``PYTHONPATH=tests/helpers python
tests/architectures/test_real_architectures.py`` prints the rows). ``zoo_unseen.XFAIL`` names the
(model, check) pairs that fail today (strict xfail, issue 25).

Each model is built (``torch.manual_seed(0)``, ``eval()``) and discovered once (`_pristine`);
every test works on a deep copy.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo_hf
import zoo_unseen
import zoo_vision
from checks import tensors
from hooks import hook_count, hooks
from torch import nn
from zoo import Expected

import normprobe
from normprobe import ModelMap
from normprobe.diagnose import diagnose
from normprobe.surgery import TARGETS

BUILDERS: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any], Expected]]] = {
    **zoo_hf.BUILDERS,
    **zoo_vision.BUILDERS,
    **zoo_unseen.BUILDERS,
}
NAMES = list(BUILDERS)
ZOOS = (zoo_hf.BUILDERS, zoo_vision.BUILDERS, zoo_unseen.BUILDERS)
assert len(NAMES) == sum(len(z) for z in ZOOS), "a name in two zoos"

DISCOVERY_PAGE = Path(__file__).resolve().parents[2] / "docs" / "discovery.md"

# Models on which reinit(model, "gpt2") refuses because of a doubt of their map: the doubt's
# kind. vit-pytorch's MaxViT: its map still takes each layer's sublayers for stacks (issue 25
# class 11 on an unpacked list), and the run of adds crossing them is a nested-stacks doubt.
REINIT_REFUSALS: dict[str, str] = {"vitpt_maxvit": "nested-stacks"}

GPT2_STD = 0.02


pytestmark = pytest.mark.slow


def _params(check: str, names: list[str] = NAMES) -> list[Any]:
    """``names`` as parameters, those failing ``check`` today (zoo_unseen.XFAIL) marked xfail."""
    return [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=zoo_unseen.XFAIL[n, check]))
        if (n, check) in zoo_unseen.XFAIL
        else n
        for n in names
    ]


@dataclass(frozen=True)
class Built:
    """A model as its builder made it, and what one discovery of it found and changed."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    expected: Expected
    model_map: ModelMap
    state: dict[str, torch.Tensor]  # before discovery
    hooks: dict[str, tuple[int, ...]]  # per module, before discovery
    hook_count: int  # conftest.hook_count before discovery
    hooks_after: dict[str, tuple[int, ...]]
    hook_count_after: int


@functools.cache
def _pristine(name: str) -> Built:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, args, kwargs, expected = BUILDERS[name]()
    model.eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before, count = hooks(model), hook_count(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        model_map = normprobe.discover(model, *args, **kwargs)
    return Built(
        model, args, kwargs, expected, model_map, state, before, count, hooks(model),
        hook_count(model),
    )  # fmt: skip


def _fresh(name: str) -> tuple[nn.Module, Built]:
    built = _pristine(name)
    return copy.deepcopy(built.model), built


def _outputs(model: nn.Module, built: Built) -> list[torch.Tensor]:
    with torch.no_grad():
        return tensors(model(*built.args, **built.kwargs))


def _loss(out: Any) -> torch.Tensor:
    """The mean square of the output's first floating tensor (logits, hidden states)."""
    return tensors(out)[0].float().pow(2).mean()


# --------------------------------------------------------------------------------------------
# 1. the map


@pytest.mark.parametrize("name", _params("map"))
def test_map_matches_the_source(name: str) -> None:
    b = _pristine(name)
    m, e = b.model_map, b.expected
    after = b.model.state_dict()
    assert list(after) == list(b.state), "discovery changed the state_dict's keys"
    changed = [k for k, v in b.state.items() if not torch.equal(after[k], v)]
    assert not changed, f"discovery changed {changed[:5]}"
    assert b.hook_count_after == b.hook_count, (
        f"hooks {b.hook_count} before discovery, {b.hook_count_after} after"
    )
    assert b.hooks_after == b.hooks, "discovery moved hooks between modules or hook dicts"

    assert dict(Counter(n.kind for n in m.norms)) == e.norms, "norm kinds"
    assert dict(Counter(n.role for n in m.norms)) == e.roles, "norm roles"
    stacks = {s.path: (s.depth, s.placement) for s in m.stacks}
    assert stacks == e.stacks, "stacks (depth, placement)"
    assert {p: len(m.adds_in(p)) for p in e.adds_per_stack} == e.adds_per_stack, "adds per stack"
    assert len(m.residual_adds) == e.residual_adds, "residual adds"
    projections = sum(a.kind == "projection" for a in m.residual_adds)
    assert projections == e.projection_adds, "projection adds"
    found = {f"{a.module}#{a.ordinal}": a.branch_out for a in m.residual_adds if a.call == 0}
    assert {k: found.get(k) for k in e.branch_out} == e.branch_out, "branch_out"
    writers = {f"{a.module}#{a.ordinal}": a.writers for a in m.residual_adds if a.call == 0}
    assert {k: writers.get(k) for k in e.writers} == e.writers, "writers"
    gates = {f"{a.module}#{a.ordinal}": a.gates for a in m.residual_adds if a.call == 0}
    assert {k: gates.get(k) for k in e.gates} == e.gates, "gates"
    assert len(m.attention) == e.attention, f"attention: {[a.path for a in m.attention]}"
    assert m.head == e.head, "head"


# --------------------------------------------------------------------------------------------
# 2. reinit("gpt2")


def _depth(m: ModelMap, stack: str | None) -> int:
    """N of GPT-2's std/sqrt(2N): the add's stack's depth (the deepest stack, or the number of
    adds, outside one), as normprobe.reinit reads it."""
    if stack is not None:
        return m.stack(stack).depth
    return max((s.depth for s in m.stacks), default=len(m.residual_adds))


def _expected_stds(model: nn.Module, m: ModelMap) -> dict[str, tuple[float, str]]:
    """Parameter name -> (std reinit("gpt2") must give it, why): 0.02/sqrt(2N) for every
    parameter named by an add's ``writer_params``, 0.02 for every other parameter of 2+ dims of a
    weight layer; embeddings (and parameters tied to them) are left out."""
    names = {id(p): n for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    embedded = {
        id(p)
        for path in m.weight_layers
        if isinstance(modules[path], nn.Embedding | nn.EmbeddingBag)
        for p in modules[path].parameters(recurse=False)
    }
    want: dict[str, tuple[float, str]] = {}
    for a in m.residual_adds:
        n = _depth(m, a.stack)
        for param in a.writer_params:
            p = model.get_parameter(param)
            std = GPT2_STD / math.sqrt(2 * n)
            if names[id(p)] in want:
                assert want[names[id(p)]][0] == std, f"{param}: two depths from two adds"
            want[names[id(p)]] = (std, f"writer of {a.module}#{a.ordinal} (N={n})")
    for path in m.weight_layers:
        for p in modules[path].parameters(recurse=False):
            if p.ndim >= 2 and id(p) not in embedded and names[id(p)] not in want:
                want[names[id(p)]] = (GPT2_STD, f"weight of {path}")
    return want


def _tolerance(numel: int) -> float:
    """Relative error allowed on the std of ``numel`` normal samples (about 1/sqrt(2n))."""
    return max(0.05, 4 / math.sqrt(2 * numel))


@pytest.mark.parametrize("name", _params("gpt2"))
def test_gpt2_reinit_scales_every_stream_writer(name: str) -> None:
    model, b = _fresh(name)
    assert any(a.writer_params for a in b.model_map.residual_adds), "no add names its writers"
    want = _expected_stds(model, b.model_map)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            normprobe.reinit(model, "gpt2", example_inputs=b.args, example_kwargs=b.kwargs)
    except ValueError as err:
        assert name in REINIT_REFUSALS, f"reinit refused: {err}"
        assert REINIT_REFUSALS[name] in {d.kind for d in b.model_map.doubts_for("reinit")}
        assert REINIT_REFUSALS[name] in str(err)
        return
    assert name not in REINIT_REFUSALS, "reinit worked; expected a refusal"
    params = dict(model.named_parameters())
    wrong = []
    for param, (std, why) in want.items():
        p = params[param].detach().float()
        got = p.std().item()
        if abs(got - std) > _tolerance(p.numel()) * std:
            wrong.append(f"{param} ({why}): std {got:.5f}, want {std:.5f}")
    assert not wrong, f"{len(wrong)} of {len(want)} parameters: " + "; ".join(wrong[:4])


def _true_depth(e: Expected, writer: str) -> int:
    """N of the innermost stack of the source's map (``Expected``) holding ``writer``."""
    holding = [p for p in e.stacks if writer.startswith(p + ".")]
    assert holding, f"{writer} is in no stack of the expected map"
    return e.stacks[max(holding, key=len)][0]


@pytest.mark.parametrize("name", _params("true_gpt2", list(zoo_unseen.BUILDERS)))
def test_gpt2_reinit_refuses_or_follows_the_source(name: str) -> None:
    """No silent wrong answer: reinit("gpt2") refuses, or every writer the source names gets
    0.02/sqrt(2N) with N its stack's depth in the source, whatever the discovered map says."""
    model, b = _fresh(name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            normprobe.reinit(model, "gpt2", example_inputs=b.args, example_kwargs=b.kwargs)
    except ValueError:
        return
    modules = dict(model.named_modules())
    wrong = []
    for add, writers in b.expected.writers.items():
        for w in writers:
            weight = modules[w].get_parameter("weight").detach()
            due = GPT2_STD / math.sqrt(2 * _true_depth(b.expected, w))
            got = weight.std().item()
            if abs(got - due) > _tolerance(weight.numel()) * due:
                wrong.append(f"{w} (writer of {add}): std {got:.5f}, due {due:.5f}")
    assert not wrong, f"{len(wrong)} writers: " + "; ".join(wrong[:4])


# --------------------------------------------------------------------------------------------
# 3. convert_norms to each norm's own kind


def _glob(path: str) -> str:
    """A glob matching exactly ``path`` (``[``, ``]``, ``*`` and ``?`` escaped)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in path)


@pytest.mark.parametrize("name", _params("convert"))
def test_same_kind_conversion_is_bit_identical(name: str) -> None:
    model, b = _fresh(name)
    before = _outputs(model, b)
    assert before, "the model returned no floating tensor"
    policy = {_glob(n.path): n.kind if n.kind in TARGETS else None for n in b.model_map.norms}
    assert any(policy.values()), "no norm of a convertible kind"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.ConversionWarning)
        model = normprobe.convert_norms(
            model, policy, example_inputs=b.args, example_kwargs=b.kwargs
        )
    after = _outputs(model, b)
    assert len(after) == len(before)
    differ = [
        f"output {i}: max |diff| {(x - y).abs().max().item():.3g}"
        for i, (x, y) in enumerate(zip(after, before, strict=True))
        if not torch.equal(x, y)
    ]
    assert not differ, "; ".join(differ)


# --------------------------------------------------------------------------------------------
# 4. a probe over 3 training steps


@pytest.mark.parametrize("name", _params("probe"))
def test_probe_trains_three_steps_and_leaves_no_hook(name: str, tmp_path: Path) -> None:
    model, b = _fresh(name)
    model.train()  # dropout on, BatchNorm on batch statistics
    before, count = hooks(model), hook_count(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    with normprobe.attach(model, optimizer=opt, log_dir=str(tmp_path), every=1) as probe:
        for _ in range(3):
            loss = _loss(model(*b.args, **b.kwargs))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert probe.latest is not None and probe.latest.step == 2
        assert probe.latest.scalars, "a logged step wrote no scalar"
    assert not probe.attached
    assert all(math.isfinite(v) for v in losses), losses
    assert hook_count(model) == count, f"hooks {count} before attach, {hook_count(model)} after"
    assert hooks(model) == before


# --------------------------------------------------------------------------------------------
# 5. diagnose at init


def _batch(model: nn.Module, b: Built) -> tuple[Any, ...] | dict[str, Any]:
    """The example inputs as diagnose takes them: positional, or all by keyword."""
    if not b.kwargs:
        return b.args
    first = list(inspect.signature(model.forward).parameters)[: len(b.args)]
    return {**dict(zip(first, b.args, strict=True)), **b.kwargs}


@pytest.mark.parametrize("name", _params("diagnose"))
def test_diagnose_at_init_finds_no_large_attention_logits(name: str) -> None:
    model, b = _fresh(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = diagnose(model, _batch(model, b), loss_fn=_loss)
    assert "attention-logits" not in found.codes, str(found)
    status = found.checks["attention-logits"]
    assert status == ("ok" if b.expected.attention else "n/a: no attention modules"), status


# --------------------------------------------------------------------------------------------
# 7. doubts


def _actions(model: nn.Module, b: Built) -> dict[str, Callable[[nn.Module], object]]:
    """Each action a doubt can name, applied to the whole model."""
    io: dict[str, Any] = {"example_inputs": b.args, "example_kwargs": b.kwargs}
    own = {_glob(n.path): n.kind if n.kind in TARGETS else None for n in b.model_map.norms}
    return {
        "reinit": lambda m: normprobe.reinit(m, "gpt2", **io),
        # CaiT's init depends on the depth, which a depth doubt is about
        "insert_branch_scale": lambda m: normprobe.insert_branch_scale(
            m, "layerscale", init="cait", **io
        ),
        "convert_norms": lambda m: normprobe.convert_norms(m, own, **io),
    }


@pytest.mark.parametrize("name", NAMES)
def test_every_doubt_makes_its_actions_refuse(name: str) -> None:
    """No silent wrong answer: each action a doubt of the map names (applied to the whole
    model) raises a ValueError naming the doubt's module, and changes nothing."""
    model, b = _fresh(name)
    converted = {n.path for n in b.model_map.norms if n.kind in TARGETS}
    doubted: dict[str, list[str]] = {}
    for d in b.model_map.doubts:
        for action in d.affects:
            if action != "convert_norms" or converted & set(d.modules):
                doubted.setdefault(action, []).append(d.path)
    doubted.pop("metrics", None)
    if not doubted:
        pytest.skip("the map has no doubt that makes an action refuse")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for action, run in _actions(model, b).items():
        if action not in doubted:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError) as refusal:
                run(model)
        assert any(p in str(refusal.value) for p in doubted[action]), f"{action}: {refusal.value}"
        after = model.state_dict()
        assert list(after) == list(state), f"{action} changed the state_dict's keys"
        assert all(torch.equal(after[k], v) for k, v in state.items()), f"{action} changed weights"


# --------------------------------------------------------------------------------------------
# docs/discovery.md


def _placement(s: normprobe.Stack) -> str:
    text: str = s.placement
    if s.placement == "parallel":
        text += f" {s.norm_placement}"
    return text + (", repeated" if s.repeated else "")


def _block_writers(m: ModelMap) -> str:
    """The writers of block 0 of the first stack holding adds, relative to the block, one add
    after the other; the first block holding an add, named, where block 0 holds none."""
    for s in m.stacks:
        adds = [a for a in m.adds_in(s.path) if a.block is not None]
        if not adds:
            continue
        block = 0 if any(a.block == 0 for a in adds) else min(a.block or 0 for a in adds)
        prefix = s.blocks[block] + "."
        cells = [
            " + ".join(f"`{w.removeprefix(prefix)}`" for w in a.writers) or "(none)"
            for a in adds
            if a.block == block
        ]
        return ("" if block == 0 else f"(block {block}) ") + "; ".join(cells)
    return "—"


def discovery_page_row(name: str) -> str:
    b = _pristine(name)
    m = b.model_map
    library = type(b.model).__module__.split(".")[0]
    family = f"{library} `{type(b.model).__name__}`"
    stacks = "; ".join(f"`{s.path}` ({s.depth}, {_placement(s)})" for s in m.stacks) or "—"
    adds = str(len(m.residual_adds))
    projections = sum(a.kind == "projection" for a in m.residual_adds)
    if projections:
        adds += f" ({projections} projection)"
    return f"| {name} | {family} | {stacks} | {adds} | {_block_writers(m)} |"


def discovery_page_rows() -> list[str]:
    """A row for every architecture whose map is right (not marked xfail in zoo_unseen)."""
    return [discovery_page_row(name) for name in NAMES if (name, "map") not in zoo_unseen.XFAIL]


def _tested_on(page: str) -> str:
    head = "## Tested on\n"
    assert head in page, "docs/discovery.md has no '## Tested on' section"
    section = page.split(head, 1)[1]
    return section.split("\n#", 1)[0]


def test_the_discovery_page_lists_every_architecture() -> None:
    section = _tested_on(DISCOVERY_PAGE.read_text())
    lines = set(section.splitlines())
    missing = [row for row in discovery_page_rows() if row not in lines]
    assert not missing, (
        f"{len(missing)} rows missing from docs/discovery.md's Tested on (print them with "
        "`PYTHONPATH=tests/helpers python tests/architectures/test_real_architectures.py`): "
        f"{missing[:3]}"
    )
    header = "| name | family | stacks (depth, placement) | adds | writers of block 0 |"
    assert header in lines


if __name__ == "__main__":
    print("\n".join(discovery_page_rows()))
