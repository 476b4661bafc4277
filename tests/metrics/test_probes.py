"""The statistics themselves, against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normprobe
from normprobe import probes


def test_rms_and_slope() -> None:
    assert float(probes.rms(torch.full((2, 4), 3.0))) == pytest.approx(3.0)
    assert float(probes.rms(torch.tensor([3.0, 4.0]))) == pytest.approx(math.sqrt(12.5))
    assert probes.rms(torch.ones(3, dtype=torch.bfloat16)).dtype == torch.float32
    # sqrt(l) growth has slope 1/2 in log-log; a flat profile 0; linear growth 1
    assert probes.loglog_slope([math.sqrt(i + 1) for i in range(12)]) == pytest.approx(0.5)
    assert probes.loglog_slope([2.0] * 5) == pytest.approx(0.0)
    assert probes.loglog_slope([float(i + 1) for i in range(7)]) == pytest.approx(1.0)
    assert math.isnan(probes.loglog_slope([1.0]))


def test_mean_cosine() -> None:
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert float(probes.mean_cosine(a, b)) == pytest.approx(0.5)  # (1 + 0) / 2
    images = torch.randn(2, 8, 3, 3)
    assert float(probes.mean_cosine(images, 2 * images)) == pytest.approx(1.0)
    # rows of several pairs stacked: one mean cosine per pair, as each pair alone gives
    c = torch.randn(2, 2)
    rows = [
        torch.stack(r)
        for r in zip(
            *[
                (probes.row_dots(x, y), probes.row_norms(x), probes.row_norms(y))
                for x, y in ((a, b), (a, c))
            ],
            strict=True,
        )
    ]
    want = [float(probes.mean_cosine(a, b)), float(probes.mean_cosine(a, c))]
    assert probes.cosines_from_rows(*rows).tolist() == pytest.approx(want)


def test_row_dots_are_the_dot_product_at_each_position_in_every_layout() -> None:
    torch.manual_seed(0)
    tokens = torch.randn(2, 5, 6), torch.randn(2, 5, 6)  # features last
    views = tokens[0].transpose(0, 1), tokens[1].transpose(0, 1)  # not contiguous
    images = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)  # channels: dim 1
    low = tokens[0].bfloat16(), tokens[1].bfloat16()
    for (a, b), dim in ((tokens, -1), (views, -1), (images, 1), (low, -1)):
        want = (a.double() * b.double()).sum(dim).reshape(-1)
        got = probes.row_dots(a, b)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_row_norms_add_up_to_the_rms() -> None:
    x = torch.randn(4, 5, 6, dtype=torch.bfloat16)
    norms = probes.row_norms(x)
    assert norms.shape == (20,) and norms.dtype == torch.float32
    assert float(norms.norm() / math.sqrt(x.numel())) == pytest.approx(float(probes.rms(x)))
    stacked = probes.rms_from_row_norms(torch.stack([norms, 2 * norms]), x.numel())
    assert stacked.tolist() == pytest.approx([float(probes.rms(x)), 2 * float(probes.rms(x))])


def test_squared_norms_summed_by_block() -> None:
    g1, g2, missing = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 12.0]), torch.zeros(())
    squares = probes.squared_norms([g1, g2, missing])
    assert squares.dtype == torch.float32 and squares.tolist() == pytest.approx([25, 144, 0])
    # block 0 holds g1 and g2: 9 + 16 + 144 = 169 = 13^2; block 1 has no gradient yet
    blocks = probes.group_sums(squares, torch.tensor([0, 0, 1]), 2)
    assert blocks.tolist() == pytest.approx([169.0, 0.0])
    wide = probes.squared_norms([g1.double(), g2.bfloat16()])
    assert wide.dtype == torch.float64 and wide.tolist() == pytest.approx([25, 144])


def test_by_shape_squared_norms_match_one_by_one() -> None:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(probes.SMALL_NUMEL + 1, generator=g)  # reduced alone
    tensors: list[torch.Tensor | None] = [
        torch.tensor([3.0, 4.0]),
        torch.randn(4, 4, generator=g),
        torch.tensor([0.0, 12.0]),
        big,
        torch.randn(4, 4, generator=g).bfloat16(),
        torch.randn(4, 4, generator=g),
        torch.randn(4, 4, generator=g).bfloat16(),
        torch.tensor([1.0, 1.0]),  # its group's other members have no gradient yet
        torch.randn(3, generator=g),  # alone: no other tensor has its shape
    ]
    present = [t for t in tensors if t is not None]
    by_shape = probes.ByShape(present)
    assert sorted(map(sorted, by_shape.groups)) == [[0, 2, 7], [1, 5], [4, 6]]
    assert by_shape.alone == [3, 8]
    want = probes.squared_norms(present)
    got = by_shape.squared_norms(present, torch.device("cpu"))
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5)
    assert got[:3].tolist() == pytest.approx([25.0, float(want[1]), 144.0])
    # gradients missing (None) count 0: a whole group, part of one, a tensor alone
    tensors[1] = tensors[5] = tensors[0] = tensors[8] = None
    got = by_shape.squared_norms(tensors, torch.device("cpu"))
    assert [got[i].item() for i in (0, 1, 5, 8)] == [0.0] * 4
    assert got[2].item() == 144.0 and got[7].item() == pytest.approx(2.0)
    assert got[3].item() == pytest.approx(float(big.square().sum()), rel=1e-5)


def test_by_shape_survives_a_tensor_that_changed_shape() -> None:
    # FSDP1 swaps a parameter between a view of its shard and the whole tensor
    tensors = [torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, 2)]
    by_shape = probes.ByShape(tensors)
    tensors[1] = torch.full((3,), 2.0)
    got = by_shape.squared_norms(tensors, torch.device("cpu"))
    assert got.tolist() == pytest.approx([4.0, 12.0, 4.0])


def test_by_shape_float64_widens_and_subclasses_stay_alone() -> None:
    class Marked(torch.Tensor):
        pass

    wide = [torch.full((2,), 3.0, dtype=torch.float64) for _ in range(2)]
    marked = torch.ones(2).as_subclass(Marked)
    tensors = [*wide, marked, torch.ones(2), torch.full((2,), 2.0)]
    by_shape = probes.ByShape(tensors)
    assert by_shape.groups == [[3, 4]] and by_shape.alone == [0, 1, 2]
    got = by_shape.squared_norms(tensors, torch.device("cpu"))
    assert got.dtype == torch.float64 and got.tolist() == pytest.approx([18.0, 18.0, 2.0, 2.0, 8.0])


def test_change_squares_exact_and_sampled() -> None:
    # p (3, 4) -> (3, 4.5) and q (0, 0) -> (1, 0) are a group, copied whole; big is sampled:
    # 210 entries, a budget of 70: q = 3 (prime to the rows of 7), runs of 16 every 48 entries,
    # 4 whole periods (192 entries), so entries 0-15, 48-63, 96-111 and 144-159 are read
    p, q = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])
    big = torch.arange(210.0).reshape(30, 7)
    sample = probes.SampledCopy([p, q, big], budgets=[70, 70, 70])
    assert sample.sampled == [2] and sample.whole == [0, 1]
    before = sample.copy([p, q, big])
    read = torch.cat([torch.arange(16.0) + start for start in (0, 48, 96, 144)])
    scale = 210 / 64  # numel / entries read
    assert sample.copy_squares(before).tolist() == pytest.approx(
        [25.0, 0.0, read.square().sum().item() * scale]
    )
    p[1], q[0] = 4.5, 1.0
    big += 2.0
    assert sample.change_squares([p, q, big], before).tolist() == pytest.approx(
        [0.25, 1.0, 64 * 4.0 * scale]  # every entry moved by 2: the whole tensor's 210 * 4
    )


def test_sampled_copy_reads_views_memory_order_and_low_precision() -> None:
    """A transposed view is read in its own order from a copy, a bfloat16 tensor's change in
    float32, and a tensor whose size is not a whole number of periods stays inside itself."""
    torch.manual_seed(0)
    wide = torch.randn(40, 50)
    view = wide.t()  # not contiguous
    low = (torch.randint(-64, 64, (1000,)) / 4).bfloat16()  # quarters up to 16: exact
    odd = torch.randn(1001)
    tensors = [view, low, odd]
    sample = probes.SampledCopy(tensors, budgets=[200, 200, 200])
    before = sample.copy(tensors)
    estimate = sample.copy_squares(before)
    exact = torch.stack([t.float().square().sum() for t in tensors])
    # runs of 16 of a random tensor: within a few standard errors of the whole one's sum
    torch.testing.assert_close(estimate, exact, rtol=0.25, atol=0)
    low.add_(0.5)  # still exact: each entry moves by 0.5
    change = sample.change_squares(tensors, before)
    assert change[0].item() == 0.0 and change[2].item() == 0.0
    assert change[1].item() == pytest.approx(1000 * 0.25, rel=1e-6)


def test_sampled_copy_under_a_budget_of_one_run_reads_the_first() -> None:
    """21 entries, a budget of 5: a period of 48 does not fit, so one run of 16 is read from
    the start and scaled by 21 / 16; 16 entries or fewer are read whole."""
    t, short = torch.arange(21.0), torch.arange(16.0)
    sample = probes.SampledCopy([t, short], budgets=[5, 4])
    assert sample.sampled == [0]
    squares = sample.copy_squares(sample.copy([t, short])).tolist()
    assert squares == pytest.approx([torch.arange(16.0).square().sum().item() * 21 / 16, 1240.0])


def test_logit_stats() -> None:
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), -2.0]])
    max_abs, rms, z = probes.logit_stats(logits).tolist()
    assert max_abs == pytest.approx(2.0)
    assert rms == pytest.approx(math.sqrt((math.log(3.0) ** 2 + 4.0) / 4))
    # mean of log(e^0 + e^0) and log(3 + e^-2)
    assert z == pytest.approx((math.log(2.0) + math.log(3.0 + math.exp(-2.0))) / 2)


def test_sdpa_logit_max_per_head_matches_materialized_logits() -> None:
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8)
    full = q @ k.transpose(-1, -2) / math.sqrt(8)
    want = full.abs().amax(dim=(0, 2, 3))  # per head: every product, masks or not
    got = probes.sdpa_logit_max(q, k)
    assert got.shape == (4,)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # chunked over query rows (5 rows of 2 x 4 heads x 10 keys), explicit scale
    got = probes.sdpa_logit_max(q, k, scale=0.5, chunk_elements=64)
    torch.testing.assert_close(got, (full * math.sqrt(8) * 0.5).abs().amax(dim=(0, 2, 3)))
    # grouped-query attention: 2 key heads serve 4 query heads, in order
    k2 = torch.randn(2, 2, 10, 8)
    expanded = k2.repeat_interleave(2, dim=1)
    want = (q @ expanded.transpose(-1, -2) / math.sqrt(8)).abs().amax(dim=(0, 2, 3))
    torch.testing.assert_close(probes.sdpa_logit_max(q, k2), want)
    flat = probes.sdpa_logit_max(q.reshape(8, 10, 8), k2.reshape(4, 10, 8), heads=4)
    torch.testing.assert_close(flat, want)  # the same, heads flattened with the batch
    # 2-D queries: one head
    assert probes.sdpa_logit_max(q[0, 0], k[0, 0]).shape == (1,)
    # heads flattened with the batch, (batch * heads, queries, dim): the index modulo heads
    flat = probes.sdpa_logit_max(q.reshape(8, 10, 8), k.reshape(8, 10, 8), heads=4)
    torch.testing.assert_close(flat, full.abs().amax(dim=(0, 2, 3)), rtol=1e-6, atol=0)
    # strided views of one fused qkv tensor, as a model's attention passes them
    qkv = torch.randn(2, 10, 3, 4, 8).permute(2, 0, 3, 1, 4)
    want = (qkv[0] @ qkv[1].transpose(-1, -2)).abs().amax(dim=(0, 2, 3)) / math.sqrt(8)
    torch.testing.assert_close(probes.sdpa_logit_max(qkv[0], qkv[1]), want, rtol=1e-6, atol=0)
    assert probes.sdpa_logit_max(q[:, :, :0], k).tolist() == [0.0] * 4  # no queries


def test_head_abs_max_reads_heads_from_either_layout() -> None:
    s = torch.randn(3, 4, 5, 5)  # (batch, heads, queries, keys)
    want = s.abs().amax(dim=(0, 2, 3))
    torch.testing.assert_close(probes.head_abs_max(s, 4), want)
    torch.testing.assert_close(probes.head_abs_max(s.reshape(12, 5, 5), 4), want)  # batch*heads
    # a layout that does not split into heads: every head gets the overall max
    assert probes.head_abs_max(torch.tensor([[-7.0, 2.0]]).expand(5, 1, 2), 2).tolist() == [7, 7]


def test_abs_max_in_float32() -> None:
    got = probes.abs_max(torch.tensor([[1.5, -3.0], [-2.5, 0.5]], dtype=torch.bfloat16))
    assert got.dtype == torch.float32 and float(got) == 3.0


def test_batchnorm_stats_by_hand() -> None:
    # One channel, batch values 1 and 3: batch mean 2, variance 1. Running mean 0, variance 4.
    x = torch.tensor([[1.0], [3.0]])
    mean_drift, var_drift, gap, settled_mean, settled_var = probes.batchnorm_stats(
        x, torch.zeros(1), torch.full((1,), 4.0), None, None, eps=1e-12
    ).tolist()
    assert mean_drift == pytest.approx(2 / 2)  # |2 - 0| / sqrt(4)
    assert var_drift == pytest.approx(math.log(4.0))  # |log(1 / 4)|
    # train: (x - 2) / 1 = [-1, 1]; eval: x / 2 = [0.5, 1.5]; difference [-1.5, -0.5]
    assert gap == pytest.approx(math.sqrt((2.25 + 0.25) / 2) / 1.0)
    assert (settled_mean, settled_var) == (mean_drift, var_drift)  # no initial share given


def test_batchnorm_settled_drift_discounts_the_initial_statistics() -> None:
    # Running mean 1.2, variance 2.8 after updates that left the initial (0, 1) a weight of 0.4:
    # the batches' own share (0.6) averages to mean 1.2 / 0.6 = 2 and variance
    # (2.8 - 0.4) / 0.6 = 4; a batch of mean 2 and variance 4 sits on them exactly.
    x = torch.tensor([[0.0], [4.0]])
    stats = probes.batchnorm_stats(
        x, torch.full((1,), 1.2), torch.full((1,), 2.8), None, None, 1e-12, torch.tensor(0.4)
    ).tolist()
    assert stats[0] == pytest.approx(0.8 / math.sqrt(2.8))  # raw: |2 - 1.2| / sqrt(2.8)
    assert stats[1] == pytest.approx(math.log(4 / 2.8))
    assert stats[3:] == pytest.approx([0.0, 0.0], abs=1e-6)
    # the module's own updates: momentum 0.1 from (0, 1), three batches of mean 5, variance 9
    bn = nn.BatchNorm1d(1)
    batch = torch.tensor([[2.0], [8.0]])  # mean 5, biased variance 9 (unbiased 18)
    for _ in range(3):
        bn(batch)
    share = (1 - 0.1) ** bn.num_batches_tracked.float()
    stats = probes.batchnorm_stats(
        batch, bn.running_mean, bn.running_var, None, None, bn.eps, share
    ).tolist()
    kept = 1 - 0.9**3  # the batches' share of the running statistics
    running_var = 0.9**3 + kept * 18
    assert stats[0] == pytest.approx((5 - kept * 5) / math.sqrt(running_var), rel=1e-4)
    assert stats[1] == pytest.approx(math.log(9 / running_var), rel=1e-4)
    assert stats[3] == pytest.approx(0.0, abs=1e-5)
    assert stats[4] == pytest.approx(math.log(2), abs=1e-5)  # BatchNorm keeps the unbiased 18


def test_batchnorm_train_eval_gap_matches_the_module() -> None:
    # As in sanity check [c]: after a few batches the running statistics differ from the
    # batch's, so train-mode and eval-mode outputs differ on the same batch.
    bn = nn.BatchNorm1d(16)
    x = torch.randn(64, 16) * 3 + 7
    for _ in range(3):
        bn(x)
    with torch.no_grad():
        y_train = F.batch_norm(x, None, None, bn.weight, bn.bias, training=True, eps=bn.eps)
        y_eval = bn.eval()(x)
    want = float((y_train - y_eval).pow(2).mean().sqrt() / y_train.pow(2).mean().sqrt())
    got = probes.batchnorm_stats(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)
    assert float(got[2]) == pytest.approx(want, rel=1e-5)
    assert want > 0.5


def test_gain_stats() -> None:
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert probes.gain_stats(w).tolist() == pytest.approx([2.5, math.sqrt(1.25)])
    assert probes.gain_stats(torch.zeros(3), offset=1.0).tolist() == [1.0, 0.0]  # Gemma at init
    stacked = torch.stack([w, torch.full((4,), 2.0)])  # one row per norm
    assert probes.gain_stats(stacked).tolist() == [pytest.approx([2.5, math.sqrt(1.25)]), [2, 0]]


def test_finite_sum() -> None:
    assert math.isfinite(probes.finite_sum(torch.ones(3, dtype=torch.bfloat16)))
    assert math.isnan(probes.finite_sum(torch.tensor([1.0, float("nan")])))
    assert math.isinf(probes.finite_sum(torch.tensor([float("inf")])))


def test_sums_of_squares_of_large_cpu_tensors_are_exact_to_float32_rounding() -> None:
    # torch's CPU reduction of a whole float32 tensor drifts with its size (1.3e-3 relative at
    # 2**24 entries, 2e-2 on the squares of a 4096 x 25088 gradient)
    torch.manual_seed(0)
    big = torch.randn(4096, 4096) * 1e-3
    exact = big.double().pow(2).sum().item()
    assert torch.linalg.vector_norm(big).item() ** 2 / exact - 1 < -1e-4  # the drift itself
    view = big.t()  # not contiguous: by its last axis
    squares = probes.squared_norms([torch.randn(10), big, view, torch.nn.Parameter(big)])
    for got in squares[1:].tolist():
        assert got == pytest.approx(exact, rel=1e-6)
    assert probes.rms(big).item() == pytest.approx(math.sqrt(exact / big.numel()), rel=1e-6)
    assert probes.rms_many([big, big[:3]])[0].item() == pytest.approx(
        math.sqrt(exact / big.numel()), rel=1e-6
    )


def test_large_cpu_tensors_reduced_together_are_each_exact() -> None:
    # several large tensors' rows in one reduction: a whole number of rows, a remainder after
    # them, a transposed view, float64, and the RMS of a batch of activations
    torch.manual_seed(0)
    sizes = [(256, 1024), (3, 70_001), (2048, 300)]
    tensors = [torch.randn(*size) * 10.0**-k for k, size in enumerate(sizes)]
    tensors.append(tensors[2].t())
    exact = [t.double().pow(2).sum().item() for t in tensors]
    got = probes.squared_norms([torch.randn(5), *tensors])[1:].tolist()
    assert got == pytest.approx(exact, rel=1e-6)
    wide = probes.squared_norms([t.double() for t in tensors])
    assert wide.dtype == torch.float64
    assert wide.tolist() == pytest.approx(exact, rel=1e-12)
    want = [math.sqrt(e / t.numel()) for e, t in zip(exact, tensors, strict=True)]
    assert probes.rms_many(tensors).tolist() == pytest.approx(want, rel=1e-6)


def test_a_large_layer_gradient_norm_is_exact_on_a_cpu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 4096), nn.Linear(4096, 4096), nn.Linear(4096, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with normprobe.attach(model, opt, every=1, sinks=[normprobe.MemorySink()]) as probe:
        model(torch.randn(4, 64)).pow(2).sum().backward()
        exact = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))
        opt.step()
    assert probe.latest is not None
    total = probe.latest.scalars["normprobe/grad_norm_total/model"]
    assert total == pytest.approx(exact, rel=1e-6)
