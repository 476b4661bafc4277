"""The spike detector: a loss spike found at its step and the steps after it logged, no host
read on the other steps, a verdict read late, NaN kept out, its settings checked, and the
Lightning and Hugging Face callbacks."""

from __future__ import annotations

import collections
import copy
import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tb import read_events, read_texts
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

import normprobe
from normprobe import tags
from normprobe.models import TinyTransformer
from normprobe.runtime.spikes import SpikeDetector, _check

SPIKE_AT = 60
STEPS = 100
LOSS_Z = tags.format("spike", "loss_z")
GRAD_Z = tags.format("spike", "grad_z")
EVENT = tags.format("spike", "blocks")


class LossOut(nn.Module):
    """A language model returning ``{"loss": ..., "logits": ...}`` as Hugging Face models do
    given labels; ``scale`` multiplies the loss (and so its gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyTransformer(width=32, depth=3, heads=2, context=16)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), x.flatten()) * self.scale
        return {"loss": loss, "logits": logits}


def train(log_dir: Path, spike_at: int | None, **options: Any) -> None:
    """``STEPS`` AdamW steps of `LossOut` on fixed batches, the loss multiplied by 50 at
    ``spike_at``; the probe reads the loss from the model's output."""
    torch.manual_seed(0)
    model = LossOut()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = torch.randint(0, 96, (STEPS, 4, 16), generator=torch.Generator().manual_seed(0))
    with normprobe.attach(model, opt, log_dir=str(log_dir), every=25, **options):
        for step, x in enumerate(batches):
            model.scale = 50.0 if step == spike_at else 1.0
            model(x)["loss"].backward()
            opt.step()
            opt.zero_grad()


def logged_steps(log_dir: Path) -> list[int]:
    return [
        s for s, _ in read_events(str(log_dir)).scalars[tags.format("grad_ratio", "model.blocks")]
    ]


def test_a_loss_spike_is_found_at_its_step_and_the_next_steps_are_logged(
    tmp_path: Path, one_thread: None
) -> None:
    with pytest.warns(RuntimeWarning, match=f"loss spike at step {SPIKE_AT} ") as caught:
        train(tmp_path, SPIKE_AT, spikes=normprobe.Spikes(capture=10))
    assert len([w for w in caught if "spike" in str(w.message)]) == 1
    events = read_events(str(tmp_path))
    [(step, z)] = events.scalars[LOSS_Z]
    assert step == SPIKE_AT and z > 6
    assert [s for s, _ in events.scalars[GRAD_Z]] == [SPIKE_AT]  # its gradient spiked too
    [(step, text)] = read_texts(str(tmp_path))[f"{EVENT}/text_summary"]
    assert step == SPIKE_AT and text.startswith(f"step {SPIKE_AT}: loss ")
    assert "(a spike)" in text and "a spike is above mean + 6 std" in text
    assert text.count("model.blocks/") == 3  # the three blocks whose gradient rose most
    # every=25, and the 10 steps after the spike
    assert logged_steps(tmp_path) == [0, 25, 50, *range(SPIKE_AT + 1, SPIKE_AT + 11), 75]
    flags = [f for f in normprobe.report_run(tmp_path).flags if f.kind.endswith("spike")]
    assert [(f.kind, f.step, f.threshold) for f in flags] == [("loss spike", SPIKE_AT, 6.0)]
    assert "model.blocks/" in flags[0].message


def test_without_a_spike_only_the_schedule_is_logged(tmp_path: Path, one_thread: None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        train(tmp_path, None)
    events = read_events(str(tmp_path))
    assert logged_steps(tmp_path) == [0, 25, 50, 75]
    assert not [t for t in [*events.scalars, *events.texts] if t.startswith("normprobe/spike/")]


def test_a_rise_below_sigma_is_no_spike(tmp_path: Path, one_thread: None) -> None:
    # the same spike, under a threshold far above it
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        train(tmp_path, SPIKE_AT, spikes=normprobe.Spikes(sigma=1e6))
    assert logged_steps(tmp_path) == [0, 25, 50, 75]


class CountTransfers(TorchFunctionMode):
    """Counts the calls that read tensor values on the host, and the detector's copies of its
    verdict into host memory."""

    READS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"})

    def __init__(self, detector: SpikeDetector) -> None:
        super().__init__()
        self.detector = detector
        self.reads = self.copies = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        self.reads += name in self.READS
        if name == "copy_":
            self.copies += any(args[0] is h for h in getattr(self.detector, "_host", ()))
        return func(*args, **(kwargs or {}))


def test_no_host_read_on_unlogged_steps_and_one_verdict_copy_per_step(tmp_path: Path) -> None:
    model = TinyTransformer(depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (2, 16))
    reads, copies = [], []
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=3, example_inputs=(x,)) as probe:
        detector = probe._spikes.detector if probe._spikes else None
        assert detector is not None
        for _ in range(6):
            with CountTransfers(detector) as counter:
                loss = model.loss(x, x)
                probe.observe_loss(loss)
                loss.backward()
                opt.step()  # the detector checks the step, then the probe writes it
                opt.zero_grad()
            reads.append(counter.reads)
            copies.append(counter.copies)
            assert not detector._pending  # on a CPU the verdict is read at the step itself
    assert reads == [1, 0, 0, 1, 0, 0]  # the logged steps' one transfer, nothing else
    assert copies == [1] * 6


