"""`normprobe.diagnose` and ``normprobe diagnose``: each finding on a model built to have it and
on one built not to, the model left as it was, and the command line on real entry modules."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import zoo
from hooks import hook_count
from torch import nn

import normprobe
from normprobe import tags
from normprobe.cli import main
from normprobe.diagnose import (
    ATTN_LOGIT_MAX,
    CHECKS,
    DiagnoseInputError,
    Diagnosis,
    default_loss,
    diagnose,
)
from normprobe.models import ResidualStack, TinyTransformer


class UserRMSNorm(nn.Module):
    """A hand-written RMSNorm: ``upcast`` computes in float32, ``outside`` puts eps outside."""

    def __init__(self, width: int, upcast: bool = True, outside: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = 1e-6
        self.upcast = upcast
        self.outside = outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if self.upcast else x
        ms = h.pow(2).mean(-1, keepdim=True)
        h = h / (ms.sqrt() + self.eps) if self.outside else h * torch.rsqrt(ms + self.eps)
        return h.to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, norm: nn.Module, width: int) -> None:
        super().__init__()
        self.norm = norm
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class NormNet(nn.Module):
    """Three Pre-LN blocks with the given norm class, a final norm and a head."""

    def __init__(self, **norm: bool) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(UserRMSNorm(32, **norm), 32) for _ in range(3)))
        self.final = UserRMSNorm(32, **norm)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.final(self.blocks(x)))


def relu_mlp(std_gain: float, depth: int = 6, width: int = 128) -> nn.Sequential:
    """Linear(width, width)+ReLU layers with weights N(0, std_gain/fan_in) and zero biases."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        lin = nn.Linear(width, width)
        nn.init.normal_(lin.weight, std=math.sqrt(std_gain / width))
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def conv_bn_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def tokens(batch: int = 2, length: int = 32) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length))


# --- findings -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pre_ln_without_a_final_norm() -> None:
    # ResidualStack has no norm between its last Pre-LN block and its head; TinyTransformer has
    # ln_f there, and its Post-LN variant ends on a norm by construction
    found = diagnose(ResidualStack(8, 32, pre_ln=True), torch.randn(16, 32))
    assert "no-final-norm" in found.codes
    assert "`head`" in str(found)
    for placement, status in (("pre", "ok"), ("post", "n/a: no Pre-LN stack")):
        model = TinyTransformer(width=32, depth=2, placement=placement)  # type: ignore[arg-type]
        assert diagnose(model, tokens()).checks["no-final-norm"] == status


def test_post_ln_top_heavy_gradients_and_deepnorm() -> None:
    # sanity check [d]'s stack: 48 blocks of width 64, batch 16, loss mean(out²): last/first block
    # gradient norm 2.35 for Post-LN; DeepNorm's init (Wang et al. 2022) brings it to about 1
    stack, x = ResidualStack(48, 64, pre_ln=False), torch.randn(16, 64)
    found = diagnose(stack, x)
    assert found.measurements[tags.format("grad_ratio", "lins")] == pytest.approx(2.35, abs=0.01)
    # a stack with top-heavy gradients needs the warmup too: both checks flag it
    assert found.codes == ["post-ln-top-heavy", "post-ln-warmup"]
    assert "2.35" in str(found) and "deepnorm" in str(found)

    normprobe.reinit(stack, "deepnorm", example_inputs=(x,))
    fixed = diagnose(stack, x)
    assert fixed.measurements[tags.format("grad_ratio", "lins")] == pytest.approx(1.0, abs=0.1)
    assert fixed.checks["post-ln-top-heavy"] == fixed.checks["post-ln-warmup"] == "ok"


class HeadlessPostLN(nn.Module):
    """ResidualStack's Post-LN blocks without the head: the output is a LayerNorm's."""

    def __init__(self, depth: int = 8, width: int = 32) -> None:
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for ln, lin in zip(self.lns, self.lins, strict=True):
            h = ln(h + lin(h))
        return h


