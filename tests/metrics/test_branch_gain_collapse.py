"""A stack whose every residual branch writes through a learned gain last starts collapsed by
design when the gains start small: timm's CaiT (layer scales of 1e-5), timm's RegNets and ResNets
(the gamma of each branch's last BatchNorm starts at 0). Its collapse is a note from the first
steps, worded for those gains; a stack without them stays a problem
(tests/report/test_report.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from conditioned import TinyDiT
from tb import read_texts

import normprobe
from normprobe import tags
from normprobe.metrics import resid_cos
from normprobe.models import ResidualStack, TinyTransformer


def _train(model: torch.nn.Module, log_dir: Path, size: int, steps: int = 3) -> normprobe.Probe:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(4, 3, size, size), torch.randint(0, 10, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, log_dir=str(log_dir), every=1) as probe:
            for _ in range(steps):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    return probe


def test_a_layer_scaled_stack_collapsed_at_init_is_a_note(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = timm.create_model(
        "cait_xxs24_224", pretrained=False, num_classes=10, img_size=32, patch_size=4
    )
    probe = _train(model, tmp_path, 32)
    assert probe.model_map is not None
    stacks = [s.path for s in probe.model_map.stacks]
    assert stacks == ["blocks", "blocks_token_only"]
    texts = read_texts(str(tmp_path))
    for s in stacks:
        assert texts[tags.format("branch_gains", s) + "/text_summary"][-1][1] == "layer scale"
    rep = normprobe.report_run(str(tmp_path))
    (collapse,) = [f for f in rep.flags if f.kind == "representation collapse"]
    assert collapse.stack == "blocks" and collapse.value > 0.999
    assert collapse.severity == "note"
    assert "learned layer scale" in collapse.message
    assert "insert_branch_scale" not in collapse.message  # it has them already


def test_branches_ending_in_a_zero_init_batchnorm_collapse_as_a_note(tmp_path: Path) -> None:
    """timm's RegNetY-200MF zero-initializes the gamma of each branch's last BatchNorm: its
    4- and 7-block stages start as identities, collapsed by design."""
    torch.manual_seed(0)
    model = timm.create_model("regnety_002", pretrained=False, num_classes=10)
    assert all(float(b.conv3.bn.weight.detach().abs().max()) == 0 for b in model.s3.children())
    probe = _train(model, tmp_path, 64)
    assert probe.model_map is not None
    texts = read_texts(str(tmp_path))
    for stack in ("s3", "s4"):
        assert texts[tags.format("branch_gains", stack) + "/text_summary"][-1][1] == "norm gain"
    rep = normprobe.report_run(str(tmp_path))
    collapses = [f for f in rep.flags if f.kind == "representation collapse"]
    assert {f.stack for f in collapses} >= {"s3"}
    assert all(f.severity == "note" and f.value > 0.999 for f in collapses)
    assert all("the gain of the norm ending it" in f.message for f in collapses)
    assert not any("insert_branch_scale" in f.message for f in collapses)


def test_a_stack_without_branch_gains_gets_no_branch_gain_text(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ResidualStack(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1):
        model(torch.randn(2, 8)).pow(2).mean().backward()
        opt.step()
    texts = read_texts(str(tmp_path))
    assert tags.format("placement", "lins") + "/text_summary" in texts
    assert not any("branch_gains" in t for t in texts)


@pytest.mark.parametrize("scaled", [True, False])
def test_layer_scales_are_the_branch_gains_of_every_add_holding_one(scaled: bool) -> None:
    """timm's ViT with ``init_values`` (LayerScale on both branches) and without."""
    torch.manual_seed(0)
    kwargs = {"init_values": 1e-5} if scaled else {}
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=4, **kwargs
    )
    m = normprobe.discover(model, torch.randn(2, 3, 32, 32))
    adds = [a for a in m.residual_adds if a.stack == "blocks"]
    assert len(adds) == 8
    assert all(bool(a.scales) == scaled for a in adds)
    assert all(a.end_norm is None for a in adds)  # Pre-LN: no norm ends a branch
    assert [bool(m.branch_gains(a)) for a in adds] == [scaled] * 8
    if scaled:
        assert m.branch_gains(adds[0]) == ("blocks.0.ls1.gamma",)


