"""NW101 on models found by user testing: a learned log-scale initialised to the scale
itself (CLIP's ``logit_scale = 100``) is a bad initialisation, not a drift, and its fix
initialises the log; an NT-Xent written by hand (exp, then a ratio of sums over later
lines) gets the stable form, not a clamp; LBFGS's own iterations inside one step() are an
update; and the diagnosis of the anomaly's birth op is the top one, ahead of a loss whose
value stayed finite.

Each runs a tiny real model under ``nanwatch.watch`` on CPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines, text, top

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reports(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)


# ------------------------------------- 1: a log-scale initialised to the scale itself


class _Clip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Linear(8, 4)
        self.txt = nn.Linear(8, 4)
        self.logit_scale = nn.Parameter(torch.tensor(100.0))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        i = F.normalize(self.img(a), dim=-1)
        t = F.normalize(self.txt(b), dim=-1)
        logit_scale = self.logit_scale.exp()
        return logit_scale * i @ t.t()


def test_log_scale_initialised_to_the_scale_gets_a_log_init_not_a_clamp_at_the_bound() -> None:
    torch.manual_seed(0)
    model = _Clip()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(6, 8)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model) as nw:
        loss = F.cross_entropy(model(x, x), torch.arange(6))
        loss.backward()
        opt.step()
        nw.step()
    d = top(nw)
    assert d.code == "NW101" and d.step == 0
    t = text(d)
    assert "drifted up" not in t  # no update came before: nothing drifted
    assert "initialised to the quantity itself" in t
    assert "self.logit_scale = nn.Parameter(torch.tensor(math.log(100.0)))" in d.fix
    assert "clamp(max=44.3)" not in d.fix
    assert "self.logit_scale.clamp(max=math.log(100.0)).exp()" in d.fix
    # no line of made-up names (std, raw) the user's code does not have
    assert "raw" not in code_lines(d.fix) and "std =" not in d.fix


# ---------------------------------------- 2: NT-Xent by hand: exp, then a ratio of sums


class _NTXent(nn.Module):
    def __init__(self, tau: float) -> None:
        super().__init__()
        self.tau = tau

    def forward(self, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
        z = F.normalize(torch.cat([z1, z2]), dim=1)
        n = z1.shape[0]
        sim = torch.exp(z @ z.t() / self.tau)
        mask = ~torch.eye(2 * n, dtype=torch.bool)
        pos = torch.cat([torch.diag(sim, n), torch.diag(sim, -n)])
        denom = (sim * mask).sum(1)
        return -torch.log(pos / denom).mean()


def test_hand_written_nt_xent_gets_the_stable_form_not_a_clamp() -> None:
    torch.manual_seed(0)
    enc = nn.Linear(8, 4)
    crit = _NTXent(tau=0.005)
    x = torch.randn(4, 8)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(enc, crit) as nw:
        crit(enc(x), enc(x + 0.1)).backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101" and d.op == "aten.exp"
    assert ".clamp(max=" not in d.fix
    assert "amax(dim=-1, keepdim=True)" in d.fix  # the row max subtracted
    assert "F.cross_entropy(z @ z.t() / self.tau" in d.fix
    assert any("normalized at" in e and "pos / denom" in e for e in d.evidence)
    assert "softmax or logsumexp written by hand" in d.explanation


def test_exp_times_a_loss_summed_is_still_a_bare_exp() -> None:
    """A precision-weighted loss (exp(-s) * l + s, summed) divides nothing by a sum of the
    exp: it is not a softmax, and keeps its clamp."""

    class Weighted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.tensor(-100.0))

        def forward(self, y: torch.Tensor) -> torch.Tensor:
            w = torch.exp(-self.s)
            total = (w * y + self.s).sum()
            return total / y.numel()

    m = Weighted()
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(m) as nw:
        m(torch.ones(3)).backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101" and ".clamp(" in d.fix and "amax" not in d.fix


# --------------------------------- 3: LBFGS moves the weights inside its own step()


def test_lbfgs_inner_iterations_are_an_update_not_the_initial_weights() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    log_d = nn.Parameter(torch.tensor(0.0))
    net.register_parameter("log_d", log_d)
    x = torch.rand(20, 2)
    y = torch.rand(20, 1)
    opt = torch.optim.LBFGS(net.parameters(), lr=200.0, max_iter=10)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (torch.exp(net.log_d) - 10.0).abs() + ((net(x) - y) ** 2).mean()
        loss.backward()
        return loss

    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(net) as nw:
        for _ in range(3):
            opt.step(closure)
            nw.step()
    d = top(nw)
    assert d.code == "NW101" and d.step == 0
    t = text(d)
    assert "before any optimizer update" not in t
    assert "inside LBFGS.step()" in t and "own iterations moved the weights" in t
    assert 'line_search_fn"] = "strong_wolfe"' in d.fix
    assert 'g["lr"] = 20   # was 200 (LBFGS)' in d.fix


# ------------------------------- 4: the birth op's diagnosis first, not a finite loss's


class _Vae(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 8)
        self.dec = nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * 100
        return torch.sigmoid(self.dec(z) * 100), mu, logvar


def test_birth_op_diagnosis_comes_before_a_finite_bce_saturation() -> None:
    torch.manual_seed(0)
    vae = _Vae()
    with torch.no_grad():
        vae.enc.bias[4:].fill_(120.0)  # logvar of 120: exp overflows float32
    x = (torch.rand(8, 16) > 0.5).float()
    bce = nn.BCELoss(reduction="sum")
    with pytest.raises(nanwatch.AnomalyError) as err, nanwatch.watch(vae) as nw:
        x_hat, mu, logvar = vae(x)
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        (bce(x_hat, x) + kl).backward()
        nw.step()
    codes = [d.code for d in top(nw) and nw.history[0].diagnoses]
    assert "NW201" in codes  # the saturated BCE is still said, second
    assert codes[0] == "NW101" and top(nw).op == "aten.exp"
    assert err.value.diagnoses[0].code == "NW101"
    assert nw.report.top is not None and nw.report.top.code == "NW101"
    assert math.isfinite(nw.report.top.priority)
