"""Real training loops on architectures the suite had not covered, run as a user runs them.
A weight_norm'd or spectral_norm'd layer whose stored tensor holds a row (a weight) of zeros
gets the parametrization's own diagnosis in sentinel too (even when the anomaly stops the
step before backward), not a generic "non-finite value" whose fix reads the model's output.
A whitening layer whose eigh backward divides by the difference of two equal eigenvalues is
pinpointed in watch mode as in sentinel, when the code that used the value belongs to an
ancestor of the child that made it (the output of a Sequential's last child). A BatchNorm
given a batch of one sample in training keeps its ValueError, and the post-mortem names the
layer and the DataLoader fix in its first sentence (the one the CLI prints). The log of a
discretized logistic's bin, a difference of two sigmoids that both rounded to 1, is
rewritten without the subtraction. Healthy loops (a GroupNorm over a constant group in
bfloat16; a channels_last float16 CNN whose GradScaler skips its overflowing steps) stay
quiet; a graph network's mean over zero neighbours is a count of 0 fixed with
clamp_min(1)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import nanwatch

torch.set_num_threads(1)

MODES = ["watch", "sentinel"]


def _train(
    model: nn.Module, step: Callable[[], torch.Tensor], mode: str, steps: int = 1, **kw: object
) -> nanwatch.Watcher:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False, **kw) as nw:
        for _ in range(steps):
            step().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


# ------------------------------------------------------------- 1: parametrizations, sentinel
class _TCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = weight_norm(nn.Conv1d(4, 8, 3, padding=1))
        self.c2 = weight_norm(nn.Conv1d(8, 8, 3, padding=1))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c2(F.relu(self.c1(x))))
        return self.head(h.mean(-1))


def _tcn(pruned: bool) -> nn.Module:
    torch.manual_seed(0)
    model = _TCN()
    if pruned:
        with torch.no_grad():  # a pruned filter: its direction v is a row of zeros
            model.c2.parametrizations.weight.original1[3].zero_()
    return model


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_norm_row_of_zeros_is_the_parametrizations_in_both_modes(mode: str) -> None:
    model = _tcn(pruned=True)
    x, y = torch.randn(16, 4, 20), torch.randint(0, 2, (16,))
    nw = _train(model, lambda: F.cross_entropy(model(x), y), mode)
    d = nw.report.diagnoses[0]
    assert (d.code, d.path) == ("NW100", "c2.parametrizations.weight.0"), d.headline
    assert d.title == (
        "NaN in the parametrization of c2's weight: a norm of 0 in what it is computed from"
    )
    said = " ".join(d.evidence)
    assert "stored in model.c2.parametrizations.weight (original0 (8, 1, 1), original1 " in said
    assert "its input v (original1) holds exact zeros" in said
    assert d.fix.startswith("t = model.c2.parametrizations.weight.original1")
    # the fix, run on the pruned model, gives the row a direction again: training is finite
    fixed = _tcn(pruned=True)
    scope = {"model": fixed, "torch": torch}
    exec(d.fix, scope)  # the diagnosis's own code
    again = _train(fixed, lambda: F.cross_entropy(fixed(x), y), mode, steps=2)
    assert again.first_anomaly is None and not again.report.diagnoses


def test_a_weight_norm_row_of_zeros_raised_before_backward_names_the_stored_tensor() -> None:
    model = _tcn(pruned=True)  # sentinel raises at the forward: no gradient was recorded
    x = torch.randn(16, 4, 20)
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(model, mode="sentinel", postmortem=False),
    ):
        model(x).sum().backward()
    d = info.value.diagnosis
    assert d is not None and d.path == "c2.parametrizations.weight.0", d
    assert d.title.startswith("NaN in the parametrization of c2's weight"), d.title
    assert "(original0 (8, 1, 1), original1 (8, 8, 3))" in " ".join(d.evidence)
    assert d.fix.startswith("t = model.c2.parametrizations.weight.original1")


def test_a_spectral_norm_of_a_zero_weight_is_named_in_sentinel() -> None:
    torch.manual_seed(0)
    zero = nn.Linear(16, 16)
    nn.init.zeros_(zero.weight)
    model = nn.Sequential(
        spectral_norm(nn.Linear(8, 16)), nn.LeakyReLU(0.2), spectral_norm(zero), nn.Linear(16, 1)
    )
    x, y = torch.randn(16, 8), torch.rand(16, 1).round()
    nw = _train(model, lambda: F.binary_cross_entropy_with_logits(model(x), y), "sentinel")
    d = nw.report.diagnoses[0]
    assert (d.code, d.path) == ("NW100", "2.parametrizations.weight.0"), d.headline
    assert d.title == "NaN in the spectral norm of 2's weight: sigma = 0 (a weight of zeros)"
    assert "parametrize.remove_parametrizations(model[2], 'weight'" in d.fix


def test_a_healthy_weight_norm_network_stays_quiet_in_sentinel() -> None:
    model = _tcn(pruned=False)
    x, y = torch.randn(16, 4, 20), torch.randint(0, 2, (16,))
    nw = _train(model, lambda: F.cross_entropy(model(x), y), "sentinel", steps=2)
    assert nw.first_anomaly is None and not nw.report.diagnoses


# --------------------------------------------- 2: eigh's backward in an ancestor's own code
class _Whiten(nn.Module):
    """ZCA whitening of learned features (deep CCA, Barlow-style losses)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.f(x)
        h = h - h.mean(0)
        cov = h.T @ h / (h.shape[0] - 1)
        evals, evecs = torch.linalg.eigh(cov)
        w = evecs @ torch.diag(evals.clamp_min(1e-5).rsqrt()) @ evecs.T
        return h @ w


