"""The spike detector: a loss spike found at its step and the steps after it logged, no host
read on the other steps, a verdict read late, NaN kept out, its settings checked, and the
Lightning and Hugging Face callbacks."""

from __future__ import annotations

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
from syncs import CountSyncs
from tb import read_events, read_texts
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

import normprobe
from normprobe import probes, tags
from normprobe.models import TinyTransformer
from normprobe.runtime.spike_rule import HostRule
from normprobe.runtime.spike_rule import check as _check
from normprobe.runtime.spikes import SpikeDetector

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


@pytest.mark.slow
def test_a_loss_spike_is_found_at_its_step_and_the_next_steps_are_logged(tmp_path: Path) -> None:
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


@pytest.mark.slow
def test_without_a_spike_only_the_schedule_is_logged(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        train(tmp_path, None)
    events = read_events(str(tmp_path))
    assert logged_steps(tmp_path) == [0, 25, 50, 75]
    assert not [t for t in [*events.scalars, *events.texts] if t.startswith("normprobe/spike/")]


@pytest.mark.slow
def test_a_rise_below_sigma_is_no_spike(tmp_path: Path) -> None:
    # the same spike, under a threshold far above it
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        train(tmp_path, SPIKE_AT, spikes=normprobe.Spikes(sigma=1e6))
    assert logged_steps(tmp_path) == [0, 25, 50, 75]


class CountTransfers(TorchFunctionMode):
    """Counts the calls that read tensor values on the host (`CountSyncs.SYNCS`), and the
    detector's copies of its verdict into host memory."""

    def __init__(self, detector: SpikeDetector) -> None:
        super().__init__()
        self.detector = detector
        self.reads = self.copies = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        self.reads += name in CountSyncs.SYNCS
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


@pytest.mark.slow
def test_a_verdict_still_on_its_way_is_read_on_a_later_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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


def test_the_host_rule_matches_the_one_on_device_tensors() -> None:
    # a CPU runs the rule on running sums in Python floats, other devices on torch tensors;
    # a value 1e9 times the others leaves the window at step 61: the sums are redone
    spikes, columns, window = normprobe.Spikes(window=32), 5, 32
    rng = np.random.default_rng(0)
    steps = rng.normal(1.0, 0.1, (80, columns)).astype(np.float32)
    steps[rng.random(steps.shape) < 0.1] = math.nan
    steps[10, 3], steps[29, 1], steps[60, 2] = math.inf, 1e9, 0.0
    steps[50, 0], steps[70, 1] = 5.0, 4.0  # spikes
    rule = HostRule(spikes, columns)
    history, present = torch.zeros(window * columns), torch.zeros(window * columns)
    flags = []
    for step, values in enumerate(steps):
        row = np.zeros(2 + 4 * columns, np.float32)
        row[2 + columns : 2 + 2 * columns] = values
        device = torch.from_numpy(row.copy())
        rule(row, step % window)
        _check(device, history, present, step % window, spikes)
        np.testing.assert_allclose(row, device.numpy(), rtol=1e-4, atol=1e-5, equal_nan=True)
        flags.append(row[:2].tolist())
    assert [s for s, f in enumerate(flags) if f != [0.0, 0.0]] == [29, 50, 70]
    assert flags[50] == [1.0, 0.0] and flags[70] == [0.0, 1.0]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"sigma": 0.0}, r"sigma=0\.0.*positive.*spikes=None"),
        ({"sigma": -1.0}, r"sigma=-1\.0.*positive"),
        ({"sigma": float("nan")}, r"sigma=nan.*positive"),
        ({"window": 4}, r"window=4.*at least 8.*spikes=None"),
        ({"capture": -1}, r"capture=-1.*0 or more"),
        ({"window": 12.5}, r"window=12\.5"),
        ({"sample": 8}, r"sample=8.*at least 16.*None to read every entry"),
        ({"sample": 1e4}, r"sample=10000\.0.*number of entries"),
        ({"sample": True}, r"sample=True"),
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


@pytest.mark.slow
def test_the_lightning_callback_sees_a_loss_spike(tmp_path: Path) -> None:
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


@pytest.mark.slow
def test_the_hugging_face_callback_reads_the_loss_from_the_models_output(tmp_path: Path) -> None:
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


