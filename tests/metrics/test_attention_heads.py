"""``attn_logits_head``: each query head's max attention logit, checked against the logits
materialized by hand on Hugging Face models (eager and fused, grouped-query, soft-capped), and
MuonClip's factors from them."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tb import read_events
from torch import nn
from torch.overrides import TorchFunctionMode

import normprobe
from normprobe import probes, tags
from normprobe.metrics.attn_logits_head import SAMPLED_ERROR, TAU
from normprobe.models import TinyTransformer
from normprobe.sinks import heatmap_tag

TOKENS = 12


class Scores(TorchFunctionMode):
    """Records the attention logits a model materializes: ``q @ k^T`` of every 4-D matmul whose
    product is (..., tokens, tokens), and the q·k of every fused attention call, each times
    ``scale`` (what the model multiplies q·k by)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.logits: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0].detach().double(), args[1].detach().double()
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scale = kwargs.get("scale") or 1 / math.sqrt(q.shape[-1])
            self.logits.append(q @ k.transpose(-1, -2) * scale)
        out = func(*args, **kwargs)
        matmul = func in (torch.matmul, torch.Tensor.__matmul__)
        if matmul and out.ndim == 4 and out.shape[-2:] == (TOKENS, TOKENS):
            q, k = args[0].detach().double(), args[1].detach().double()
            self.logits.append(q @ k * self.scale)
        return out


def per_head(logits: torch.Tensor) -> list[float]:
    return logits.abs().amax(dim=(0, 2, 3)).tolist()


def logged_heads(model: nn.Module, inputs: dict[str, Any], tmp_path: Path) -> list[list[float]]:
    """The probe's per-head vector of each attention module after one logged forward."""
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=["attn_logits_head"]) as probe:
        with torch.no_grad():
            model(**inputs)
        probe.step()
        assert probe.model_map is not None and probe.latest is not None
        profiles = probe.latest.profiles
        return [profiles[probe.tag("attn_logits_head", a.path)] for a in probe.model_map.attention]


def llama(attn: str, context: int = 32) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query: two query heads share each key head
        max_position_embeddings=context,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).eval()
    for layer in model.model.layers:  # heads far apart, so that a mixed-up head shows
        with torch.no_grad():
            layer.self_attn.q_proj.weight.view(4, 16, 64).mul_(
                torch.tensor([1.0, 3.0, 9.0, 27.0])[:, None, None]
            )
    return model


def test_llama_heads_equal_the_materialized_logits_eager_and_sdpa(tmp_path: Path) -> None:
    ids = {"input_ids": torch.randint(0, 64, (2, TOKENS))}
    found = {}
    for attn in ("eager", "sdpa"):
        model = llama(attn)
        scaling = model.model.layers[0].self_attn.scaling
        scores = Scores(scaling)
        with torch.no_grad(), scores:
            model(**ids)
        want = [per_head(s) for s in scores.logits]
        assert len(want) == 2  # one product per layer
        got = logged_heads(model, ids, tmp_path / attn)
        assert [len(h) for h in got] == [4, 4]  # the query's heads, not the 2 key heads
        for g, w in zip(got, want, strict=True):
            assert g == pytest.approx(w, rel=1e-5)
            assert max(w) / min(w) > 10  # the heads differ as the weights were scaled
        found[attn] = got
    for eager, sdpa in zip(found["eager"], found["sdpa"], strict=True):
        assert eager == pytest.approx(sdpa, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "llama"])