@pytest.mark.gpu_bound_weaker(
    reason=(
        "a gradient is read at the step end, after the update wrote it into the weights: the "
        "forward that eigh's backward needs cannot be made again with the old weights"
    )
)
@pytest.mark.parametrize("mode", MODES)
def test_eighs_backward_at_repeated_eigenvalues_is_pinpointed_in_both_modes(mode: str) -> None:
    torch.manual_seed(0)
    model = _Whiten()
    with torch.no_grad():  # 4 dead features: the eigenvalue 0, four times
        model.f[2].weight[4:].zero_()
        model.f[2].bias[4:].zero_()
    x, t = torch.randn(64, 6), torch.randn(64, 8)
    nw = _train(model, lambda: F.mse_loss(model(x), t), mode)
    d = nw.report.diagnoses[0]
    assert (d.code, d.path, d.op) == ("NW111", "_Whiten", "aten.div_.Tensor"), d.headline
    assert d.title == "Backward of eigh at repeated eigenvalues"
    said = " ".join(d.evidence)
    assert "LinalgEighBackward0 divides by the differences of the eigenvalues" in said
    assert "evals, evecs = torch.linalg.eigh(cov)" in said
    assert "torch.linalg.eigh(cov + 1e-4 * jitter)" in d.fix


@pytest.mark.gpu_bound_weaker(
    reason=(
        "a gradient is read at the step end, after the update: the first anomaly is not "
        "pinpointed to eigh's backward (see above), so the advice names another first value"
    )
)
@pytest.mark.parametrize("mode", MODES)
def test_an_error_raised_after_a_recorded_anomaly_leads_with_that_anomaly(mode: str) -> None:
    torch.manual_seed(0)
    model = _Whiten()
    with torch.no_grad():
        model.f[2].weight[4:].zero_()
        model.f[2].bias[4:].zero_()
    x, t = torch.randn(64, 6), torch.randn(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(torch.linalg.LinAlgError) as info,
        nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw,
    ):
        for _ in range(3):  # step 0: NaN gradients, applied; step 1: eigh of a NaN matrix
            F.mse_loss(model(x), t).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    assert type(info.value) is torch.linalg.LinAlgError  # torch's own, not replaced
    error = nw.report.error
    assert error is not None and error["step"] == 1
    assert error["advice"].startswith(
        "The run's first anomaly came at step 0, and training went on"
    ), error["advice"]
    assert "by aten.div_.Tensor in the backward of " in error["advice"]
    assert (
        "(NW111). The exception is most likely a consequence: fix that first." in (error["advice"])
    )


# ------------------------------------------------------ 3: a BatchNorm given one sample
@pytest.mark.parametrize("mode", MODES)
def test_a_batchnorm_given_a_batch_of_one_names_the_layer_and_drop_last(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.BatchNorm1d(8),
        nn.ReLU(), nn.Linear(8, 2),
    )  # fmt: skip
    batches = [torch.randn(4, 3, 8, 8), torch.randn(1, 3, 8, 8)]  # the epoch's short last one
    with (
        pytest.raises(ValueError, match="Expected more than 1 value per channel") as info,
        nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw,
    ):
        for x in batches:
            F.cross_entropy(model(x), torch.zeros(x.shape[0], dtype=torch.long)).backward()
            nw.step()
    assert type(info.value) is ValueError  # torch's own, not replaced
    error = nw.report.error
    assert error is not None and error["class"] == "norm-one-value"
    assert error["advice"].startswith(
        "3 (BatchNorm1d) got an input of shape [1, 8] in training, one value per channel, "
        "whose variance cannot be computed: drop the epoch's short last batch "
        "(DataLoader(..., drop_last=True))"
    ), error["advice"]
    assert "It is a batch of 1 sample" in error["advice"]
    assert "model.eval() before predicting one sample" in error["advice"]


