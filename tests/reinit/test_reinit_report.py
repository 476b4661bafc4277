"""`reinit_with_report`: the report's numbers are the ones applied, measured on the parameters.

A drawn tensor's root mean square (its mean is 0) is checked against the reported std within 4
standard errors: the relative standard error of a sample std is 1/sqrt(2n) for normal draws and
sqrt(0.2/n), smaller, for uniform ones. Constants are checked exactly.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
from checks import check_reinit_report
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import normprobe
from normprobe import reinit, reinit_with_report
from normprobe.models import TinyTransformer
from normprobe.reinit import deepnorm_constants

IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))


def quiet(call: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        return call(*args, **kwargs)


def test_gpt2_on_a_tiny_transformer_reports_the_std_it_drew() -> None:
    torch.manual_seed(0)
    model, report = reinit_with_report(TinyTransformer(depth=6), "gpt2", example_inputs=(IDS,))
    check_reinit_report(model, report)
    by_path = {c.path: c.treatment for c in report.changed}
    proj = by_path["blocks.3.mlp.proj.weight"]
    assert proj.std == pytest.approx(0.02 / math.sqrt(12)) and proj.formula == "0.02/sqrt(2*6)"
    assert by_path["blocks.3.mlp.fc.weight"].std == 0.02
    assert by_path["blocks.0.ln_1.weight"].value == 1.0 and by_path["ln_f.bias"].value == 0.0
    assert report.left == []


def test_reinit_is_unchanged_by_the_report() -> None:
    a = TinyTransformer(depth=2)
    b = copy.deepcopy(a)
    torch.manual_seed(1)
    returned = reinit(a, "xavier", example_inputs=(IDS,))
    torch.manual_seed(1)
    b, _ = reinit_with_report(b, "xavier", example_inputs=(IDS,))
    assert returned is a
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_48_block_model_reads_in_one_row_per_layer_of_a_block() -> None:
    _, report = reinit_with_report(TinyTransformer(depth=48), "gpt2", example_inputs=(IDS,))
    text = str(report)
    assert len(text.splitlines()) == 19  # title, header, 17 kinds of tensor
    assert "blocks.{0..47}.attn.proj.weight  normal std 0.002041  0.02/sqrt(2*48)" in text
    assert text.startswith(
        "reinit 'gpt2' (std=0.02, n_layers=None): 581 tensors set, 0 parameters left"
    )


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=96,
        n_positions=32,
        n_embd=64,
        n_layer=3,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def test_gpt2_on_hugging_face_gpt2_names_the_tied_head_once() -> None:
    model, report = quiet(reinit_with_report, _hf_gpt2(), "gpt2")
    check_reinit_report(model, report)
    wte = next(c for c in report.changed if c.path == "transformer.wte.weight")
    assert wte.aliases == ("lm_head.weight",)
    c_proj = [c for c in report.changed if c.path.endswith("mlp.c_proj.weight")]
    assert [c.treatment.formula for c in c_proj] == ["0.02/sqrt(2*3)"] * 3
    rows = [" ".join(line.split()) for line in str(report).splitlines()]
    assert "transformer.h.{0..2}.attn.c_proj.weight normal std 0.008165 0.02/sqrt(2*3)" in rows
    assert "transformer.wte.weight (also lm_head.weight) normal std 0.02 std=0.02" in rows


def test_deepnorm_reports_each_third_of_a_fused_qkv_and_the_fixed_scalers() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(depth=6, placement="post")
    model, report = reinit_with_report(model, "deepnorm", example_inputs=(IDS,))
    check_reinit_report(model, report)
    alpha, beta = deepnorm_constants(6)
    qkv = [c for c in report.changed if c.path == "blocks.2.attn.qkv.weight"]
    assert [c.outputs for c in qkv] == [(0, 64), (64, 128), (128, 192)]
    assert [c.treatment.std for c in qkv] == pytest.approx([1 / 8, 1 / 8, beta / 8])
    scalers = {c.path: c.treatment.value for c in report.scalers}
    assert scalers["blocks.5.mlp.proj.scale"] == pytest.approx(1 / alpha)
    assert len(scalers) == 12
    left = dict(report.left)
    assert left["blocks.0.ln_1.weight"] == "norm layer: deepnorm keeps norm gains and biases"
    assert left["tok.weight"] == "embedding: deepnorm leaves embeddings as they are"
    assert left["head.weight"] == "not on a residual branch"


def _resnet() -> nn.Module:
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    model = ResNet(BasicBlock, (2, 2, 2, 2), num_classes=10, channels=(16, 32, 64, 128))
    return quiet(normprobe.convert_norms, model, "identity")


def test_fixup_on_a_resnet_reports_he_times_its_depth_factor_and_the_new_scalars() -> None:
    images = torch.randn(2, 3, 32, 32)
    model, report = reinit_with_report(_resnet(), "fixup", example_inputs=(images,))
    check_reinit_report(model, report)
    by_path = {c.path: c for c in report.changed}
    conv1 = by_path["layer2.1.conv1.inner.weight"].treatment  # 32 * 3 * 3 outputs
    assert conv1.std == pytest.approx(math.sqrt(2 / (32 * 9)) * 8**-0.5)
    assert conv1.formula == "sqrt(2)/sqrt(fan_out 288)*L^(-1/(2m-2)), L=8, m=2"
    assert by_path["layer2.1.conv2.inner.weight"].treatment.value == 0.0
    shortcut = by_path["layer2.0.downsample.0.inner.weight"].treatment  # 1x1, 32 outputs
    assert shortcut.std == pytest.approx(math.sqrt(2 / 32))
    assert by_path["fc.inner.weight"].treatment.value == 0.0
    scale = by_path["layer2.1.conv2.scale"]
    assert scale.created and scale.treatment.value == 1.0
    created = [c.path for c in report.changed if c.created]
    scalars = ("bias_in", "bias_out", "scale")
    assert created == [n for n, _ in model.named_parameters() if n.rpartition(".")[2] in scalars]
    assert "created (build the optimizer after)" in str(report)


def test_fixup_says_it_left_a_tied_head() -> None:
    with pytest.warns(UserWarning, match="shared with"):
        model, report = quiet(reinit_with_report, _hf_gpt2(), "fixup", allow_norms=True)
    check_reinit_report(model, report)
    why = dict(report.left)["transformer.wte.weight"]
    assert why == "the head, tied to 'transformer.wte': fixup leaves it (zeroing it zeroes both)"


@pytest.mark.parametrize("distribution", ["normal", "uniform"])
def test_kaiming_and_xavier_report_the_fans_and_leave_embeddings(distribution: str) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(depth=2)
    model, report = reinit_with_report(
        model, "kaiming", example_inputs=(IDS,), distribution=distribution, mode="fan_out"
    )
    check_reinit_report(model, report)
    fc2 = next(c.treatment for c in report.changed if c.path == "blocks.1.mlp.proj.weight")
    assert fc2.how == distribution and fc2.std == pytest.approx(math.sqrt(2 / 64))
    assert fc2.formula == "1.414/sqrt(fan_out 64)"
    assert dict(report.left)["pos.weight"] == "embedding: kaiming leaves embeddings as they are"
    model, report = reinit_with_report(model, "xavier", example_inputs=(IDS,), gain=2.0)
    check_reinit_report(model, report)
    fc = next(c.treatment for c in report.changed if c.path == "blocks.0.mlp.fc.weight")
    assert fc.std == pytest.approx(2 * math.sqrt(2 / (64 + 256)))


def test_zero_branch_says_what_is_no_branch_end() -> None:
    model, report = reinit_with_report(
        TinyTransformer(depth=2), "zero_branch", example_inputs=(IDS,)
    )
    check_reinit_report(model, report)
    assert {c.path for c in report.changed} == {
        f"blocks.{i}.{m}.proj.{p}"
        for i in range(2)
        for m in ("attn", "mlp")
        for p in ("weight", "bias")
    }
    assert dict(report.left)["blocks.1.mlp.fc.weight"] == "not the last module of a residual branch"


class _Doubled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def test_a_parametrized_weight_is_reported_with_the_parameters_it_comes_from() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(depth=2)
    weight_norm(model.blocks[0].mlp.fc)
    parametrize.register_parametrization(model.blocks[1].mlp.fc, "weight", _Doubled())
    with pytest.warns(UserWarning, match="keeps its value"):
        model, report = reinit_with_report(model, "kaiming", example_inputs=(IDS,))
    check_reinit_report(model, report)
    normed = next(c for c in report.changed if c.path == "blocks.0.mlp.fc.weight")
    assert normed.parameters == (
        "blocks.0.mlp.fc.parametrizations.weight.original0",
        "blocks.0.mlp.fc.parametrizations.weight.original1",
    )
    why = dict(report.left)["blocks.1.mlp.fc.parametrizations.weight.original"]
    assert why == "its parametrization cannot be set to a given tensor: kept its value"