def test_sampled_query_rows_read_a_lower_bound_within_its_stated_error(
    tmp_path: Path, name: str
) -> None:
    """On 512 tokens the recompute forms a quarter of the products: each head's max
    is at most the max over every product, the module's within SAMPLED_ERROR of it."""
    tokens = 512
    torch.manual_seed(0)
    if name == "tiny":
        model: nn.Module = TinyTransformer(width=64, depth=2, heads=4, context=tokens)
        scale = 1 / math.sqrt(16)
    else:
        model = llama("sdpa", context=tokens)
        scale = model.model.layers[0].self_attn.scaling
    ids = torch.randint(0, 64, (4, tokens))
    inputs = {"idx": ids} if name == "tiny" else {"input_ids": ids}
    scores = Scores(scale)
    with torch.no_grad(), scores:
        model(**inputs)
    want = [per_head(s) for s in scores.logits]
    got = logged_heads(model, inputs, tmp_path)
    assert len(got) == len(want) == 2
    assert len(probes.logit_sample(torch.zeros(tokens, 1), torch.zeros(tokens, 1))) == 2  # sampled
    for g, w in zip(got, want, strict=True):
        assert all(a <= b * (1 + 1e-6) for a, b in zip(g, w, strict=True))
        assert max(g) >= (1 - SAMPLED_ERROR) * max(w)


def test_gemma2_heads_are_soft_capped_as_the_model_caps_them(tmp_path: Path) -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cap = 5.0
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        attn_logit_softcapping=cap,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(400.0)  # raw logits far past the cap
            layer.self_attn.k_proj.weight.mul_(10.0)
    ids = {"input_ids": torch.randint(0, 64, (1, TOKENS))}
    scaling = model.model.layers[0].self_attn.scaling
    scores = Scores(scaling)
    with torch.no_grad(), scores:
        model(**ids)
    raw = [per_head(s) for s in scores.logits]
    assert all(v > 2 * cap for heads in raw for v in heads)
    want = [[cap * math.tanh(v / cap) for v in heads] for heads in raw]
    got = logged_heads(model, ids, tmp_path)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-5)
        assert max(g) < cap


def test_tags_argmax_head_and_muonclip_factors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(width=32, depth=3, heads=4, context=TOKENS)
    hot = model.blocks[1].attn
    with torch.no_grad():  # head 2 of block 1: queries 40x larger, so its logits are too
        hot.qkv.weight[16:24].mul_(40.0)
    x = torch.randint(0, 96, (2, TOKENS))
    with normprobe.attach(model, log_dir=str(tmp_path)) as probe:
        with torch.no_grad():
            model(x)
        probe.step()
        record = probe.latest
        assert record is not None
        heads = record.profiles[probe.tag("attn_logits_head", "blocks.1.attn")]
        assert max(range(4), key=heads.__getitem__) == 2
        assert record.scalars[probe.tag("attn_head_argmax", "blocks.1.attn")] == 2.0
        assert record.scalars[probe.tag("attn_head_max", "blocks.1.attn")] == max(heads)
        # the module's max over heads is the one attn_logits writes
        assert record.scalars[probe.tag("attn_logit_max", "blocks.1.attn")] == pytest.approx(
            max(heads)
        )
        tau = (heads[2] + sorted(heads)[-2]) / 2  # only head 2 is past it
        factors = normprobe.qk_clip_factors(probe, tau=tau)
        assert sorted(factors) == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
        assert factors["blocks.1.attn"].tolist() == pytest.approx(
            [1.0, 1.0, tau / heads[2], 1.0], rel=1e-6
        )
        assert factors["blocks.0.attn"].tolist() == [1.0] * 4
        over = record.scalars[tags.format("attn_heads_over_tau", "blocks")]
        assert over == sum(
            v > TAU
            for a in ("blocks.0.attn", "blocks.1.attn", "blocks.2.attn")
            for v in record.profiles[probe.tag("attn_logits_head", a)]
        )
        with pytest.raises(ValueError, match="tau must be a positive"):
            normprobe.qk_clip_factors(probe, tau=0.0)
    events = read_events(str(tmp_path))
    profile = events.profiles[probe.tag("attn_logits_head", "blocks.1.attn")]
    assert profile[0][1] == pytest.approx(heads)
    # the depth view: heads x blocks of the stack's attention
    assert heatmap_tag("attn_logits_head", "blocks", "attn") in events.images


