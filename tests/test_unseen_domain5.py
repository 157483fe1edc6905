"""Unseen-model follow-ups for NW110/NW111: a log whose argument nothing names no longer
gets the softmax/logits recipe when the evidence contradicts it (a negative argument, a
determinant, values that are not probabilities); a naive softplus log(1 + exp(rho)) that
rounded to 0 is named as such, not as a hand-written logsumexp; a Beta log_prob at a
target of exactly 0 blames the target; a float count is fixed like an integer one; a
float16 difference that cancelled to 0 is told apart from a feature that did not vary."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)


def _diag(run) -> nanwatch.Diagnosis:
    with pytest.raises(nanwatch.AnomalyError) as info:
        run()
    return info.value.diagnoses[0]


_PROBABILITY_RECIPE = ("log_softmax", "logsigmoid", "binary_cross_entropy_with_logits")


# ---------------------------------------------------------------- item 1: honest fallback


class _InvConv(nn.Module):
    """Glow's invertible 1x1 convolution, W a rotation-reflection from QR (det = -1)."""

    def __init__(self, c: int, *, healthy: bool) -> None:
        super().__init__()
        q, _ = torch.linalg.qr(torch.randn(c, c))
        if torch.det(q) > 0:  # a reflection: det -1, a valid invertible matrix
            q = q * torch.tensor([-1.0] + [1.0] * (c - 1))
        self.weight = nn.Parameter(q)
        self.healthy = healthy

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = F.conv2d(x, self.weight.unsqueeze(2).unsqueeze(3))
        if self.healthy:
            logdet = 16 * torch.linalg.slogdet(self.weight).logabsdet
        else:
            logdet = 16 * torch.log(torch.det(self.weight))
        return out, logdet


def _flow(mode: str, *, healthy: bool = False) -> None:
    torch.manual_seed(0)
    m = _InvConv(4, healthy=healthy)
    with nanwatch.watch(m, mode=mode) as nw:
        z, logdet = m(torch.randn(8, 4, 4, 4))
        loss = (0.5 * z**2).mean() - logdet.mean()
        loss.backward()
        nw.step()


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_log_of_a_negative_determinant_suggests_slogdet(mode: str) -> None:
    d = _diag(lambda: _flow(mode))
    assert d.code == "NW110"
    assert d.source is not None and d.source.endswith(f":{_line_of('torch.log(torch.det')}")
    text = "\n".join(d.evidence)
    assert "determinant" in text
    assert "logdet = 16 * torch.linalg.slogdet(self.weight).logabsdet" in d.fix
    assert "clamp" not in d.fix.split("#")[0]
    assert not any(r in d.fix for r in _PROBABILITY_RECIPE)
    assert "determinant" in d.explanation and "underflow to exactly 0" not in d.explanation


def test_slogdet_flow_stays_silent() -> None:
    _flow("watch", healthy=True)