def test_post_ln_without_a_head_needs_a_loss() -> None:
    # mean(LN(x)²) is 1 for every x (unit gains, zero biases): the default loss has no gradient
    # worth comparing, so the check waits for a loss_fn
    model, x = HeadlessPostLN(), torch.randn(16, 32)
    skipped = diagnose(model, x)
    assert skipped.loss == pytest.approx(1.0, abs=1e-4)
    assert skipped.checks["post-ln-top-heavy"].startswith("n/a: no output head: pass loss_fn")
    target = torch.randn(16, 32)
    measured = diagnose(model, x, loss_fn=lambda out: (out - target).pow(2).mean())
    assert measured.checks["post-ln-top-heavy"] == "ok"  # 8 blocks: last/first about 1
    assert measured.measurements[tags.format("grad_ratio", "lins")] < 2.0


@pytest.mark.slow
def test_residual_growth() -> None:
    # Pre-LN, torch's default init: each branch adds var(W)·64 = 1/3 (kaiming_uniform(a=√5)
    # gives var 1/(3·64)) to a unit-variance stream, so after l blocks var ≈ 1 + l/3: growth over
    # 48 blocks ≈ sqrt(17 / (4/3)) = 3.6, a log-log slope near sqrt(l)'s 0.5
    stack, x = ResidualStack(48, 64, pre_ln=True), torch.randn(16, 64)
    found = diagnose(stack, x)
    assert "residual-growth" in found.codes
    assert found.measurements[tags.format("resid_growth", "lins")] == pytest.approx(3.6, rel=0.1)
    assert found.measurements[tags.format("resid_slope", "lins")] > 0.3

    # GPT-2's init writes N(0, 0.02/sqrt(96)) into the stream: it stays flat
    normprobe.reinit(stack, "gpt2", example_inputs=(x,))
    flat = diagnose(stack, x)
    assert flat.checks["residual-growth"] == "ok"
    assert abs(flat.measurements[tags.format("resid_slope", "lins")]) < 0.05


def test_large_attention_logits_and_qk_norm() -> None:
    def scaled(qk_norm: bool) -> TinyTransformer:
        model = TinyTransformer(width=32, depth=2, heads=4, qk_norm=qk_norm)
        with torch.no_grad():
            for block in model.blocks:
                block.attn.qkv.weight.mul_(40)  # q·k grows 1600x: from about 0.06 to about 100
        return model

    found = diagnose(scaled(False), tokens())
    assert found.codes == ["attention-logits"]
    logits = [v for k, v in found.measurements.items() if "attn_logit_max" in k]
    assert max(logits) > ATTN_LOGIT_MAX
    assert "QK-norm" in str(found)

    # LayerNorm'd q and k of head size 8 have norm sqrt(8): |q·k|/sqrt(8) <= sqrt(8) = 2.83
    bounded = diagnose(scaled(True), tokens())
    assert bounded.checks["attention-logits"] == "ok"
    logits = [v for k, v in bounded.measurements.items() if "attn_logit_max" in k]
    assert 0 < max(logits) <= math.sqrt(8) + 1e-3


def test_batchnorm_on_a_tiny_batch() -> None:
    found = diagnose(conv_bn_net(), torch.randn(2, 3, 8, 8))
    assert found.codes == ["batchnorm-batch"]
    assert "batch of 2 per device" in str(found) and "groupnorm" in str(found)
    assert diagnose(conv_bn_net(), torch.randn(16, 3, 8, 8)).checks["batchnorm-batch"] == "ok"


def test_batchnorm_across_ranks_needs_syncbatchnorm() -> None:
    x = torch.randn(16, 3, 8, 8)
    found = diagnose(conv_bn_net(), x, world_size=4)
    assert found.codes == ["batchnorm-batch"]
    assert "not synchronized" in str(found)
    synced = normprobe.convert_norms(conv_bn_net(), "syncbatchnorm")
    assert diagnose(synced, x, world_size=4).checks["batchnorm-batch"] == "ok"
    # synchronized, 2 per device x 4 ranks = 8 samples: enough
    assert diagnose(synced, x[:2], world_size=4).checks["batchnorm-batch"] == "ok"


def test_norm_reducing_in_low_precision() -> None:
    x = torch.randn(4, 8, 32)
    found = diagnose(NormNet(upcast=False), x)
    assert found.codes == ["low-precision-norm"]
    # squares of inputs of RMS 1024 overflow float16: the whole output is lost
    assert found.measurements["diagnose/lowp_error/float16/blocks.0.norm"] > 0.5
    assert "blocks.{0..2}.norm, final" in str(found)
    ok = diagnose(NormNet(upcast=True), x)
    assert ok.checks["low-precision-norm"] == "ok"
    # what is left is float16's rounding of the output: 2^-11 relative, a few 1e-4 in RMS
    assert ok.measurements["diagnose/lowp_error/float16/blocks.0.norm"] < 1e-3


