"""convert_norms: checked against numbers derived by hand and on real models from
tests/helpers/zoo.py."""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import zoo
from hooks import hook_count
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import normprobe
from normprobe.layers import BatchNormNd, DyT, LayerNorm2d, RMSNorm2d
from normprobe.models import TinyTransformer
from normprobe.surgery import (
    HYBRIDNORM,
    TARGETS,
    ConversionWarning,
    convert_norms,
    convert_norms_with_report,
)
from normprobe.surgery.builders import BUILDERS, NormSpec, create_norm
from normprobe.surgery.targets import CLASS_NAMES

# Two rows with zero mean. Mean squares: (1+1+4+4+9+9)/8 = 3.5 and (16+16+1+1)/8 = 4.25; after
# adding 1 to every element they become 3.5 + 1 = 4.5 and 4.25 + 1 = 5.25 (the cross term is 0).
ROWS = torch.tensor([[1.0, -1, 2, -2, 3, -3, 0, 0], [4, -4, 0, 0, 0, 0, 1, -1]])
MEAN_SQ = torch.tensor([[3.5], [4.25]])
GAIN = torch.arange(1, 9) / 4
EPS = 1e-5


def _kinds(model: nn.Module, *args: object, **kwargs: object) -> dict[str, int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        found = normprobe.discover(model, *args, **kwargs)
    return dict(Counter(n.kind for n in found.norms))


def _train(
    model: nn.Module, loss_fn: Callable[[], torch.Tensor], opt: torch.optim.Optimizer
) -> list[float]:
    """20 steps on one fixed batch; the loss must stay finite and go down."""
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] and sum(losses[-5:]) < sum(losses[:5]), losses
    return losses


