"""A tensor the model changes in place after the probe read it is measured as it was read:
a BatchNorm's output before ``ReLU(inplace=True)`` and ``out += identity`` (every torchvision
ResNet), a residual stream before the next block's ``x += f(x)`` (without autograd)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normprobe


def _logged(model: nn.Module, x: torch.Tensor, steps: int, train: bool) -> list[dict[str, float]]:
    """The scalars of ``steps`` logged steps (every=1)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay as they are
    sink = normprobe.MemorySink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, every=1, sinks=[sink]) as probe:
            seen = []
            for _ in range(steps):
                out = model(x)
                if train:
                    out.float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                assert probe.latest is not None
                seen.append(dict(probe.latest.scalars))
    return seen


def test_batchnorm_outputs_of_a_torchvision_resnet_are_read_before_in_place_changes() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()  # running stats: repeatable
    x = torch.randn(2, 3, 32, 32)
    # what each BatchNorm hands on, copied as it leaves the module
    expected: dict[str, float] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm2d):

            def keep(m: nn.Module, args: Any, out: torch.Tensor, name: str = name) -> None:
                expected[name] = out.detach().float().pow(2).mean().sqrt().item()

            handles.append(module.register_forward_hook(keep))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    assert len(expected) == 20
    for scalars in _logged(model, x, 3, train=True):  # the first logged forward, and later ones
        read = {
            tag.split("/norm_out_rms/")[1]: v
            for tag, v in scalars.items()
            if "/norm_out_rms/" in tag
        }
        assert len(read) == 20
        for name, rms in expected.items():
            tag = next(t for t in read if t.replace("/", ".") == name)
            # every one of them is changed in place next (relu_, or out += identity): the
            # values after would differ by 10% or more
            assert read[tag] == pytest.approx(rms, rel=1e-5), name


class InPlaceBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += self.fc(self.ln(x))  # possible without autograd only
        return x


class InPlaceNet(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList([InPlaceBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


# streams of 128 entries, held to be reduced together, and of 73,728 (past `SMALL`), each
# reduced as it is read and kept, for the next block's cosine, as a copy
@pytest.mark.parametrize("rows", [8, 4608])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_stream_cosines_hold_under_in_place_residual_adds(mode: Any, rows: int) -> None:
    torch.manual_seed(0)
    model, x = InPlaceNet(), torch.randn(rows, 16)
    with torch.no_grad():  # by hand: a copy of every block's stream
        streams = [model.inp(x)]
        for block in model.blocks:
            streams.append(block(streams[-1].clone()))
    cosines = {
        i: F.cosine_similarity(streams[i], streams[i + 1], dim=-1).mean().item()
        for i in range(1, 4)
    }
    rms = {i: streams[i + 1].pow(2).mean().sqrt().item() for i in range(4)}
    with mode():
        logged = _logged(model, x, 3, train=False)
    for scalars in logged:
        for i, want in cosines.items():
            got = scalars[f"normprobe/resid_cos/blocks/{i}"]
            assert got == pytest.approx(want, rel=1e-5), (i, got, want)
            assert -1 <= got <= 1 and not math.isnan(got)
        for i, want in rms.items():
            assert scalars[f"normprobe/resid_rms/blocks/{i}"] == pytest.approx(want, rel=1e-5)


class ConvBnRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.relu(self.bn(self.conv(x))).mean((2, 3)))
        return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_graph_reads_the_batchnorm_output_before_relu_(backend: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = ConvBnRelu().eval(), torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        want = model.bn(model.conv(x)).pow(2).mean().sqrt().item()  # about 1.4x the post-ReLU
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = normprobe.Probe(
        model, optimizer=opt, every=1, persistent_hooks=True, sinks=[normprobe.MemorySink()]
    )
    probe.discover_now(x)
    run = torch.compile(model, backend=backend)
    try:
        for _ in range(3):
            run(x).sum().backward()
            opt.step()
            opt.zero_grad()
            assert probe.latest is not None
            assert probe.latest.scalars["normprobe/norm_out_rms/bn"] == pytest.approx(
                want, rel=1e-5
            )
    finally:
        probe.remove()


class SwitchingBlock(nn.Module):
    """``x + f(x)``, or ``x += f(x)`` once ``in_place`` is set (a model that changes its ways
    after the probe learned it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.in_place = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            x += self.fc(self.ln(x))
            return x
        return x + self.fc(self.ln(x))


def test_streams_changed_in_place_after_the_first_logged_forward_are_dropped_not_misread() -> None:
    torch.manual_seed(0)
    model = InPlaceNet()
    model.blocks = nn.ModuleList([SwitchingBlock(16) for _ in range(4)])
    x = torch.randn(8, 16)
    with torch.no_grad():  # by hand: every block's stream
        streams = [model.inp(x)]
        for block in model.blocks:
            streams.append(block(streams[-1]))
    rms = {i: streams[i + 1].pow(2).mean().sqrt().item() for i in range(4)}
    sink = normprobe.MemorySink()
    seen = []
    with torch.no_grad(), normprobe.attach(model, every=1, sinks=[sink]) as probe:
        for step in range(4):
            for block in model.blocks:
                assert isinstance(block, SwitchingBlock)
                block.in_place = step >= 2
            model(x)
            probe.step()
            assert probe.latest is not None
            seen.append(
                {
                    int(tag.rsplit("/", 1)[1]): value
                    for tag, value in probe.latest.scalars.items()
                    if tag.startswith("normprobe/resid_rms/blocks/")
                }
            )
    # steps 0 and 1: every block; step 2: the streams held to be reduced together were changed
    # by the next block before then, and only the last block's is left; step 3 reads each one
    # as it comes
    assert [sorted(s) for s in seen] == [[0, 1, 2, 3], [0, 1, 2, 3], [3], [0, 1, 2, 3]]
    for s in seen:
        for i, value in s.items():
            assert value == pytest.approx(rms[i], rel=1e-5)
