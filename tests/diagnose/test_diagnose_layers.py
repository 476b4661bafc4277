"""`diagnose` points at the layer: ``layer-jump`` on healthy models and on one layer scaled by
1e4 (its weight, its block's code, its backward), the Post-LN checks agreeing per stack, and the
two forms of ``loss_fn``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from hooks import hook_count
from torch import nn

from normprobe.cli import main
from normprobe.diagnose import DiagnoseInputError, Diagnosis, diagnose
from normprobe.diagnose.layers import JUMP_MIN, role
from normprobe.models import TinyTransformer


def tokens(batch: int = 4, length: int = 32) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length))


def tiny(depth: int = 6, **kw: Any) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(width=32, depth=depth, **kw)


def jump_max(result: Diagnosis) -> float:
    return max(v for k, v in result.measurements.items() if k.startswith("diagnose/jump_max/"))


def test_role_puts_block_indices_as_stars() -> None:
    assert role("model.layers.11.mlp.down_proj") == "model.layers.*.mlp.down_proj"
    assert role("layer2.0.conv1") == "layer2.*.conv1"
    assert role("3") == "*"


def _resnet() -> tuple[nn.Module, torch.Tensor]:
    from timm.models.resnet import BasicBlock, ResNet

    # 3 blocks in the first stage: peers to compare (resnet18's 2 per stage have one each)
    return ResNet(BasicBlock, [3, 2, 2, 2], num_classes=10), torch.randn(8, 3, 32, 32)


def _zoo(name: str) -> tuple[nn.Module, Any]:
    z = zoo.build(name)
    return z.model, ({"input_ids": z.args[0], **z.kwargs} if z.kwargs else z.args)


HEALTHY = {
    "pre-ln": lambda: (tiny(), tokens()),
    "post-ln": lambda: (tiny(placement="post"), tokens()),
    "gpt2": lambda: _zoo("gpt2"),
    "llama": lambda: _zoo("llama"),
    "vit": lambda: _zoo("vit"),
    "resnet": _resnet,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_healthy_models_have_no_layer_jump(name: str) -> None:
    # at init same-role layers draw their weights from one distribution: their gains stay within
    # 2.1x of each other here (resnet50: 2.03), a third of JUMP_MIN at most
    torch.manual_seed(0)
    model, batch = HEALTHY[name]()
    result = diagnose(model, batch)
    assert result.checks["layer-jump"] == "ok"
    assert 1.0 <= jump_max(result) < JUMP_MIN / 3


def test_layer_scaled_by_1e4_is_named_with_its_block() -> None:
    model, ids = tiny(), tokens()
    with torch.no_grad():
        model.blocks[2].mlp.proj.weight.mul_(1e4)
    result = diagnose(model, ids)
    finding = next(f for f in result.findings if f.code == "layer-jump")
    assert finding.paths == ("blocks.2.mlp.proj",)
    assert finding.title.startswith("`blocks.2.mlp.proj` (block 2 of `blocks`) scales its output")
    # the weight is 1e4x, so are its forward and backward gains against its 5 peers
    measured = result.measurements
    assert measured["diagnose/output_jump/blocks.2.mlp.proj"] == pytest.approx(1e4, rel=0.2)
    assert measured["diagnose/gradient_jump/blocks.2.mlp.proj"] == pytest.approx(1e4, rel=0.2)
    assert "std=0.02" in finding.suggestion and "gpt2" not in finding.suggestion
    # the stream's growth is that one jump: the finding says where, and no global re-init
    growth = next(f for f in result.findings if f.code == "residual-growth")
    assert "jumps at block 2" in growth.title
    assert "blocks.2.mlp.proj" in growth.suggestion and "gpt2" not in growth.suggestion
    # the unscaled writes still say what they are: N(0, 0.02) like the other layers
    assert measured["diagnose/write_std_ratio/blocks"] == pytest.approx(1.0, abs=0.05)


def test_hugging_face_layer_is_named_by_its_module_path() -> None:
    model, batch = _zoo("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1e4)
    result = diagnose(model, batch)
    finding = result.findings[0]
    assert finding.code == "layer-jump"
    assert finding.paths == ("model.layers.1.mlp.down_proj",)
    assert "(block 1 of `model.layers`)" in finding.title
    doc = result.to_dict()
    assert doc["checks"]["layer-jump"] == {"status": "found", "reason": None}
    assert doc["measurements"]["diagnose/output_jump/model.layers.1.mlp.down_proj"] > 1e3


class Scaled(nn.Module):
    """``inner(x) * scale``: a scale in a block's code, not in a weight."""

    def __init__(self, inner: nn.Module, scale: float) -> None:
        super().__init__()
        self.inner = inner
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def test_scale_in_a_blocks_code_names_the_block() -> None:
    model, ids = tiny(), tokens()
    model.blocks[2].mlp = Scaled(model.blocks[2].mlp, 1e4)
    result = diagnose(model, ids)
    finding = next(f for f in result.findings if f.code == "layer-jump")
    assert finding.paths == ("blocks.2",)
    assert "jumps" in finding.title and "at block 2" in finding.title
    assert "no weight layer of `blocks.2` stands out" in finding.suggestion
    assert not any(k.startswith("diagnose/output_jump/") for k in result.measurements)
    growth = next(f for f in result.findings if f.code == "residual-growth")
    assert "blocks.2" in growth.suggestion and "gpt2" not in growth.suggestion


