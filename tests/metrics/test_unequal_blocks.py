"""The top/bottom gradient ratio compares a stack's last block with its first. Where the two hold
very different numbers of parameters (timm's DaViT, whose `stages` stack runs stages of widths
96..768 as blocks of one stream), a gradient norm's growth with the block's size reads as a skew:
such a ratio is a note naming both sizes, never a problem."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tb import read_texts
from timm.models.davit import DaVit
from transformers import T5Config, T5ForConditionalGeneration

import normprobe
from normprobe import tags
from normprobe.metrics import grad_norm
from normprobe.metrics.core.run import run_flags


def _trainable(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def test_davit_stages_of_different_widths_get_their_sizes_written(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = DaVit(depths=(1, 1, 3, 1), embed_dims=(16, 32, 64, 128), num_heads=(1, 2, 4, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1) as probe:
            for _ in range(2):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert probe.model_map is not None
    assert {s.path for s in probe.model_map.stacks} == {"stages", "stages.2.blocks"}
    texts = read_texts(str(tmp_path))
    sizes = texts[tags.format("block_params", "stages") + "/text_summary"]
    first, last = _trainable(model.stages[0]), _trainable(model.stages[3])
    assert sizes == [(0, f"{first} {last}")]  # once per run
    assert last > 30 * first
    # the three blocks of stage 2 are alike: no sizes, their ratio judged as ever
    assert tags.format("block_params", "stages.2.blocks") + "/text_summary" not in texts


def test_t5s_first_block_holding_the_position_bias_counts_as_alike(tmp_path: Path) -> None:
    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4,
        decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    blocks = model.encoder.block
    first, second = _trainable(blocks[0]), _trainable(blocks[-1])
    assert first == second + 32 * 4  # the relative attention bias: buckets x heads
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(1, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    texts = read_texts(str(tmp_path))
    assert not [t for t in texts if t.startswith(tags.format("block_params", ""))]
    assert tags.format("placement", "encoder.block") + "/text_summary" in texts


@pytest.mark.parametrize("sizes", [None, "7200 6850560"])
def test_a_ratio_past_the_problem_limit_is_a_note_for_unlike_blocks(sizes: str | None) -> None:
    stack = "stages"
    ratio = {tags.format("grad_ratio", stack): [(0, 12.0), (1, 11.0), (2, 12.0)]}
    texts = {tags.format("placement", stack): [(0, "pre-ln")]}
    if sizes is not None:
        texts[tags.format("block_params", stack)] = [(0, sizes)]
    (flag,) = run_flags(ratio, texts)
    assert flag.kind == "top-heavy gradients" and flag.value == 12.0
    if sizes is None:
        assert (flag.severity, flag.threshold) == ("problem", grad_norm.TOP_PROBLEM)
        assert "warm the learning rate up" in flag.message
    else:
        assert (flag.severity, flag.threshold) == ("note", grad_norm.TOP_LIMIT)
        assert "7,200 and 6,850,560 trainable parameters" in flag.message
        assert "deepnorm" not in flag.message
