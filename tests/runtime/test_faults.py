"""Faults in the middle of training: what reaches the disk, which hooks stay, what copies carry.

Every fault is real: an exception or KeyboardInterrupt raised from inside block 1's attention
(where the probe has a torch function mode entered on logged steps), from backward, from an
optimizer's step, or a weight set to NaN. Event files are read back from disk right after the
fault, before anything else is called on the probe.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from faulty_training import EVERY, STEPS, FailingAdamW, Tripwire, attach, batch, make_model, train
from hooks import hook_count
from lightning.pytorch.loggers import TensorBoardLogger
from tb import Events, read_events, read_texts
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.data import DataLoader

import normprobe
from normprobe import tags
from normprobe.metrics import nonfinite
from normprobe.runtime import InertHook, attached_probe


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Events:
    """The same run without a fault."""
    log_dir = tmp_path_factory.mktemp("reference")
    model = make_model()
    opt = FailingAdamW(model.parameters())
    wire = Tripwire(model, "", None)
    with attach(model, opt, log_dir):
        train(model, opt, wire)
    wire.handle.remove()
    return read_events(str(log_dir))


def assert_logged_up_to(events: Events, reference: Events, fault: int) -> None:
    """Every tag of the clean run, with its values on every logged step before ``fault``."""
    logged = [s for s in range(fault) if s % EVERY == 0]
    assert set(events.scalars) == set(reference.scalars)
    for tag, series in events.scalars.items():
        want = [(s, v) for s, v in reference.scalars[tag] if s < fault]
        assert [s for s, _ in series] == logged, tag
        assert [v for _, v in series] == pytest.approx([v for _, v in want], rel=1e-6), tag
    for tag, profiles in events.profiles.items():
        assert [s for s, _ in profiles] == logged, tag
    assert len(events.layouts) == 1


def no_probe_hooks_on(opt: torch.optim.Optimizer) -> bool:
    return not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


KINDS = ["forward", "backward", "optimizer", "interrupt"]


@pytest.mark.slow
@pytest.mark.parametrize("at", [4, 5], ids=["on-a-logged-step", "between-logged-steps"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_leaves_every_logged_step_on_disk_and_no_hook(
    tmp_path: Path, reference: Events, kind: str, at: int
) -> None:
    model = make_model()
    opt = FailingAdamW(model.parameters(), fail_at=at if kind == "optimizer" else None)
    wire = Tripwire(model, kind, at)
    error: type[BaseException] = KeyboardInterrupt if kind == "interrupt" else RuntimeError
    with pytest.raises(error), attach(model, opt, tmp_path):
        train(model, opt, wire)
    assert_logged_up_to(read_events(str(tmp_path)), reference, at)
    wire.handle.remove()
    assert hook_count(model) == 0 and no_probe_hooks_on(opt)
    assert not _get_current_function_mode_stack()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["forward", "interrupt"])
def test_without_a_with_block_the_probe_stays_and_training_can_go_on(
    tmp_path: Path, reference: Events, kind: str
) -> None:
    model = make_model()
    opt = FailingAdamW(model.parameters())
    wire = Tripwire(model, kind, 4)
    probe = attach(model, opt, tmp_path)
    with pytest.raises(KeyboardInterrupt if kind == "interrupt" else RuntimeError):
        train(model, opt, wire)
    assert probe.attached and not no_probe_hooks_on(opt)
    if kind == "forward":
        # the failed forward put every step logged before it on disk
        assert_logged_up_to(read_events(str(tmp_path)), reference, 4)
        # the root's always_call hook ran: only the probe's root hooks (the pre-hook, and the
        # hook on its output that ends the backward) and the tripwire stay
        assert hook_count(model) == 3 and not _get_current_function_mode_stack()
    else:
        # a KeyboardInterrupt skips even always_call hooks: the reading hooks and the
        # attention reader's function mode stay until the next forward starts
        assert hook_count(model) > 2 and _get_current_function_mode_stack()
    wire.at = None
    train(model, opt, wire, start=4)  # retry the step that failed, then go on
    assert not _get_current_function_mode_stack()
    probe.remove()
    assert_logged_up_to(read_events(str(tmp_path)), reference, STEPS)
    wire.handle.remove()
    assert hook_count(model) == 0 and no_probe_hooks_on(opt)


def test_a_retried_forward_is_measured_afresh(tmp_path: Path) -> None:
    # The failed forward had already found block 0's output finite; after a NaN, the retry
    # must find it again (and name block 0), not keep the failed forward's verdict.
    model = make_model()
    opt = FailingAdamW(model.parameters())
    wire = Tripwire(model, "forward", 0)
    probe = attach(model, opt, tmp_path)
    wire.step = 0
    with pytest.raises(RuntimeError, match="forward failed"):
        model.loss(batch(0), batch(0))
    wire.handle.remove()
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"output of blocks\.0 \(block; module not"):
        model.loss(batch(0), batch(0)).backward()
        opt.step()
    probe.remove()
    assert read_texts(str(tmp_path))[tags.format("nonfinite", "first") + "/text_summary"] == [
        (0, "blocks.0" + nonfinite.BLOCK)
    ]


def test_nan_mid_training_names_the_first_module(tmp_path: Path, reference: Events) -> None:
    model = make_model()
    opt = FailingAdamW(model.parameters())
    fault = 4
    with attach(model, opt, tmp_path):
        for step in range(STEPS):
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always", RuntimeWarning)
                if step == fault:
                    with torch.no_grad():
                        model.blocks[1].mlp.fc.weight[0, 0] = float("nan")
                model.loss(batch(step), batch(step)).backward()
                opt.step()
                opt.zero_grad()
            messages = [str(w.message) for w in warned if w.category is RuntimeWarning]
            if step == fault:
                assert len(messages) == 1
                # the step names the block; the next one, logged for it, would name the module
                assert "first appeared in the output of blocks.1 (block; " in messages[0]
            else:
                assert not messages  # warned once, on the step it happened
    events = read_events(str(tmp_path))
    assert_logged_up_to(before(events, fault), reference, fault)
    counts = events.scalars[tags.format("nonfinite", "modules")]
    assert [s for s, _ in counts] == [0, 2, 4, 5, 6]
    assert [v for _, v in counts[:2]] == [0, 0] and all(v > 0 for _, v in counts[2:])
    first = read_texts(str(tmp_path))[tags.format("nonfinite", "first") + "/text_summary"]
    # after AdamW stepped on NaN gradients every weight is NaN: on the step logged to name the
    # module, the embedding comes first
    assert first == [(4, "blocks.1" + nonfinite.BLOCK), (5, "tok"), (6, "tok")]
    assert hook_count(model) == 0 and no_probe_hooks_on(opt)


def before(events: Events, step: int) -> Events:
    """The events of the steps before ``step``."""
    scalars = {t: [(s, v) for s, v in series if s < step] for t, series in events.scalars.items()}
    profiles = {t: [(s, b) for s, b in h if s < step] for t, h in events.profiles.items()}
    return dataclasses.replace(events, scalars=scalars, profiles=profiles)


def test_optimizer_subclass_calling_super_step_counts_one_step(tmp_path: Path) -> None:
    # torch runs the step hooks of FailingAdamW.step and of AdamW.step inside it: nested, one
    # training step (the probe used to count two, logging steps 0, 1, 2, 3 as 0, 2, 4, 6)
    model = make_model()
    opt = FailingAdamW(model.parameters())
    calls: list[int] = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    wire = Tripwire(model, "", None)
    with attach(model, opt, tmp_path) as probe:
        train(model, opt, wire, start=STEPS - 4)
    assert len(calls) == 8  # the nesting is real: two post hooks per step
    assert probe.step_count == 4
    steps = [s for s, _ in read_events(str(tmp_path)).scalars[tags.format("grad_ratio", "blocks")]]
    assert steps == [0, 2]
    wire.handle.remove()


# Lightning -------------------------------------------------------------------------------------
class LM(L.LightningModule):
    def __init__(self, kind: str, at: int) -> None:
        super().__init__()
        self.model = make_model()
        self.wire = Tripwire(self.model, kind, at)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.wire.step = self.global_step
        return self.model.loss(batch, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.fixture
def keep_sigint() -> Iterator[None]:
    """Lightning ignores SIGINT from its first KeyboardInterrupt on: put the handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


