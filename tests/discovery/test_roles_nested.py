"""Residual blocks nested in, or followed by, other residual structure: a Post-LN block inside a
larger skip (neuralforecast's TFT decoder), a Post-LN norm in front of a projected add
(TSMixerx), a skip around a whole inner stack (compressai's AttentionBlock)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normprobe


class GRN(nn.Module):
    """neuralforecast/models/tft.py ``GRN``: ``layer_norm(a + glu(lin_i(elu(lin_a(a)))))``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin_a = nn.Linear(d, d)
        self.lin_i = nn.Linear(d, d)
        self.glu = nn.Linear(d, 2 * d)
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        x = nn.functional.glu(self.glu(self.lin_i(nn.functional.elu(self.lin_a(a)))))
        return self.layer_norm(x + a)


class TFTDecoder(nn.Module):
    """neuralforecast/models/tft.py ``TemporalFusionDecoder.forward``: three Post-LN blocks
    (enrichment GRN, gated attention, position-wise GRN) inside the decoder's own Post-LN skip
    from ``temporal_features``; attention stands in as one linear layer."""

    def __init__(self, d: int = 8, encoder_length: int = 2) -> None:
        super().__init__()
        self.encoder_length = encoder_length
        self.enrichment_grn = GRN(d)
        self.attention = nn.Linear(d, d)
        self.attention_gate = nn.Linear(d, d)
        self.attention_ln = nn.LayerNorm(d)
        self.positionwise_grn = GRN(d)
        self.decoder_gate = nn.Linear(d, d)
        self.decoder_ln = nn.LayerNorm(d)

    def forward(self, temporal_features: torch.Tensor) -> torch.Tensor:
        enriched = self.enrichment_grn(temporal_features)
        x = self.attention(enriched)[:, self.encoder_length :]
        temporal_features = temporal_features[:, self.encoder_length :]
        enriched = enriched[:, self.encoder_length :]
        x = self.attention_ln(self.attention_gate(x) + enriched)
        x = self.positionwise_grn(x)
        return self.decoder_ln(self.decoder_gate(x) + temporal_features)


def test_post_ln_blocks_inside_a_larger_skip_are_post_norms() -> None:
    # each of the four norms reads a sum nothing else reads: LN(x + f(x)), a post norm; the
    # inner sums derive from the decoder's stream, but only through their own adds
    m = normprobe.discover(TFTDecoder(), torch.randn(2, 5, 8))
    roles = {n.path: n.role for n in m.norms}
    assert roles == {
        "enrichment_grn.layer_norm": "post",
        "attention_ln": "post",
        "positionwise_grn.layer_norm": "post",
        "decoder_ln": "post",
    }
    norms = [(a.module, a.ordinal, a.pre_norm, a.post_norm) for a in m.residual_adds]
    assert norms == [
        ("enrichment_grn", 0, None, "enrichment_grn.layer_norm"),
        ("", 0, None, "attention_ln"),
        ("positionwise_grn", 0, None, "positionwise_grn.layer_norm"),
        ("", 1, None, "decoder_ln"),
    ]


class MixingLayer(nn.Module):
    """neuralforecast/models/tsmixerx.py ``MixingLayerWithStaticExogenous`` (its static feature
    mixer as one linear layer): ``TemporalMixing`` returns ``temporal_norm(x + input)``, then
    ``FeatureMixing`` (2d -> d) returns ``feature_norm(x + project_residual(input))``, both
    sides reading the temporal norm's output."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.stat = nn.Linear(3, d)
        self.temporal_lin = nn.Linear(h, h)
        self.temporal_norm = nn.LayerNorm((h, 2 * d))
        self.feature_lin_1 = nn.Linear(2 * d, d)
        self.feature_lin_2 = nn.Linear(d, d)
        self.project_residual = nn.Linear(2 * d, d)
        self.feature_norm = nn.LayerNorm((h, d))

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, stat_exog = inputs
        x = torch.cat((x, self.stat(stat_exog)), dim=2)
        t = torch.relu(self.temporal_lin(x.permute(0, 2, 1))).permute(0, 2, 1)
        x = self.temporal_norm(t + x)
        f = self.feature_lin_2(torch.relu(self.feature_lin_1(x)))
        return self.feature_norm(f + self.project_residual(x)), stat_exog


class TSMixerxLike(nn.Module):
    """Three mixing layers in a ``nn.Sequential``, as TSMixerx's ``mixing_block``."""

    def __init__(self, d: int = 8, h: int = 4) -> None:
        super().__init__()
        self.mixing_block = nn.Sequential(*(MixingLayer(d, h) for _ in range(3)))

    def forward(self, x: torch.Tensor, stat_exog: torch.Tensor) -> torch.Tensor:
        return self.mixing_block((x, stat_exog))[0]


