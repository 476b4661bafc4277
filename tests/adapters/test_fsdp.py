"""NormProbe on sharded models: two CPU processes over gloo, run by tests/helpers/fsdp_train.py.

fsdp2: Lightning's ModelParallelStrategy with ``fully_shard`` (DTensor parameters) and the
callback. With ``normprobe.attach``: fsdp1, torch's FullyShardedDataParallel (``use_orig_params``,
as Lightning's FSDPStrategy, which refuses a CPU, sets it up); hsdp, ``fully_shard`` on a 2-D
mesh that replicates every parameter on both ranks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import free_port, script_env, start, wait_all
from tb import read_events

from normprobe import probes, tags

SCRIPT = Path(__file__).parents[1] / "helpers" / "fsdp_train.py"
MODES = ("fsdp2", "fsdp1", "hsdp")
# where rank 0 writes, how the stack of blocks is tagged, which steps are logged (every 2:
# Lightning logs step s when (s + 1) % 2 == 0, the plain probe when s % 2 == 0; both step 0),
# and the placement of the parameters
LOGS = {"fsdp2": "tb/version_0", "fsdp1": "tb0", "hsdp": "tb0"}
STACK = {"fsdp2": "net.blocks", "fsdp1": "blocks", "hsdp": "blocks"}
LOGGED = {"fsdp2": [0, 1, 3], "fsdp1": [0, 2], "hsdp": [0, 2]}
PLACEMENTS = {"fsdp2": ["S(0)"], "fsdp1": [], "hsdp": ["R", "S(0)"]}

Run = tuple[Path, dict[int, dict[str, Any]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    out = tmp_path_factory.mktemp("fsdp")
    port = free_port()
    commands = [["fsdp2"], ["plain", str(out), "0", port], ["plain", str(out), "1", port]]
    # all at once: Lightning's run (it starts its second rank), the plain API's ranks
    env = script_env(SCRIPT)
    procs = [start([str(SCRIPT), *args[:1], str(out), *args[2:]], out, env) for args in commands]
    wait_all(procs, [" ".join(args) for args in commands])
    return {
        mode: (
            out / mode,
            {r: json.loads((out / mode / f"rank{r}.json").read_text()) for r in (0, 1)},
        )
        for mode in MODES
    }


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_parameters_are_sharded_or_replicated(runs: dict[str, Run], mode: str) -> None:
    _, ranks = runs[mode]
    for rank in (0, 1):
        local, full = ranks[rank]["sharded"]
        assert ranks[rank]["placements"] == PLACEMENTS[mode]
        if mode == "hsdp":
            assert local == full  # both ranks hold all of it: it must count once
        else:
            assert local < full  # this rank holds part of the block's parameters


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_gradient_norms_are_the_full_gradients(runs: dict[str, Run], mode: str) -> None:
    out, ranks = runs[mode]
    events = read_events(str(out / LOGS[mode]))
    full = ranks[0]["grads"]  # from gathered gradients: the same on both ranks
    assert full == ranks[1]["grads"]
    for block in range(3):
        series = events.scalars[tags.format("grad_norm", STACK[mode], block)]
        assert [s for s, _ in series] == LOGGED[mode]
        for step, value in series:
            assert value == pytest.approx(full[str(step)][block], rel=1e-5)


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_update_ratios_and_gains_are_of_the_whole_tensors(runs: dict[str, Run], mode: str) -> None:
    out, ranks = runs[mode]
    events = read_events(str(out / LOGS[mode]))
    seen = ranks[0]
    for block in range(3):
        ratios = events.scalars[tags.format("update_ratio", STACK[mode], block)]
        means = events.scalars[tags.format("norm_gain_mean", STACK[mode], block, "ln_1")]
        stds = events.scalars[tags.format("norm_gain_std", STACK[mode], block, "ln_1")]
        assert [s for s, _ in ratios] == [s for s, _ in means] == LOGGED[mode]
        for step, value in ratios:
            assert value == pytest.approx(seen["updates"][str(step)][block], rel=1e-5)
        for (step, mean), (_, std) in zip(means, stds, strict=True):
            want_mean, want_std = seen["gains"][str(step)][block]
            assert want_std > 0.1  # the witness initialized them spread out
            assert (mean, std) == pytest.approx((want_mean, want_std), rel=1e-5)


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_one_collective_per_logged_step_and_no_implicit_ones(
    runs: dict[str, Run], mode: str
) -> None:
    _, ranks = runs[mode]
    want = {str(s): int(s in LOGGED[mode]) for s in range(4)}
    for rank in (0, 1):
        assert ranks[rank]["collectives"] == want
        assert ranks[rank]["dtensor_ops"] == []  # none could redistribute a shard


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_rank_zero_writes_unsharded_names(runs: dict[str, Run], mode: str) -> None:
    out, ranks = runs[mode]
    assert (ranks[0]["sinks"], ranks[1]["sinks"]) == (1, 0)
    if mode != "fsdp2":  # attach() opens no event file on rank 1
        assert not (out / "tb1").exists()
    scalars = read_events(str(out / LOGS[mode])).scalars

    # a block's outlier channel is written on the steps where every rank found the same one;
    # the sink adds the dashboard's summary tags to the event file
    def steady(names: Iterable[str]) -> set[str]:
        skipped = (tags.prefix("outlier_channel"), tags.prefix("summary"))
        return {t for t in names if not t.startswith(skipped)}

    assert steady(scalars) == steady(ranks[0]["tags"]) == steady(ranks[1]["tags"])
    assert not [t for t in scalars if "_fsdp_wrapped_module" in t or "FSDP" in t]
    assert tags.format("resid_rms", STACK[mode], 2) in scalars
    assert tags.format("norm_in_rms", STACK[mode], 0, "ln_2") in scalars


def test_lightning_fsdp_strategy_needs_a_gpu() -> None:
    """Why fsdp1 runs without Lightning here; if this starts to pass, test the strategy."""
    import lightning as L

    with pytest.raises(ValueError, match="The strategy `fsdp` requires a GPU accelerator"):
        L.Trainer(accelerator="cpu", devices=2, strategy="fsdp")


def test_lightning_fsdp_strategy_sums_shards_unless_it_does_not_shard() -> None:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from normprobe.lightning import _param_reduce

    assert _param_reduce(FSDPStrategy()) == "sum"
    assert _param_reduce(FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")) == "sum"
    assert _param_reduce(FSDPStrategy(sharding_strategy="NO_SHARD")) == "mean"
    assert _param_reduce(DDPStrategy()) == "mean"


def test_gain_moments_of_shards_add_up_to_the_whole_gain() -> None:
    weight = torch.randn(10) * 0.3
    shards = [weight[:6], weight[6:], weight[:0]]  # uneven, and one rank holding nothing
    total = torch.stack([probes.gain_moments(s, offset=1.0) for s in shards]).sum(dim=0)
    mean, std = probes.gain_from_moments(*total.tolist())
    gain = 1.0 + weight.double()
    assert (mean, std) == pytest.approx((float(gain.mean()), float(gain.std(unbiased=False))))
    assert all(math.isnan(v) for v in probes.gain_from_moments(0.0, 0.0, 0.0))
    plain = torch.nn.Linear(2, 2)
    assert not probes.is_sharded(plain)
    assert probes.shard_share(plain.weight) == 1.0 and probes.local(plain.weight) is plain.weight
