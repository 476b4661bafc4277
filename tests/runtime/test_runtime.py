"""`normprobe.attach` on real training loops: values, schedule, event files and clean-up."""

from __future__ import annotations

import copy
import gc
import io
import math
import pickle
import types
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from hooks import hook_count
from syncs import CountSyncs
from tb import read_events
from torch import nn

import normprobe
from normprobe import tags
from normprobe.models import ResidualStack, TinyTransformer


def stack_grad_ratio(pre_ln: bool, tmp_path: Path) -> float:
    """Sanity check [d] through the probe: one forward/backward of the 48-block stack."""
    torch.manual_seed(0)
    stack = ResidualStack(48, 64, pre_ln=pre_ln)
    with normprobe.attach(stack, log_dir=str(tmp_path), metrics=["grad_norm"]) as probe:
        stack(torch.randn(16, 64)).pow(2).mean().backward()
        probe.step()
    assert probe.latest is not None
    return probe.latest.scalars[tags.format("grad_ratio", "lins")]


def test_grad_ratio_reproduces_check_d(tmp_path: Path) -> None:
    # As examples/check_d_grad_ratio.py: Pre-LN 0.40 (bottom-heavy), Post-LN 2.35 (top-heavy).
    assert round(stack_grad_ratio(True, tmp_path / "pre"), 2) == 0.40
    assert round(stack_grad_ratio(False, tmp_path / "post"), 2) == 2.35


class OrthogonalWrites(nn.Module):
    """Each block adds a fixed unit-RMS vector orthogonal to all others: RMS after block l is
    exactly sqrt(l + 1) when the input is zero."""

    def __init__(self, depth: int = 16, width: int = 64) -> None:
        super().__init__()
        basis = torch.linalg.qr(torch.randn(width, width))[0] * math.sqrt(width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        with torch.no_grad():
            for block, row in zip(self.blocks, basis, strict=False):
                block.weight.zero_()
                block.bias.copy_(row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_residual_growth_and_slope(tmp_path: Path) -> None:
    model = OrthogonalWrites()
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=["resid_rms"]) as probe:
        model(torch.zeros(4, 64))
        probe.step()
    assert probe.latest is not None
    s = probe.latest.scalars
    for block in range(16):
        want = pytest.approx(math.sqrt(block + 1))
        assert s[tags.format("resid_rms", "blocks", block, depth=16)] == want
    assert s[tags.format("resid_growth", "blocks")] == pytest.approx(4.0)  # sqrt(16) / sqrt(1)
    assert s[tags.format("resid_slope", "blocks")] == pytest.approx(0.5, abs=1e-5)


def test_stream_norm_and_cosine_values_match_a_manual_forward(tmp_path: Path) -> None:
    model = ResidualStack(6, 32, pre_ln=True)
    x = torch.randn(8, 32)
    metrics = ["resid_rms", "resid_cos", "norm_rms"]
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=metrics) as probe:
        model(x)
        probe.step()
    assert probe.latest is not None
    s = probe.latest.scalars
    h, streams = x, []
    with torch.no_grad():
        for i, (ln, lin) in enumerate(zip(model.lns, model.lins, strict=True)):
            assert s[tags.format("norm_in_rms", f"lns.{i}")] == pytest.approx(
                float(h.pow(2).mean().sqrt())
            )
            assert s[tags.format("norm_out_rms", f"lns.{i}")] == pytest.approx(
                float(ln(h).pow(2).mean().sqrt()), rel=1e-5
            )
            h = h + lin(ln(h))
            streams.append(h)
    for i, h in enumerate(streams):
        assert s[tags.format("resid_rms", "lins", i)] == pytest.approx(
            float(h.pow(2).mean().sqrt())
        )
    for i in range(1, 6):
        cos = F.cosine_similarity(streams[i - 1], streams[i], dim=-1).mean()
        assert s[tags.format("resid_cos", "lins", i)] == pytest.approx(float(cos), rel=1e-5)


def test_post_ln_stream_is_read_after_the_norm(tmp_path: Path) -> None:
    model = ResidualStack(4, 32, pre_ln=False)
    x = torch.randn(8, 32)
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=["resid_rms"]) as probe:
        model(x)
        probe.step()
    h = x
    with torch.no_grad():
        for i, (ln, lin) in enumerate(zip(model.lns, model.lins, strict=True)):
            h = ln(h + lin(h))
            got = probe.latest.scalars[tags.format("resid_rms", "lins", i)]  # type: ignore[union-attr]
            assert got == pytest.approx(float(h.pow(2).mean().sqrt()), rel=1e-5)


