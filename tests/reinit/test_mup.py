"""muP: width records, per-layer learning rates, save/load, and the coordinate check."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normprobe import plots
from normprobe.mup import COORD_PANEL_SIZE, coord_check, mup, mup_param_groups, mup_shapes


class MLP(nn.Module):
    """``inp -> relu -> h1 -> relu -> h2 -> relu -> out``; ``out_mult`` scales the readout's
    input, as microsoft/mup's MuReadout does (only the reference model below sets it)."""

    def __init__(self, width: int, d_in: int = 32, n_out: int = 10) -> None:
        super().__init__()
        self.out_mult = 1.0
        self.inp = nn.Linear(d_in, width)
        self.h1 = nn.Linear(width, width)
        self.h2 = nn.Linear(width, width)
        self.out = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.h2(F.relu(self.h1(F.relu(self.inp(x))))))
        return self.out(h * self.out_mult)


def lrs(model: nn.Module, groups: list[dict[str, object]]) -> dict[str, tuple[float, float]]:
    """Parameter name -> (lr, weight decay) from param groups."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {
        by_id[id(p)]: (g["lr"], g["weight_decay"])  # type: ignore[misc]
        for g in groups
        for p in g["params"]  # type: ignore[attr-defined]
    }


def test_mup_marks_each_kind_and_rescales_only_readout_and_biases() -> None:
    # width 256 over base 64: m = 4. Readout weight * 1/sqrt(4); biases of layers whose fan-in
    # grows * sqrt(4); input and hidden weights unchanged.
    model = MLP(256)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert mup(model, base_width=64) is model
    shapes = mup_shapes(model)
    assert {n: s.kind for n, s in shapes.items()} == {
        "inp.weight": "input",
        "inp.bias": "vector",
        "h1.weight": "hidden",
        "h1.bias": "vector",
        "h2.weight": "hidden",
        "h2.bias": "vector",
        "out.weight": "output",
        "out.bias": "fixed",
    }
    assert shapes["h1.weight"].base == (64, 64) and shapes["h1.weight"].fanin_mult == 4.0
    assert shapes["out.weight"].fanin_mult == 4.0 and shapes["inp.weight"].fanout_mult == 4.0
    assert torch.equal(model.inp.weight, before["inp.weight"])
    assert torch.equal(model.inp.bias, before["inp.bias"])
    assert torch.equal(model.h1.weight, before["h1.weight"])
    assert torch.equal(model.h1.bias, 2 * before["h1.bias"])
    assert torch.equal(model.out.weight, before["out.weight"] / 2)
    assert torch.equal(model.out.bias, 2 * before["out.bias"])

    zero = mup(MLP(256), base_width=64, zero_readout=True)
    assert torch.all(zero.out.weight == 0) and torch.all(zero.out.bias == 0)
    at_base = mup(MLP(64), base_width=64, zero_readout=True)  # width dims known at m = 1 too
    assert torch.all(at_base.out.weight == 0)
    assert mup_shapes(at_base)["h1.weight"].kind == "hidden"


def test_adam_groups_give_hidden_matrices_lr_over_m_and_wd_times_m() -> None:
    # base 64, target 256, lr 1e-2, wd 0.1: hidden 0.0025 / 0.4 (as microsoft/mup's MuAdam);
    # the readout too, because its 1/m output multiplier is folded into the weight
    model = mup(MLP(256), base_width=64)
    got = lrs(model, mup_param_groups(model, 1e-2, "adam", weight_decay=0.1))
    for name in ("h1.weight", "h2.weight", "out.weight"):
        assert got[name] == pytest.approx((0.0025, 0.4))
    for name in ("inp.weight", "inp.bias", "h1.bias", "out.bias"):
        assert got[name] == pytest.approx((0.01, 0.1))


def test_sgd_groups_follow_the_paper() -> None:
    model = mup(MLP(256), base_width=64)
    got = lrs(model, mup_param_groups(model, 0.1, "sgd", weight_decay=0.01))
    assert got["h1.weight"] == pytest.approx((0.1, 0.01))  # fan-in and fan-out both x4
    assert got["inp.weight"] == pytest.approx((0.4, 0.0025))  # vector-like: lr * m
    assert got["h1.bias"] == pytest.approx((0.4, 0.0025))
    assert got["out.weight"] == pytest.approx((0.025, 0.04))  # folded readout: lr / m
    assert got["out.bias"] == pytest.approx((0.1, 0.01))


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_folded_readout_trains_exactly_like_an_explicit_output_multiplier(
    optimizer: str,
) -> None:
    # microsoft/mup: readout weight and bias * sqrt(m), input to the readout / m, readout lr
    # untouched (Adam) or * m (SGD, vector-like). normprobe folds the 1/m into the weight.
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    folded = MLP(256)
    explicit = copy.deepcopy(folded)
    mup(folded, base_width=64)
    explicit.out_mult = 1 / 4
    with torch.no_grad():
        for p in (explicit.out.weight, explicit.out.bias, explicit.h1.bias, explicit.h2.bias):
            p.mul_(2)
    e = explicit
    opt_a: torch.optim.Optimizer
    opt_b: torch.optim.Optimizer
    if optimizer == "adam":
        lr = 1e-2
        reference = [
            {"params": [e.h1.weight, e.h2.weight], "lr": lr / 4},
            {"params": [e.inp.weight, e.inp.bias, e.h1.bias, e.h2.bias, e.out.weight, e.out.bias]},
        ]
        opt_a = torch.optim.Adam(mup_param_groups(folded, lr, "adam"), lr=lr, eps=1e-12)
        opt_b = torch.optim.Adam(reference, lr=lr, eps=1e-12)
    else:
        lr = 0.5
        reference = [
            {"params": [e.h1.weight, e.h2.weight, e.out.bias]},
            {
                "params": [e.inp.weight, e.inp.bias, e.h1.bias, e.h2.bias, e.out.weight],
                "lr": lr * 4,
            },
        ]
        opt_a = torch.optim.SGD(mup_param_groups(folded, lr, "sgd"), lr=lr)
        opt_b = torch.optim.SGD(reference, lr=lr)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), explicit(x))
    for _ in range(5):
        for model, opt in ((folded, opt_a), (explicit, opt_b)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    with torch.no_grad():
        torch.testing.assert_close(folded(x), explicit(x), rtol=1e-5, atol=1e-5)


def test_width_records_survive_state_dict_save_and_load() -> None:
    marked = mup(MLP(256), base_width=64)
    expected = mup_shapes(marked)
    buffer = io.BytesIO()
    torch.save(marked.state_dict(), buffer)
    assert "h1.mup_base_weight" in marked.state_dict()

    # a fresh model marked with another base takes the checkpoint's records
    fresh = mup(MLP(256), base_width=128)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    assert mup_shapes(fresh) == expected
    groups = lrs(fresh, mup_param_groups(fresh, 1e-2))
    assert groups["h1.weight"] == pytest.approx((0.0025, 0.0))

    # the whole module pickled, and a deep copy
    whole = io.BytesIO()
    torch.save(marked, whole)
    whole.seek(0)
    assert mup_shapes(torch.load(whole, weights_only=False)) == expected
    assert mup_shapes(copy.deepcopy(marked)) == expected

    # an unmarked model refuses the records (call mup() first) and has none to give
    buffer.seek(0)
    with pytest.raises(RuntimeError, match="mup_base_weight"):
        MLP(256).load_state_dict(torch.load(buffer))
    with pytest.raises(ValueError, match=r"call normprobe\.mup\(model"):
        mup_param_groups(MLP(256), 1e-2)


def test_mup_twice_raises_and_rescale_false_only_remarks() -> None:
    model = mup(MLP(256), base_width=64)
    readout = model.out.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"already ran on this model.*rescale=False"):
        mup(model, base_width=64)
    mup(model, base_width=128, rescale=False)
    assert torch.equal(model.out.weight, readout)
    assert mup_shapes(model)["h1.weight"].fanin_mult == 2.0


def test_base_model_is_exact_where_base_width_guesses() -> None:
    # a vocabulary of 512 is a multiple of the width 256, so base_width takes it for a width dim
    def lm(width: int) -> nn.Module:
        return nn.Sequential(
            nn.Embedding(512, width), nn.Linear(width, width), nn.Linear(width, 512)
        )

    guessed = mup_shapes(mup(lm(256), base_width=64))
    exact = mup_shapes(mup(lm(256), base_model=lm(64)))
    assert guessed["0.weight"].kind == "hidden"
    assert {n: s.kind for n, s in exact.items()} == {
        "0.weight": "input",
        "1.weight": "hidden",
        "1.bias": "vector",
        "2.weight": "output",
        "2.bias": "fixed",
    }
    with torch.device("meta"):
        base = lm(64)
    assert mup_shapes(mup(lm(256), base_model=base)) == exact


def test_mup_reads_fans_of_transposed_hf_conv1d() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    def gpt2(width: int) -> nn.Module:
        config = GPT2Config(
            vocab_size=100,
            n_positions=32,
            n_embd=width,
            n_layer=2,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=False,
        )
        return GPT2LMHeadModel(config)

    shapes = mup_shapes(mup(gpt2(128), base_model=gpt2(64)))
    mlp_proj = shapes["transformer.h.0.mlp.c_proj.weight"]  # Conv1D weight (4w, w) = (in, out)
    assert mlp_proj.shape == (512, 128) and mlp_proj.kind == "hidden"
    assert (mlp_proj.fanin_mult, mlp_proj.fanout_mult) == (2.0, 2.0)
    assert shapes["transformer.wte.weight"].kind == "input"
    assert shapes["lm_head.weight"].kind == "output"


def test_a_tied_readout_is_refused_with_the_way_out() -> None:
    class Tied(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.emb = nn.Embedding(100, width)
            self.head = nn.Linear(width, 100, bias=False)
            self.head.weight = self.emb.weight

    with pytest.raises(ValueError, match=r"head\.weight is a muP readout.*emb\.weight.*Untie"):
        mup(Tied(128), base_model=Tied(64))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "exactly one of base_width"),
        ({"base_width": 64, "base_model": MLP(64)}, ValueError, "exactly one of base_width"),
        ({"base_width": 512}, ValueError, "base_width 512 is larger than the model's width 256"),
        ({"base_width": 0}, ValueError, "base_width must be a positive integer, got 0"),
        ({"base_model": MLP(512)}, ValueError, r"base_model is wider than the model at"),
        ({"base_model": nn.Linear(3, 3)}, ValueError, r"only in the model: \['inp.weight'"),
    ],
)
def test_mup_bad_input(
    kwargs: dict[str, object], error: type[Exception], match: str | None
) -> None:
    with pytest.raises(error, match=match):
        mup(MLP(256), **kwargs)  # type: ignore[arg-type]


def test_param_groups_and_coord_check_bad_input() -> None:
    model = mup(MLP(128), base_width=64)
    with pytest.raises(ValueError, match="optimizer must be 'adam' or 'sgd', got 'lion'"):
        mup_param_groups(model, 1e-2, "lion")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lr must be a positive number, got 0"):
        mup_param_groups(model, 0)
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="two or more integer widths"):
        coord_check(MLP, [64], x)
    with pytest.raises(ValueError, match="steps must be a positive integer, got 0"):
        coord_check(MLP, [64, 128], x, steps=0)


@pytest.mark.slow
def test_coord_check_sp_grows_with_width_and_mup_stays_flat(tmp_path: Path) -> None:
    # Adam, lr 3e-3, 3 steps, widths 64..1024. SP: a hidden activation moves by about
    # lr * width per step, so its RMS grows with width; muP divides hidden lr by width/64.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    widths = [64, 128, 256, 512, 1024]
    sp = coord_check(MLP, widths, x, y, steps=3, lr=3e-3)
    mu = coord_check(
        lambda w: mup(MLP(w), base_width=64, zero_readout=True),
        widths,
        x,
        y,
        steps=3,
        lr=3e-3,
        plot=tmp_path / "coord.png",
    )
    assert (sp.parametrization, mu.parametrization) == ("SP", "muP")
    assert mu.modules == ("inp", "h1", "h2", "out", "<root>") and mu.steps == (0, 1, 2, 3)
    for hidden in ("h1", "h2"):
        assert sp.slope(hidden) > 0.25
        assert sp.rms[(hidden, 3)][-1] > 2 * sp.rms[(hidden, 3)][0]
    assert all(abs(s) <= 0.1 for s in mu.slopes().values()), mu.slopes()
    assert all(abs(mu.slope(m, 0)) <= 0.1 for m in ("inp", "h1", "h2"))  # init: all widths alike
    assert len(mu.rows()) == 5 * 4 * 5
    assert str(mu).startswith("Coordinate check (muP, adam lr=0.003)")

    from PIL import Image

    with Image.open(tmp_path / "coord.png") as image:
        assert image.format == "PNG"
        pixels = np.asarray(image.convert("RGB")).astype(int)
    # a panel per step (four) side by side, a title above, one legend row of the modules below
    w, h = COORD_PANEL_SIZE
    assert pixels.shape[:2] == (plots.TITLE_HEIGHT + h + plots.LEGEND_ROW, 4 * w)
    for k in range(4):  # each panel draws every module with a positive RMS at that step
        panel = pixels[plots.TITLE_HEIGHT : plots.TITLE_HEIGHT + h, k * w : (k + 1) * w]
        assert (panel != 255).any(axis=2).mean() > 0.05
        for i, m in enumerate(mu.modules):
            if m != "out" and all(v > 0 for v in mu.rms[(m, k)]):  # "out" is under "<root>"
                color = plots.PALETTE[i]
                assert (np.abs(panel - color).sum(axis=2) <= 24).sum() > 150, (k, m)