class LateCopy:
    """A device-to-host copy (a CUDA event) that is done from the second time it is asked."""

    def __init__(self) -> None:
        self.asked = 0

    def query(self) -> bool:
        self.asked += 1
        return self.asked > 1

    def synchronize(self) -> None:
        self.asked = 2


def test_a_verdict_still_on_its_way_is_read_on_a_later_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    send = SpikeDetector._send

    def send_late(self: SpikeDetector, step: int) -> None:
        send(self, step)
        checked, slot, _ = self._pending.pop()
        self._pending.append((checked, slot, LateCopy()))  # type: ignore[arg-type]

    monkeypatch.setattr(SpikeDetector, "_send", send_late)
    with pytest.warns(RuntimeWarning, match=f"at step {SPIKE_AT} "):
        train(tmp_path, SPIKE_AT, spikes=normprobe.Spikes(capture=4))
    events = read_events(str(tmp_path))
    assert [s for s, _ in events.scalars[LOSS_Z]] == [SPIKE_AT]  # the spike keeps its step
    # found one step later: the 4 steps after that one are logged
    assert logged_steps(tmp_path) == [0, 25, 50, *range(SPIKE_AT + 2, SPIKE_AT + 6), 75]


def test_nan_and_inf_neither_spike_nor_enter_the_history() -> None:
    weight = nn.Parameter(torch.zeros(4))
    detector = SpikeDetector(normprobe.Spikes(window=32), [weight], {})
    steady = [1 + 0.05 * math.sin(i) for i in range(20)]
    found = []
    for step, loss in enumerate([*steady, math.nan, math.inf, 1.0, 50.0]):
        weight.grad = torch.full((4,), 0.5)  # a gradient norm of 1 at every step: no spike
        detector.observe_loss(torch.tensor(loss), explicit=True)
        detector.watch(step)
        found += detector.found()
    # NaN and Inf were left out of the history: 50 is a spike against the 21 finite losses
    [event] = found
    assert event.step == 23 and event.kind == "loss spike" and event.loss is not None
    assert event.loss.history == 21
    assert event.loss.mean == pytest.approx((sum(steady) + 1.0) / 21, rel=1e-5)
    assert not event.grad.spiked and event.grad.value == pytest.approx(1.0)