def test_post_norm_in_front_of_a_projected_add_stays_post() -> None:
    # the temporal norm closes its block's first add (no norm reads that add's stream), so it is
    # the post norm of that add, not a pre norm of the projected feature add: 3 blocks x 2 adds,
    # 6 post norms, a Post-LN stack
    m = normprobe.discover(TSMixerxLike(), torch.randn(2, 4, 8), torch.randn(2, 4, 3))
    (stack,) = m.stacks
    assert (stack.path, stack.placement) == ("mixing_block", "post-ln")
    assert {n.path: n.role for n in m.norms} == {
        f"mixing_block.{b}.{n}": "post" for b in range(3) for n in ("temporal_norm", "feature_norm")
    }
    norms = [(a.module, a.kind, a.pre_norm, a.post_norm) for a in m.residual_adds]
    assert norms == [
        row
        for b in range(3)
        for row in (
            (f"mixing_block.{b}", "identity", None, f"mixing_block.{b}.temporal_norm"),
            (f"mixing_block.{b}", "projection", None, f"mixing_block.{b}.feature_norm"),
        )
    ]


class PreActPair(nn.Module):
    """A pre-normed add, then a norm in front of a projected add in the same block: the norm
    follows a Pre-LN add, so it is the projected add's pre norm (both sides read it)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm0 = nn.LayerNorm(d)
        self.f = nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d)
        self.g = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, 2 * d))
        self.proj = nn.Linear(d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.f(self.norm0(x))
        h = self.norm1(x)
        return self.g(h) + self.proj(h)


def test_norm_after_a_pre_normed_add_feeds_the_projection_as_pre() -> None:
    m = normprobe.discover(
        nn.Sequential(PreActPair(4), PreActPair(8), PreActPair(16)), torch.randn(2, 4)
    )
    assert {n.role for n in m.norms} == {"pre"}
    assert [a.pre_norm for a in m.residual_adds] == [
        f"{b}.{n}" for b in range(3) for n in ("norm0", "norm1")
    ]


class ResidualUnit(nn.Module):
    """compressai/layers/layers.py ``AttentionBlock.ResidualUnit``: ``relu(conv(x) + x)``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(n, n // 2, 1), nn.ReLU(), nn.Conv2d(n // 2, n, 3, padding=1)
        )
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv(x) + x)


class AttentionBlock(nn.Module):
    """compressai/layers/layers.py ``AttentionBlock``: ``x + conv_a(x) * sigmoid(conv_b(x))``,
    ``conv_a`` three residual units, ``conv_b`` three and a 1x1 conv: the skip goes around the
    whole ``conv_a`` stack, whose three last convs all write its sum."""

    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.conv_a = nn.Sequential(*(ResidualUnit(n) for _ in range(3)))
        self.conv_b = nn.Sequential(*(ResidualUnit(n) for _ in range(3)), nn.Conv2d(n, n, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv_a(x) * torch.sigmoid(self.conv_b(x))


@pytest.mark.filterwarnings("ignore::normprobe.DiscoveryWarning")  # no norms, as compressai's
def test_skip_around_a_whole_inner_stack_is_no_add_of_that_stack() -> None:
    m = normprobe.discover(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), AttentionBlock()), torch.randn(1, 3, 8, 8)
    )
    where = [(a.module, a.stack, a.block) for a in m.residual_adds]
    # conv_a's three units, conv_b's three, one add each; then the block's own add, in no stack
    assert where[:3] == [(f"1.conv_a.{b}", "1.conv_a", b) for b in range(3)]
    assert [(s, b) for _, s, b in where[3:6]] == [(where[3][1], b) for b in range(3)]
    assert where[6] == ("1", None, None)
    assert ("add-outside-stack", "1") in {(d.kind, d.path) for d in m.doubts}
