"""NormProbe on DeepSpeed ZeRO: two CPU processes over gloo, run by tests/helpers/deepspeed_train.py
(the plain engine) and tests/helpers/deepspeed_hf_train.py (a Hugging Face Trainer, and a loop
with Accelerate's DeepSpeed plugin).

Stages 0 to 3 against stage 0's witness (same weights, same batches; stage 0 all-reduces the
gradients after the backward, where the probe must not read them), two micro-batches a step and
``gradient_clipping`` far below the gradients' norm: the logged per-block gradient norms are
those of the whole gradients before clipping (values clipped would be 10x smaller), and the
weight statistics those of the whole weights, although each rank holds a part of them.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
from launch import free_port, run_ranks, script_env, start, wait_all

pytest.importorskip("deepspeed")

import normprobe
from normprobe.models import TinyTransformer
from normprobe.runtime.spikes import DEFAULT_SPIKES
from normprobe.runtime.zero import warn_spikes

SCRIPT = Path(__file__).parents[1] / "helpers" / "deepspeed_train.py"
STAGES = ("0", "1", "2", "3")  # 0: a DeepSpeed engine without ZeRO, the reference
ZERO = STAGES[1:]
# the Trainer: ZeRO-1 reads as ZeRO-2 does (the same optimizer class), tested with the plain engine
HF_STAGES = ("0", "2", "3")
ACCELERATED = ("0", "3")  # Accelerate's plugin: the engine as the model; ZeRO-3's parameters
LOGGED = ["0", "2"]  # of steps 0 to 2, every 2
CLIP = 0.05  # the script's gradient_clipping

Ranks = dict[int, dict[str, Any]]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Ranks:
    return run_ranks(SCRIPT, tmp_path_factory.mktemp("deepspeed"), 2)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_the_stages_are_zero_optimizers(ranks: Ranks) -> None:
    names = {stage: ranks[0][stage]["optimizer"] for stage in STAGES}
    assert names == {
        "0": "AdamW",
        "1": "DeepSpeedZeroOptimizer",
        "2": "DeepSpeedZeroOptimizer",
        "3": "DeepSpeedZeroOptimizer_Stage3",
    }


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_gradient_norms_are_the_whole_gradients_before_clipping(ranks: Ranks, stage: str) -> None:
    reference, run = ranks[0]["0"], ranks[0][stage]
    assert sorted(run["logged"]) == LOGGED
    for step in LOGGED:
        assert run["totals"][step] > 10 * CLIP  # DeepSpeed clips these by 10x or more
        logged = run["logged"][step]["grad_norm"]
        assert logged == pytest.approx(reference["grads"][step], rel=1e-5)
        assert logged == pytest.approx(run["grads"][step], rel=1e-5)
        assert ranks[1][stage]["logged"][step] == run["logged"][step]  # one reduced value


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_weight_statistics_are_of_the_whole_weights(ranks: Ranks, stage: str) -> None:
    reference, run = ranks[0]["0"], ranks[0][stage]
    for step in LOGGED:
        logged = run["logged"][step]
        assert logged["weight_rms"] == pytest.approx(reference["weights"][step], rel=1e-5)
        assert logged["update_ratio"] == pytest.approx(run["updates"][step], rel=1e-5)
        assert logged["update_ratio"] == pytest.approx(reference["updates"][step], rel=1e-4)
        gains = reference["gains"][step]
        assert all(std > 0.1 for _, std in gains)  # spread out: the std is measured
        assert logged["norm_gain_mean"] == pytest.approx([m for m, _ in gains], rel=1e-5)
        assert logged["norm_gain_std"] == pytest.approx([s for _, s in gains], rel=1e-5)
        assert all(v > 0 for v in logged["resid_rms"])  # the forward's reads, stage 3 too


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_one_collective_per_logged_step_and_hooks_removed(ranks: Ranks, stage: str) -> None:
    for rank in (0, 1):
        run = ranks[rank][stage]
        assert run["collectives"] == {"0": 1, "1": 0, "2": 1}
        assert run["left"] == {"step_wrapped": False, "hooks": 0}
    assert (ranks[0][stage]["sinks"], ranks[1][stage]["sinks"]) == (2, 0)  # rank 0 writes


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.parametrize("stage", ZERO)
def test_without_the_zero_optimizer_the_parameter_families_are_refused(
    ranks: Ranks, stage: str
) -> None:
    metrics, warned = ranks[0][stage]["unpaired"]
    assert metrics == ["resid_rms"]
    (message,) = [w for w in warned if "DeepSpeed" in w]
    assert "grad_norm, weight_rms, update_ratio, norm_gain are not logged" in message
    assert "optimizer=engine.optimizer" in message
    assert ("stage 3" in message) == (stage == "3")
    assert ranks[1][stage]["unpaired"] == [["resid_rms"], []]  # rank 0 says it
    # without ZeRO the engine is found: its gradients are whole in each parameter's .grad
    metrics, warned = ranks[0]["0"]["unpaired"]
    assert {"grad_norm", "weight_rms", "update_ratio", "norm_gain"} <= set(metrics)
    assert not warned


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch: a Hugging Face Trainer with a DeepSpeed config of each stage, then a loop
    with Accelerate's DeepSpeed plugin of each of ACCELERATED (its runs under 10 + stage)."""
    out = tmp_path_factory.mktemp("deepspeed_hf")
    script = SCRIPT.with_name("deepspeed_hf_train.py")
    env = script_env(SCRIPT, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    command = [str(script), str(out), ",".join(HF_STAGES), ",".join(ACCELERATED)]
    env |= {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    procs = [start(command, out, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    wait_all(procs, ["rank 0", "rank 1"])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


OPTIMIZERS = {
    "0": "AdamW",
    "1": "DeepSpeedZeroOptimizer",
    "2": "DeepSpeedZeroOptimizer",
    "3": "DeepSpeedZeroOptimizer_Stage3",
}


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_hf_trainer_with_zero_stages_0_2_3_logs_gradients_before_clipping(
    wrapped: list[dict[str, Any]],
) -> None:
    """The Trainer runs DeepSpeed's step inside Accelerate's backward, before it calls any
    callback: the callback reads the gradients when the engine's step (stage 0) or the ZeRO
    optimizer's starts."""
    reference = wrapped[0]["0"]["grads"]
    for stage in HF_STAGES:
        run = wrapped[0][stage]
        assert run["optimizer"] == OPTIMIZERS[stage]
        assert run["logged"] == wrapped[1][stage]["logged"]
        assert sorted(run["logged"]) == ["1", "2"]
        for step, logged in run["logged"].items():
            assert logged == pytest.approx(run["grads"][step], rel=1e-5)
            assert logged == pytest.approx(reference[step], rel=1e-5)
            # the Trainer's own total (none at stage 0), before clipping: 20x the clip
            total = run["totals"].get(step, math.inf)
            assert total > 20 * 0.05 and total >= math.sqrt(sum(v * v for v in logged))
        assert (stage == "0") == (not run["totals"])


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_accelerate_deepspeed_plugin_logs_gradients_before_clipping(
    wrapped: list[dict[str, Any]],
) -> None:
    """``attach(model, opt)`` with what ``accelerator.prepare`` returned: the engine itself
    (stage 0: its step is found) and Accelerate's optimizer (the ZeRO optimizer behind it)."""
    reference = wrapped[0]["10"]["grads"]
    for stage in ACCELERATED:
        run = wrapped[0][f"1{stage}"]
        assert run["optimizer"] == OPTIMIZERS[stage]
        assert sorted(run["logged"]) == ["0", "1"] == sorted(run["grads"])
        for step, logged in run["logged"].items():
            assert sum(v * v for v in logged) > (10 * 0.05) ** 2  # clipped by 10x or more
            assert logged == pytest.approx(run["grads"][step], rel=1e-5)
            assert logged == pytest.approx(reference[step], rel=1e-5)


def test_deepspeed_optimizers_without_zero_are_refused_by_name() -> None:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    model = TinyTransformer(depth=2, width=16)
    for cls in (BF16_Optimizer, FP16_Optimizer):
        optimizer = cls.__new__(cls)  # its class alone decides
        with pytest.raises(TypeError, match=f'{cls.__name__} .*"stage": 1'):
            normprobe.attach(model, optimizer)
        assert not model._forward_pre_hooks and normprobe.attached_probe(model) is None


def test_the_spike_detector_is_off_under_zero_said_so_in_one_process() -> None:
    with pytest.warns(RuntimeWarning, match=r"spike detector \(spikes\) is off .* stage 2"):
        warn_spikes(2, DEFAULT_SPIKES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_spikes(2, None)  # turned off by the user: nothing to say
