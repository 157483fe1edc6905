"""Unseen models: a diffusion model's noise schedule whose alpha_bar (a cumulative product
of 1 - beta) reaches exactly 0 -- a linear schedule that ends at beta = 1, a cosine
schedule without the usual clipping -- or exactly 1 (a first beta of 0). The batch's
timesteps pick those entries for a few items, and x / sqrt(alpha_bar), rsqrt(alpha_bar)
or x / sqrt(1 - alpha_bar) is inf there. The story follows the data: the zero operand is
an entry of the schedule table read at the timesteps, the table is built by a cumprod,
and the fix clips the betas where it is built (or leaves those timesteps out), never an
eps for a standard deviation or a padding row."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

MODES = ["watch", "sentinel", "forensic"]


class Eps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None].float() / 100], 1))


class Linear(nn.Module):
    """Predicts the noise; x0 is recovered by dividing by sqrt(alpha_bar)."""

    def __init__(self, beta_end: float) -> None:
        super().__init__()
        self.eps = Eps()
        betas = torch.linspace(1e-4, beta_end, 50)
        self.register_buffer("alphas_bar", torch.cumprod(1 - betas, 0))

    def forward(self, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ab = self.alphas_bar[t][:, None]
        noise = torch.randn_like(x0)
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        eps = self.eps(xt, t)
        x0_pred = (xt - (1 - ab).sqrt() * eps) / ab.sqrt()
        return F.mse_loss(eps, noise) + 0.1 * F.mse_loss(x0_pred, x0)


def _cosine_betas(steps: int, clip: bool) -> torch.Tensor:
    s = torch.arange(steps + 1, dtype=torch.float32)
    f = torch.cos((s / steps + 0.008) / 1.008 * math.pi / 2) ** 2
    betas = 1 - (f / f[0])[1:] / (f / f[0])[:-1]
    return betas.clamp(max=0.999) if clip else betas


def extract(a: torch.Tensor, t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return a.gather(-1, t).reshape(t.shape[0], *((1,) * (len(shape) - 1)))


class Cosine(nn.Module):
    """Reads alpha_bar through a gather helper and takes its rsqrt."""

    def __init__(self, clip: bool) -> None:
        super().__init__()
        self.eps = Eps()
        self.alphas_bar = torch.cumprod(1 - _cosine_betas(50, clip), dim=0)

    def forward(self, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = extract(self.alphas_bar, t, x0.shape)
        noise = torch.randn_like(x0)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        eps = self.eps(xt, t)
        x0_pred = (xt - (1 - a).sqrt() * eps) * torch.rsqrt(a)
        return F.mse_loss(eps, noise) + 0.01 * F.mse_loss(x0_pred, x0)


class Snr(nn.Module):
    """Divides by sqrt(1 - alpha_bar): its first entry is 1 when the first beta is 0."""

    def __init__(self, beta_start: float) -> None:
        super().__init__()
        self.eps = Eps()
        alphas = 1 - torch.linspace(beta_start, 0.02, 50)
        self.register_buffer("alphas_bar", torch.cumprod(alphas, 0))

    def forward(self, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ab = self.alphas_bar[t][:, None]
        noise = torch.randn_like(x0)
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        eps = self.eps(xt, t)
        score = -eps / (1 - ab).sqrt()
        return F.mse_loss(eps, noise) + 0.1 * score.pow(2).mean()


class LogWeighted(nn.Module):
    """Weights the loss by -log(alpha_bar)."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = Eps()
        self.register_buffer("alphas_bar", torch.cumprod(1 - torch.linspace(1e-4, 1.0, 50), 0))

    def forward(self, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ab = self.alphas_bar[t][:, None]
        noise = torch.randn_like(x0)
        eps = self.eps(ab.sqrt() * x0 + (1 - ab).sqrt() * noise, t)
        w = -torch.log(ab)
        return (w * (eps - noise) ** 2).mean()


class LogSnr(nn.Module):
    """Weights the loss by the log signal-to-noise ratio, a logit of alpha_bar by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = Eps()
        self.register_buffer("alphas_bar", torch.cumprod(1 - torch.linspace(1e-4, 1.0, 50), 0))

    def forward(self, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ab = self.alphas_bar[t][:, None]
        noise = torch.randn_like(x0)
        eps = self.eps(ab.sqrt() * x0 + (1 - ab).sqrt() * noise, t)
        log_snr = torch.log(ab) - torch.log(1 - ab)
        return (log_snr * (eps - noise) ** 2).mean()


T = torch.tensor([0, 10, 25, 49] * 2)


def _train(model: nn.Module, mode: str) -> None:
    torch.manual_seed(0)
    x0 = torch.randn(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanwatch.watch(model, mode=mode, postmortem=False) as nw:
        model(x0, T).backward()
        opt.step()
        opt.zero_grad()
        nw.step()


def _diag(model: nn.Module, mode: str) -> nanwatch.Diagnosis:
    torch.manual_seed(0)
    with pytest.raises(nanwatch.AnomalyError) as info:
        _train(model, mode)
    return info.value.diagnoses[0]


def _no_other_story(d: nanwatch.Diagnosis) -> None:
    for wrong in ("padding", "standard deviation", "RMSNorm", "count of selected"):
        assert wrong not in d.explanation and wrong not in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_a_schedule_that_ends_at_beta_1_is_named_as_a_zero_table_entry(mode: str) -> None:
    torch.manual_seed(0)
    d = _diag(Linear(beta_end=1.0), mode)
    assert d.code == "NW111"
    assert d.title == "Division by zero: self.alphas_bar[t] is 0 for some t"
    text = "\n".join(d.evidence)
    assert (
        "the denominator ab.sqrt() is an entry of the table self.alphas_bar read at the "
        "indices t (ab = self.alphas_bar[t][:, None])" in text
    )
    assert (
        "2 of the 8 values are exactly 0: the entries of self.alphas_bar read for them are 0"
        in (text)
    )
    assert 'self.register_buffer("alphas_bar", torch.cumprod(1 - betas, 0))' in text
    assert "an integer tensor of 8 values (input[1], int64), as many as the values read" in text
    assert "1 - betas = 0 where betas = 1" in d.explanation
    _no_other_story(d)
    first, *rest = d.fix.splitlines()
    line = first.split("   #")[0]
    assert line == (
        'self.register_buffer("alphas_bar", torch.cumprod(1 - betas.clamp(max=0.999), 0))'
    )
    assert "# or leave those indices out: draw t below int((self.alphas_bar > 0).sum())" in rest
    # the pasted line builds a table with no entry of 0, the healthy steps unchanged
    betas = torch.linspace(1e-4, 1.0, 50)
    buffers: dict[str, torch.Tensor] = {}
    scope = {
        "torch": torch,
        "betas": betas,
        "self": type("M", (), {"register_buffer": lambda _, k, v: buffers.__setitem__(k, v)})(),
    }
    exec(line, scope)
    fixed = buffers["alphas_bar"]
    assert (fixed > 0).all()
    assert torch.equal(fixed[:40], torch.cumprod(1 - betas, 0)[:40])


@pytest.mark.parametrize("mode", MODES)
def test_an_unclipped_cosine_schedule_read_by_a_gather_is_named_at_the_rsqrt(mode: str) -> None:
    d = _diag(Cosine(clip=False), mode)
    assert d.code == "NW112"
    assert d.title.endswith(": self.alphas_bar[t] is 0 for some t")
    text = "\n".join(d.evidence)
    assert (
        "the input of the root a is an entry of the table self.alphas_bar read at the indices "
        "t (a = extract(self.alphas_bar, t, x0.shape))" in text
    )
    assert "self.alphas_bar = torch.cumprod(1 - _cosine_betas(50, clip), dim=0)" in text
    assert "rsqrt(0) = 1 / sqrt(0) is inf" in d.explanation
    _no_other_story(d)
    line = d.fix.splitlines()[0].split("   #")[0]
    assert line == (
        "self.alphas_bar = torch.cumprod(1 - _cosine_betas(50, clip).clamp(max=0.999), dim=0)"
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_first_beta_of_0_makes_1_minus_alpha_bar_0(mode: str) -> None:
    d = _diag(Snr(beta_start=0.0), mode)
    assert d.code == "NW111"
    assert d.title == "Division by zero: 1 - self.alphas_bar[t] is 0 for some t"
    text = "\n".join(d.evidence)
    assert "the entries of self.alphas_bar read for them are 1, and 1 - 1 = 0" in text
    _no_other_story(d)
    first, second, *_ = d.fix.splitlines()
    line = first.split("   #")[0]
    assert line == "alphas = alphas.clamp(max=1 - torch.finfo(torch.float32).eps)"
    assert (
        second == "# or leave those indices out: draw t from int((self.alphas_bar == 1).sum()) on"
    )
    scope = {"torch": torch, "alphas": 1 - torch.linspace(0.0, 0.02, 50)}
    exec(line, scope)
    assert (1 - torch.cumprod(scope["alphas"], 0) > 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_the_log_of_a_zero_alpha_bar_is_named_as_a_table_entry(mode: str) -> None:
    d = _diag(LogWeighted(), mode)
    assert d.code == "NW110"
    assert d.title == "Log of zero or of a negative number: self.alphas_bar[t] is 0 for some t"
    assert "the input of the log ab is an entry of the table self.alphas_bar" in "\n".join(
        d.evidence
    )
    assert "probability" not in d.explanation and "log(0) is -inf" in d.explanation
    line = d.fix.splitlines()[0].split("   #")[0]
    assert line == (
        'self.register_buffer("alphas_bar", torch.cumprod(1 - torch.linspace(1e-4, 1.0, '
        "50).clamp(max=0.999), 0))"
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_log_snr_by_hand_of_a_zero_alpha_bar_is_told_as_the_table_not_pixels(
    mode: str,
) -> None:
    d = _diag(LogSnr(), mode)
    assert d.code == "NW110"
    assert "pixel" not in d.explanation.lower() and "pixel" not in d.fix.lower()
    assert "ab is read from the table self.alphas_bar at the indices t" in d.explanation
    assert "a logit of self.alphas_bar[t]" in "\n".join(d.evidence)
    first, second = d.fix.splitlines()[:2]
    assert first.startswith("log_snr = torch.logit(ab, eps=torch.finfo(ab.dtype).eps)")
    assert second.startswith("# or keep self.alphas_bar's entries inside (0, 1) where it is ")
    assert "test_unseen_schedule.py:" in second


@pytest.mark.parametrize(
    "model", [lambda: Linear(beta_end=0.02), lambda: Cosine(clip=True), lambda: Snr(1e-4)]
)
def test_schedules_kept_off_0_and_1_stay_silent(model: object) -> None:
    assert callable(model)
    _train(model(), "watch")


def test_a_zero_std_is_still_told_as_a_feature_that_did_not_vary() -> None:
    """A denominator made in the line, read from no table: the old story."""
    lin = nn.Linear(4, 4)

    def run() -> None:
        with nanwatch.watch(lin, postmortem=False) as nw:
            h = lin(torch.randn(6, 4))
            x = torch.cat([h[:, :3], torch.ones(6, 1)], 1)
            z = (x - x.mean(0)) / x.std(0)
            z.sum().backward()
            nw.step()

    with pytest.raises(nanwatch.AnomalyError) as info:
        run()
    d = info.value.diagnoses[0]
    assert d.code == "NW111" and "for some" not in d.title
    assert "table" not in "\n".join(d.evidence)