def _classify(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    labels = torch.arange(x.shape[0]) % 10
    return lambda: F.cross_entropy(model(x), labels)


# ------------------------------------------------------------------------------------------------
# check [b]: LayerNorm and RMSNorm agree on zero-mean rows, and only LayerNorm ignores a shift


def test_layernorm_to_rmsnorm_agrees_on_zero_mean_rows_and_not_after_a_shift() -> None:
    ln = nn.LayerNorm(8, eps=EPS, bias=False)
    with torch.no_grad():
        ln.weight.copy_(GAIN)
    rms = convert_norms(ln, "rmsnorm")
    assert type(rms) is nn.RMSNorm and rms is not ln  # a root norm comes back as a new object
    assert rms.weight is ln.weight and rms.eps == EPS
    expected = ROWS / torch.sqrt(MEAN_SQ + EPS) * GAIN
    torch.testing.assert_close(ln(ROWS), expected)
    torch.testing.assert_close(rms(ROWS), expected)
    torch.testing.assert_close(ln(ROWS + 1), expected)  # LayerNorm re-centers
    shifted = (ROWS + 1) / torch.sqrt(MEAN_SQ + 1 + EPS) * GAIN
    torch.testing.assert_close(rms(ROWS + 1), shifted)  # RMSNorm only rescales
    assert (rms(ROWS + 1) - ln(ROWS + 1)).abs().max() > 0.3


def test_rmsnorm_to_layernorm_agrees_on_zero_mean_rows_and_not_after_a_shift() -> None:
    rms = nn.RMSNorm(8, eps=EPS)
    with torch.no_grad():
        rms.weight.copy_(GAIN)
    ln = convert_norms(rms, "layernorm")
    assert type(ln) is nn.LayerNorm and ln.weight is rms.weight and ln.bias is None
    expected = ROWS / torch.sqrt(MEAN_SQ + EPS) * GAIN
    torch.testing.assert_close(ln(ROWS), expected)
    torch.testing.assert_close(rms(ROWS), expected)
    torch.testing.assert_close(ln(ROWS + 1), expected)
    torch.testing.assert_close(rms(ROWS + 1), (ROWS + 1) / torch.sqrt(MEAN_SQ + 1 + EPS) * GAIN)


class _HFNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.llama = LlamaRMSNorm(16, eps=1e-6)
        self.gemma = GemmaRMSNorm(16, eps=1e-6)
        with torch.no_grad():
            self.llama.weight.normal_(1.0, 0.2)
            self.gemma.weight.normal_(0.0, 0.2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.llama(x), self.gemma(x)


@pytest.mark.parametrize("traced", [False, True])
def test_llama_and_gemma_rmsnorm_become_nn_rmsnorm_bit_identically(traced: bool) -> None:
    model = _HFNorms()
    x = torch.randn(2, 5, 16)
    llama_out, gemma_out = model(x)
    gemma_weight = model.gemma.weight
    gemma_before = gemma_weight.detach().clone()
    model, report = convert_norms_with_report(
        model, "rmsnorm", example_inputs=(x,) if traced else None
    )
    assert type(model.llama) is nn.RMSNorm and type(model.gemma) is nn.RMSNorm
    assert model.llama.eps == model.gemma.eps == 1e-6
    new_llama, new_gemma = model(x)
    assert torch.equal(new_llama, llama_out) and torch.equal(new_gemma, gemma_out)
    # Gemma's x_hat * (1 + w) is folded into the same Parameter: w + 1
    assert model.gemma.weight is gemma_weight
    assert torch.equal(gemma_weight.detach(), gemma_before + 1)
    assert [c.max_abs_diff for c in report.conversions] == [0.0, 0.0]
    assert any("1 + weight" in n for c in report.conversions for n in c.notes)


# ------------------------------------------------------------------------------------------------
# real models from configs


def test_llama_rmsnorm_to_layernorm_trains_and_converts_back_exactly() -> None:
    z = zoo.build("llama")
    ids = z.args[0]
    with torch.no_grad():
        logits = z.model(*z.args, **z.kwargs).logits
    params = [p for _, p in z.model.named_parameters()]
    keys = list(z.model.state_dict())
    opt = torch.optim.Adam(z.model.parameters(), lr=1e-3)  # built before: must stay valid
    model = convert_norms(z.model, "layernorm", example_inputs=z.args, example_kwargs=z.kwargs)
    assert _kinds(model, *z.args, **z.kwargs) == {"layernorm": 9}
    assert all(a is b for a, (_, b) in zip(params, model.named_parameters(), strict=True))
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        as_layernorm = model(*z.args, **z.kwargs).logits
        assert not torch.allclose(as_layernorm, logits, atol=1e-3)  # LayerNorm re-centers
        model = convert_norms(model, "rmsnorm")  # back, without example inputs
        assert torch.equal(model(*z.args, **z.kwargs).logits, logits)
    assert _kinds(model, *z.args, **z.kwargs) == {"rmsnorm": 9}
    model = convert_norms(model, "layernorm", example_inputs=z.args, example_kwargs=z.kwargs)
    _train(model, lambda: model(ids, labels=ids, use_cache=False).loss, opt)


def test_bert_layernorm_to_rmsnorm_drops_the_biases_from_model_and_optimizer() -> None:
    z = zoo.build("bert")
    opt = torch.optim.AdamW(z.model.parameters(), lr=1e-3)
    biases = {f"{n.path}.bias" for n in normprobe.discover(z.model).norms}
    model, report = convert_norms_with_report(
        z.model, "rmsnorm", optimizer=opt, example_inputs=z.args, example_kwargs=z.kwargs
    )
    assert _kinds(model, *z.args, **z.kwargs) == {"rmsnorm": 9}
    assert len(biases) == 9 and set(report.removed_keys) == biases
    assert set(report.removed_parameters) == biases and report.optimizer_updated
    held = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in model.parameters()}
    assert all(c.dropped == ("bias",) for c in report.conversions)
    assert re.search(
        r"\n  encoder\.layer\.\{0\.\.3\}\.output\.LayerNorm +LayerNorm +RMSNorm", str(report)
    )
    target = torch.ones(2, 16, 64)

    def loss() -> torch.Tensor:
        return F.mse_loss(model(*z.args, **z.kwargs).last_hidden_state, target)

    _train(model, loss, opt)


@pytest.mark.slow
def test_resnet_batchnorm_to_groupnorm_drops_running_statistics() -> None:
    z = zoo.build("resnet18")
    model, report = convert_norms_with_report(
        z.model, "groupnorm", example_inputs=z.args, num_groups=32
    )
    assert _kinds(model, *z.args) == {"groupnorm": 20}
    assert {m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)} == {32}
    assert len(report.removed_keys) == 20 * 3  # running_mean, running_var, num_batches_tracked
    assert all(
        k.endswith(("running_mean", "running_var", "num_batches_tracked"))
        for k in report.removed_keys
    )
    model.train()
    _train(model, _classify(model, *z.args), torch.optim.Adam(model.parameters(), lr=1e-3))