def test_update_ratio_and_gain_with_sgd(tmp_path: Path) -> None:
    model = ResidualStack(3, 8)
    with torch.no_grad():
        model.lns[1].weight.copy_(torch.tensor([1.0, 2, 3, 4, 1, 2, 3, 4]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = ["update_ratio", "norm_gain", "grad_norm"]
    with normprobe.attach(model, opt, log_dir=str(tmp_path), metrics=metrics) as probe:
        model(torch.randn(4, 8)).pow(2).sum().backward()
        before = [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in model.lins]
        grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in model.lins]
        opt.step()
    s = probe.latest.scalars  # type: ignore[union-attr]
    for i in range(3):
        # plain SGD moves each parameter by lr * grad
        want = 0.1 * float(grads[i].norm()) / float(before[i].norm())
        assert s[tags.format("update_ratio", "lins", i)] == pytest.approx(want, rel=1e-4)
        assert s[tags.format("grad_norm", "lins", i)] == pytest.approx(float(grads[i].norm()))
    assert s[tags.format("norm_gain_mean", "lns.1")] == pytest.approx(2.5)
    assert s[tags.format("norm_gain_std", "lns.1")] == pytest.approx(math.sqrt(1.25))


def test_logits_and_attention_logits_of_hf_gpt2(tmp_path: Path) -> None:
    z = zoo.build("gpt2")
    model = z.model.train()
    captured: dict[str, torch.Tensor] = {}

    def grab(mod: nn.Module, args: Any, out: Any) -> None:
        captured["logits"] = out.detach()

    # the expected attention logits, from q and k the way GPT-2 computes them
    def qk(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
        q, k, _ = out.detach().split(64, dim=-1)
        q = q.view(2, 16, 4, 16).transpose(1, 2)
        k = k.view(2, 16, 4, 16).transpose(1, 2)
        s = (q @ k.transpose(-1, -2)) / 4.0  # every product: the causal mask is left out
        captured.setdefault("attn", s.abs().max())

    h1 = model.lm_head.register_forward_hook(grab)
    h2 = model.transformer.h[0].attn.c_attn.register_forward_hook(qk)
    metrics = ["logits", "attn_logits"]
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=metrics) as probe:
        model(*z.args, **z.kwargs).logits.sum().backward()
        probe.step()
    h1.remove()
    h2.remove()
    s = probe.latest.scalars  # type: ignore[union-attr]
    logits = captured["logits"]
    assert s[tags.format("logits", "max_abs")] == pytest.approx(float(logits.abs().max()))
    assert s[tags.format("logits", "rms")] == pytest.approx(float(logits.pow(2).mean().sqrt()))
    assert s[tags.format("logits", "z")] == pytest.approx(
        float(logits.logsumexp(-1).mean()), rel=1e-5
    )
    attn = s[tags.format("attn_logit_max", "transformer.h", 0, "attn")]
    assert attn == pytest.approx(float(captured["attn"]), rel=1e-4)
    assert len([t for t in s if t.startswith(tags.prefix("attn_logit_max"))]) == 4


def test_eager_attention_logits_skip_the_mask(tmp_path: Path) -> None:
    z = zoo.build("gpt2_eager")
    with normprobe.attach(z.model, log_dir=str(tmp_path), metrics=["attn_logits"]) as probe:
        with torch.no_grad():
            z.model(*z.args, **z.kwargs)
        probe.step()
    attn = tags.prefix("attn_logit_max")
    values = [v for t, v in probe.latest.scalars.items() if t.startswith(attn)]  # type: ignore[union-attr]
    assert len(values) == 4 and all(0 < v < 100 for v in values)


def test_batchnorm_drift_and_train_eval_gap(tmp_path: Path) -> None:
    # Sanity check [c]: running statistics lag the batch, so train != eval.
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 8) * 4 + 3
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1, metrics=["bn_stats"]) as p:
        for _ in range(3):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    bn = model[1]
    s = p.latest.scalars  # type: ignore[union-attr]
    # the last logged forward saw running statistics updated by the two steps before it
    assert s[tags.format("bn_gap", "1")] > 0.1
    assert s[tags.format("bn_mean_drift", "1")] > 0.1
    assert s[tags.format("bn_var_drift", "1")] > 0.1
    assert float(bn.running_mean.abs().mean()) > 0.1


