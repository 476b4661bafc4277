"""The ``outliers`` family: ratio, channel and kurtosis against hand computations on the stream
tensors themselves, healthy models at init, and the report's flag on a run built to have it."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import normprobe
from normprobe import probes, tags
from normprobe.metrics.outliers import RATIO_LIMIT
from normprobe.models import ResidualStack, TinyTransformer

BUMP = 10.0  # the massive activation injected: about 500x the median |x| of TinyTransformer
BLOCK, CHANNEL, POSITION = 2, 7, 5


def _inject(model: TinyTransformer) -> None:
    """Add ``BUMP`` to one channel at one position of block ``BLOCK``'s MLP output, and take it
    out again in the next block's: only block ``BLOCK``'s stream holds it."""

    def bump(sign: float) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            extra = torch.zeros_like(out)
            extra[0, POSITION, CHANNEL] = sign * BUMP
            return out + extra

        return hook

    model.blocks[BLOCK].mlp.register_forward_hook(bump(1.0))
    model.blocks[BLOCK + 1].mlp.register_forward_hook(bump(-1.0))


def _typical(magnitudes: torch.Tensor) -> float:
    """The median of the |x| above 1% of the 90th percentile of the nonzero ones (the lower
    middle value, and the lower of two neighbours, as torch takes them)."""
    nonzero = magnitudes[magnitudes > 0].sort().values
    high = nonzero[(len(nonzero) - 1) * 9 // 10]
    kept = nonzero[nonzero > 0.01 * high]
    return float(kept[(len(kept) - 1) // 2])


def _hand_stats(stream: torch.Tensor) -> tuple[float, int, float]:
    """(max |x| / median non-negligible |x|, the max's channel, kurtosis of the channels' RMS)
    of a (batch, positions, channels) stream, without `probes`."""
    flat = stream.detach().double().abs().flatten()
    median = _typical(flat)
    channel = int(flat.argmax()) % stream.shape[-1]
    rms = stream.detach().double().pow(2).mean(dim=(0, 1)).sqrt()
    kurtosis = rms.pow(4).mean() / rms.pow(2).mean().pow(2)
    return float(flat.max() / median), channel, float(kurtosis)


def _logged(model: nn.Module, inputs: torch.Tensor) -> dict[str, list[float]]:
    """The depth profiles of one logged forward of ``model`` (no optimizer)."""
    sink = normprobe.MemorySink()
    with normprobe.attach(model, sinks=[sink], metrics=["outliers"], every=1) as probe:
        with torch.no_grad():
            model(inputs)
        probe.step()
    return sink.records[0].profiles


def test_finds_the_injected_block_and_channel() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(depth=4, width=32, context=16)
    _inject(model)
    captured: list[torch.Tensor] = []
    for block in model.blocks:  # a Pre-LN block's output is its last residual add's
        block.register_forward_hook(lambda m, a, out: captured.append(out.detach().clone()))
    assert probes.MEDIAN_SAMPLE >= 1 * 16 * 32  # each stream's median taken over all of it
    profiles = _logged(model, torch.randint(0, 96, (1, 16)))
    ratios = profiles[tags.format("outlier_ratio", "blocks")]
    channels = profiles[tags.format("outlier_channel", "blocks")]
    kurtoses = profiles[tags.format("outlier_kurtosis", "blocks")]
    assert max(range(4), key=ratios.__getitem__) == BLOCK
    assert channels[BLOCK] == CHANNEL
    assert ratios[BLOCK] > RATIO_LIMIT > max(r for b, r in enumerate(ratios) if b != BLOCK)
    for b, stream in enumerate(captured[-4:]):  # the logged forward's (discovery runs one)
        ratio, channel, kurtosis = _hand_stats(stream)
        assert ratios[b] == pytest.approx(ratio, rel=1e-5)
        assert channels[b] == channel
        assert kurtoses[b] == pytest.approx(kurtosis, rel=1e-5)


def _one_loud_channel(shape: tuple[int, ...], dim: int, channel: int, k: float) -> torch.Tensor:
    """Entries +-1 at random, those of ``channel`` along ``dim`` +-k."""
    x = torch.randint(0, 2, shape).float() * 2 - 1
    x.narrow(dim, channel, 1).mul_(k)
    return x


def _closed_form_kurtosis(channels: int, k: float) -> float:
    """The channels' RMS are s = (1, ..., 1, k), d of them: mean(s^4) / mean(s^2)^2 =
    ((d - 1 + k^4) / d) / ((d - 1 + k^2) / d)^2 = d (d - 1 + k^4) / (d - 1 + k^2)^2."""
    d = channels
    return d * (d - 1 + k**4) / (d - 1 + k**2) ** 2


def test_kurtosis_of_one_loud_channel_has_its_closed_form() -> None:
    torch.manual_seed(0)
    model = ResidualStack(depth=2, width=8)
    with torch.no_grad():  # zero branches: each block's stream is the input
        for lin in model.lins:
            lin.weight.zero_()
            lin.bias.zero_()
    x = _one_loud_channel((5, 8), -1, channel=3, k=4.0)
    profiles = _logged(model, x)
    expected = _closed_form_kurtosis(8, 4.0)  # 2104 / 529
    assert profiles[tags.format("outlier_kurtosis", "lins")] == pytest.approx([expected] * 2)
    # 35 of the 40 entries are +-1: the median |x| is 1 and the ratio is k
    assert profiles[tags.format("outlier_ratio", "lins")] == pytest.approx([4.0, 4.0])
    assert profiles[tags.format("outlier_channel", "lins")] == [3.0, 3.0]


def test_image_channels_lie_along_dim_1() -> None:
    torch.manual_seed(0)
    x = _one_loud_channel((2, 6, 5, 5), 1, channel=4, k=3.0)
    ratio, channel, kurtosis = probes.outlier_stats(x).tolist()
    assert (ratio, channel) == (pytest.approx(3.0), 4.0)
    assert kurtosis == pytest.approx(_closed_form_kurtosis(6, 3.0))


def test_zeros_are_left_out_of_the_median() -> None:
    # a ReLU's zeros are sparsity, not magnitude: the median is of 1, 2, 3 and 8
    x = torch.tensor([[0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 8.0, 0.0]])
    ratio, channel, _ = probes.outlier_stats(x).tolist()
    assert (ratio, channel) == (4.0, 6.0)
    assert math.isnan(probes.outlier_stats(torch.zeros(2, 3))[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_median_of_many_rows_is_torchs_of_their_non_negligible_entries(
    dtype: torch.dtype,
) -> None:
    # on a CPU the rows are sorted by numpy; each must give what torch's nanquantile and
    # nanmedian give once zeros and negligible entries are NaN: rows of odd and even length,
    # zeros, NaNs, infinities, near-zero entries, none left at all
    torch.manual_seed(0)
    for length in (1, 2, 5, 8, 512):
        rows = torch.randn(48, length, dtype=dtype).abs()
        rows[rows < 0.4] = 0.0
        rows[torch.rand(rows.shape) < 0.2] *= 1e-3
        rows[torch.rand(rows.shape) < 0.1] = math.nan
        rows[torch.rand(rows.shape) < 0.05] = math.inf
        rows[0], rows[1] = 0.0, math.nan
        top, power = torch.ones(48, 4, dtype=dtype), torch.ones(48, 4, dtype=dtype)
        nonzero = rows.masked_fill(rows == 0, math.nan)
        high = nonzero.nanquantile(0.9, dim=-1, keepdim=True, interpolation="lower")
        expected = nonzero.masked_fill(nonzero <= 0.01 * high, math.nan).nanmedian(dim=-1).values
        ratios = probes.outlier_stats_many(top, power, rows)[:, 0]
        torch.testing.assert_close(ratios, (1 / expected).float(), equal_nan=True)
    # by hand: zeros and NaN left out, the lower middle of 1, 2, 3, 8 (an even count)
    by_hand = torch.tensor([[0.0, 8.0, math.nan, 3.0, 0.0, 1.0, 2.0]], dtype=dtype)
    ratio = probes.outlier_stats_many(torch.full((1, 1), 8.0, dtype=dtype), top[:1], by_hand)
    assert ratio[0, 0] == 4.0


def test_the_last_forward_of_a_step_counts() -> None:
    model = ResidualStack(depth=2, width=8)
    with torch.no_grad():
        for lin in model.lins:
            lin.weight.zero_()
            lin.bias.zero_()
    sink = normprobe.MemorySink()
    with normprobe.attach(model, sinks=[sink], metrics=["outliers"], every=1) as probe:
        model(_one_loud_channel((5, 8), -1, channel=1, k=4.0))
        model(_one_loud_channel((5, 8), -1, channel=6, k=2.0))
        probe.step()
    profiles = sink.records[0].profiles
    assert profiles[tags.format("outlier_channel", "lins")] == [6.0, 6.0]
    assert profiles[tags.format("outlier_ratio", "lins")] == pytest.approx([2.0, 2.0])


def test_not_chosen_costs_no_reduction(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.Tensor] = []
    parts = probes.outlier_parts

    def counted(t: torch.Tensor, scratch: torch.Tensor | None = None) -> probes.OutlierParts:
        calls.append(t)
        return parts(t, scratch)

    monkeypatch.setattr(probes, "outlier_parts", counted)
    model = ResidualStack(depth=2, width=8)
    sink = normprobe.MemorySink()
    with normprobe.attach(model, sinks=[sink], metrics=["resid_rms"], every=1) as probe:
        model(torch.randn(5, 8))
        probe.step()
    assert tags.format("resid_rms", "lins", 1) in sink.records[0].scalars
    assert calls == []
    with normprobe.attach(model, sinks=[sink], metrics=["outliers"], every=1) as probe:
        model(torch.randn(5, 8))
        probe.step()
    assert len(calls) == 2  # the patch is the one the family calls


def _gpt2() -> tuple[nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=4, n_head=4)
    return GPT2LMHeadModel(config).eval(), torch.randint(0, 128, (4, 64))


def _resnet() -> tuple[nn.Module, torch.Tensor]:
    import timm

    # zero-initialized last norms: at init each block's stream is its ReLU'd input, half zeros
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    return model.eval(), torch.randn(2, 3, 64, 64)


@pytest.mark.parametrize("build", ["tiny", "gpt2", "resnet18"])
def test_healthy_models_at_init_stay_below_the_flag(build: str) -> None:
    torch.manual_seed(0)
    if build == "tiny":
        model: nn.Module = TinyTransformer()
        inputs = torch.randint(0, 96, (8, 64))
    else:
        model, inputs = _gpt2() if build == "gpt2" else _resnet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on a tiny vocabulary
        profiles = _logged(model, inputs)
    ratios = [v for tag, vs in profiles.items() if "/outlier_ratio/" in tag for v in vs]
    assert len(ratios) >= 4 and all(math.isfinite(r) for r in ratios)
    assert max(ratios) < RATIO_LIMIT / 10  # Gaussian-like streams read under 10
    kurtoses = [v for tag, vs in profiles.items() if "/outlier_kurtosis/" in tag for v in vs]
    assert len(kurtoses) == len(ratios) and all(k >= 1.0 for k in kurtoses)


def _train(log_dir: Path, inject: bool, metrics: tuple[str, ...] = ("outliers",)) -> Path:
    torch.manual_seed(0)
    model = TinyTransformer(depth=4, width=32, context=16)
    if inject:
        _inject(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with normprobe.attach(
        model, optimizer=opt, log_dir=str(log_dir), every=1, metrics=list(metrics)
    ):
        for _ in range(3):
            x = torch.randint(0, 96, (4, 16))
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
    return log_dir


def test_report_flags_massive_activations_naming_block_and_channel(tmp_path: Path) -> None:
    report = normprobe.report_run(_train(tmp_path / "bad", inject=True))
    (flag,) = [f for f in report.flags if f.kind == "massive activations"]
    assert (flag.stack, flag.step, flag.threshold) == ("blocks", 2, RATIO_LIMIT)
    assert flag.value > RATIO_LIMIT
    assert f"block {BLOCK}'s stream" in flag.message and f"channel {CHANNEL}" in flag.message
    assert report.row("blocks", "outlier_ratio[max]").values[-1] == pytest.approx(flag.value)
    # no attention logged for the stack: the advice names no attention sink
    assert "what writes that channel" in flag.message and "sink" not in flag.message
    with_attention = _train(tmp_path / "attn", inject=True, metrics=("outliers", "attn_logits"))
    (flag,) = [f for f in normprobe.report_run(with_attention).flags if f.kind == flag.kind]
    assert "explicit sink" in flag.message and "QK-norm" in flag.message

    healthy = normprobe.report_run(_train(tmp_path / "good", inject=False))
    assert healthy.row("blocks", "outlier_ratio[max]").max < RATIO_LIMIT / 10
    assert not [f for f in healthy.flags if f.kind == "massive activations"]


def test_large_streams_take_the_median_of_an_even_sample() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 16, 96)  # 98,304 entries: every 53rd of them is the sample
    x[40, 3, 17] = 500.0
    stride = probes.sample_stride(x.shape, probes.MEDIAN_SAMPLE)
    sample = x.flatten()[::stride].abs().double()
    assert len(sample) <= probes.MEDIAN_SAMPLE and 96 % stride != 0
    median = _typical(sample)
    ratio, channel, kurtosis = probes.outlier_stats(x).tolist()
    assert ratio == pytest.approx(500.0 / median, rel=1e-5)  # the max itself is exact
    assert channel == 17
    assert kurtosis == pytest.approx(_hand_stats(x)[2], rel=1e-5)
    # the sample's median estimates the whole stream's: |N(0, 1)| above 1% of its 90th
    # percentile (1.645) has median 0.685 (0.674 with the 1.3% below left in)
    exact = _typical(x.abs().flatten().double())
    assert median == pytest.approx(exact, rel=0.05)
    assert exact == pytest.approx(0.685, rel=0.02)


def test_the_sample_is_a_copy_of_the_stream_when_read() -> None:
    # the median is taken later, for every block at once: a stream changed in place after its
    # read (an in-place add in an evaluation forward) must not change what was read
    x = torch.tensor([[1.0, 2.0, 3.0, 8.0]])
    parts = probes.outlier_parts(x)
    x.zero_()
    ratio, channel, _ = probes.outlier_stats_many(*parts).tolist()
    assert (ratio, channel) == (4.0, 3.0)  # 8 over the lower middle of 1, 2, 3, 8


def test_a_mass_of_near_zero_entries_is_left_out_of_the_median() -> None:
    # a LeakyReLU(0.01) halves a Gaussian into |x| and 0.01 |x|: the median of every nonzero
    # entry would sit at the boundary between them (about 0.01), the ratio past 100
    torch.manual_seed(0)
    x = nn.functional.leaky_relu(torch.randn(4, 128), 0.01)
    ratio, _, _ = probes.outlier_stats(x).tolist()
    magnitudes = x.abs().flatten().double()
    assert ratio == pytest.approx(float(magnitudes.max()) / _typical(magnitudes), rel=1e-5)
    assert ratio < 10
    everything = magnitudes.sort().values[(len(magnitudes) - 1) // 2]
    assert float(magnitudes.max() / everything) > RATIO_LIMIT  # the plain median's ratio


def test_timm_cspresnet_reads_no_massive_activations(tmp_path: Path) -> None:
    """timm's CSPResNet-50: LeakyReLU streams whose branches end in a BatchNorm zero at init;
    its streams hold half near-zero entries and no huge one."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("cspresnet50", pretrained=False, num_classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1, metrics=["outliers"]):
        for _ in range(3):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    report = normprobe.report_run(tmp_path)
    assert not [f for f in report.flags if f.kind == "massive activations"]
    for stack in ("stages.0.blocks", "stages.1.blocks", "stages.3.blocks"):
        assert report.row(stack, "outlier_ratio[max]").max < RATIO_LIMIT / 5