def _grad_norms(
    model: TinyTransformer, spikes: normprobe.Spikes | None, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[float], list[float], int]:
    """grad_norm's per-block values after one step, the exact ones, and the passes grad_norm
    made over the gradients itself (`probes.ByShape.squared_norms` calls; its clip-factor
    sample is another pass, which reads no large gradient here)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = normprobe.MemorySink()
    own = []
    original = probes.ByShape.squared_norms
    monkeypatch.setattr(
        probes.ByShape,
        "squared_norms",
        lambda self, *args: own.append(1) or original(self, *args),
    )
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with normprobe.attach(model, opt, sinks=[sink], metrics=["grad_norm"], spikes=spikes):
        model.loss(tokens, tokens).backward()
        exact = [
            torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in block.parameters()]))
            for block in model.blocks
        ]
        opt.step()
    logged = sink.records[0].profiles[tags.format("grad_norm", "blocks")]
    return logged, [float(n) for n in exact], len(own)


def test_logged_grad_norms_are_exact_whatever_the_detector_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(width=32, depth=3, context=16)
    runs = []
    for spikes in (normprobe.Spikes(sample=None), normprobe.Spikes(sample=256), None):
        logged, exact, own = _grad_norms(copy.deepcopy(model), spikes, monkeypatch)
        assert logged == pytest.approx(exact, rel=1e-5)
        runs.append(own)
    # grad_norm's own pass, unless the detector read every gradient whole at the same
    # backward's end: grad_norm then takes its squares
    assert runs == [0, 1, 1]


def _exact_squares(tensors: list[torch.Tensor | None]) -> list[float]:
    return [0.0 if t is None else float(t.double().pow(2).sum()) for t in tensors]


def _in_order(squares: probes.SquareSums, values: torch.Tensor) -> list[float]:
    out = [0.0] * len(values)
    for position, value in zip(squares.order, values.tolist(), strict=True):
        out[position] = value
    return out


def test_square_sums_read_whole_are_exact_for_every_kind_of_gradient() -> None:
    torch.manual_seed(0)
    conv = torch.randn(32, 16, 3, 3).to(memory_format=torch.channels_last)
    tensors = [
        torch.randn(300),  # joined, 1-D
        torch.randn(20, 30),  # joined, flattened
        torch.randn(200, 100),  # large: its own norm
        torch.randn(50).bfloat16(),
        torch.randn(64, 64).double(),
        torch.randn(40, 30).t(),  # not contiguous
        conv,
        torch.randn(10),  # a missing gradient, below
        # shapes that repeat: stacked a shape at a time, a missing gradient among them too
        *(torch.randn(6, 4) for _ in range(3)),
        *(torch.randn(6, 4).bfloat16() for _ in range(2)),
    ]
    squares = probes.SquareSums(tensors, sample=None)
    assert not squares.sampled
    assert [group for group, _ in squares.groups] == [[8, 9, 10], [11, 12]]
    given: list[torch.Tensor | None] = [*tensors[:7], None, tensors[8], None, *tensors[10:12], None]
    want = _exact_squares([t.float() if t is not None else None for t in given])
    assert _in_order(squares, squares(given)) == pytest.approx(want, rel=1e-5)


def test_a_sample_scales_to_the_whole_tensor_and_walks_through_all_columns() -> None:
    shape = (1024, 256)
    squares = probes.SquareSums([torch.zeros(shape)], sample=4096)
    [(_, (runs, width), _)] = squares.runs
    assert width == probes.CHUNK and runs * width <= 4096 + probes.CHUNK
    # a constant tensor: the sample's mean square is the tensor's
    [estimate] = squares([torch.full(shape, 0.5)]).tolist()
    assert estimate == pytest.approx(0.25 * 1024 * 256, rel=1e-6)
    # every column is read in some rows: a gradient in one column alone is seen
    for column in range(shape[1]):
        grad = torch.zeros(shape)
        grad[:, column] = 1.0
        assert squares([grad]).item() > 0, column
    # channels_last (read in memory order) and a view that does not fill its memory (copied)
    conv = torch.full((64, 64, 3, 3), 2.0).to(memory_format=torch.channels_last)
    strided = torch.full((512, 64), 2.0)[::2]
    squares = probes.SquareSums([conv, strided], sample=1024)
    assert squares.sampled == [0, 1]
    got = _in_order(squares, squares([conv, strided]))
    assert got == pytest.approx([4.0 * conv.numel(), 4.0 * strided.numel()], rel=1e-6)


# The bound the Spikes docstring states for the default sample: the total gradient norm within
# 3% of the exact one, each block's within 10%.
TOTAL_BOUND, BLOCK_BOUND = 0.03, 0.10


def test_the_sampled_gradient_norms_are_within_the_stated_bound() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(width=128, depth=4, context=32)
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    blocks = [[index[id(p)] for p in block.parameters()] for block in model.blocks]
    tables = [id(p) in {id(model.tok.weight), id(model.pos.weight)} for p in params]
    squares = probes.SquareSums(params, normprobe.Spikes().sample, tables)
    assert len(squares.sampled) == 4 * 4 + 1  # each block's four large matrices, and the head
    opt = torch.optim.AdamW(params, lr=1e-3)
    data = torch.randint(0, 96, (10, 8, 32), generator=torch.Generator().manual_seed(0))
    for tokens in data:
        opt.zero_grad(set_to_none=True)
        model.loss(tokens, tokens).backward()
        grads = [p.grad for p in params]
        got, want = _in_order(squares, squares(grads)), _exact_squares(grads)
        assert math.sqrt(sum(got) / sum(want)) == pytest.approx(1.0, abs=TOTAL_BOUND)
        for block in blocks:
            ratio = sum(got[i] for i in block) / sum(want[i] for i in block)
            assert math.sqrt(ratio) == pytest.approx(1.0, abs=BLOCK_BOUND)
        opt.step()


@pytest.mark.slow
def test_a_broad_gradient_spike_is_caught_by_a_sampled_detector(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match=f"spike at step {SPIKE_AT} "):
        train(tmp_path, SPIKE_AT, spikes=normprobe.Spikes(sample=256))
    events = read_events(str(tmp_path))
    assert [s for s, _ in events.scalars[GRAD_Z]] == [SPIKE_AT]


def test_only_a_detector_reading_every_entry_sees_a_spike_the_sample_skips() -> None:
    # the limit of a sample: a gradient that rises at entries outside it goes unseen
    weight = nn.Parameter(torch.zeros(64, 64))
    noise = torch.randn(40, 64, 64, generator=torch.Generator().manual_seed(0))
    found = {}
    for sample in (None, 256):
        detector = SpikeDetector(normprobe.Spikes(window=32, sample=sample), [weight], {})
        events = []
        for step, grad in enumerate(noise):
            weight.grad = grad.clone()
            if step == 30:
                weight.grad.view(-1)[probes.CHUNK] = 1000.0  # past the first run of the sample
            detector.watch(step)
            events += detector.found()
        found[sample] = [(e.step, e.kind) for e in events]
    assert found == {None: [(30, "gradient spike")], 256: []}


def test_embedding_tables_are_read_whole(tmp_path: Path) -> None:
    model = LossOut()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with normprobe.attach(
        model, opt, log_dir=str(tmp_path), spikes=normprobe.Spikes(sample=256)
    ) as probe:
        model(torch.randint(0, 96, (2, 16)))["loss"].backward()
        opt.step()
        assert probe._spikes is not None
        detector = probe._spikes.detector
        [(_, squares)] = detector._passes
    sampled = {id(detector.params[i]) for i in squares.sampled}
    assert id(model.model.tok.weight) not in sampled  # 96 x 32: past the sample, whole
    assert id(model.model.blocks[0].mlp.fc.weight) in sampled


def test_sparse_embedding_gradients_count_their_values(tmp_path: Path) -> None:
    """``nn.Embedding(sparse=True)`` gives a sparse gradient: its sum of squares is its
    values' (repeated tokens coalesced first), and the other columns are unaffected."""

    class SparseTok(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(50, 8, sparse=True)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(3)
            )
            self.head = nn.Linear(8, 50)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.tok(x)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)

    torch.manual_seed(0)
    model = SparseTok()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.tensor([[1, 2, 2, 7]])  # token 2 twice: two entries of one row to coalesce
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1) as probe:
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        assert model.tok.weight.grad is not None and model.tok.weight.grad.is_sparse
        opt.step()
        assert probe._spikes is not None
        total = float(probe._spikes.detector._x[1])
    exact = math.sqrt(
        sum(
            (p.grad.to_dense() if p.grad.is_sparse else p.grad).pow(2).sum().item()
            for p in model.parameters()
            if p.grad is not None
        )
    )
    assert total == pytest.approx(exact, rel=1e-5)
    block = probe.latest.scalars[tags.format("grad_norm", "blocks", 0, depth=3)]
    want = math.sqrt(sum(p.grad.pow(2).sum().item() for p in model.blocks[0].parameters()))
    assert block == pytest.approx(want, rel=1e-5)