@pytest.mark.parametrize("kind", ["interrupt", "backward"])
def test_lightning_fault_mid_epoch_flushes_and_removes_hooks(
    tmp_path: Path, kind: str, keep_sigint: None
) -> None:
    module = LM(kind, at=3)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        log_every_n_steps=2,  # logged: 0, then 1, 3, 5
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=TensorBoardLogger(str(tmp_path), name="run"),
        callbacks=[normprobe.NormProbe()],
    )
    data = DataLoader(torch.randint(0, 96, (64, 16)), batch_size=4)  # type: ignore[arg-type]
    # Lightning turns a KeyboardInterrupt into sys.exit(1) after its on_exception hooks
    with pytest.raises(SystemExit if kind == "interrupt" else RuntimeError):
        trainer.fit(module, data)
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    events = read_events(trainer.logger.log_dir)
    assert [s for s, _ in events.scalars[tags.format("grad_ratio", "model.blocks")]] == [0, 1]
    assert [s for s, _ in events.scalars[tags.format("resid_rms", "model.blocks", 2)]] == [0, 1]
    module.wire.handle.remove()
    assert hook_count(module) == 0
    assert not _get_current_function_mode_stack()


# copies ----------------------------------------------------------------------------------------
def _saved(obj: object) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES: dict[str, Callable[[Any], Any]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "torch.save": _saved,
}