def test_torch_norm_classes_are_not_judged_for_low_precision() -> None:
    # torch's InstanceNorm2d in bfloat16 on a CPU errs by 3-5% (its own kernel, and the model
    # runs in float32): the advice, torch's class, is the class it already is
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.InstanceNorm2d(8)) for _ in range(3)]
    model = nn.Sequential(*blocks)
    found = diagnose(model, torch.randn(2, 8, 8, 8))
    assert "low-precision-norm" not in found.codes
    assert not any("lowp_error" in key for key in found.measurements)


class Conditioned(nn.Module):
    """A U-Net's blocks, each reading one shared time embedding through a Linear of its own
    (``to_emb``) scaled by a FiLM gain: one block's gain still small, as it starts at 0."""

    def __init__(self, blocks: int = 6, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(1, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.to_emb = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.gains = [1.0] * blocks
        self.gains[2] = 0.02

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = self.embed(t)
        for layer, to_emb, gain in zip(self.layers, self.to_emb, self.gains, strict=True):
            x = x + layer(torch.relu(x)) * (1 + gain * to_emb(emb))
        return x


def test_a_layer_reading_a_shared_input_is_judged_on_its_own_gradient() -> None:
    # the shared embedding's gradient sums six blocks' contributions: over the small-gain
    # block's output gradient it read as a backward gain of ~50, against ~1 for its peers
    torch.manual_seed(0)
    found = diagnose(Conditioned(), (torch.randn(8, 16), torch.rand(8, 1)))
    assert "layer-jump" not in found.codes
    assert found.measurements["diagnose/jump_max/gradient/layers"] < 2  # 44.5 from the sum


def test_eps_outside_the_square_root() -> None:
    x = torch.randn(4, 8, 32)
    found = diagnose(NormNet(outside=True), x)
    assert found.codes == ["eps-outside-sqrt"]
    assert "eps 1e-06" in str(found)
    assert diagnose(NormNet(outside=False), x).checks["eps-outside-sqrt"] == "ok"


def test_relu_net_initialized_for_tanh() -> None:
    # as in sanity check [e]: Linear+ReLU with Var(W) = 1/fan_in keeps E[y²] = E[x²]/2 per layer,
    # Kaiming's 2/fan_in (He et al. 2015) keeps E[y²] = E[x²]
    x = torch.randn(64, 128)
    found = diagnose(relu_mlp(1.0), x)
    assert found.codes == ["relu-init"]
    assert found.measurements["diagnose/relu_ratio/0"] == pytest.approx(0.5, abs=0.08)
    assert "kaiming" in str(found)
    kept = diagnose(relu_mlp(2.0), x)
    assert kept.checks["relu-init"] == "ok"
    assert kept.measurements["diagnose/relu_ratio/0"] == pytest.approx(1.0, abs=0.15)
    # a chain of 2 is too short to judge
    assert diagnose(relu_mlp(1.0, depth=2), x).checks["relu-init"].startswith("n/a")


@pytest.mark.slow
def test_gpt_without_residual_projection_scaling() -> None:
    # TinyTransformer's init: N(0, 0.02) everywhere, the stream-writing projections included
    model, ids = TinyTransformer(width=32, depth=6), tokens()
    found = diagnose(model, ids)
    assert found.codes == ["no-residual-scaling"]
    assert found.measurements["diagnose/write_std_ratio/blocks"] == pytest.approx(1.0, abs=0.05)
    # GPT-2's init: the projections N(0, 0.02/sqrt(2·6)), the ratio 1/sqrt(12) = 0.289
    normprobe.reinit(model, "gpt2", example_inputs=(ids,))
    fixed = diagnose(model, ids)
    assert fixed.measurements["diagnose/write_std_ratio/blocks"] == pytest.approx(0.289, abs=0.02)
    assert fixed.codes == []
    assert "No problems found." in str(fixed)


# --- the report, the loss, the model left alone -----------------------------------------------


@pytest.mark.slow
def test_report_lists_findings_with_evidence_and_suggestions() -> None:
    found = diagnose(ResidualStack(48, 64, pre_ln=True), torch.randn(16, 64))
    text = str(found)
    assert text.splitlines()[1] == "2 findings:"
    assert "1. Pre-LN stack without a final norm  [no-final-norm]" in text
    assert "3.7" in text  # the measured growth, in two findings
    assert text.count("-> ") == 2
    assert set(found.checks) == set(CHECKS)
    assert "post-ln-top-heavy (no Post-LN stack)" in text


def test_default_loss() -> None:
    assert default_loss(torch.tensor([[1.0, 3.0]])).item() == 5.0  # (1 + 9) / 2
    assert default_loss({"logits": torch.tensor([2.0]), "hidden": torch.ones(3)}).item() == 4.0
    own = torch.tensor(0.25)
    assert default_loss({"loss": own, "logits": torch.ones(2)}) is own
    assert default_loss((torch.arange(3), torch.tensor([3.0, 4.0]))).item() == 12.5
    with pytest.raises(DiagnoseInputError, match="loss_fn"):
        default_loss({"ids": torch.arange(3)})


def test_hugging_face_model_with_keyword_inputs() -> None:
    # GPT-2 returns a ModelOutput: the default loss reads .logits; HF's own init already scales
    # c_proj by 1/sqrt(2N), and the 4-block zoo model ends on ln_f
    z = zoo.build("gpt2")
    result = diagnose(z.model, {"input_ids": z.args[0], **z.kwargs})
    assert result.checks["no-final-norm"] == "ok"
    assert result.codes == []
    assert not z.model.training  # the zoo builds it in eval mode; diagnose trains, then restores


def test_batch_forms_and_custom_loss() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * scale

    model, x, s = TwoInputs(), torch.ones(2, 4), torch.tensor(2.0)
    by_tuple = diagnose(model, (x, s), loss_fn=lambda out: out.sum())
    by_dict = diagnose(model, {"x": x, "scale": s}, loss_fn=lambda out: out.sum())
    expected = float(model(x, s).sum().detach())
    assert by_tuple.loss == pytest.approx(expected) and by_dict.loss == pytest.approx(expected)


def test_model_is_left_as_it_was() -> None:
    model = nn.Sequential(conv_bn_net(), nn.Dropout(0.5))
    model.eval()
    model[0][0].weight.grad = marker = torch.full_like(model[0][0].weight, 7.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = hook_count(model)
    x = torch.randn(4, 3, 8, 8)
    rng = torch.get_rng_state()
    result = diagnose(model, x)
    assert isinstance(result, Diagnosis)
    assert model[0][0].weight.grad is marker
    assert all(p.grad is None for n, p in model.named_parameters() if n != "0.0.weight")
    assert not any(m.training for m in model.modules())
    for k, v in model.state_dict().items():  # BatchNorm's running statistics included
        assert torch.equal(v, state[k]), k
    assert hook_count(model) == hooks
    assert torch.equal(torch.get_rng_state(), rng)


def test_bad_inputs_name_the_problem() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(DiagnoseInputError, match="got str"):
        diagnose(model, "tokens")  # type: ignore[arg-type]
    with pytest.raises(DiagnoseInputError, match=r"scalar tensor, got Tensor of shape \(2, 4\)"):
        diagnose(model, torch.ones(2, 4), loss_fn=lambda out: out)
    model.requires_grad_(False)
    with pytest.raises(DiagnoseInputError, match="requires grad"):
        diagnose(model, torch.ones(2, 4))
    with pytest.raises(DiagnoseInputError, match=r"needs a torch\.nn\.Module"):
        diagnose(lambda x: x, torch.ones(2))  # type: ignore[arg-type]


# --- the command line -----------------------------------------------------------------------------

ENTRY = """
import torch
from torch import nn
from normprobe.models import ResidualStack, TinyTransformer
import normprobe


def no_final_norm():
    torch.manual_seed(0)
    return ResidualStack(8, 32, pre_ln=True), torch.randn(16, 32)


def clean():
    torch.manual_seed(0)
    model, ids = TinyTransformer(width=32, depth=2), torch.randint(0, 96, (2, 16))
    return model, ids, lambda logits: logits.pow(2).mean()


def wrong():
    return torch.randn(3)


def not_a_model():
    return "model", torch.randn(3)
"""


@pytest.fixture
def entry_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> str:
    name = f"np_entry_{request.node.name}"
    (tmp_path / f"{name}.py").write_text(ENTRY)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --path edits sys.path
    monkeypatch.chdir(tmp_path.parent)
    return name


def test_cli_exit_codes(
    entry_module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diagnose", f"{entry_module}:no_final_norm", "--path", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "no-final-norm" in out and "-> add a LayerNorm/RMSNorm" in out
    assert main(["diagnose", f"{entry_module}:clean", "--path", str(tmp_path)]) == 0
    assert "No problems found." in capsys.readouterr().out


def test_cli_bad_entries(
    entry_module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = {
        f"{entry_module}:missing": (
            "has no function 'missing'; functions there: "
            "['clean', 'no_final_norm', 'not_a_model', 'wrong']"
        ),
        f"{entry_module}:wrong": "must return (model, batch) or (model, batch, loss_fn) with "
        "model an nn.Module, got Tensor",
        f"{entry_module}:not_a_model": "got a tuple of (str, Tensor)",
        "no_such_module_here:build": "no module 'no_such_module_here' on the import path",
        entry_module: f"ENTRY must be module:function, like mymodels:build, got '{entry_module}'",
    }
    # without --path the module is not found (before anything imported it): how to fix that
    assert main(["diagnose", f"{entry_module}:clean"]) == 2
    assert "add it with --path DIR" in capsys.readouterr().err
    for entry, message in cases.items():
        assert main(["diagnose", entry, "--path", str(tmp_path)]) == 2, entry
        err = capsys.readouterr().err
        assert message in err, err


@pytest.mark.slow
@pytest.mark.subprocess
def test_cli_runs_as_a_module(entry_module: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "normprobe.cli", "diagnose", f"{entry_module}:no_final_norm"],
        cwd=tmp_path,  # the current directory is searched without --path
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "Pre-LN stack without a final norm" in done.stdout


def test_cli_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["diagnose", "--help"])
    assert done.value.code == 0
    assert "0 no finding, 1 findings, 2 bad input" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_post_ln_without_deepnorm_init_says_it_needs_a_warmup() -> None:
    from normprobe import demo
    from normprobe.corpus import CharCorpus

    corpus = CharCorpus(context=demo.CONTEXT)
    x, y = corpus.batch(8)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    torch.manual_seed(0)
    post = normprobe.diagnose(demo._post_ln(corpus.vocab_size), (x,), loss_fn=loss)
    assert post.codes == ["post-ln-warmup"]
    (finding,) = post.findings
    ratio = post.measurements[tags.format("grad_ratio", "blocks")]
    assert f"(last / first {ratio:.3g})" in " ".join(finding.evidence)
    assert "normprobe.reinit(model, 'deepnorm'" in finding.suggestion
    # the same stack with DeepNorm's initialization carries the fix
    torch.manual_seed(0)
    assert normprobe.diagnose(demo._deepnorm(corpus.vocab_size), (x,), loss_fn=loss).codes == []


def test_each_check_is_one_file_holding_its_title_and_thresholds() -> None:
    import pkgutil

    from normprobe.diagnose import checks

    files = {m.name for m in pkgutil.iter_modules(checks.__path__)} - {"base"}
    registered = {c.run.__module__.rpartition(".")[2]: c for c in checks.REGISTRY}
    assert set(registered) == files  # every check file is registered, once
    for name, check in registered.items():
        assert check.code.replace("-", "_") == name  # the file is named for the code
        assert check.title and CHECKS[check.code] == check.title
        module = sys.modules[check.run.__module__]
        for constant, value in check.thresholds.items():
            assert getattr(module, constant) == value  # declared in (or imported into) its file
            assert isinstance(value, int | float) and math.isfinite(value)
    structural = {c.code for c in checks.REGISTRY if not c.thresholds}
    assert structural == {"no-final-norm", "eps-outside-sqrt"}


def test_diagnose_runs_the_registered_checks_in_order() -> None:
    from normprobe.diagnose.checks import REGISTRY

    found = diagnose(ResidualStack(8, 32), torch.randn(4, 32))
    assert list(found.checks) == [c.code for c in REGISTRY] == list(CHECKS)
