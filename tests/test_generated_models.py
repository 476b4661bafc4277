"""Hypothesis builds random architectures; discovery must report what was built, and the probe,
`convert_norms` and `reinit` must work on each (or refuse with the documented error).

A `Spec` says how a model is built: depth (1-64 blocks, flat or nested in stages), the norm
class (torch's LayerNorm or RMSNorm, or a user's RMSNorm under an unusual name), its placement
(pre, post, sandwich, none) and QK-norm, residual or not, one or two branches per block, a
block shared (called twice) or registered under two names, tied embedding and head, dtype, and
the output (tensor, tuple or dict). The expected map follows from the spec alone.
"""

from __future__ import annotations

import copy
import math
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from checks import (
    NO_ADDS,
    NO_NORMS,
    NOT_POST_LN,
    TO_CHANNELS,
    Snapshot,
    check_conversion,
    check_reinit,
    hooks,
    no_hooks,
    tensors,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import normprobe
from normprobe import ModelMap

VOCAB = 16
TOKENS = 4
N_OUT = 4


class Levelizer(nn.Module):
    """A user's RMSNorm whose name and gain (``g``) say nothing: ``g * x / rms(x)``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


NORMS: dict[str, tuple[type[nn.Module], str]] = {
    "layernorm": (nn.LayerNorm, "layernorm"),
    "rmsnorm": (nn.RMSNorm, "rmsnorm"),
    "levelizer": (Levelizer, "rmsnorm"),
}


@dataclass(frozen=True)
class Spec:
    width: int
    stages: int  # 0: one flat stack `blocks`; n: `stages.i.blocks`, n stages
    per_stage: int  # blocks per stage (the whole depth when flat)
    norm: str
    placement: str  # pre, post, sandwich, none
    qk: bool
    final: bool
    residual: bool
    branches: tuple[str, ...]  # ("attn", "mlp") or ("mlp",)
    shared: str  # none, twice (a block called twice after the stack), alias (two names)
    tokens: bool
    tied: bool
    output: str  # tensor, tuple, dict
    dtype: torch.dtype

    @property
    def depth(self) -> int:
        return max(self.stages, 1) * self.per_stage

    @property
    def calls(self) -> int:
        """Block calls in one forward: the stack's blocks, plus the shared block twice."""
        return self.depth + (2 if self.shared == "twice" else 0)

    @property
    def block_norms(self) -> int:
        per_branch = {"pre": 1, "post": 1, "sandwich": 2, "none": 0}[self.placement]
        qk = 2 if self.qk and "attn" in self.branches else 0
        return per_branch * len(self.branches) + qk

    @property
    def has_norms(self) -> bool:
        return self.block_norms > 0 or self.final

    def expected_norms(self) -> int:
        blocks = self.depth + (1 if self.shared == "twice" else 0)
        return blocks * self.block_norms + int(self.final)


class Attention(nn.Module):
    def __init__(self, d: int, make_norm: Any) -> None:
        super().__init__()
        self.heads = 2
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        hd = d // self.heads
        self.q_norm = make_norm(hd) if make_norm is not None else None
        self.k_norm = make_norm(hd) if make_norm is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(x)))
        return out


