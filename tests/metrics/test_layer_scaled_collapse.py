"""A stack whose every residual branch writes through a learned layer scale starts collapsed by
design (timm's CaiT: scales of 1e-5): its collapse is a note from the first steps, worded for
layer scales; a stack without them stays a problem (tests/report/test_report.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from tb import read_texts

import normprobe
from normprobe import tags
from normprobe.models import ResidualStack


def test_a_layer_scaled_stack_collapsed_at_init_is_a_note(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = timm.create_model(
        "cait_xxs24_224", pretrained=False, num_classes=10, img_size=32, patch_size=4
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1) as probe:
            for _ in range(3):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert probe.model_map is not None
    stacks = [s.path for s in probe.model_map.stacks]
    assert stacks == ["blocks", "blocks_token_only"]
    texts = read_texts(str(tmp_path))
    assert all(tags.format("layer_scales", s) + "/text_summary" in texts for s in stacks)
    rep = normprobe.report_run(str(tmp_path))
    (collapse,) = [f for f in rep.flags if f.kind == "representation collapse"]
    assert collapse.stack == "blocks" and collapse.value > 0.999
    assert collapse.severity == "note"
    assert "learned layer scale" in collapse.message
    assert "insert_branch_scale" not in collapse.message  # it has them already


def test_a_stack_without_layer_scales_gets_no_layer_scale_text(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ResidualStack(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1):
        model(torch.randn(2, 8)).pow(2).mean().backward()
        opt.step()
    texts = read_texts(str(tmp_path))
    assert tags.format("placement", "lins") + "/text_summary" in texts
    assert not any("layer_scales" in t for t in texts)


@pytest.mark.parametrize("scaled", [True, False])
def test_the_layer_scale_text_goes_with_every_add_holding_a_scale(scaled: bool) -> None:
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