def test_muonclip_factors_need_the_family_and_a_logged_step(tmp_path: Path) -> None:
    model = TinyTransformer(width=16, depth=2, heads=2, context=TOKENS)
    with (
        normprobe.attach(model, log_dir=str(tmp_path), metrics=["attn_logits_head"]) as probe,
        pytest.raises(RuntimeError, match="has not logged a step"),
    ):
        normprobe.qk_clip_factors(probe)
    with (
        normprobe.attach(model, log_dir=str(tmp_path), metrics=["grad_norm"]) as probe,
        pytest.raises(ValueError, match="does not log 'attn_logits_head'"),
    ):
        normprobe.qk_clip_factors(probe)


def test_a_model_without_attention_says_so_once(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with (
        pytest.warns(normprobe.DiscoveryWarning, match=r"no attention modules \(attn_logits_head"),
        normprobe.attach(model, log_dir=str(tmp_path), metrics=["attn_logits_head"]) as probe,
    ):
        model(torch.randn(2, 4))
        probe.step()
    assert probe.latest is None or not probe.latest.profiles


def test_report_names_the_head_of_an_attention_blow_up(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(width=32, depth=2, heads=4, context=TOKENS)
    with torch.no_grad():  # head 3 of block 0: logits far past attn_logits' limit of 50
        model.blocks[0].attn.qkv.weight[24:32].mul_(300.0)  # its queries
        model.blocks[0].attn.qkv.weight[56:64].mul_(30.0)  # and keys
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randint(0, 96, (2, TOKENS))
    metrics = ["attn_logits", "attn_logits_head"]
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1, metrics=metrics):
        for _ in range(3):
            model.loss(x, x).backward()
            opt.step()
    flags = [f for f in normprobe.report_run(tmp_path).flags if f.kind == "logit blow-up"]
    assert len(flags) == 1
    assert "blocks/0.attn (head 3)" in flags[0].message


def test_attention_is_not_missed_aloud_unless_asked_for(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with normprobe.attach(model, log_dir=str(tmp_path)) as probe:  # every family
            model(torch.randn(2, 4))
            probe.step()
    said = " ".join(str(w.message) for w in caught)
    assert "no stacks of blocks" in said  # what every model is expected to have
    assert "attention" not in said and "BatchNorm" not in said


class RowAttention(nn.Module):
    """ESM's MSA row attention: logits laid out heads first, (heads, rows, queries, keys)."""

    def __init__(self, width: int = 16, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, columns, width)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(-3)
        scores = torch.einsum("rihd,rjhd->hrij", q, k) / math.sqrt(q.shape[-1])
        y = torch.einsum("hrij,rjhd->rihd", scores.softmax(-1), v)
        return self.out(y.flatten(-2))


class RowBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = RowAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


def test_heads_first_logits_give_the_module_max_and_no_per_head_values(tmp_path: Path) -> None:
    # 3 rows, 4 heads: read as (..., heads, queries, keys) the rows were taken for heads
    torch.manual_seed(0)
    model = nn.Sequential(RowBlock(), RowBlock())
    x = torch.randn(3, 5, 16)
    found = normprobe.discover(model, x).attention
    assert [(a.path, a.impl, a.heads) for a in found] == [
        (f"{i}.attn", "eager", 1) for i in range(2)
    ]
    with normprobe.attach(model, log_dir=str(tmp_path), every=1) as probe:
        with torch.no_grad():
            model(x)
        probe.step()
        scalars = probe.latest.scalars if probe.latest is not None else {}
    attn = model[0].attn
    q, k, _ = attn.qkv(model[0].norm(x)).unflatten(-1, (3, 4, -1)).unbind(-3)
    want = float(torch.einsum("rihd,rjhd->hrij", q, k).abs().max()) / 2.0  # sqrt(head_dim 4)
    assert scalars[probe.tag("attn_logit_max", "0.attn")] == pytest.approx(want, rel=1e-5)
