"""Generative and density models, each run in sentinel, watch and forensic:

- a mixture density network whose scale is ``sigma = F.elu(self.sig(h)) + 1`` and whose NLL
  divides by it in the model's own forward: forensic (and every mode that reads the line)
  said "the denominator underflowed to 0" with linear attention's eps fix; it is the
  elu(x) + 1 that rounded to 0, and the fix rewrites the user's scale with a softplus;
- a RealNVP affine coupling ``y2 = x2 * torch.exp(s) + t`` whose exp overflows one update
  after Adam at lr 0.2 moved the weights by more than their size: the fix leads with the
  learning rate, the clamp only as a guard;
- a diffusion schedule built as ``1 - cumsum(betas)`` (negative past some t) whose
  ``ab.sqrt()`` is NaN: the base has no autograd history, so not softplus (nothing is
  learned) but a check where the table is built;
- a flow's ``log(|det W|)`` of a large invertible matrix whose det underflows to 0: slogdet,
  not an eps (log(eps) replaces the true log|det|).

Each has a healthy control: the fixed code trains clean."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)

MODES = ["sentinel", "watch", "forensic"]
_ELU_BOUND = math.log(torch.finfo(torch.float32).eps / 4)


def _run(model: nn.Module, mode: str, step, steps: int, lr: float = 1e-3) -> nanwatch.Watcher:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            loss = step(model)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            if nw.report.diagnoses:
                break
    return nw


# ------------------------------------------------------------------ 1: MDN, elu(x) + 1
class _Mdn(nn.Module):
    def __init__(self, bias: float, softplus: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, 32), nn.Tanh())
        self.pi = nn.Linear(32, 3)
        self.mu = nn.Linear(32, 3)
        self.sig = nn.Linear(32, 3)
        self.softplus = softplus
        with torch.no_grad():
            self.sig.bias.fill_(bias)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        logpi = F.log_softmax(self.pi(h), -1)
        mu = self.mu(h)
        if self.softplus:  # noqa: SIM108  (the scale's own statement is what the fix rewrites)
            sigma = F.softplus(self.sig(h)) + 1e-3
        else:
            sigma = F.elu(self.sig(h)) + 1
        z = (y - mu) / sigma
        logp = logpi - 0.5 * z**2 - torch.log(sigma) - 0.5 * math.log(2 * math.pi)
        return -torch.logsumexp(logp, -1).mean()


class _TanhMdn(_Mdn):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        sigma = torch.tanh(self.sig(h)) + 1
        z = (y - self.mu(h)) / sigma
        logp = F.log_softmax(self.pi(h), -1) - 0.5 * z**2 - torch.log(sigma)
        return -torch.logsumexp(logp, -1).mean()


def _mdn_step(model: nn.Module) -> torch.Tensor:
    y = torch.rand(64, 1) * 2 - 1
    return model(y + 0.1 * torch.randn(64, 1), y)


@pytest.mark.parametrize("mode", MODES)
def test_an_mdn_scale_elu_plus_one_that_rounded_to_zero_is_named_in_every_mode(mode: str) -> None:
    torch.manual_seed(0)
    nw = _run(_Mdn(bias=_ELU_BOUND - 3), mode, _mdn_step, steps=2)
    d = nw.report.diagnoses[0]
    assert (d.code, d.title) == ("NW111", "Division by zero: elu(x) + 1 rounded to 0"), d
    said = " ".join(d.evidence)
    assert "the denominator is elu(x) + 1 (made by add <- elu <- addmm" in said, said
    assert "linear attention" not in d.explanation
    first = d.fix.splitlines()[0]
    assert first.startswith(
        "sigma = F.softplus(self.sig(h)) + 1e-3   # was sigma = F.elu(self.sig(h)) + 1"
    ), d.fix
    assert "sigma + 1e-6" not in d.fix


def test_a_partly_saturated_elu_scale_says_how_many_values_are_zero() -> None:
    torch.manual_seed(0)
    model = _Mdn(bias=_ELU_BOUND)
    with torch.no_grad():
        model.sig.weight.mul_(20)
    nw = _run(model, "forensic", _mdn_step, steps=2)
    d = nw.report.diagnoses[0]
    assert d.title == "Division by zero: elu(x) + 1 rounded to 0", d
    zeros, numel = d.evidence[0].split(" exact zeros")[0].split()[-1], 192
    assert int(zeros) < numel
    assert d.explanation.startswith(f"{zeros} of this denominator's {numel} values are exactly 0")


@pytest.mark.parametrize("mode", MODES)
def test_a_tanh_plus_one_scale_gets_its_own_statement_rewritten(mode: str) -> None:
    torch.manual_seed(0)
    bound = 0.5 * math.log(torch.finfo(torch.float32).eps / 8)
    nw = _run(_TanhMdn(bias=bound - 3), mode, _mdn_step, steps=2)
    d = nw.report.diagnoses[0]
    assert d.title == "Division by zero: tanh(x) + 1 rounded to 0", d
    assert d.fix.splitlines()[0].startswith(
        "sigma = F.softplus(self.sig(h)) + 1e-3   # was sigma = torch.tanh(self.sig(h)) + 1"
    ), d.fix


@pytest.mark.parametrize("mode", MODES)
def test_the_softplus_scale_trains_clean(mode: str) -> None:
    torch.manual_seed(0)
    nw = _run(_Mdn(bias=_ELU_BOUND - 3, softplus=True), mode, _mdn_step, steps=3)
    assert nw.report.diagnoses == []


# ------------------------------------------------------- 2: RealNVP, lr too large for exp
class _Coupling(nn.Module):
    def __init__(self, d: int, flip: bool) -> None:
        super().__init__()
        self.flip = flip
        self.net = nn.Sequential(nn.Linear(d // 2, 64), nn.ReLU(), nn.Linear(64, d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x1, x2 = x.chunk(2, dim=1)
        if self.flip:
            x1, x2 = x2, x1
        s, t = self.net(x1).chunk(2, dim=1)
        y2 = x2 * torch.exp(s) + t
        y = torch.cat([y2, x1] if self.flip else [x1, y2], dim=1)
        return y, s.sum(dim=1)


class _RealNvp(nn.Module):
    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Coupling(d, i % 2 == 1) for i in range(n))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logdet = x.new_zeros(x.shape[0])
        for layer in self.layers:
            x, ld = layer(x)
            logdet = logdet + ld
        return x, logdet


def _nvp_step(model: nn.Module) -> torch.Tensor:
    z, logdet = model(torch.randn(256, 8))
    return (0.5 * (z**2).sum(dim=1) - logdet).mean()


@pytest.mark.parametrize("mode", MODES)
def test_a_coupling_exp_that_overflows_after_an_oversized_update_leads_with_the_lr(
    mode: str,
) -> None:
    torch.manual_seed(0)
    nw = _run(_RealNvp(), mode, _nvp_step, steps=10, lr=0.2)
    d = nw.report.diagnoses[0]
    assert (d.code, d.op, d.step) == ("NW101", "aten.exp", 1), d
    said = " ".join(d.evidence)
    assert "the update at step 0 (Adam, param group 0, lr 0.2) moved layers." in said, said
    lines = d.fix.splitlines()
    assert 'param_groups[0]["lr"] = 1e-3   # was 0.2 (Adam)' in lines[0], d.fix
    assert lines[1].startswith("# only as a guard, after the lr: y2 = x2 * torch.exp(s.clamp("), (
        d.fix
    )
    assert "the learning rate is too large" in d.explanation
    assert "drifted up" not in d.explanation


@pytest.mark.parametrize("mode", MODES)
def test_the_coupling_flow_at_a_usual_lr_trains_clean(mode: str) -> None:
    torch.manual_seed(0)
    nw = _run(_RealNvp(), mode, _nvp_step, steps=30, lr=1e-3)
    assert nw.report.diagnoses == []


# ------------------------------------------- 3: diffusion, a schedule with negative entries
_T = 1000
_BETAS = torch.linspace(1e-4, 0.02, _T)
_WRONG_ALPHA_BAR = 1.0 - torch.cumsum(_BETAS, dim=0)  # a sum of betas: negative past t ~ 100
_ALPHA_BAR = torch.cumprod(1.0 - _BETAS, dim=0)


class _Denoiser(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d + 1, 64), nn.SiLU(), nn.Linear(64, d))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None].float() / _T], dim=1))


def _diffusion_step(alpha_bar: torch.Tensor):
    def step(model: nn.Module) -> torch.Tensor:
        x0 = torch.randn(128, 8)
        t = torch.randint(0, _T, (128,))
        noise = torch.randn_like(x0)
        ab = alpha_bar[t][:, None]
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        return F.mse_loss(model(xt, t), noise)

    return step


def test_a_root_of_a_schedule_with_negative_entries_is_checked_where_it_is_built() -> None:
    torch.manual_seed(0)
    nw = _run(_Denoiser(), "forensic", _diffusion_step(_WRONG_ALPHA_BAR), steps=2)
    d = nw.report.diagnoses[0]
    assert (d.code, d.op) == ("NW112", "aten.sqrt"), d
    said = " ".join(d.evidence)
    assert "the base has no autograd history (made by unsqueeze <- index" in said, said
    assert "ab = alpha_bar[t][:, None] reads alpha_bar" in said, said
    assert d.fix.splitlines()[0].startswith("assert (alpha_bar >= 0).all(), alpha_bar.min()")
    assert "softplus" not in d.fix
    assert "not a network output" in said and "nothing here is learned" in d.explanation


@pytest.mark.parametrize("mode", MODES)
def test_the_cumprod_schedule_trains_clean(mode: str) -> None:
    torch.manual_seed(0)
    nw = _run(_Denoiser(), mode, _diffusion_step(_ALPHA_BAR), steps=3)
    assert nw.report.diagnoses == []


# ------------------------------------------- 4: a flow's log|det W| that underflowed to 0
class _Invertible(nn.Module):
    def __init__(self, d: int, slogdet: bool = False) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.linalg.qr(torch.randn(d, d))[0] * 0.7)
        self.slogdet = slogdet

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = x @ self.W.T
        if self.slogdet:
            logdet = torch.linalg.slogdet(self.W).logabsdet
        else:
            logdet = torch.log(torch.abs(torch.det(self.W)))
        return z, logdet.expand(x.shape[0])


def _flow_step(model: nn.Module) -> torch.Tensor:
    z, logdet = model(torch.randn(32, 256))
    return (0.5 * (z**2).sum(dim=1) - logdet).mean()


@pytest.mark.parametrize("mode", MODES)
def test_the_log_of_a_determinant_that_underflowed_leads_with_slogdet(mode: str) -> None:
    torch.manual_seed(0)
    nw = _run(_Invertible(256), mode, _flow_step, steps=2, lr=1e-4)
    d = nw.report.diagnoses[0]
    assert (d.code, d.title) == ("NW110", "Log of a determinant that reached 0"), d
    first = d.fix.splitlines()[0]
    assert first.startswith("logdet = torch.linalg.slogdet(self.W).logabsdet"), d.fix
    assert "not an eps inside the log" in d.fix
    assert "torch.linalg.slogdet sums the logs of the pivots" in d.explanation


@pytest.mark.parametrize("mode", MODES)
def test_the_slogdet_flow_trains_clean(mode: str) -> None:
    torch.manual_seed(0)
    nw = _run(_Invertible(256, slogdet=True), mode, _flow_step, steps=3, lr=1e-4)
    assert nw.report.diagnoses == []


def test_without_the_line_the_graph_still_names_the_determinant() -> None:
    """sentinel, the log in a submodule called by index (``flows[0](x)``): the line is not
    read, the loss graph shows log <- abs <- linalgdet."""
    torch.manual_seed(0)
    flows = nn.ModuleList([_Invertible(256)])
    opt = torch.optim.Adam(flows.parameters(), lr=1e-4)
    with nanwatch.watch(flows, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        loss = _flow_step(flows[0])
        loss.backward()
        opt.step()
        nw.step()
    d = nw.report.diagnoses[0]
    assert d.title == "Log of a determinant that reached 0", d
    assert d.fix.splitlines()[0].startswith("torch.linalg.slogdet(M).logabsdet   # in place of")


# ------------------------------- 5: a GAN discriminator's log(D(real)) + log(1 - D(fake))
def _gan(mode: str, logits: bool) -> nanwatch.Watcher:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    layers = [nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1)]
    D = nn.Sequential(*layers) if logits else nn.Sequential(*layers, nn.Sigmoid())
    og = torch.optim.Adam(G.parameters(), lr=0.05)
    od = torch.optim.Adam(D.parameters(), lr=0.05)
    with nanwatch.watch([G, D], mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(40):
            real = torch.randn(128, 2) * 0.5 + 20.0
            fake = G(torch.randn(128, 8))
            if logits:
                d_loss = -(F.logsigmoid(D(real)) + F.logsigmoid(-D(fake.detach()))).mean()
            else:
                d_loss = -(torch.log(D(real)) + torch.log(1 - D(fake.detach()))).mean()
            od.zero_grad()
            d_loss.backward()
            od.step()
            g_loss = -(F.logsigmoid(D(fake)) if logits else torch.log(D(fake))).mean()
            og.zero_grad()
            g_loss.backward()
            og.step()
            nw.step()
            if nw.report.diagnoses:
                break
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_a_discriminator_loss_by_hand_leads_with_logsigmoid_of_the_logits(mode: str) -> None:
    d = _gan(mode, logits=False).report.diagnoses[0]
    assert d.code == "NW110", d
    assert (
        d.title == "Log of zero in a hand-written binary cross-entropy: the sigmoid saturated at 1"
    )
    assert "clamp" not in d.fix.splitlines()[0] and "logsigmoid" in d.fix, d.fix
    if mode == "forensic":  # the line is read: rewritten in the user's names
        own = [ln for ln in d.fix.splitlines() if ln.startswith("d_loss = ")]
        assert own and own[0].startswith(
            "d_loss = -(F.logsigmoid(D(real)) + F.logsigmoid(-D(fake.detach()))).mean()"
        ), d.fix


@pytest.mark.parametrize("mode", MODES)
def test_the_discriminator_on_logits_trains_clean(mode: str) -> None:
    assert _gan(mode, logits=True).report.diagnoses == []