@pytest.mark.slow
def test_schedule_event_files_layout_and_depth_view(tmp_path: Path) -> None:
    model = TinyTransformer(depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=3):
        for _ in range(7):
            x = torch.randint(0, 96, (4, 32))
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
    events = read_events(str(tmp_path))
    assert [step for step, _ in events.scalars[tags.format("grad_ratio", "blocks")]] == [0, 3, 6]
    resid_0 = events.scalars[tags.format("resid_rms", "blocks", 0)]
    assert [step for step, _ in resid_0] == [0, 3, 6]
    families = {parsed.series for t in events.scalars if (parsed := tags.parse(t))}
    assert families == {
        "resid_rms", "resid_growth", "resid_slope", "resid_cos", "norm_in_rms", "norm_out_rms",
        "norm_gain_mean", "norm_gain_std", "grad_norm", "grad_ratio", "grad_norm_total",
            "grad_norm_rest", "grad_clip_factor", "update_ratio", "logits",
        "attn_logit_max", "nonfinite", "weight_rms", "outlier_ratio", "outlier_channel",
        "outlier_kurtosis", "attn_head_max", "attn_head_argmax", "attn_heads_over_tau",
        "summary",  # the sink's log2 ratios and each stack's largest logit, for the dashboard
    }  # fmt: skip
    # depth view: one histogram per metric and stack, one bucket per block
    steps, buckets = zip(*events.profiles[tags.format("resid_rms", "blocks")], strict=True)
    assert steps == (0, 3, 6) and all(len(b) == 3 for b in buckets)
    assert len(events.layouts) == 1
    titles = {
        (category.title, chart.title) for category in events.layouts[0].category
        for chart in category.chart
    }  # fmt: skip
    # a chart per block (3 blocks: all of them), a line per run in each
    assert {("normprobe resid_rms", f"blocks/{b}") for b in range(3)} <= titles
    assert ("normprobe norm_out_rms", "blocks/2.ln_1") in titles


def test_every_block_gets_a_tag_up_to_the_cap(tmp_path: Path) -> None:
    model = ResidualStack(40, 8)
    with normprobe.attach(
        model, log_dir=str(tmp_path), metrics=["resid_rms"], max_block_tags=8
    ) as p:
        model(torch.randn(2, 8))
        p.step()
    record = p.latest
    assert record is not None
    per_block = [
        tags.parse(t) for t in record.scalars if t.startswith(tags.prefix("resid_rms", "lins"))
    ]
    blocks = sorted(tag.block for tag in per_block if tag is not None and tag.block is not None)
    assert blocks[0] == 0 and blocks[-1] == 39 and len(blocks) == 8
    assert len(record.profiles[tags.format("resid_rms", "lins")]) == 40


@pytest.mark.slow
def test_one_host_transfer_per_logged_step_and_none_otherwise(tmp_path: Path) -> None:
    model = TinyTransformer(depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (2, 16))
    per_step = []
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=3, example_inputs=(x,)):
        for _ in range(6):
            with CountSyncs() as counter:
                model.loss(x, x).backward()
                opt.step()
                opt.zero_grad()
            per_step.append(counter.count)
    assert per_step == [1, 0, 0, 1, 0, 0]


def _tensors_held(probe: normprobe.Probe) -> list[torch.Tensor]:
    """Tensors of two or more dimensions reachable from the probe, apart from the model's,
    the optimizer's and the sinks' own: activations or statistics it kept."""
    skip = {id(probe.model), id(probe.optimizer), *(id(s) for s in probe.sinks)}
    skip |= {id(p) for p in probe.model.parameters()}
    seen, held, todo = set(skip), [], [probe]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type | nn.Module | torch.optim.Optimizer):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.dim() >= 2:
                held.append(obj)
        elif isinstance(obj, types.FunctionType):  # its closure, not its module's globals
            todo += [c.cell_contents for c in obj.__closure__ or ()] + list(obj.__defaults__ or ())
        elif not isinstance(obj, types.ModuleType):
            todo += gc.get_referents(obj)
    return held


@pytest.mark.slow
def test_no_activation_is_kept_on_unlogged_steps(tmp_path: Path) -> None:
    model = TinyTransformer(depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    outputs: list[weakref.ref[torch.Tensor]] = []
    handles = [
        b.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
        for b in model.blocks
    ]
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=2) as probe:
        for _ in range(2):
            outputs.clear()
            x = torch.randint(0, 96, (2, 16))
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
            gc.collect()
            assert outputs and all(ref() is None for ref in outputs)
            measured = probe._forwards.measured
            assert not measured.whole and not measured.parts
            assert not _tensors_held(probe)
    for h in handles:
        h.remove()