def test_vit_layernorm_to_dyt_adds_alpha_to_the_existing_optimizer() -> None:
    z = zoo.build("vit")
    paths = [n.path for n in normprobe.discover(z.model).norms]
    opt = torch.optim.Adam(
        [
            {"params": [p for n, p in z.model.named_parameters() if "norm" in n], "lr": 2e-3},
            {"params": [p for n, p in z.model.named_parameters() if "norm" not in n]},
        ],
        lr=1e-3,
    )
    model, report = convert_norms_with_report(z.model, "dyt", optimizer=opt, example_inputs=z.args)
    modules = dict(model.named_modules())
    assert all(type(modules[p]) is DyT and not modules[p].channels_first for p in paths)
    assert _kinds(model, *z.args) == {"dyt": 9}  # discovery knows DyT by class
    alphas = [modules[p].alpha for p in paths]
    assert report.added_keys == [f"{p}.alpha" for p in paths]
    assert all(any(a is p for p in opt.param_groups[0]["params"]) for a in alphas)
    _train(model, _classify(model, *z.args), opt)
    assert all(a.item() != 0.5 for a in alphas)  # the optimizer trained them


@pytest.mark.slow
def test_convnext_layernorm2d_to_channels_first_dyt() -> None:
    z = zoo.build("convnext_atto")
    with pytest.warns(ConversionWarning, match="build the optimizer after this call"):
        model = convert_norms(z.model, "dyt", example_inputs=z.args)
    dyts = [m for m in model.modules() if isinstance(m, DyT)]
    assert len(dyts) == 17 and all(m.channels_first for m in dyts)
    assert _kinds(model, *z.args) == {"dyt": 17}
    _train(model, _classify(model, *z.args), torch.optim.Adam(model.parameters(), lr=1e-3))


def test_gpt2_hybridnorm_keeps_layernorm_after_attention_only() -> None:
    z = zoo.build("gpt2")
    ids = z.args[0]
    model, report = convert_norms_with_report(
        z.model, HYBRIDNORM, example_inputs=z.args, example_kwargs=z.kwargs
    )
    kinds = {n.path: n.kind for n in normprobe.discover(model, *z.args, **z.kwargs).norms}
    assert {p for p, k in kinds.items() if k == "layernorm"} == {
        f"transformer.h.{i}.ln_2" for i in range(4)
    }
    assert Counter(kinds.values()) == {"rmsnorm": 5, "layernorm": 4}
    assert [why for _, why in report.kept] == ["already a LayerNorm"] * 4
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, lambda: model(ids, labels=ids, use_cache=False).loss, opt)


@pytest.mark.parametrize(
    ("name", "after_attention", "after_ffn"),
    [
        # Pre-LN: the norm reading the attention add's sum is the FFN's pre norm
        ("llama", "model.layers.{}.post_attention_layernorm", "model.layers.{}.input_layernorm"),
        # Post-LN: each add's own post norm
        ("bert", "encoder.layer.{}.attention.output.LayerNorm", "encoder.layer.{}.output."
         "LayerNorm"),
        # sandwich: the branch's own post norm, before the add
        ("gemma2", "model.layers.{}.post_attention_layernorm", "model.layers.{}.post_feedforward_"
         "layernorm"),
    ],
)  # fmt: skip
def test_positions_name_the_first_norm_after_each_branch(
    name: str, after_attention: str, after_ffn: str
) -> None:
    z = zoo.build(name)
    _, report = convert_norms_with_report(
        z.model,
        {"post-attention": "identity", "post-ffn": "rmsnorm"},
        example_inputs=z.args,
        example_kwargs=z.kwargs,
    )
    by_target = {t: {c.path for c in report.conversions if c.target == t} for t in TARGETS}
    assert by_target["identity"] == {after_attention.format(i) for i in range(4)}
    # Pre-LN: the next block's input norm follows the FFN add; after the last block comes `final`
    blocks = range(1, 4) if name == "llama" else range(4)
    assert by_target["rmsnorm"] == {after_ffn.format(i) for i in blocks}