def test_the_norm_ending_a_branch_is_its_end_norm_and_its_weight_the_gain() -> None:
    """A branch's last BatchNorm (timm's ResNet-26), SwinV2-CR's post norms (no pre norm) and
    a sandwich's post norms end their branches; a Pre-LN block's do not."""
    torch.manual_seed(0)
    resnet = timm.create_model("resnet26", pretrained=False, num_classes=10)
    m = normprobe.discover(resnet, torch.randn(2, 3, 32, 32))
    adds = m.adds_in("layer3")
    assert [a.end_norm for a in adds] == ["layer3.0.bn3", "layer3.1.bn3"]
    assert [m.branch_gains(a) for a in adds] == [("layer3.0.bn3.weight",), ("layer3.1.bn3.weight",)]
    swin = timm.create_model(
        "swinv2_cr_tiny_ns_224", pretrained=False, img_size=(32, 32), window_size=4, depths=(2, 2)
    )
    m = normprobe.discover(swin, torch.randn(2, 3, 32, 32))
    adds = m.adds_in("stages.1.blocks")
    assert [a.end_norm for a in adds] == [
        f"stages.1.blocks.{b}.norm{i}" for b in (0, 1) for i in (1, 2)
    ]
    assert all(a.sandwich_norm is None and a.pre_norm is None for a in adds)
    sandwich = TinyTransformer(width=16, depth=2, placement="sandwich")
    m = normprobe.discover(sandwich, torch.randint(0, 96, (2, 8)))
    assert [a.end_norm for a in m.residual_adds] == [a.sandwich_norm for a in m.residual_adds]
    assert m.residual_adds[0].end_norm == "blocks.0.ln_1_post"
    assert m.branch_gains(m.residual_adds[0]) == ("blocks.0.ln_1_post.weight",)
    pre = normprobe.discover(TinyTransformer(width=16, depth=2), torch.randint(0, 96, (2, 8)))
    assert all(a.end_norm is None and not pre.branch_gains(a) for a in pre.residual_adds)


def test_a_stack_gated_by_its_condition_collapses_as_a_note(tmp_path: Path) -> None:
    """A DiT whose adaLN-Zero gates start at zero (Peebles & Xie 2023): each block writes 0 at
    init, so consecutive streams are equal (cosine 1) and stay past 0.999 while the gates grow.
    Past `JUDGED_AFTER` logged steps the collapse is still a note, worded for those gates."""
    torch.manual_seed(0)
    model = TinyDiT(width=16, depth=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, label = torch.randn(8, 6, 4), torch.randint(0, 10, (8,))
    target = torch.randn(8, 6, 4)
    steps = resid_cos.JUDGED_AFTER + 2
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1):
        for _ in range(steps):
            F.mse_loss(model(x, label), target).backward()
            opt.step()
            opt.zero_grad()
    texts = read_texts(str(tmp_path))
    assert texts[tags.format("branch_gains", "blocks") + "/text_summary"] == [(0, "condition gate")]
    rep = normprobe.report_run(str(tmp_path))
    assert rep.row("blocks", "resid_cos[deep]").first == 1.0  # nothing written at step 0
    (collapse,) = [f for f in rep.flags if f.kind == "representation collapse"]
    assert collapse.severity == "note" and collapse.value > resid_cos.COLLAPSE_COS


def test_flux_single_blocks_behind_small_condition_gates_collapse_as_a_note(
    tmp_path: Path,
) -> None:
    """diffusers' Flux at default init: each single block's gate, a linear map of the timestep
    and text embedding, reads about 0.1, its write 3% of the stream's RMS; the four single
    blocks stay past 0.999 through a healthy run's first steps, the turn flat."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=4, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch, tokens = 4, 64
    latents, text = torch.randn(batch, tokens, 16), torch.randn(batch, 7, 32)
    pooled = torch.randn(batch, 32)
    ids = {"img_ids": torch.zeros(tokens, 3), "txt_ids": torch.zeros(7, 3)}
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1):
        for _ in range(resid_cos.JUDGED_AFTER + 2):
            t = torch.rand(batch)
            noise = torch.randn_like(latents)
            noisy = (1 - t.view(-1, 1, 1)) * latents + t.view(-1, 1, 1) * noise
            out = model(
                noisy, encoder_hidden_states=text, pooled_projections=pooled, timestep=t, **ids
            )
            F.mse_loss(out.sample, noise - latents).backward()
            opt.step()
            opt.zero_grad()
    texts = read_texts(str(tmp_path))
    stack = "single_transformer_blocks"
    assert texts[tags.format("branch_gains", stack) + "/text_summary"] == [(0, "condition gate")]
    rep = normprobe.report_run(str(tmp_path))
    (collapse,) = [f for f in rep.flags if f.kind == "representation collapse"]
    assert collapse.stack == stack and collapse.value > resid_cos.COLLAPSE_COS
    assert collapse.severity == "note"
    assert "a gate computed from the condition (adaLN-Zero's)" in collapse.message
