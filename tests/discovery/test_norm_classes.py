"""Which modules are norms, for classes found in real libraries that look like one by name or
by behaviour but are not one (or not a known one): compressai's GDN, e3nn's BatchNorm over
irreps and its ``o3.Norm``, neuralforecast's ``MaybeLayerNorm`` around an ``nn.Identity`` and
its ``TemporalNorm`` scaler, which the forward never calls."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import normprobe
from normprobe.discovery.model_map import ModelMap


def _discover(model: nn.Module, *inputs: torch.Tensor) -> ModelMap:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # these small models have no residual adds
        return normprobe.discover(model.eval(), *inputs)


class GDN(nn.Module):
    """compressai's ``compressai.layers.GDN`` (compressai/layers/gdn.py): ``y_i = x_i /
    sqrt(beta_i + sum_j gamma_ij x_j^2)``, or ``x_i * sqrt(...)`` with ``inverse=True``; beta
    = 1 and gamma = 0.1 I at init (compressai stores both reparametrized, which changes
    nothing here)."""

    def __init__(self, channels: int, inverse: bool = False) -> None:
        super().__init__()
        self.inverse = inverse
        self.beta = nn.Parameter(torch.ones(channels))
        self.gamma = nn.Parameter(0.1 * torch.eye(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        norm = nn.functional.conv2d(x**2, self.gamma.reshape(c, c, 1, 1), self.beta)
        return x * (norm.sqrt() if self.inverse else norm.rsqrt())


class GDNCodec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 16, 3, padding=1)
        self.gdn = GDN(16)
        self.igdn = GDN(16, inverse=True)
        self.dec = nn.Conv2d(16, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.igdn(self.gdn(self.enc(x))))


def test_gdn_at_its_init_is_no_norm() -> None:
    # with beta = 1 and gamma = 0.1 I, GDN is elementwise, x / sqrt(1 + 0.1 x^2): at the
    # probe's input size (rms 10) scaling x by 7.3 moves y by percents, not under 0.1%. Only the
    # probe's random parameters (gamma ~ 1 everywhere: x / sqrt(1 + sum_j x_j^2)) made it an
    # "rmsnorm", and the inverse GDN shared that answer (the probe cached by class and shape)
    found = _discover(GDNCodec(), torch.rand(2, 3, 8, 8))
    assert found.norms == []
    assert found.doubts == []


def test_gdn_and_inverse_gdn_of_one_shape_each_get_their_own_answer() -> None:
    # gamma = 1/16 everywhere and beta = 1e-6: x / sqrt(1e-6 + mean_c x^2), an RMSNorm over the
    # 16 channels (dim 1); the inverse, x * sqrt(...), grows with its input: no norm
    model = GDNCodec()
    with torch.no_grad():
        for layer in (model.gdn, model.igdn):
            layer.gamma.fill_(1 / 16)
            layer.beta.fill_(1e-6)
    (norm,) = _discover(model, torch.rand(2, 3, 8, 8)).norms
    assert (norm.path, norm.kind, norm.layout, norm.dims) == (
        "gdn",
        "rmsnorm",
        "channels-first",
        (16,),
    )


class ConvNextLayerNorm(nn.Module):
    """transformers' ``ConvNextLayerNorm`` (transformers/models/convnext/modeling_convnext.py):
    over the last dim, or over dim 1 with ``data_format="channels_first"``."""

    def __init__(self, dim: int, data_format: str = "channels_last") -> None:
        super().__init__()
        self.data_format = data_format
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.data_format == "channels_last":
            return nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias)
        x = x.permute(0, 2, 3, 1)
        y = nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias)
        return y.permute(0, 3, 1, 2)


class CubeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = ConvNextLayerNorm(8, "channels_first")
        self.last = ConvNextLayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(x).tanh())


def test_two_instances_of_one_class_on_one_shape_each_get_their_own_layout() -> None:
    # a (2, 8, 8, 8) input: dim 1 and the last dim are both 8 channels; the probe once
    # answered for the class and the shape, and the second module got the first's layout
    found = _discover(CubeNet(), torch.randn(2, 8, 8, 8))
    layouts = [(n.path, n.kind, n.layout, n.dims) for n in found.norms]
    assert layouts == [
        ("first", "layernorm", "channels-first", (8,)),
        ("last", "layernorm", "channels-last", (8,)),
    ]


class BatchNorm(nn.Module):
    """e3nn's ``e3nn.nn.BatchNorm`` (e3nn/nn/_batchnorm.py), affine=False, train mode, over
    ``scalars`` 0e channels then ``vectors`` 1o ones (3 components each): a scalar is centered
    and divided by its RMS over the batch, a vector divided by the RMS over the batch of its
    3 components jointly."""

    def __init__(self, scalars: int, vectors: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.scalars, self.vectors, self.eps = scalars, vectors, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x[:, : self.scalars]
        s = s - s.mean(0)
        s = s / (s.pow(2).mean(0) + self.eps).sqrt()
        v = x[:, self.scalars :].reshape(len(x), self.vectors, 3)
        v = v / (v.pow(2).mean((0, 2), keepdim=True) + self.eps).sqrt()
        return torch.cat([s, v.reshape(len(x), -1)], 1)


class IrrepsNet(nn.Module):
    def __init__(self, vectors: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8 + 3 * vectors, 8 + 3 * vectors)
        self.bn = BatchNorm(8, vectors)
        self.out = nn.Linear(8 + 3 * vectors, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = torch.cat([10 * h[:, :8], h[:, 8:]], 1)  # the largest element is a scalar's
        return self.out(self.bn(h))


def test_batch_statistics_a_vectors_components_share_are_no_known_norm() -> None:
    # 8x0e + 2x1o: a scalar column's statistics are its own, a vector component's are shared
    # with its 2 other components (14 columns, 10 statistics): no torch norm computes that.
    # Perturbing the largest element only (a scalar's) once saw a batchnorm over 14 channels
    found = _discover(IrrepsNet(2).train(), torch.randn(64, 14))
    (norm,) = found.norms
    assert (norm.path, norm.kind, norm.layout) == ("bn", "unknown", "")
    assert [(d.kind, d.path) for d in found.doubts] == [("unknown-norm", "bn")]


def test_batch_statistics_of_scalars_only_are_a_batchnorm() -> None:
    # 8x0e alone: each of the 8 columns normalized over the batch, as nn.BatchNorm1d(8)
    found = _discover(IrrepsNet(0).train(), torch.randn(64, 8))
    (norm,) = found.norms
    assert (norm.kind, norm.layout, norm.dims) == ("batchnorm", "batch", (8,))
    assert found.doubts == []


class EquivariantLayerNormFast(nn.Module):
    """Equiformer's ``EquivariantLayerNormFast`` (atomicarchitects/equiformer,
    nets/fast_layer_norm.py), without affine, over 8x0e + 2x1o: the 8 scalars centered and
    divided by their RMS, the 2 vectors divided by the RMS of their 6 components."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x[:, :8] - x[:, :8].mean(1, keepdim=True)
        s = s / (s.pow(2).mean(1, keepdim=True) + 1e-5).sqrt()
        v = x[:, 8:] / (x[:, 8:].pow(2).mean(1, keepdim=True) + 1e-5).sqrt()
        return torch.cat([s, v], 1)


class EquivariantBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(14, 14)
        self.norm = EquivariantLayerNormFast()
        self.out = nn.Linear(14, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.lin(x)))


def test_statistics_of_part_of_the_last_dim_are_no_known_norm() -> None:
    # perturbing a scalar moves the 8 scalars, a vector component the 6 vector components:
    # statistics over the last dim each time, but over neither all of its 14 entries
    found = _discover(EquivariantBlock(), torch.randn(16, 14))
    (norm,) = found.norms
    assert (norm.path, norm.kind, norm.layout) == ("norm", "unknown", "")
    assert [(d.kind, d.path) for d in found.doubts] == [("unknown-norm", "norm")]


class Norm(nn.Module):
    """e3nn's ``e3nn.o3.Norm`` (e3nn/o3/_norm.py): the magnitude of each irrep, 8 scalars and 2
    vectors in (14 values), 10 magnitudes out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vectors = x[:, 8:].reshape(len(x), 2, 3).norm(dim=2)
        return torch.cat([x[:, :8].abs(), vectors], 1)


class NormGate(nn.Module):
    """e3nn's ``NormActivation``: each irrep scaled by a function of its magnitude."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(14, 14)
        self.norm = Norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        gate = torch.sigmoid(self.norm(h))
        return h * torch.cat([gate[:, :8], gate[:, 8:].repeat_interleave(3, 1)], 1)


def test_a_module_named_norm_with_another_output_size_is_no_norm() -> None:
    found = _discover(NormGate(), torch.randn(4, 14))
    assert found.norms == []
    assert found.doubts == []


class MaybeLayerNorm(nn.Module):
    """neuralforecast's TFT ``MaybeLayerNorm`` (neuralforecast/models/tft.py): an ``nn.Identity``
    when its output size is 1, else a LayerNorm."""

    def __init__(self, output_size: int | None, hidden_size: int) -> None:
        super().__init__()
        identity = output_size == 1
        self.ln = nn.Identity() if identity else nn.LayerNorm(output_size or hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


class GatedResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.plain = MaybeLayerNorm(1, 8)  # a joint GRN of one variable: no norm
        self.norm = MaybeLayerNorm(None, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.plain(self.lin(x)))


def test_a_norm_named_wrapper_of_an_identity_is_no_norm() -> None:
    # the two wrappers are of one class and see inputs of one shape: each its own answer
    found = _discover(GatedResidual(), torch.randn(2, 5, 8))
    assert [(n.path, n.kind) for n in found.norms] == [("norm.ln", "layernorm")]
    assert found.doubts == []


class TemporalNorm(nn.Module):
    """neuralforecast's ``TemporalNorm`` scaler (neuralforecast/common/_scalers.py): a model's
    ``scaler`` that the data module, not the forward, calls, on a series and its mask."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mean = (x * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
        return (x - mean) * mask


class Forecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scaler = TemporalNorm()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def test_a_norm_the_forward_never_calls_raises_no_doubt() -> None:
    # the scaler of unknown kind is in no stream: converting the model's norms cannot touch it
    found = _discover(Forecaster(), torch.randn(2, 5, 8))
    assert [n.path for n in found.norms] == ["norm"]
    assert found.doubts == []
    assert any(note.startswith("scaler (TemporalNorm)") for note in found.notes)


def test_without_example_inputs_the_scaler_is_still_a_doubt() -> None:
    # no forward says whether it is called: its name is all there is
    found = _discover(Forecaster())
    assert [(d.kind, d.path) for d in found.doubts] == [("unknown-norm", "scaler")]