def test_nonfinite_names_the_first_module_and_warns_once(tmp_path: Path) -> None:
    model = ResidualStack(4, 8)
    with torch.no_grad():
        model.lins[2].weight[0, 0] = float("nan")
    with normprobe.attach(model, log_dir=str(tmp_path), every=1, metrics=["nonfinite"]) as probe:
        # a block whose norm lies in another list is read from the streams around it first
        with pytest.warns(
            RuntimeWarning,
            match=r"first appeared in the output of lns\.2 \+ lins\.2 \(block; module not",
        ):
            model(torch.randn(2, 8))
            probe.step()
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second warning would raise here
            model(torch.randn(2, 8))
            probe.step()
    record = probe.latest
    assert record is not None and record.texts == {tags.format("nonfinite", "first"): "lins.2"}
    # lins.2 (read inside its block, logged for it), then everything downstream: the block
    # itself, block 3, head and the root
    assert record.scalars[tags.format("nonfinite", "modules")] == 5
    summary = tags.format("nonfinite", "first") + "/text_summary"  # TensorBoard's text plugin
    placements = {  # written once per run, for report's wording
        tags.format("placement", stack) + "/text_summary": [0] for stack in ("lins", "lns")
    }
    flags = tags.format("flags", "run") + "/text_summary"  # report's flags, as the run goes
    assert read_events(str(tmp_path)).texts == {summary: [0, 1], **placements, flags: [1]}


def test_residual_read_from_inside_a_forward(tmp_path: Path) -> None:
    # The sum is clamped before any module sees it: read by counting adds inside the block.
    class Clamped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x + self.fc(self.norm(x))).clamp(-100, 100) * 1.0

    model = nn.Sequential(Clamped(), Clamped())
    x = torch.randn(3, 8)
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=["resid_rms"]) as probe:
        model(x)
        probe.step()
    assert probe.model_map is not None
    assert [a.anchor.hook for a in probe.model_map.residual_adds] == ["inside", "inside"]  # type: ignore[union-attr]
    with torch.no_grad():
        first = x + model[0].fc(model[0].norm(x))
    got = probe.latest.scalars[tags.format("resid_rms", "root", 0)]  # type: ignore[union-attr]
    assert got == pytest.approx(float(first.pow(2).mean().sqrt()))