def test_an_instancenorm_given_a_one_element_map_says_the_map_is_too_small() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.InstanceNorm2d(8), nn.ReLU())
    with (
        pytest.raises(ValueError, match="Expected more than 1 spatial element") as info,
        nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw,
    ):
        model(torch.randn(2, 3, 3, 3))
    assert type(info.value) is ValueError
    error = nw.report.error
    assert error is not None and error["class"] == "norm-one-value"
    assert error["advice"].startswith(
        "1 (InstanceNorm2d) got an input of shape [2, 8, 1, 1] in training, a map of one "
        "element per channel, whose variance cannot be computed: give the model larger inputs"
    ), error["advice"]


# ------------------------------------------------------------- 4: healthy loops stay quiet
class _UNetBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, 16)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.t = nn.Linear(8, 16)
        self.norm2 = nn.GroupNorm(4, 16)
        self.out = nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv(F.silu(self.norm(x))) + self.t(temb)[..., None, None]
        return self.out(F.silu(self.norm2(h)))


@pytest.mark.parametrize("mode", MODES)
def test_a_bf16_groupnorm_over_a_constant_group_stays_quiet(mode: str) -> None:
    torch.manual_seed(0)
    model = _UNetBlock().to(torch.bfloat16)
    x = torch.randn(4, 16, 8, 8, dtype=torch.bfloat16)
    x[:, :4] = 0  # zero-padded channels: the first group is constant, its variance 0
    temb = torch.randn(4, 8, dtype=torch.bfloat16)
    noise = torch.randn(4, 3, 8, 8)
    nw = _train(model, lambda: F.mse_loss(model(x, temb).float(), noise), mode, steps=2)
    assert nw.first_anomaly is None and not nw.report.diagnoses


@pytest.mark.parametrize("mode", MODES)
def test_a_channels_last_fp16_cnn_whose_scaler_skips_overflows_stays_quiet(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, 10),
    ).to(memory_format=torch.channels_last)  # fmt: skip
    x = torch.randn(8, 3, 16, 16).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # far too large: overflows
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    assert scaler.get_scale() < 2.0**24  # it did skip overflowing steps
    assert nw.first_anomaly is None and not nw.report.diagnoses


# ----------------------------------------------- 5: a graph's mean over zero neighbours
class _MeanConv(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.root = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        agg = torch.zeros_like(x).index_add_(0, dst, self.lin(x)[src])
        deg = torch.zeros(x.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0]))
        agg = agg / deg.unsqueeze(-1)
        return F.relu(agg + self.root(x))


class _GNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = _MeanConv(8)
        self.c2 = _MeanConv(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        return self.head(self.c2(self.c1(x, edges), edges))


@pytest.mark.parametrize("mode", MODES)
def test_a_gnn_mean_over_a_node_with_no_neighbours_is_a_count_of_zero(mode: str) -> None:
    torch.manual_seed(0)
    model = _GNN()
    x = torch.randn(6, 8)
    edges = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])  # nodes 4 and 5: no incoming edge
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    nw = _train(model, lambda: F.cross_entropy(model(x, edges), y), mode)
    d = nw.report.diagnoses[0]
    assert (d.code, d.path, d.op) == ("NW111", "c1", "aten.div.Tensor"), d.headline
    assert "denominator is a count held in a float32 tensor" in d.evidence[0]
    assert d.fix.startswith("agg = agg / deg.unsqueeze(-1).clamp_min(1)")