def _line_of(snippet: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if snippet in line and "_line_of" not in line:
                return i
    raise AssertionError(snippet)


class _Denoiser(nn.Module):
    """EDM-style conditioning on log(sigma); sigma sampled from a grid with a trailing 0."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(9, 8)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        c_noise = sigma.log() / 4
        return self.net(torch.cat([x, c_noise[:, None]], 1))


def _edm(*, healthy: bool = False) -> None:
    torch.manual_seed(0)
    grid = torch.cat([torch.linspace(80.0, 0.002, 10), torch.zeros(1)])
    if healthy:
        grid = grid[:-1]
    m = _Denoiser()
    with nanwatch.watch(m) as nw:
        sigma = grid[torch.arange(len(grid))]
        loss = m(torch.randn(len(grid), 8), sigma).pow(2).mean()
        loss.backward()
        nw.step()


def test_log_of_a_zero_that_is_no_probability_names_the_values_not_softmax() -> None:
    d = _diag(_edm)
    assert d.code == "NW110"
    assert d.source is not None and d.source.endswith(f":{_line_of('c_noise = sigma.log()')}")
    text = "\n".join(d.evidence)
    assert "sigma is not a probability" in text and "values up to 80" in text
    assert not any(r in d.fix for r in _PROBABILITY_RECIPE)
    assert "c_noise = sigma.clamp_min(torch.finfo(sigma.dtype).tiny).log() / 4" in d.fix
    assert "not a probability" in d.explanation


def test_edm_without_the_zero_sigma_stays_silent() -> None:
    _edm(healthy=True)


def test_log_of_a_negative_value_offers_no_floor_or_probability_recipe() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raw = self.lin(x)
            return torch.log(raw - 5.0)

    torch.manual_seed(0)
    m = Scale()

    def run() -> None:
        with nanwatch.watch(m) as nw:
            m(torch.randn(8, 4)).sum().backward()
            nw.step()

    d = _diag(run)
    assert d.code == "NW110"
    assert "not an underflow" in "\n".join(d.evidence)
    assert "domain error" in d.explanation
    assert not any(r in d.fix for r in _PROBABILITY_RECIPE)
    assert ".clamp_min(" not in d.fix


# ---------------------------------------------------------------- item 2: naive softplus


class _BayesLinear(nn.Module):
    def __init__(self, *, healthy: bool) -> None:
        super().__init__()
        self.w_mu = nn.Parameter(torch.randn(1, 4) * 0.1)
        self.w_rho = nn.Parameter(torch.full((1, 4), -20.0))
        self.healthy = healthy
        self.kl = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.healthy:
            sigma = F.softplus(self.w_rho) + 1e-6
        else:
            sigma = torch.log(1 + torch.exp(self.w_rho))  # exactly 0 in float32
        w = self.w_mu + sigma * torch.randn_like(sigma)
        self.kl = (-torch.log(sigma) + 0.5 * (sigma**2 + self.w_mu**2) - 0.5).sum()
        return F.linear(x, w)


def _bayes(mode: str, *, healthy: bool = False) -> None:
    torch.manual_seed(0)
    m = _BayesLinear(healthy=healthy)
    with nanwatch.watch(m, mode=mode) as nw:
        loss = F.mse_loss(m(torch.randn(8, 4)), torch.randn(8, 1)) + m.kl / 8
        loss.backward()
        nw.step()


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_a_naive_softplus_that_rounded_to_0_is_no_logsumexp(mode: str) -> None:
    d = _diag(lambda: _bayes(mode))
    assert d.code == "NW110"
    text = "\n".join(d.evidence)
    assert "log of a sum of exp() terms" not in text
    assert "softplus written by hand" in d.explanation
    assert "-16.64" in d.explanation  # log(eps / 2) in float32
    if mode == "forensic":
        assert d.source is not None and d.source.endswith(f":{_line_of('self.kl = (-torch.log')}")
        assert "sigma was made by sigma = torch.log(1 + torch.exp(self.w_rho))" in text
        line = d.fix.split("   #")[0]
        assert line == "sigma = F.softplus(self.w_rho) + 1e-6"
    else:
        assert d.fix.startswith("sigma = F.softplus(rho) + 1e-6   # not torch.log(1 + torch.exp")


def test_softplus_bayes_layer_stays_silent() -> None:
    _bayes("watch", healthy=True)


def test_a_log_of_a_sum_of_exps_outside_modules_still_says_logsumexp() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 3)

    def run() -> None:
        with nanwatch.watch(m) as nw:
            z = m(torch.randn(8, 4))
            d0, d1 = z[:, 0] ** 2 + 1, z[:, 1] ** 2 + 1  # distances >= 1
            soft_min = -0.001 * torch.log(torch.exp(-d0 / 0.001) + torch.exp(-d1 / 0.001))
            (soft_min.mean() + 1e4 * (z**2).mean()).backward()
            nw.step()

    d = _diag(run)
    assert d.code == "NW110"
    assert "log of a sum of exp() terms" in "\n".join(d.evidence)
    assert "torch.logsumexp" in d.fix


# ---------------------------------------------------------------- item 5: Beta target at 0


def _beta(mode: str, *, healthy: bool = False) -> None:
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    x = torch.randn(16, 4)
    y = torch.rand(16) * 0.9 + 0.05
    if not healthy:
        y[3] = 0.0  # a fraction k/n with k = 0
    with nanwatch.watch(net, mode=mode) as nw:
        ab = F.softplus(net(x)) + 1e-3
        loss = -torch.distributions.Beta(ab[:, 0], ab[:, 1]).log_prob(y).mean()
        loss.backward()
        nw.step()


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_beta_log_prob_at_a_target_of_0_blames_the_target(mode: str) -> None:
    d = _diag(lambda: _beta(mode))
    assert d.code == "NW110"
    text = "\n".join(d.evidence)
    assert "the value given to Beta.log_prob (y) sits on the edge of the support (0, 1)" in text
    assert not any(r in d.fix for r in _PROBABILITY_RECIPE)
    line = d.fix.split("   #")[0]
    assert line == (
        "loss = -torch.distributions.Beta(ab[:, 0], ab[:, 1]).log_prob(y.clamp("
        "torch.finfo(y.dtype).eps, 1 - torch.finfo(y.dtype).eps)).mean()"
    )
    ab = F.softplus(torch.randn(16, 2)) + 1e-3
    y = torch.tensor([0.0, 1.0, 0.5])
    scope = {"torch": torch, "ab": ab[:3], "y": y}
    exec(line, scope)
    assert torch.isfinite(scope["loss"])


def test_beta_with_targets_inside_0_1_stays_silent() -> None:
    _beta("watch", healthy=True)


# ---------------------------------------------------------------- item 3: a float count


class _Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, h: torch.Tensor, batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
        s = torch.zeros(num_graphs, h.size(1)).index_add_(0, batch, h)
        cnt = torch.bincount(batch, minlength=num_graphs)
        cnt = cnt.to(h.dtype)
        return self.head(s / cnt[:, None])


def test_a_count_held_in_a_float_tensor_is_fixed_like_a_count() -> None:
    torch.manual_seed(0)
    m = _Pool()

    def run() -> None:
        with nanwatch.watch(m) as nw:
            m(torch.randn(5, 4), torch.tensor([0, 0, 0, 2, 2]), 3).sum().backward()
            nw.step()

    d = _diag(run)
    assert d.code == "NW111"
    assert d.source is not None and d.source.endswith(f":{_line_of('self.head(s / cnt[')}")
    text = "\n".join(d.evidence)
    assert "a count held in a float32 tensor" in text and "bincount" in text
    line = d.fix.split("   #")[0]
    assert line == "return self.head(s / cnt[:, None].clamp_min(1))"
    assert "finfo(d.dtype)" not in d.fix


def test_a_float_count_without_empty_groups_stays_silent() -> None:
    torch.manual_seed(0)
    m = _Pool()
    with nanwatch.watch(m) as nw:
        m(torch.randn(5, 4), torch.tensor([0, 0, 1, 2, 2]), 3).sum().backward()
        nw.step()


def test_a_float_std_of_zero_is_not_called_a_count() -> None:
    class Standardize(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x - x.mean(0)) / x.std(0)

    m = nn.Sequential(Standardize(), nn.Linear(3, 1))
    x = torch.randn(6, 3)
    x[:, 1] = 2.0  # a constant feature: std 0, the others are not whole numbers

    def run() -> None:
        with nanwatch.watch(m) as nw:
            m(x).sum().backward()
            nw.step()

    d = _diag(run)
    assert d.code == "NW111"
    assert "a count held in" not in "\n".join(d.evidence)
    assert "clamp_min(1)" not in d.fix


# ---------------------------------------------------------------- item 4: float16 cancellation


class _Diffusion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 8)
        betas = torch.linspace(1e-4, 0.02, 100, dtype=torch.float64)
        self.register_buffer("alphas_cumprod", torch.cumprod(1 - betas, 0).float())

    def forward(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ab = self.alphas_cumprod[t][:, None]
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        x0_hat = self.net(xt)
        eps_hat = (xt - ab.sqrt() * x0_hat) / (1 - ab).sqrt()
        return (eps_hat.float() - noise.float()).pow(2).mean()


def _fp16_diffusion(*, first_t: int) -> None:
    torch.manual_seed(0)
    m = _Diffusion().half()
    x0 = torch.randn(16, 8).half()
    t = torch.randint(5, 100, (16,))
    t[3] = first_t
    noise = torch.randn(16, 8).half()
    with nanwatch.watch(m) as nw:
        m(x0, t, noise).backward()
        nw.step()


def test_a_float16_difference_that_cancelled_to_0_says_keep_it_in_float32() -> None:
    assert (1 - _Diffusion().half().alphas_cumprod[0]).item() == 0.0  # 0.9999 -> 1.0
    d = _diag(lambda: _fp16_diffusion(first_t=0))
    assert d.code == "NW111"
    assert "float16 difference cancelled to 0" in d.title
    assert d.source is not None and d.source.endswith(f":{_line_of('eps_hat = (xt - ab.sqrt()')}")
    text = "\n".join(d.evidence)
    assert "is made by 1 - ab in float16" in text
    assert "ab is read from self.alphas_cumprod" in text
    assert "did not vary" not in d.explanation and "float32" in d.explanation
    assert "keep it float32" in d.fix
    assert d.fix.split("   #")[0] == (
        "eps_hat = (xt - ab.sqrt() * x0_hat) / (1 - ab.float()).sqrt()"
    )
    assert "whose eps is 0.000977" in text  # torch.finfo(torch.float16).eps


def test_float16_diffusion_away_from_t0_stays_silent() -> None:
    _fp16_diffusion(first_t=50)