# ------------------------------------------------------------------------------------------------
# what surgery preserves


class _Shared(nn.Module):
    """``a`` registered twice (``a``, ``b``); ``c`` a second layer tied to ``a``'s weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.LayerNorm(4)
        self.b = self.a
        self.c = nn.LayerNorm(4)
        self.c.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def test_shared_modules_convert_once_and_tied_weights_stay_tied() -> None:
    model = _Shared()
    weight = model.a.weight
    model, report = convert_norms_with_report(model, "rmsnorm")
    assert model.a is model.b and type(model.a) is nn.RMSNorm
    assert model.a.weight is weight and model.c.weight is weight
    assert [(c.path, c.aliases) for c in report.conversions] == [("a", ("b",)), ("c", ())]
    assert list(model.state_dict()) == ["a.weight", "b.weight", "c.weight"]


class _TiedGemma(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = GemmaRMSNorm(4)
        self.second = GemmaRMSNorm(4)
        self.second.weight = self.first.weight
        with torch.no_grad():
            self.first.weight.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_a_tied_gemma_gain_is_shifted_once() -> None:
    model = convert_norms(_TiedGemma(), "rmsnorm")
    assert model.first.weight is model.second.weight
    assert model.first.weight.tolist() == [1.5] * 4  # 0.5 + 1, not 0.5 + 2


def test_a_gemma_gain_shared_with_an_excluded_layer_is_refused() -> None:
    model = _TiedGemma()
    with pytest.raises(ValueError, match=r"first\.weight is also second\.weight.*nothing"):
        convert_norms(model, "rmsnorm", exclude="second")
    assert type(model.first) is GemmaRMSNorm and model.first.weight.tolist() == [0.5] * 4


def test_dtype_requires_grad_and_training_mode_are_kept() -> None:
    model = nn.Sequential(
        nn.Linear(4, 4), nn.LayerNorm(4), nn.LayerNorm(4), nn.LayerNorm(4, elementwise_affine=False)
    ).double()  # the last has no tensor of its own: its DyT takes the model's dtype
    model[1].requires_grad_(False)
    model[2].eval()
    with pytest.warns(ConversionWarning):  # new alphas, no optimizer given
        model = convert_norms(model, "dyt")
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert not model[1].alpha.requires_grad and not model[1].weight.requires_grad
    assert model[2].alpha.requires_grad
    assert model[1].training and not model[2].training
    assert model(torch.ones(2, 4, dtype=torch.float64)).dtype == torch.float64


def test_forward_and_backward_hooks_move_to_the_new_layer() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    seen: list[str] = []
    handles = [
        model[1].register_forward_pre_hook(lambda m, a: seen.append(f"pre {type(m).__name__}")),
        model[1].register_forward_hook(
            lambda m, a, k, out: seen.append("post kwargs"), with_kwargs=True
        ),
        model[1].register_full_backward_hook(lambda m, gi, go: seen.append("backward")),
    ]
    model = convert_norms(model, "rmsnorm")
    model(torch.randn(2, 4)).sum().backward()
    assert seen == ["pre RMSNorm", "post kwargs", "backward"]
    for h in handles:  # the handles from before the conversion still remove them
        h.remove()
    model(torch.randn(2, 4)).sum().backward()
    assert len(seen) == 3 and hook_count(model) == 0


def test_conversion_is_refused_while_a_probe_is_attached(tmp_path: Path) -> None:
    from normprobe.runtime import attach

    model = TinyTransformer(depth=2)
    tokens = torch.randint(0, 96, (2, 8))
    probe = attach(model, log_dir=str(tmp_path), example_inputs=(tokens,))
    try:
        with pytest.raises(RuntimeError, match=r"probe is attached.*probe\.remove\(\), convert"):
            convert_norms(model, "rmsnorm")
        assert type(model.ln_f) is nn.LayerNorm
    finally:
        probe.remove()
    model = convert_norms(model, "rmsnorm")
    assert type(model.ln_f) is nn.RMSNorm


def test_renamed_gains_are_reported_so_old_checkpoints_load() -> None:
    z = zoo.build("custom_rmsnorm")
    old_state = {k: v.clone() for k, v in z.model.state_dict().items()}
    model, report = convert_norms_with_report(z.model, "rmsnorm", example_inputs=z.args)
    assert report.renamed_keys["final.gain"] == "final.weight"
    assert len(report.renamed_keys) == 9 and not report.removed_keys and not report.added_keys
    with torch.no_grad():
        model.final.weight.fill_(3.0)
    model.load_state_dict({report.renamed_keys.get(k, k): v for k, v in old_state.items()})
    assert torch.equal(model.final.weight, old_state["final.gain"])


def test_new_parameters_join_the_group_of_their_layer_or_warn_without_optimizer() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(
        [{"params": model[1].parameters(), "lr": 0.1}, {"params": model[0].parameters()}],
        lr=0.01,
        momentum=0.9,
    )
    model[2].weight.grad = torch.ones(4)
    opt.step()  # momentum state for the BatchNorm weight exists
    model = convert_norms(model, {"1": "dyt", "2": "identity"}, optimizer=opt)
    assert [len(g["params"]) for g in opt.param_groups] == [3, 2]
    assert opt.param_groups[0]["params"][-1] is model[1].alpha
    assert len(opt.state) == 0  # the removed BatchNorm weight took its momentum with it
    with pytest.warns(ConversionWarning, match=r"created 1 new parameters.*optimizer=opt"):
        convert_norms(nn.Sequential(nn.LayerNorm(4)), "dyt")


def test_syncbatchnorm_round_trip_shares_parameters_and_statistics() -> None:
    bn = nn.BatchNorm2d(2).eval()
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([1.0, 2.0]))
        bn.running_var.copy_(torch.tensor([4.0, 9.0]))
    model = nn.Sequential(bn)
    model = convert_norms(model, "syncbatchnorm")
    assert type(model[0]) is nn.SyncBatchNorm and model[0].running_var is bn.running_var
    model = convert_norms(model, "batchnorm")
    assert type(model[0]) is BatchNormNd and model[0].weight is bn.weight
    x = torch.tensor([3.0, 8.0]).view(1, 2, 1, 1)
    # eval: (x - mean) / sqrt(var + eps) = (3 - 1) / 2 and (8 - 2) / 3
    torch.testing.assert_close(model(x).flatten(), torch.tensor([1.0, 2.0]), rtol=0, atol=1e-5)


def test_batchnorm_to_identity_removes_it() -> None:
    model, report = convert_norms_with_report(nn.Sequential(nn.BatchNorm1d(3)), "identity")
    x = torch.randn(4, 3)
    assert torch.equal(model(x), x)
    assert report.removed_keys == [
        "0.weight", "0.bias", "0.running_mean", "0.running_var", "0.num_batches_tracked"
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------------
# policies and filters


def test_policy_globs_win_over_roles_and_roles_over_the_rest() -> None:
    model = TinyTransformer(depth=2, qk_norm=True)
    tokens = torch.randint(0, 96, (2, 8))
    policy = {"*": "rmsnorm", "qk": "dyt", "blocks.1.*": "identity", "final": None}
    with pytest.warns(ConversionWarning, match="created 2 new parameters"):  # the DyT alphas
        model, report = convert_norms_with_report(model, policy, example_inputs=(tokens,))
    kinds = {c.path: c.result for c in report.conversions}
    assert kinds["blocks.0.attn.q_norm"] == "DyT" and kinds["blocks.0.ln_1"] == "RMSNorm"
    assert kinds["blocks.1.attn.q_norm"] == "Identity" and kinds["blocks.1.ln_2"] == "Identity"
    assert report.kept == [("ln_f", "policy key 'final' leaves it")]
    assert len(report.conversions) == 8


def test_include_and_exclude_select_by_path_and_warn_when_they_match_nothing() -> None:
    model = TinyTransformer(depth=2)
    with pytest.warns(ConversionWarning, match=r"exclude='blocks\.9\.\*' matches no norm"):
        model, report = convert_norms_with_report(
            model, "rmsnorm", include="blocks.*", exclude=["*.ln_2", "blocks.9.*"]
        )
    assert [c.path for c in report.conversions] == ["blocks.0.ln_1", "blocks.1.ln_1"]
    assert type(model.ln_f) is nn.LayerNorm and type(model.blocks[0].ln_2) is nn.LayerNorm
    with pytest.warns(ConversionWarning, match=r"policy key 'post_attention' selects no norm"):
        convert_norms(model, {"post_attention": "layernorm"})


def test_role_policies_need_example_inputs_or_a_model_map() -> None:
    model = TinyTransformer(depth=2)
    tokens = torch.randint(0, 96, (2, 8))
    with pytest.raises(ValueError, match=r"\['pre'\] are roles.*example_inputs=\(x,\)"):
        convert_norms(model, {"pre": "rmsnorm"})
    model_map = normprobe.discover(model, tokens)
    model = convert_norms(model, {"pre": "rmsnorm"}, model_map=model_map)
    assert type(model.blocks[1].ln_2) is nn.RMSNorm and type(model.ln_f) is nn.LayerNorm
    with pytest.raises(ValueError, match=r"model_map lists LayerNorm at 'blocks.0.ln_1'"):
        convert_norms(model, "dyt", model_map=model_map)  # the map is now out of date


# ------------------------------------------------------------------------------------------------
# bad input


def test_unknown_target_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown norm target 'rmsnrom'.*'layernorm'.*'dyt'"):
        convert_norms(nn.Sequential(nn.LayerNorm(4)), "rmsnrom")
    with pytest.raises(ValueError, match=r"'batchnrm' for policy key 'qk'"):
        convert_norms(nn.Sequential(nn.LayerNorm(4)), {"qk": "batchnrm"})


def test_batchnorm_to_rmsnorm_needs_a_channel_layout() -> None:
    model = nn.Sequential(nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2), nn.BatchNorm2d(2))
    with pytest.raises(ValueError, match=r"^1 \(BatchNorm2d\).*channels_first=True.*1 more"):
        convert_norms(model, "rmsnorm")
    assert type(model[1]) is nn.BatchNorm2d and type(model[2]) is nn.BatchNorm2d
    model = convert_norms(model, "rmsnorm", channels_first=True)
    assert type(model[1]) is RMSNorm2d
    x = torch.tensor([3.0, 4.0]).view(1, 2, 1, 1)  # one position, channels 3 and 4
    rms = math.sqrt((9 + 16) / 2 + 1e-5)
    torch.testing.assert_close(model[1](x).flatten(), torch.tensor([3 / rms, 4 / rms]))


def test_conversions_that_would_normalize_the_wrong_axis_are_refused() -> None:
    with pytest.raises(ValueError, match=r"channels-last.*'layernorm', 'rmsnorm' or 'dyt'"):
        convert_norms(nn.Sequential(nn.LayerNorm(4)), "groupnorm")
    with pytest.raises(ValueError, match=r"40 channels.*num_groups=8"):
        convert_norms(nn.Sequential(nn.GroupNorm(4, 40)), "groupnorm", num_groups=32)
    from timm.layers import BatchNormAct2d

    with pytest.raises(ValueError, match=r"also runs \['act'\]"):
        convert_norms(nn.Sequential(BatchNormAct2d(8)), "groupnorm", num_groups=4)
    model = nn.Sequential(LayerNorm2d(8))
    assert convert_norms(model, "layernorm")[0] is model[0]  # already channels-first LayerNorm


class _DoubledLayerNorm(nn.Module):
    """Named like a LayerNorm, but returns twice one."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * F.layer_norm(x, self.weight.shape, self.weight)


