"""Discovery on small hand-built models: each rule checked where the answer is known by design."""

from __future__ import annotations

import copy
import math
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hooks import hook_count
from torch import nn

import normprobe
from normprobe.models import ResidualStack, TinyTransformer


class Scaler(nn.Module):
    """A user's RMSNorm under a name no pattern knows; ``outside`` puts eps outside the root."""

    def __init__(self, width: int, eps: float = 1e-3, outside: bool = False) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.eps = eps
        self.outside = outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = x.pow(2).mean(-1, keepdim=True)
        root = ms.sqrt() + self.eps if self.outside else (ms + self.eps).sqrt()
        return x / root * self.gain


class PreBlock(nn.Module):
    def __init__(self, width: int, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Net(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_residual_stack_lists_are_two_parallel_stacks_with_root_adds() -> None:
    # ResidualStack keeps 48 LayerNorms and 48 Linears in two ModuleLists and adds in the root's
    # loop: both lists are stacks, and each of the 48 adds writes through lins.i.
    for pre_ln, role, placement in ((True, "pre", "pre-ln"), (False, "post", "post-ln")):
        m = normprobe.discover(ResidualStack(48, 64, pre_ln=pre_ln), torch.randn(16, 64))
        assert {s.path: (s.depth, s.placement) for s in m.stacks} == {
            "lns": (48, placement),
            "lins": (48, placement),
        }
        assert len(m.residual_adds) == 48
        assert [a.ordinal for a in m.residual_adds] == list(range(48))
        assert {a.module for a in m.residual_adds} == {""}
        assert [a.branch_out for a in m.residual_adds] == [f"lins.{i}" for i in range(48)]
        assert [(a.stack, a.block) for a in m.residual_adds] == [("lins", i) for i in range(48)]
        assert {n.role for n in m.norms} == {role}
        assert m.head == "head"
    # execution order: Post-LN runs lins.0 before lns.0
    assert [s.path for s in m.stacks] == ["lins", "lns"]


def test_user_rmsnorm_is_found_by_behaviour_with_eps_placement() -> None:
    x = torch.randn(4, 8, 32)
    for outside, where in ((False, "inside-sqrt"), (True, "outside-sqrt")):
        model = Net([PreBlock(32, Scaler(32, 1e-3, outside)) for _ in range(3)])
        m = normprobe.discover(model, x)
        assert [n.path for n in m.norms] == [f"blocks.{i}.norm" for i in range(3)]
        n = m.norms[0]
        assert (n.kind, n.role, n.layout, n.dims) == ("rmsnorm", "pre", "channels-last", (32,))
        assert n.recognized_by.startswith("behaviour")
        assert (n.eps, n.eps_attr, n.eps_placement) == (1e-3, "eps", where)
        assert n.gain_offset == 0.0 and n.affine == ("gain",)
        assert m.stacks[0].placement == "pre-ln"


@pytest.mark.parametrize("scale", [1e-16, 1e-30, 1e4])
def test_a_user_rmsnorm_is_found_whatever_the_scale_of_its_input(scale: float) -> None:
    # a signal that vanished through many layers without norms (1e-16 at init) reaches a final
    # norm whose eps dominates it there: probed at a size where eps is negligible, it normalizes
    class Vanishing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = Scaler(32, 1e-6, False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.norm(x * scale)
            return out

    m = normprobe.discover(Vanishing(), torch.randn(4, 8, 32))
    assert [(n.path, n.kind, n.eps_placement) for n in m.norms] == [
        ("norm", "rmsnorm", "inside-sqrt")
    ]


@pytest.mark.parametrize(
    ("make", "kind", "layout"),
    [
        (lambda c: nn.BatchNorm2d(c), "batchnorm", "batch"),
        (lambda c: nn.GroupNorm(4, c), "groupnorm", "groups"),
        (lambda c: nn.InstanceNorm2d(c, affine=True), "instancenorm", "spatial"),
    ],
)
def test_torch_norm_classes(make: object, kind: str, layout: str) -> None:
    class ConvBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = make(16)  # type: ignore[operator]
            self.conv = nn.Conv2d(16, 16, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.conv(self.norm(x))

    m = normprobe.discover(Net([ConvBlock(), ConvBlock()]), torch.randn(2, 16, 8, 8))
    assert [(n.kind, n.layout, n.role) for n in m.norms] == [(kind, layout, "pre")] * 2
    assert m.norms[0].recognized_by.startswith("torch class")


def test_timm_norm_classes_by_class_and_behaviour() -> None:
    timm_layers = pytest.importorskip("timm.layers")
    x4 = torch.randn(2, 16, 8, 8)
    for make, kind, layout in (
        (timm_layers.LayerNorm2d, "layernorm", "channels-first"),  # LayerNorm over C of NCHW
        (timm_layers.BatchNormAct2d, "batchnorm", "batch"),  # BN + activation in one module
    ):
        model = nn.Sequential(make(16), nn.Conv2d(16, 16, 1))
        with pytest.warns(normprobe.DiscoveryWarning, match="no residual adds"):
            m = normprobe.discover(model, x4)
        assert (m.norms[0].kind, m.norms[0].layout) == (kind, layout)
        assert m.norms[0].recognized_by.startswith("subclass of nn.")
    with pytest.warns(normprobe.DiscoveryWarning):
        m = normprobe.discover(nn.Sequential(timm_layers.RmsNorm(32)), torch.randn(4, 32))
    n = m.norms[0]
    assert (n.kind, n.class_name, n.eps_placement) == ("rmsnorm", "RmsNorm", "inside-sqrt")
    assert n.recognized_by == "class name RmsNorm; kind by behaviour"


def test_gemma_style_gain_is_measured() -> None:
    class OnePlusRMS(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(width))
            self.eps = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return x * (1.0 + self.weight)

    m = normprobe.discover(Net([PreBlock(32, OnePlusRMS(32))]), torch.randn(4, 32))
    assert m.norms[0].gain_offset == 1.0
    assert m.norms[0].kind == "rmsnorm"


def test_non_residual_adds_are_rejected() -> None:
    # Position-embedding add, attention-mask add and tanh-GELU's internal add: none is residual.
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(32, 96)
            self.proj = nn.Linear(32, 32)
            self.register_buffer("mask", torch.triu(torch.full((8, 8), -1e9), 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            scores = q @ k.transpose(-1, -2) / math.sqrt(32) + self.mask
            return self.proj(scores.softmax(-1) @ v)

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 64)
            self.out = nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(F.gelu(self.fc(x), approximate="tanh"))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.randn(8, 32))
            self.attn = Attn()
            self.mlp = Mlp()
            self.manual_gelu = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.pos
            x = x + self.attn(x)
            h = self.manual_gelu(x)
            h = 0.5 * h * (1 + torch.tanh(0.79788 * (h + 0.044715 * h.pow(3))))
            return x + self.mlp(h)

    with pytest.warns(normprobe.DiscoveryWarning, match="no normalization"):
        m = normprobe.discover(Model(), torch.randn(2, 8, 32))
    assert [(a.module, a.ordinal, a.branch_out) for a in m.residual_adds] == [
        ("", 0, "attn.proj"),
        ("", 1, "mlp.out"),
    ]
    assert [(a.path, a.impl) for a in m.attention] == [("attn", "eager")]


def test_projection_shortcut_and_deepnorm_scale() -> None:
    class Down(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
            self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
            self.shortcut = nn.Conv2d(8, 16, 1, stride=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv2(F.relu(self.conv1(x))) + self.shortcut(x)

    with pytest.warns(normprobe.DiscoveryWarning):
        m = normprobe.discover(Down(), torch.randn(2, 8, 8, 8))
    (add,) = m.residual_adds
    assert (add.kind, add.branch_out, add.branch_layers) == (
        "projection",
        "conv2",
        ("conv1", "conv2"),
    )

    alpha = (2 * 4) ** 0.25
    m = normprobe.discover(
        TinyTransformer(placement="post", alpha=alpha), torch.randint(0, 96, (2, 16))
    )
    assert m.stacks[0].placement == "deepnorm"
    assert all(a.skip_scale == pytest.approx(alpha) for a in m.residual_adds)


def test_qk_norm_sandwich_and_final_roles() -> None:
    ids = torch.randint(0, 96, (2, 16))
    m = normprobe.discover(TinyTransformer(placement="sandwich", qk_norm=True), ids)
    roles = {n.path.split(".", 2)[-1]: n.role for n in m.norms if n.path.startswith("blocks.0.")}
    assert roles == {
        "ln_1": "pre",
        "ln_1_post": "sandwich-post",
        "ln_2": "pre",
        "ln_2_post": "sandwich-post",
        "attn.q_norm": "qk",
        "attn.k_norm": "qk",
    }
    assert m.norm("ln_f").role == "final"
    assert (m.stacks[0].placement, m.stacks[0].qk_norm) == ("sandwich", True)
    assert [a.impl for a in m.attention] == ["sdpa"] * 4


def test_data_dependent_control_flow_where_fx_fails() -> None:
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(PreBlock(16, nn.LayerNorm(16)) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                if x.norm() > 0:  # data-dependent: symbolic tracing cannot follow it
                    x = block(x)
            return x

    model = Gate()
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)
    m = normprobe.discover(model, torch.randn(3, 16))
    assert len(m.residual_adds) == 4
    assert m.stacks[0].placement == "pre-ln"


def test_nested_stacks_and_expert_lists() -> None:
    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + sum(e(x) for e in self.experts)  # every expert reads the same input

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(Experts(), Experts())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(x)

    with pytest.warns(normprobe.DiscoveryWarning, match="no normalization"):
        m = normprobe.discover(nn.Sequential(Stage(), Stage()), torch.randn(2, 16))
    assert [(s.path, s.depth, s.parent) for s in m.stacks] == [
        ("", 2, None),
        ("0.blocks", 2, ""),
        ("1.blocks", 2, ""),
    ]
    assert [(a.stack, a.block) for a in m.residual_adds] == [
        ("0.blocks", 0),
        ("0.blocks", 1),
        ("1.blocks", 0),
        ("1.blocks", 1),
    ]


def test_without_inputs_the_map_comes_from_the_module_tree() -> None:
    m = normprobe.discover(TinyTransformer(depth=3))
    assert not m.traced and m.residual_adds == []
    assert [s.path for s in m.stacks] == ["blocks"]
    assert len(m.norms) == 7
    assert "pass example inputs" in str(m)


def test_discovery_is_read_only() -> None:
    model = TinyTransformer(depth=2)
    model.train()
    model.blocks[0].eval()
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    state = copy.deepcopy(model.state_dict())
    modes = [m.training for m in model.modules()]
    hooks = hook_count(model)
    ids = torch.randint(0, 96, (2, 16))
    rng = torch.get_rng_state()
    normprobe.discover(model, ids)
    assert calls == [1]  # the model's own hooks run: a forward may need them
    assert hook_count(model) == hooks
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(after[k], state[k]) for k in state)
    handle.remove()


class ForcedWeightNormLinear(nn.Linear):
    """EDM2's forced weight normalization: in training, the forward writes its weight back
    normalized to unit rows (``self.weight.copy_``) before applying it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.weight.copy_(F.normalize(self.weight, dim=1))
        return F.linear(x, self.weight, self.bias)


def test_parameters_a_forward_writes_in_place_survive_discovery() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ForcedWeightNormLinear(8, 8), nn.ReLU(), ForcedWeightNormLinear(8, 8))
    before = copy.deepcopy(model.state_dict())
    normprobe.discover(model, torch.randn(4, 8))
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    model(torch.randn(4, 8))  # the forward itself still normalizes them: rows of norm 1
    torch.testing.assert_close(model[0].weight.norm(dim=1), torch.ones(8))


def test_batchnorm_running_stats_survive_discovery() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).train()
    before = copy.deepcopy(model.state_dict())
    with pytest.warns(normprobe.DiscoveryWarning):
        normprobe.discover(model, torch.randn(4, 3, 8, 8) * 5 + 2)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.training


def test_bad_inputs() -> None:
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module, got dict"):
        normprobe.discover({"not": "a model"})  # type: ignore[arg-type]
    model = TinyTransformer(depth=2)
    with pytest.raises(ValueError, match="exceeds the context") as info:
        normprobe.discover(model, torch.randint(0, 96, (1, 500)))
    assert "normprobe.discover ran one forward pass" in "".join(info.value.__notes__)
    assert hook_count(model) == 0


def test_hooks_removed_when_forward_raises_midway() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom in block 1")

    model = Net([PreBlock(8, nn.LayerNorm(8)), Boom()])
    with pytest.raises(RuntimeError, match="boom in block 1"):
        normprobe.discover(model, torch.randn(2, 8))
    assert hook_count(model) == 0


def test_no_norms_and_no_residuals_warn_and_render_empty_sections() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.warns(normprobe.DiscoveryWarning) as record:
        m = normprobe.discover(model, torch.randn(3, 4))
    assert len(record) == 2
    assert m.norms == [] and m.residual_adds == [] and m.stacks == []
    text = str(m)
    assert "Norms (0: none)\n  (none)" in text and "Residual adds (0)\n  (none)" in text
    assert m.head == "2"


def test_discover_on_first_forward_runs_once_on_real_inputs() -> None:
    model = ResidualStack(4, 16)
    maps: list[normprobe.ModelMap] = []
    normprobe.discover_on_first_forward(model, maps.append)
    out = model(torch.randn(2, 16))
    model(torch.randn(2, 16))
    assert out.shape == (2, 16)
    assert len(maps) == 1 and len(maps[0].residual_adds) == 4
    assert hook_count(model) == 0


def test_anchor_reads_equal_the_add_outputs() -> None:
    # Read every residual add at its anchor with plain hooks and compare with the values the
    # forward computed: the RMS must match the stream after each block.
    model = ResidualStack(6, 16)
    x = torch.randn(4, 16)
    m = normprobe.discover(model, x)
    modules = dict(model.named_modules())
    seen: dict[int, float] = {}
    handles = []
    for i, add in enumerate(m.residual_adds):
        anchor = add.anchor
        assert anchor is not None and anchor.hook == "pre"

        def read(mod: nn.Module, args: tuple[torch.Tensor, ...], i: int = i) -> None:
            seen[i] = float(args[0].detach().pow(2).mean().sqrt())

        handles.append(modules[anchor.module].register_forward_pre_hook(read))
    model(x)
    for h in handles:
        h.remove()
    h = x
    expected = []
    with torch.no_grad():
        for ln, lin in zip(model.lns, model.lins, strict=True):
            h = h + lin(ln(h))
            expected.append(float(h.pow(2).mean().sqrt()))
    assert [seen[i] for i in range(6)] == pytest.approx(expected, rel=1e-6)


def test_a_block_registered_under_two_names_keeps_its_first_name() -> None:
    # `alias` is stack.0 under a second name; named_modules() calls it stack.0, and so must every
    # part of the map: the stack keeps all 3 blocks and the first add belongs to stack.0
    class Aliased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stack = nn.ModuleList(PreBlock(8, nn.LayerNorm(8)) for _ in range(3))
            self.alias = self.stack[0]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.stack:
                x = block(x)
            return x

    m = normprobe.discover(Aliased(), torch.randn(2, 8))
    assert [(s.path, s.depth) for s in m.stacks] == [("stack", 3)]
    assert m.stacks[0].blocks == ("stack.0", "stack.1", "stack.2")
    assert [a.module for a in m.residual_adds] == ["stack.0", "stack.1", "stack.2"]
    assert [a.stack for a in m.residual_adds] == ["stack"] * 3
    assert [n.path for n in m.norms] == ["stack.0.norm", "stack.1.norm", "stack.2.norm"]


class _CollectingEncoder(nn.Module):
    """Reads, in its own forward, what forward hooks on its blocks collected (as transformers 5
    collects hidden states), and installs those hooks on its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(3)]
        )
        self.head = nn.Linear(24, 4)
        self.collected: list[torch.Tensor] | None = None
        self.installed = False

    def _collect(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if self.collected is not None:
            self.collected.append(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.installed:
            for b in self.blocks:
                b.register_forward_hook(self._collect)
            self.installed = True
        self.collected = []
        for b in self.blocks:
            x = x + b(x)
        states, self.collected = self.collected, None
        return self.head(torch.cat([states[0], states[1], states[2]], dim=-1))


def test_a_forward_that_needs_its_own_hooks_is_discovered_and_keeps_them() -> None:
    model = _CollectingEncoder()
    x = torch.randn(2, 5, 8)
    expected = model(x)
    hooks = hook_count(model)
    m = normprobe.discover(model, x)
    assert [a.writers for a in m.residual_adds] == [(f"blocks.{i}.1",) for i in range(3)]
    assert hook_count(model) == hooks
    fresh = _CollectingEncoder()  # hooks installed during discovery's own forward stay
    fresh.load_state_dict(model.state_dict())
    normprobe.discover(fresh, x)
    assert hook_count(fresh) == 3
    assert torch.equal(fresh(x), expected)


class _ScaledSandwich(nn.Module):
    """``x + gamma * post(fc(pre(x)))`` with the user's RMSNorm ``Scaler`` (its gain a plain
    multiply, like a layer scale's)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.pre = Scaler(width)
        self.fc = nn.Linear(width, width)
        self.post = Scaler(width)
        self.gamma = nn.Parameter(torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.post(self.fc(self.pre(x)))


def test_layer_scales_are_named_by_first_name_and_never_a_norms_gain() -> None:
    # blocks.0 is also `alias`: its scale is blocks.0.gamma only, and the sandwich norm's gain
    # (a multiply by a parameter, under either name) is no layer scale; the layer scale after
    # the sandwich norm leaves it the branch's sandwich-post norm
    model = Net([_ScaledSandwich(8) for _ in range(3)])
    model.alias = model.blocks[0]
    m = normprobe.discover(model, torch.randn(2, 8))
    assert [a.scales for a in m.residual_adds] == [(f"blocks.{i}.gamma",) for i in range(3)]
    assert [a.sandwich_norm for a in m.residual_adds] == [f"blocks.{i}.post" for i in range(3)]
    assert Counter(n.role for n in m.norms) == {"pre": 3, "sandwich-post": 3}
    assert m.stacks[0].placement == "sandwich"
    normprobe.reinit(model, "zero_branch", example_inputs=(torch.randn(2, 8),), model_map=m)
    assert all(not block.post.gain.any() for block in model.blocks)  # not the writers


class _FusedExperts(nn.Module):
    """Fused expert weights applied as ``F.linear(x, w[e])``, weighted by a router child."""

    def __init__(self, width: int, experts: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.w = nn.Parameter(torch.randn(experts, width, width) / math.sqrt(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [F.linear(x, w) for w in self.w]  # the experts run before their router
        gates = torch.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for e, y in enumerate(outs):
            out = out + gates[..., e : e + 1] * y
        return out


class _MoeBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.experts = _FusedExperts(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.experts(x)
        return out


def test_fixup_wraps_a_fused_expert_layer_around_its_wrapped_router() -> None:
    # the fused experts (a writer) hold their router (a branch layer): the router's scalars
    # go inside the experts' wrapper, where the experts' forward calls them
    model = Net([_MoeBlock(8) for _ in range(2)])
    x = torch.randn(2, 8)
    m = normprobe.discover(model, x)
    assert [(a.writers, a.writer_params, a.gates) for a in m.residual_adds] == [
        ((f"blocks.{i}.experts",), (f"blocks.{i}.experts.w",), (f"blocks.{i}.experts.router",))
        for i in range(2)
    ]
    normprobe.reinit(model, "fixup", example_inputs=(x,), model_map=m)
    keys = set(model.state_dict())
    assert {"blocks.0.experts.inner.w", "blocks.0.experts.inner.router.inner.weight"} <= keys
    assert not model.blocks[0].experts.inner.w.any()
    assert torch.equal(model(x), x)  # every branch starts at 0


class _SharedPostLN(nn.Module):
    """ALBERT's pattern: one Post-LN block ``ln(x + lin(x))`` run ``runs`` times."""

    def __init__(self, width: int = 8, runs: int = 4) -> None:
        super().__init__()
        self.runs = runs
        self.block = nn.ModuleDict({"lin": nn.Linear(width, width), "ln": nn.LayerNorm(width)})
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.runs):
            x = self.block["ln"](x + self.block["lin"](x))
        return self.head(x)


def test_a_shared_post_ln_block_has_its_norm_after_every_run() -> None:
    model = _SharedPostLN(runs=4)
    x = torch.randn(3, 8)
    m = normprobe.discover(model, x)
    assert len(m.residual_adds) == 4
    assert [a.post_norm for a in m.residual_adds] == ["block.ln"] * 4
    [stack] = m.stacks
    assert stack.repeated and stack.depth == 4
    # DeepNorm for N = 4 runs: the branch is scaled by 1 / alpha, alpha = (2N)^(1/4) = 8^(1/4)
    normprobe.reinit(model, "deepnorm", example_inputs=(x,))
    [scale] = normprobe.branch_scales(model).values()
    assert float(scale.scale) == pytest.approx(8**-0.25)


def test_a_norm_closing_the_last_block_of_a_res_post_norm_stack_is_final() -> None:
    # timm/models/swin_transformer_v2_cr.py: blocks normalize each branch's output
    # (x + norm1(attn(x)), res-post-norm) and the last stage's last block ends with norm3 on
    # its sum (extra_norm_stage): that norm closes the stack, it makes no block Post-LN
    from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr

    torch.manual_seed(0)
    model = SwinTransformerV2Cr(
        img_size=(32, 32),
        patch_size=4,
        window_size=(4, 4),
        embed_dim=16,
        depths=(2, 2),
        num_heads=(2, 2),
        num_classes=10,
    ).eval()
    m = normprobe.discover(model, torch.randn(2, 3, 32, 32))
    assert {s.path: s.placement for s in m.stacks} == {
        "stages": "in-branch",
        "stages.0.blocks": "in-branch",
        "stages.1.blocks": "in-branch",
    }
    assert m.norm("stages.1.blocks.1.norm3").role == "final"
    assert {n.role for n in m.norms if ".blocks." in n.path and "norm3" not in n.path} == {"branch"}
    with pytest.raises(ValueError, match="Post-LN"):  # no add of these stacks has a norm after it
        normprobe.reinit(model, "deepnorm", model_map=m)