class Block(nn.Module):
    """For each branch: ``x = x + f(n(x))`` (pre), ``n(x + f(x))`` (post), ``x + n2(f(n1(x)))``
    (sandwich) or ``x + f(x)``; without the residual, the same with ``x +`` left out."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        cls = NORMS[spec.norm][0]
        d = spec.width
        for b in spec.branches:
            qk_norm = cls if spec.qk and b == "attn" else None
            self.add_module(b, Attention(d, qk_norm) if b == "attn" else Mlp(d))
            if spec.placement in ("pre", "sandwich"):
                self.add_module(f"{b}_in", cls(d))
            if spec.placement == "sandwich":
                self.add_module(f"{b}_post", cls(d))
            if spec.placement == "post":
                self.add_module(f"{b}_out", cls(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.spec.placement
        for b in self.spec.branches:
            h = getattr(self, f"{b}_in")(x) if p in ("pre", "sandwich") else x
            h = getattr(self, b)(h)
            if p == "sandwich":
                h = getattr(self, f"{b}_post")(h)
            x = x + h if self.spec.residual else h
            if p == "post":
                x = getattr(self, f"{b}_out")(x)
        return x


class Stage(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.per_stage))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Net(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        d = spec.width
        self.inp: nn.Module = nn.Embedding(VOCAB, d) if spec.tokens else nn.Linear(d, d)
        self.stack = (
            nn.ModuleList(Stage(spec) for _ in range(spec.stages))
            if spec.stages
            else nn.ModuleList(Block(spec) for _ in range(spec.per_stage))
        )
        first = self.stack[0].blocks[0] if spec.stages else self.stack[0]
        if spec.shared == "twice":
            self.shared = Block(spec)
        elif spec.shared == "alias":
            self.alias = first
        self.final = NORMS[spec.norm][0](d) if spec.final else None
        self.head = nn.Linear(d, VOCAB if spec.tokens else N_OUT, bias=False)
        if spec.tied:
            self.head.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> Any:
        h = self.inp(x)
        for layer in self.stack:
            h = layer(h)
        if self.spec.shared == "twice":
            h = self.shared(self.shared(h))
        if self.final is not None:
            h = self.final(h)
        y = self.head(h)
        if self.spec.output == "tuple":
            return y, h
        if self.spec.output == "dict":
            return {"logits": y, "hidden": h}
        return y


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    # one model in eight is deep (up to 64 blocks); the rest stay small so 200 examples are quick
    deep = draw(st.integers(0, 7)) == 0
    if draw(st.booleans()):
        stages, per_stage = draw(st.integers(1, 4)), draw(st.integers(1, 16 if deep else 3))
    else:
        stages, per_stage = 0, draw(st.integers(7, 64) if deep else st.integers(1, 6))
    tokens = draw(st.booleans())
    return Spec(
        width=draw(st.sampled_from([8, 16])),
        stages=stages,
        per_stage=per_stage,
        norm=draw(st.sampled_from(list(NORMS))),
        placement=draw(st.sampled_from(["pre", "post", "sandwich", "none"])),
        qk=draw(st.booleans()),
        final=draw(st.booleans()),
        residual=draw(st.booleans()),
        branches=draw(st.sampled_from([("attn", "mlp"), ("mlp",)])),
        shared=draw(st.sampled_from(["none", "twice", "alias"])),
        tokens=tokens,
        tied=tokens and draw(st.booleans()),
        output=draw(st.sampled_from(["tensor", "tuple", "dict"])),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
    )


def _build(spec: Spec) -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    model = Net(spec).to(spec.dtype)
    if spec.tokens:
        return model, torch.randint(0, VOCAB, (2, TOKENS))
    return model, torch.randn(2, TOKENS, spec.width, dtype=spec.dtype)


def _loss(out: Any, x: torch.Tensor) -> torch.Tensor:
    y = tensors(out)[0]
    if y.shape[-1] == VOCAB and not x.is_floating_point():
        return F.cross_entropy(y.reshape(-1, VOCAB).float(), x.reshape(-1))
    return y.float().pow(2).mean()


def _stack_paths(spec: Spec) -> dict[str, int]:
    """Stacks discovery must report (two or more blocks in a chain), with their depths."""
    if not spec.stages:
        return {"stack": spec.per_stage} if spec.per_stage >= 2 else {}
    found = {"stack": spec.stages} if spec.stages >= 2 else {}
    if spec.per_stage >= 2:
        found |= {f"stack.{i}.blocks": spec.per_stage for i in range(spec.stages)}
    return found


def _check_map(spec: Spec, m: ModelMap) -> None:
    kind = NORMS[spec.norm][1]
    assert len(m.norms) == spec.expected_norms(), m
    assert all(n.kind == kind for n in m.norms), Counter(n.kind for n in m.norms)
    adds = spec.calls * len(spec.branches) if spec.residual else 0
    assert len(m.residual_adds) == adds, m
    stacks = {s.path: s.depth for s in m.stacks}
    expected_stacks = _stack_paths(spec)
    assert {p: stacks.get(p) for p in expected_stacks} == expected_stacks, m
    assert m.head == "head"
    if not spec.residual:
        return
    n_stack_blocks = spec.depth
    roles = Counter(n.role for n in m.norms)
    # a norm on an add's sum is "post" wherever it sits
    per_block = {
        "pre": {"pre": len(spec.branches)},
        "post": {"post": len(spec.branches)},
        "sandwich": {"pre": len(spec.branches), "sandwich-post": len(spec.branches)},
        "none": {},
    }[spec.placement]
    if spec.qk and "attn" in spec.branches:
        per_block = per_block | {"qk": 2}
    if spec.shared != "twice":  # the shared block's norms sit outside any stack
        expected = Counter({r: k * n_stack_blocks for r, k in per_block.items()})
        if spec.final:  # after the last block of a stack; with no stack, it normalizes the
            # last sum of a block without norms (post), or follows a normed block (other)
            lone = "post" if spec.placement == "none" else "other"
            expected["final" if _stack_paths(spec) else lone] += 1
        assert roles == expected, m
    placement = {"pre": "pre-ln", "post": "post-ln", "sandwich": "sandwich", "none": "no-norm"}
    inner = [p for p in expected_stacks if (p == "stack" and not spec.stages) or ".blocks" in p]
    for p in inner:
        assert m.stack(p).placement == placement[spec.placement], m
        assert m.stack(p).qk_norm == (spec.qk and "attn" in spec.branches), m


def _train(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = _loss(model(x), x)
        assert loss.isfinite(), loss
        loss.backward()
        opt.step()
        opt.zero_grad()


def _expect_convert(spec: Spec, target: str) -> str | None:
    """The words of the documented refusal, or None when the conversion must work."""
    if not spec.has_norms:
        return NO_NORMS
    if target in ("groupnorm", "batchnorm", "syncbatchnorm"):
        return TO_CHANNELS
    return None


def _expect_reinit(spec: Spec, scheme: str) -> str | None:
    if scheme in ("kaiming", "xavier"):
        return None
    if not spec.residual:
        return NO_ADDS
    # a block run twice links its post norms to the sums of its first run only: refused
    if scheme == "deepnorm" and (spec.placement != "post" or spec.shared == "twice"):
        return NOT_POST_LN
    return None


def _probe(model: nn.Module, x: torch.Tensor, baseline: Any, fault: bool) -> ModelMap:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as logs:
        # every=2: step 0 is logged, step 1 is not
        with normprobe.attach(model, optimizer=opt, log_dir=logs, every=2) as probe:
            _train(model, x, opt, 2)
            assert probe.latest is not None and probe.latest.step == 0
            values = probe.latest.scalars.values()
            assert all(math.isfinite(v) for v in values), probe.latest.scalars
        assert hooks(model) == baseline
        assert probe.model_map is not None
        if not fault:
            return probe.model_map
        norms = probe.model_map.norms
        last = model.get_submodule(norms[-1].path if norms else "head")

        def fail(*_: object) -> None:
            raise RuntimeError("boom inside forward")

        handle = last.register_forward_hook(fail)
        try:
            with normprobe.attach(model, optimizer=opt, log_dir=logs, every=1):
                _train(model, x, opt, 1)
            raise AssertionError("the forward did not raise")
        except RuntimeError as err:
            assert "boom" in str(err)
        handle.remove()
        assert hooks(model) == baseline, "a hook is left after an exception inside forward"
        return probe.model_map


TARGETS = ["layernorm", "rmsnorm", "groupnorm", "dyt", "identity", "batchnorm"]
SCHEMES = ["gpt2", "fixup", "deepnorm", "kaiming", "xavier", "zero_branch"]


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    spec=specs(),
    targets=st.lists(st.sampled_from(TARGETS), min_size=2, max_size=2, unique=True),
    scheme=st.sampled_from(SCHEMES),
    fault=st.integers(0, 3).map(lambda k: k == 0),
)
def test_generated_model(spec: Spec, targets: list[str], scheme: str, fault: bool) -> None:
    model, x = _build(spec)
    before = Snapshot.of(model)
    baseline = hooks(model)
    pristine = copy.deepcopy(model)

    # a probe over a few steps (its map is discovery's), then maybe an exception inside forward:
    # no hook left either way
    model_map = _probe(model, x, baseline, fault)
    _check_map(spec, model_map)
    assert [(p.dtype, p.device) for p in model.parameters()] == list(before.placement.values())

    for target in targets:
        converted = copy.deepcopy(pristine)
        start = Snapshot.of(converted)
        refusal = _expect_convert(spec, target)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                converted, report = normprobe.convert_norms_with_report(
                    converted, target, model_map=model_map
                )
            except ValueError as err:
                assert refusal is not None and refusal in str(err), (target, err)
                start.unchanged(converted)
                continue
        warned = " ".join(str(w.message) for w in caught)
        if refusal == NO_NORMS:
            assert NO_NORMS in warned and not report.conversions
            start.unchanged(converted)
            continue
        assert refusal is None, (target, report)
        assert len(report.conversions) + len(report.kept) == spec.expected_norms()
        check_conversion(converted, start, report)
        out = converted(x)
        assert all(t.isfinite().all() for t in tensors(out))
        assert all(t.dtype == spec.dtype for t in tensors(out))

    reinitialized = copy.deepcopy(pristine)
    start = Snapshot.of(reinitialized)
    refusal = _expect_reinit(spec, scheme)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # fixup's tied-head notice
            normprobe.reinit(reinitialized, scheme, example_inputs=(x,), model_map=model_map)
    except ValueError as err:
        assert refusal is not None and refusal in str(err), (scheme, err)
        start.unchanged(reinitialized)
        return
    assert refusal is None, scheme
    check_reinit(reinitialized, start, scheme)
    assert all(t.isfinite().all() for t in tensors(reinitialized(x)))


def test_probe_on_a_float64_model() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)).double()
    x = torch.randn(2, 8, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as logs:
        with normprobe.attach(model, optimizer=opt, log_dir=logs, every=1) as probe:
            _train(model, x, opt, 1)
        assert probe.latest is not None and probe.latest.scalars
    assert no_hooks(model)