def test_backward_scaled_by_a_hook_names_the_layer() -> None:
    model, ids = tiny(), tokens()
    handle = model.blocks[2].mlp.proj.register_full_backward_hook(
        lambda mod, grad_in, grad_out: tuple(None if g is None else g * 1e4 for g in grad_in)
    )
    hooks = hook_count(model)
    try:
        result = diagnose(model, ids)
    finally:
        handle.remove()
    assert hook_count(model) == hooks - 1
    (finding,) = [f for f in result.findings if f.code == "layer-jump"]
    assert finding.paths == ("blocks.2.mlp.proj",)
    assert "scales its gradient" in finding.title
    assert "backward hook" in finding.suggestion
    assert result.measurements["diagnose/gradient_jump/blocks.2.mlp.proj"] == pytest.approx(
        1e4, rel=0.2
    )
    assert "diagnose/output_jump/blocks.2.mlp.proj" not in result.measurements
    assert result.checks["residual-growth"] == "ok"  # the forward is untouched


def _verdicts_agree(result: Diagnosis) -> None:
    text = str(result)
    passed = next((line for line in text.splitlines() if line.startswith("Passed: ")), "")
    for code, status in result.checks.items():
        assert (status == "found") == (code in result.codes), code
        if code in result.codes:
            assert code not in passed, code


@pytest.mark.slow
def test_deep_post_ln_checks_agree() -> None:
    # 24 Post-LN blocks fed embeddings of RMS 1 (the first norm then does not amplify block 0's
    # gradient): the top block gets 4.2x the first one's gradient
    model = tiny(depth=24, placement="post")
    with torch.no_grad():
        model.tok.weight.normal_()
        model.pos.weight.normal_()
    result = diagnose(model, tokens())
    assert result.codes == ["post-ln-top-heavy", "post-ln-warmup"]
    warmup = result.findings[1]
    assert "top-heavy: post-ln-top-heavy" in " ".join(warmup.evidence)
    _verdicts_agree(result)
    # with TinyTransformer's small embeddings block 0 gets the most: only the warmup is flagged
    plain = diagnose(tiny(depth=24, placement="post"), tokens())
    assert plain.codes == ["post-ln-warmup"]
    _verdicts_agree(plain)


# --- loss_fn ------------------------------------------------------------------------------------


def _linear() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(4, 4), torch.arange(8.0).reshape(2, 4)


def test_loss_fn_of_output_or_of_output_and_batch() -> None:
    model, x = _linear()
    out = model(x).detach()

    def with_default(output: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return output.sum() if reduction == "sum" else output.mean()

    def star(*args: Any) -> torch.Tensor:
        return (args[0] * args[1]).sum()

    cases = {
        "output": (lambda output: output.sum(), out.sum()),
        "output, batch": (lambda output, batch: (output * batch).sum(), (out * x).sum()),
        "a default": (with_default, out.sum()),  # batch is not passed as `reduction`
        "*args": (star, (out * x).sum()),
    }
    for name, (fn, expected) in cases.items():
        assert diagnose(model, x, fn).loss == pytest.approx(float(expected)), name


def test_loss_fn_of_another_signature_is_refused() -> None:
    model, x = _linear()

    def three(output: Any, batch: Any, target: Any) -> torch.Tensor:
        return output.sum()

    def keyword(output: Any, *, target: Any) -> torch.Tensor:
        return output.sum()

    expected = r"loss_fn\(output\) or loss_fn\(output, batch\)"
    for fn in (three, keyword, lambda: torch.tensor(0.0)):
        with pytest.raises(DiagnoseInputError, match=expected):
            diagnose(model, x, fn)  # type: ignore[arg-type]
    with pytest.raises(DiagnoseInputError, match="three\\(output, batch, target\\)"):
        diagnose(model, x, three)  # type: ignore[arg-type]
    with pytest.raises(DiagnoseInputError, match=r"loss_fn\(output, batch\), got int"):
        diagnose(model, x, 3)  # type: ignore[arg-type]


ENTRY = """
import torch
from torch import nn


def _model():
    torch.manual_seed(0)
    return nn.Linear(4, 4), torch.arange(8.0).reshape(2, 4)


def two():
    model, x = _model()
    return model, x, lambda output, batch: (output * batch).sum()


def three():
    model, x = _model()
    return model, x, lambda output, batch, target: output.sum()
"""


@pytest.fixture
def entry_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> str:
    name = f"np_loss_entry_{request.node.name}"
    (tmp_path / f"{name}.py").write_text(ENTRY)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --path edits sys.path
    return name


def test_cli_loss_fn_forms(
    entry_module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["diagnose", f"{entry_module}:two", "--path", str(tmp_path), "--json"])
    assert status in (0, 1)
    torch.manual_seed(0)
    model, x = nn.Linear(4, 4), torch.arange(8.0).reshape(2, 4)
    expected = float((model(x) * x).sum().detach())
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(expected, rel=1e-5)

    assert main(["diagnose", f"{entry_module}:three", "--path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{entry_module}:three: loss_fn must be callable as loss_fn(output) or " in err
    assert "(output, batch, target)" in err


def test_cli_help_states_the_loss_fn_signature(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["diagnose", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "loss_fn is called as loss_fn(output), or as loss_fn(output, batch)" in text