def test_the_rule_on_device_tensors_matches_the_one_on_numpy_arrays() -> None:
    # a CPU runs the rule on numpy arrays, other devices on torch tensors: the same function
    spikes, columns = normprobe.Spikes(window=16), 5
    rng = np.random.default_rng(0)
    history = rng.normal(1.0, 0.1, 16 * columns).astype(np.float32)
    present = (rng.random(16 * columns) > 0.1).astype(np.float32)
    present.reshape(16, columns)[:, 0] = 1.0  # a full history: past the warm-up
    history *= present
    row = np.zeros(2 + 4 * columns, np.float32)
    row[2 + columns : 2 + 2 * columns] = [5.0, 1.02, math.nan, 0.9, math.inf]
    arrays = [row, history, present]
    tensors = [torch.from_numpy(a.copy()) for a in arrays]
    with np.errstate(divide="ignore", invalid="ignore"):
        _check(np, *arrays, 3, spikes)
    _check(torch, *tensors, 3, spikes)
    for a, t in zip(arrays, tensors, strict=True):
        np.testing.assert_allclose(t.numpy(), a, rtol=1e-6, equal_nan=True)
    assert row[:2].tolist() == [1.0, 0.0]  # the first column spiked, the second did not
    assert present.reshape(16, columns)[3].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"sigma": 0.0}, r"sigma=0\.0.*positive.*spikes=None"),
        ({"sigma": -1.0}, r"sigma=-1\.0.*positive"),
        ({"sigma": float("nan")}, r"sigma=nan.*positive"),
        ({"window": 4}, r"window=4.*at least 8.*spikes=None"),
        ({"capture": -1}, r"capture=-1.*0 or more"),
        ({"window": 12.5}, r"window=12\.5"),
    ],
)
def test_bad_settings_name_the_value_and_the_way_out(setting: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        normprobe.Spikes(**setting)


def test_spikes_none_turns_the_detector_off(tmp_path: Path) -> None:
    model = TinyTransformer(depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with normprobe.attach(model, opt, log_dir=str(tmp_path), spikes=None) as probe:
        model.loss(*[torch.randint(0, 96, (2, 16))] * 2).backward()
        opt.step()
        assert probe._spikes is None


class SpikyLM(L.LightningModule):
    """``training_step`` returns the loss, 50 times larger at global step ``spike_at``."""

    def __init__(self, spike_at: int) -> None:
        super().__init__()
        self.model = TinyTransformer(width=32, depth=2, heads=2, context=16)
        self.spike_at = spike_at

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model.loss(batch, batch)
        return loss * 50 if self.global_step == self.spike_at else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_the_lightning_callback_sees_a_loss_spike(tmp_path: Path, one_thread: None) -> None:
    torch.manual_seed(0)
    data = DataLoader(torch.randint(0, 96, (40 * 4, 16)), batch_size=4)  # type: ignore[arg-type]
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=40,
        log_every_n_steps=20,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=TensorBoardLogger(str(tmp_path), name="run"),
        callbacks=[normprobe.NormProbe(spikes=normprobe.Spikes(capture=3))],
    )
    with pytest.warns(RuntimeWarning, match="loss spike at step 30 "):
        trainer.fit(SpikyLM(spike_at=30), data)
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    events = read_events(trainer.logger.log_dir)
    assert [s for s, _ in events.scalars[LOSS_Z]] == [30]
    grad_ratio = events.scalars[tags.format("grad_ratio", "model.blocks")]
    assert [s for s, _ in grad_ratio] == [0, 19, 31, 32, 33, 39]


def test_the_hugging_face_callback_reads_the_loss_from_the_models_output(
    tmp_path: Path, one_thread: None
) -> None:
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from normprobe.hf import NormProbeCallback

    class Spiky(nn.Module):
        """GPT-2 whose loss (``{"loss": ...}``, what the Trainer trains on) is 50 times larger
        while ``scale`` says so."""

        def __init__(self) -> None:
            super().__init__()
            config = transformers.GPT2Config(
                vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2
            )
            self.gpt = transformers.GPT2LMHeadModel(config)
            self.scale = 1.0

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
            return {"loss": self.gpt(input_ids=input_ids, labels=labels).loss * self.scale}

    class SpikeAt(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model.scale = 50.0 if state.global_step + 1 == 30 else 1.0

    torch.manual_seed(0)
    model = Spiky()
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (40 * 4, 16))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=40,
        logging_steps=20,
        per_device_train_batch_size=4,
        report_to=["tensorboard"],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    callbacks = [SpikeAt(), NormProbeCallback(spikes=normprobe.Spikes(capture=3))]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    with pytest.warns(RuntimeWarning, match="loss spike at step 30 "):
        trainer.train()
    [run] = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    events = read_events(str(run))
    assert [s for s, _ in events.scalars[LOSS_Z]] == [30]
    grad_ratio = events.scalars[tags.format("grad_ratio", "gpt.transformer.h")]
    assert [s for s, _ in grad_ratio] == [20, 31, 32, 33, 40]


def _gradient_passes(model: nn.Module, tokens: torch.Tensor, detector: bool) -> tuple[Any, int]:
    """grad_norm's per-block values after one step, and the passes over the gradients taken:
    the most times one gradient was handed to a batched norm or a stack (`probes.ByShape`)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = normprobe.MemorySink()
    reduced: collections.Counter[int] = collections.Counter()
    originals = {"_foreach_norm": torch._foreach_norm, "stack": torch.stack}

    def counting(name: str) -> Any:
        def call(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            grads = {id(p.grad) for p in model.parameters()}
            if tensors and all(id(t) in grads for t in tensors):
                reduced.update(id(t) for t in tensors)
            return originals[name](tensors, *args, **kwargs)

        return call

    spikes = normprobe.Spikes() if detector else None
    with normprobe.attach(model, opt, sinks=[sink], metrics=["grad_norm"], spikes=spikes):
        for name in originals:
            setattr(torch, name, counting(name))
        try:
            model.loss(tokens, tokens).backward()
            opt.step()
        finally:
            for name, original in originals.items():
                setattr(torch, name, original)
    return sink.records[0].profiles[tags.format("grad_norm", "blocks")], max(reduced.values())


def test_grad_norm_reuses_the_detectors_pass_over_the_gradients() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(width=32, depth=3, context=16)
    tokens = torch.randint(0, 96, (2, 16))
    with_detector = _gradient_passes(copy.deepcopy(model), tokens, detector=True)
    without = _gradient_passes(copy.deepcopy(model), tokens, detector=False)
    assert with_detector[0] == pytest.approx(without[0], rel=1e-6)
    assert (with_detector[1], without[1]) == (1, 1)  # the detector's pass, or grad_norm's own