# --------------------------------- 6: the log of a difference of two saturated sigmoids
class _Logistic(nn.Module):
    """A PixelCNN++-style head: a mean and a log-scale per pixel."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 6, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        return out[:, :3], out[:, 3:]


def _bin_log_likelihood(model: nn.Module, x: torch.Tensor, *, stable: bool) -> torch.Tensor:
    mean, log_scale = model(x)
    inv = torch.exp(-log_scale)
    plus = inv * (x - mean + 1 / 255)
    minus = inv * (x - mean - 1 / 255)
    if stable:
        log_p = F.logsigmoid(plus) + F.logsigmoid(-minus) + torch.log(-torch.expm1(minus - plus))
    else:
        log_p = torch.log(torch.sigmoid(plus) - torch.sigmoid(minus))
    return -log_p.mean()


@pytest.mark.parametrize("mode", MODES)
def test_the_log_of_a_discretized_logistic_bin_that_rounded_to_0_is_rewritten(mode: str) -> None:
    model = _logistic_init()
    x = torch.rand(4, 3, 8, 8) * 2 - 1
    nw = _train(model, lambda: _bin_log_likelihood(model, x, stable=False), mode)
    d = nw.report.diagnoses[0]
    assert (d.code, d.op) == ("NW110", "aten.log"), d.headline
    assert d.title == "Log of a difference of sigmoids that rounded to 0"
    assert "log <- sub <- sigmoid" in " ".join(d.evidence)
    assert d.fix.startswith(
        "log_p = F.logsigmoid(a) + F.logsigmoid(-b) + torch.log(-torch.expm1(b - a))"
    )
    # the fix's form, with a = plus and b = minus, trains the same model finitely
    again = _logistic_init()
    quiet = _train(again, lambda: _bin_log_likelihood(again, x, stable=True), mode, steps=2)
    assert quiet.first_anomaly is None and not quiet.report.diagnoses


def _logistic_init() -> nn.Module:
    torch.manual_seed(0)
    model = _Logistic()
    with torch.no_grad():
        model.net[2].bias[3:].fill_(-6.0)  # sharp distributions: both cdfs round to 1
    return model


# ---------------------------------------- 7: a log-cosh loss on targets in the hundreds
@pytest.mark.parametrize("mode", MODES)
def test_a_log_cosh_loss_whose_cosh_overflowed_is_written_without_cosh(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    x, y = torch.randn(64, 4), torch.randn(64, 1) * 100  # prices, not standardized
    y[0] = 500.0

    def log_cosh() -> torch.Tensor:
        d = model(x) - y
        return torch.log(torch.cosh(d)).mean()

    nw = _train(model, log_cosh, mode)
    d = nw.report.diagnoses[0]
    assert (d.code, d.op) == ("NW101", "aten.cosh"), d.headline
    assert d.fix.startswith("log_cosh = d.abs() + F.softplus(-2 * d.abs()) - math.log(2)")
    assert "clamp" not in d.fix.split("\n")[0]

    # the fix's form: the same loss where cosh is finite, and finite where it is not
    small = torch.linspace(-20, 20, 41, dtype=torch.float64)
    exact = torch.log(torch.cosh(small))
    assert torch.allclose(small.abs() + F.softplus(-2 * small.abs()) - math.log(2), exact)
    model2 = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))

    def stable() -> torch.Tensor:
        e = model2(x) - y
        return (e.abs() + F.softplus(-2 * e.abs()) - math.log(2)).mean()

    quiet = _train(model2, stable, mode, steps=2)
    assert quiet.first_anomaly is None and not quiet.report.diagnoses


# ------------------------------------ 8: a Poincaré embedding pushed onto the ball's boundary
class _Poincare(nn.Module):
    def __init__(self, *, margin: bool) -> None:
        super().__init__()
        self.margin = margin
        self.emb = nn.Embedding(20, 2)
        with torch.no_grad():
            self.emb.weight.uniform_(-0.3, 0.3)
            self.emb.weight[5] = torch.tensor([0.6, 0.8])  # |x| = 1: an update took it there

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        x, y = self.emb(u), self.emb(v)
        sq = ((x - y) ** 2).sum(-1)
        nx = 1 - (x**2).sum(-1)
        ny = 1 - (y**2).sum(-1)
        if self.margin:
            nx, ny = nx.clamp_min(1e-5), ny.clamp_min(1e-5)
        return torch.acosh(1 + 2 * sq / (nx * ny))


@pytest.mark.parametrize("mode", MODES)
def test_a_poincare_distance_at_the_balls_boundary_projects_the_points(mode: str) -> None:
    torch.manual_seed(0)
    model = _Poincare(margin=False)
    u, v = torch.tensor([0, 1, 2, 5]), torch.tensor([3, 4, 5, 6])
    nw = _train(model, lambda: model(u, v).mean(), mode)
    d = nw.report.diagnoses[0]
    assert (d.code, d.path) == ("NW111", "_Poincare"), d.headline
    assert d.title == "Division by zero: a point on the boundary of the Poincaré ball"
    assert "nx = 1 - (x**2).sum(-1); ny = 1 - (y**2).sum(-1)" in d.evidence[0]
    lines = d.fix.split("\n")
    assert lines[2] == "    n = model.emb.weight.norm(dim=-1, keepdim=True)", d.fix
    assert "nx = (1 - (x**2).sum(-1)).clamp_min(1e-5)" in d.fix
    assert "ny = (1 - (y**2).sum(-1)).clamp_min(1e-5)" in d.fix
    # the fix: the points projected inside and the factors kept off 0 train finitely
    torch.manual_seed(0)
    fixed = _Poincare(margin=True)
    exec("\n".join(lines[:4]), {"model": fixed, "torch": torch})  # the projection
    assert fixed.emb.weight.norm(dim=-1).max() < 1
    quiet = _train(fixed, lambda: fixed(u, v).mean(), mode, steps=2)
    assert quiet.first_anomaly is None and not quiet.report.diagnoses