class CopyInside:
    """A forward hook that copies the model and its optimizer once, from inside the forward."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, how: str) -> None:
        self.how, self.done, self.armed = how, False, 0
        self.refs = {"model": model, "opt": opt}
        self.copy: dict[str, Any] = {}

    def __call__(self, *_: Any) -> None:
        if self.done:  # also in the copy, which carries this hook along
            return
        self.done, self.armed = True, hook_count(self.refs["model"])
        self.copy = COPIES[self.how](self.refs)


def only_inert_hooks(model: nn.Module) -> bool:
    hooks = [
        h
        for m in model.modules()
        for d in (m._forward_pre_hooks, m._forward_hooks)
        for h in d.values()
    ]
    return all(isinstance(h, InertHook | CopyInside) for h in hooks)


@pytest.mark.slow
@pytest.mark.parametrize("how", COPIES)
def test_a_copy_taken_mid_logged_step_and_after_surgery_runs_without_the_probe(
    tmp_path: Path, how: str
) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wire = Tripwire(model, "", None)
    with attach(model, opt, tmp_path / "a"):
        train(model, opt, wire)
    wire.handle.remove()
    model = normprobe.convert_norms(model, "rmsnorm")  # surgery, then a new probe
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = attach(model, opt, tmp_path / "b")
    grab = CopyInside(model, opt, how)
    handle = model.blocks[1].attn.proj.register_forward_hook(grab)
    x = batch(0)
    model.loss(x, x).backward()
    handle.remove()
    opt.step()
    opt.zero_grad()
    twin, twin_opt = grab.copy["model"], grab.copy["opt"]
    # the copy was taken with hooks armed; the probe's root hooks stay between logged steps
    assert grab.armed > 20 and hook_count(model) == 2
    assert isinstance(twin.blocks[0].ln_1, nn.RMSNorm) and only_inert_hooks(twin)
    assert attached_probe(twin) is None
    assert all(
        isinstance(h, InertHook)
        for d in (twin_opt._optimizer_step_pre_hooks, twin_opt._optimizer_step_post_hooks)
        for h in d.values()
    )
    # the twin trains on its own: the original probe neither counts nor writes its steps
    # (the probe is still attached: its writer's thread may not have written yet, flush it)
    probe.sinks[0].flush()
    before = read_events(str(tmp_path / "b")).scalars[tags.format("grad_ratio", "blocks")]
    for step in range(3):
        twin.loss(batch(step), batch(step)).backward()
        twin_opt.step()
        twin_opt.zero_grad()
    assert probe.step_count == 1
    probe.sinks[0].flush()
    assert read_events(str(tmp_path / "b")).scalars[tags.format("grad_ratio", "blocks")] == before
    with torch.no_grad():
        assert torch.equal(twin(x), copy.deepcopy(twin)(x))
    # no live probe: surgery accepts the copy (it refuses the probed original), a probe attaches
    with pytest.raises(RuntimeError, match="probe is attached"):
        normprobe.convert_norms(model, "dyt")
    with pytest.warns(UserWarning, match="build the optimizer after this call"):
        twin = normprobe.convert_norms(twin, "dyt")
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    with attach(twin, twin_opt, tmp_path / "twin"):
        twin.loss(x, x).backward()
        twin_opt.step()
    assert (
        tags.format("norm_out_rms", "blocks", 0, "ln_1")
        in read_events(str(tmp_path / "twin")).scalars
    )
    probe.remove()
    assert hook_count(model) == 0


CRASHING_SCRIPT = """
import sys
import torch
import faulty_training as f

torch.set_num_threads(1)  # as the reference run (the tests run torch on one thread)

model = f.make_model()
opt = f.FailingAdamW(model.parameters(), fail_at=int(sys.argv[2]))
probe = f.attach(model, opt, sys.argv[1])  # no with block, never removed
f.train(model, opt, f.Tripwire(model, "", None))
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_process_that_dies_of_an_uncaught_exception_leaves_its_steps_on_disk(
    tmp_path: Path, reference: Events
) -> None:
    # writing never waits for the disk; what is still queued when the interpreter exits,
    # here on an error nobody catches, is written out on the way
    at = 7
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_SCRIPT)
    helpers = str(Path(__file__).parents[1] / "helpers")
    path = os.pathsep.join(p for p in (helpers, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    logs = tmp_path / "logs"
    done = subprocess.run(
        [sys.executable, str(script), str(logs), str(at)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "RuntimeError" in done.stderr
    assert_logged_up_to(read_events(str(logs)), reference, at)