def test_model_without_norms_logs_what_applies_and_warns_once(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.warns(normprobe.DiscoveryWarning) as record:
        probe = normprobe.attach(model, log_dir=str(tmp_path), every=1)
        model(torch.randn(3, 4)).sum().backward()
        probe.step()
    probe.remove()
    assert len(record) == 1
    assert "no residual adds" in str(record[0].message) and "no norm layers" in str(
        record[0].message
    )
    assert probe.latest is not None and tags.format("logits", "max_abs") in probe.latest.scalars


def test_bad_input() -> None:
    model = TinyTransformer(depth=1)
    with pytest.raises(ValueError, match=r"metric 'grad_norms' \(did you mean 'grad_norm'\?\)"):
        normprobe.attach(model, metrics=["grad_norms"])
    with pytest.raises(ValueError, match="`every` must be a positive integer"):
        normprobe.attach(model, every=0)
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module"):
        normprobe.attach("model")  # type: ignore[arg-type]
    assert hook_count(model) == 0


def test_attach_twice_is_refused_until_removed(tmp_path: Path) -> None:
    model = TinyTransformer(depth=1)
    probe = normprobe.attach(model, log_dir=str(tmp_path / "a"))
    with pytest.raises(RuntimeError, match="already attached"):
        normprobe.attach(model, log_dir=str(tmp_path / "b"))
    probe.remove()
    probe.remove()  # idempotent
    normprobe.attach(model, log_dir=str(tmp_path / "c")).remove()
    assert hook_count(model) == 0


class Flaky(nn.Module):
    """A stack whose forward, or backward, raises when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.body = ResidualStack(3, 8)
        self.fail = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if self.fail == "forward":
            raise RuntimeError("forward failed")
        if self.fail == "backward":
            out.register_hook(_raise_backward)
        return out


def _raise_backward(grad: torch.Tensor) -> None:
    raise RuntimeError("backward failed")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_exception_in_training_leaves_no_hook_and_a_flushed_file(
    tmp_path: Path, where: str
) -> None:
    model = Flaky()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with (
        pytest.raises(RuntimeError, match=f"{where} failed"),
        normprobe.attach(model, opt, log_dir=str(tmp_path), every=1),
    ):
        for step in range(3):
            model.fail = where if step == 2 else ""
            model(torch.randn(2, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert hook_count(model) == 0
    ratio = read_events(str(tmp_path)).scalars[tags.format("grad_ratio", "body.lins")]
    steps = [s for s, _ in ratio]
    assert steps == [0, 1]


def test_state_dict_survives_and_copies_carry_no_probe(tmp_path: Path) -> None:
    model = TinyTransformer(depth=2)
    before = copy.deepcopy(model.state_dict())
    x = torch.randint(0, 96, (2, 16))
    probe = normprobe.attach(model, log_dir=str(tmp_path), example_inputs=(x,))
    model(x)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    clones: list[Callable[[nn.Module], nn.Module]] = [
        copy.deepcopy,
        lambda m: pickle.loads(pickle.dumps(m)),
        lambda m: torch.load(_saved(m), weights_only=False),
    ]
    for clone in clones:
        twin = clone(model)
        assert torch.equal(twin(x), model(x))
        assert normprobe.attach(twin, log_dir=str(tmp_path / "twin")).remove() is None
    with pytest.warns(RuntimeWarning, match="no training step"):  # forwards only, no step
        probe.remove()


def _saved(model: nn.Module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return buffer


def test_existing_summary_writer_stays_open(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    model = ResidualStack(2, 8)
    with normprobe.attach(model, writer=writer, metrics=["resid_rms"]) as probe:
        model(torch.randn(2, 8))
        probe.step()
    writer.add_scalar("mine", 1.0, 0)
    writer.close()
    assert {"mine", tags.format("resid_rms", "lins", 0)} <= set(read_events(str(tmp_path)).scalars)


@pytest.mark.parametrize("persistent", [False, True])
def test_reading_hooks_live_only_in_logged_forwards(tmp_path: Path, persistent: bool) -> None:
    model = ResidualStack(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[int] = []
    spy = model.lins[0].register_forward_pre_hook(lambda *_: seen.append(hook_count(model)))
    probe = normprobe.Probe(model, optimizer=opt, every=2, persistent_hooks=persistent)
    probe.discover_now(torch.randn(2, 8))
    assert len(seen) == 1  # the model's own hooks run in discovery's forward
    seen.clear()
    values = []
    for _ in range(4):
        model(torch.randn(2, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        values.append(probe.latest.step if probe.latest else None)
    probe.remove()
    spy.remove()
    armed = seen[0]
    # a hook on every module (non-finite outputs), and pre-hooks for the norms' and streams' reads;
    # at most one pair per module, whatever reads it: besides them the spy, the probe's root
    # pre-hook, the hook on its output that ends the backward and the hook that ends a recorded
    # forward
    modules = len(list(model.modules()))
    assert modules + 1 < armed <= 2 * modules + 4
    # between logged steps: the spy and the probe's root hooks only (the pre-hook, and the hook
    # on its output that ends the backward), unless kept registered
    assert seen == [armed, armed if persistent else 3, armed, armed if persistent else 3]
    assert values == [0, 0, 2, 2]
    assert hook_count(model) == 0


def test_gradients_are_read_after_accumulation_and_unscaling(tmp_path: Path) -> None:
    model = ResidualStack(3, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    options: dict[str, Any] = {"log_dir": str(tmp_path), "metrics": ["grad_norm"]}
    with normprobe.attach(model, opt, scaler=scaler, **options) as probe:
        for _ in range(2):  # two micro-batches accumulate into one optimizer step
            scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
        scaler.unscale_(opt)
        want = [
            float(torch.cat([p.grad.flatten() for p in m.parameters()]).norm()) for m in model.lins
        ]
        scaler.step(opt)
        scaler.update()
    got = [probe.latest.scalars[tags.format("grad_norm", "lins", i)] for i in range(3)]  # type: ignore[union-attr]
    assert got == pytest.approx(want)
    assert probe.step_count == 1


def test_a_model_that_is_itself_a_norm_layer(tmp_path: Path) -> None:
    bn = nn.BatchNorm1d(16)
    x = torch.randn(64, 16) + 3  # batch mean 3 against running mean 0 and variance 1
    options: dict[str, Any] = {"metrics": ["bn_stats"], "every": 1, "example_inputs": (x,)}
    with normprobe.attach(bn, log_dir=str(tmp_path), **options) as probe:
        bn(x)
        probe.step()
        bn(x)
        probe.step()
    assert probe.model_map is not None and [n.path for n in probe.model_map.norms] == [""]
    assert probe.latest is not None and probe.latest.step == 1
    # after one training forward the running mean moved 10% of the way: drift ~ 2.7
    drift = probe.latest.scalars[tags.format("bn_mean_drift", "root")]
    assert drift == pytest.approx(2.7, rel=0.05)


def test_a_measured_nan_is_logged_as_nan_not_dropped(tmp_path: Path) -> None:
    model = ResidualStack(4, 8)
    with torch.no_grad():
        model.lins[2].weight[0, 0] = float("nan")
    metrics = ["resid_rms", "grad_norm"]
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=metrics) as probe:
        model(torch.randn(2, 8)).pow(2).mean().backward()
        probe.step()
    assert probe.latest is not None
    s = probe.latest.scalars
    assert math.isfinite(s[tags.format("resid_rms", "lins", 1)])
    assert math.isnan(s[tags.format("resid_rms", "lins", 2)]) and math.isnan(
        s[tags.format("resid_rms", "lins", 3)]
    )
    assert math.isnan(s[tags.format("grad_ratio", "lins")])
    events = read_events(str(tmp_path))
    assert math.isnan(events.scalars[tags.format("resid_rms", "lins", 3)][0][1])  # on disk too


class _Widening(nn.Module):
    """``short(x) + fc(ln(x))``: an identity shortcut, or a Linear one that widens the stream."""

    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width_in)
        self.fc = nn.Linear(width_in, width_out)
        self.short = nn.Identity() if width_in == width_out else nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.short(x) + self.fc(self.ln(x))


class _WideningStack(nn.Module):
    def __init__(self, widths: list[tuple[int, int]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Widening(i, o) for i, o in widths)
        self.head = nn.Linear(widths[-1][1], 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_stream_statistics_of_blocks_with_different_widths(tmp_path: Path) -> None:
    # the blocks' streams differ in size (8 then 16 features), so the per-step reduction
    # across blocks cannot stack them: each must still get its own RMS and cosine
    torch.manual_seed(0)
    widths = [(8, 8), (8, 16), (16, 16), (16, 16)]
    model = _WideningStack(widths)
    streams: list[torch.Tensor] = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, a, out: streams.append(out.detach()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1) as probe:
        model(torch.randn(5, 8)).sum().backward()
        opt.step()
    assert probe.latest is not None
    got = probe.latest.scalars
    # block 1's add widens through a Linear shortcut as deep as its branch: not a residual add
    rms = {b: float(streams[b].pow(2).mean().sqrt()) for b in (0, 2, 3)}
    resid = tags.prefix("resid_rms")
    assert {k: v for k, v in got.items() if k.startswith(resid)} == {
        tags.format("resid_rms", "blocks", b): pytest.approx(v, rel=1e-5) for b, v in rms.items()
    }
    cosine = F.cosine_similarity(streams[2], streams[3], dim=-1).mean()
    assert got[tags.format("resid_cos", "blocks", 3)] == pytest.approx(float(cosine), rel=1e-5)
    assert tags.format("resid_cos", "blocks", 2) not in got  # block 1's stream was not read


def test_forwards_without_a_step_warn_on_remove() -> None:
    model = ResidualStack(4, 8)
    probe = normprobe.attach(model, sinks=[normprobe.MemorySink()])
    model(torch.randn(2, 8)).sum().backward()
    with pytest.warns(RuntimeWarning, match=r"saw 1 forward.*no training step.*probe\.step\(\)"):
        probe.remove()
    # with a step, nothing to say
    stepped = normprobe.attach(model, sinks=[normprobe.MemorySink()])
    model(torch.randn(2, 8)).sum().backward()
    stepped.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stepped.remove()
    # removed by an exception that ends the loop: the exception says what happened
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyError), normprobe.attach(model, sinks=[normprobe.MemorySink()]):
            model(torch.randn(2, 8))
            raise KeyError("the loop failed")


def test_example_inputs_as_a_mapping_are_keyword_inputs() -> None:
    model = TinyTransformer(depth=2)
    ids = torch.randint(0, 96, (2, 8))
    sink = normprobe.MemorySink()
    with normprobe.attach(model, sinks=[sink], example_inputs={"idx": ids}) as probe:
        assert probe.model_map is not None and len(probe.model_map.stacks) == 1
    with pytest.raises(TypeError, match=r"mapping.*example_kwargs is given too"):
        normprobe.attach(model, example_inputs={"idx": ids}, example_kwargs={"idx": ids})