def test_a_same_kind_conversion_that_changes_the_output_warns() -> None:
    model = nn.Sequential(_DoubledLayerNorm(4))
    # LayerNorm outputs are about 1 in size: doubling them moves some by more than 1
    with pytest.warns(ConversionWarning, match=r"new LayerNorm differs from the old _Doubled"):
        model, report = convert_norms_with_report(model, "layernorm")
    diff = report.conversions[0].max_abs_diff
    assert diff is not None and diff > 1


class _EpsOutsideRMSNorm(nn.Module):
    """``x / (rms(x) + eps) * weight``: eps outside the square root."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.weight


def test_an_eps_outside_the_square_root_is_noted() -> None:
    model = nn.Sequential(nn.Linear(8, 8), _EpsOutsideRMSNorm(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConversionWarning)  # 1e-5 moved: outputs still agree
        model, report = convert_norms_with_report(
            model, "rmsnorm", example_inputs=(torch.randn(4, 8),)
        )
    assert type(model[1]) is nn.RMSNorm and model[1].eps == 1e-5
    assert report.conversions[0].notes == (
        "eps moved inside the square root (it was added to the RMS/std)",
    )
    assert "Converted 1 norm layer: 1 _EpsOutsideRMSNorm -> RMSNorm" in str(report)


def test_timm_channels_first_norms_are_recognized_without_example_inputs() -> None:
    from timm.layers import LayerNorm2d as TimmLayerNorm2d

    model = convert_norms(nn.Sequential(TimmLayerNorm2d(2)), "rmsnorm")
    assert type(model[0]) is RMSNorm2d
    x = torch.tensor([3.0, -3.0]).view(1, 2, 1, 1)  # at one position: RMS = 3
    torch.testing.assert_close(model(x).flatten(), torch.tensor([1.0, -1.0]))


@pytest.mark.slow
def test_wrapped_and_compiled_models_are_refused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with pytest.raises(TypeError, match=r"compiled.*convert the model before compiling"):
        convert_norms(torch.compile(model), "rmsnorm")
    with pytest.raises(TypeError, match=r"wrapped in DataParallel.*`\.module`"):
        convert_norms(nn.DataParallel(model), "rmsnorm")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        with pytest.raises(TypeError, match=r"wrapped in DistributedDataParallel.*wrap the result"):
            convert_norms(ddp, "rmsnorm")
    finally:
        dist.destroy_process_group()
    assert type(model[1]) is nn.LayerNorm


def test_a_model_without_norms_warns_and_stays_unchanged() -> None:
    z = zoo.build("no_norm")
    state = {k: v.clone() for k, v in z.model.state_dict().items()}
    with pytest.warns(ConversionWarning, match="no normalization layers in NoNormNet"):
        model = convert_norms(z.model, "rmsnorm", example_inputs=z.args)
    assert model is z.model
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------------------------
# the builder registry


def test_every_target_has_a_registered_builder() -> None:
    """A name added to TARGETS without a builder in normprobe/surgery/builders.py fails here."""
    assert sorted(BUILDERS) == sorted(TARGETS)
    assert sorted(CLASS_NAMES) == sorted(TARGETS)  # how messages name it
    spec = NormSpec((8,), (8,), 2, False, True, True, None, 0.5)
    for target in TARGETS:
        assert isinstance(create_norm(target, spec), nn.Module)
    assert create_norm("layernorm", spec).eps == 1e-5  # torch's default when no eps is known
    assert create_norm("rmsnorm", spec).eps is None  # RMSNorm's own: the dtype's epsilon
    with pytest.raises(ValueError, match="no norm builder is registered for target 'nope'"):
        create_norm(cast(Any, "nope"), spec)


# ------------------------------------------------------------------------------------------------
# the layers


def test_dyt_computes_gamma_tanh_alpha_x_plus_beta() -> None:
    dyt = DyT(3)
    with torch.no_grad():
        dyt.weight.copy_(torch.tensor([1.0, 2.0, 3.0]))
        dyt.bias.copy_(torch.tensor([0.5, 0.0, 0.0]))
    x = torch.tensor([2.0, 0.0, -2.0])
    t = math.tanh(0.5 * 2.0)  # alpha starts at 0.5
    torch.testing.assert_close(dyt(x), torch.tensor([t + 0.5, 0.0, -3 * t]))
    cf = DyT(3, channels_first=True)
    cf.load_state_dict(dyt.state_dict())
    torch.testing.assert_close(cf(x.view(1, 3, 1, 1)).flatten(), dyt(x))
