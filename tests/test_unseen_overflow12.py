"""Found by user testing: a hand-written Cox partial likelihood, log(cumsum(exp(risk))),
gets torch.logcumsumexp (a clamp of the exp makes the loss unbounded below), and a
risk-set sum of exps under a mask whose log a later line takes gets torch.logsumexp over
x + log(mask).

Each runs a tiny real model under ``nanwatch.watch`` on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import top

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reports(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)


# ------------------------------------------- 1: log(cumsum(exp(x))) is logcumsumexp


def _cox_loss(risk: torch.Tensor, event: torch.Tensor) -> torch.Tensor:
    risk = risk.squeeze(-1)
    log_risk_set = torch.log(torch.cumsum(torch.exp(risk), 0))
    return -((risk - log_risk_set) * event).sum() / event.sum()


def test_log_cumsum_exp_gets_logcumsumexp_not_a_clamp() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(30.0)
    x, e = torch.randn(16, 4) * 3, (torch.rand(16) < 0.6).float()
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model, mode="forensic") as nw:
        _cox_loss(model(x), e).backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101" and d.op == "aten.exp"
    assert d.fix.startswith("log_risk_set = torch.logcumsumexp(risk, 0)")
    assert "clamp(" not in d.fix.splitlines()[0]


class _CoxPHLoss(nn.Module):
    def forward(self, risk: torch.Tensor, t: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        risk = risk.squeeze(-1)
        at_risk = (t[None, :] >= t[:, None]).float()
        denom = (at_risk * torch.exp(risk)[None, :]).sum(1)
        return -((risk - torch.log(denom)) * e).sum() / e.sum().clamp_min(1)


def test_masked_sum_of_exps_then_log_gets_logsumexp_with_log_mask() -> None:
    torch.manual_seed(0)
    model, crit = nn.Sequential(nn.Linear(4, 1)), _CoxPHLoss()
    with torch.no_grad():
        model[0].weight.fill_(30.0)
    x, t, e = torch.randn(16, 4) * 3, torch.rand(16), (torch.rand(16) < 0.5).float()
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model, crit) as nw:
        crit(model(x), t, e).backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101" and d.op == "aten.exp"
    first = d.fix.splitlines()[0]
    assert first.startswith("log_denom = torch.logsumexp(risk[None, :] + torch.log(at_risk), 1)"), (
        d.fix
    )
    assert "use log_denom where" in d.fix and "torch.log(denom)" in d.fix
    # the suggested line is the same value as the user's log of the masked sum
    risk, at_risk = torch.randn(5), (t[None, :5] >= t[:5, None]).float()
    want = torch.log((at_risk * torch.exp(risk)[None, :]).sum(1))
    got = torch.logsumexp(risk[None, :] + torch.log(at_risk), 1)
    assert torch.allclose(want, got)


def test_unlocated_exp_fix_mentions_log_space_for_summed_exps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(30.0)
    x, e = torch.randn(16, 4) * 3, (torch.rand(16) < 0.6).float()
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model) as nw:
        _cox_loss(model(x), e).backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101"
    assert "torch.logcumsumexp" in d.fix or "torch.logsumexp" in d.fix


# ---------------------- 2: a float16 module moved to float32 gets nested inputs cast too


class _Cell(nn.Module):
    """An LSTM-like cell whose state c grows past float16's max over the steps."""

    def __init__(self) -> None:
        super().__init__()
        self.ih = nn.Linear(2, 8)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _, c = state
        g = torch.relu(self.ih(x))
        c = c + g * 30000.0
        return torch.tanh(c), c


class _Loop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = _Cell(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = x.new_zeros(x.shape[0], 8)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.head(h)


def test_float16_cell_fix_casts_nested_state_and_keeps_an_overflowing_output() -> None:
    torch.manual_seed(0)
    model = _Loop().half()
    with torch.no_grad():
        model.cell.ih.bias.fill_(1.0)
    x = torch.randn(2, 6, 2).half()
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model, mode="forensic") as nw:
        model(x).float().sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101" and d.path == "cell"
    assert d.fix.startswith("model.cell.float()")
    assert "register_forward_pre_hook(lambda m, args: torch.utils._pytree.tree_map(" in d.fix
    assert "out.to(" not in d.fix  # never .to() on what may be a tuple
    assert "no hook casting its outputs back" in d.fix
    # the fix's lines, pasted, run: the nested float16 state reaches the float32 cell
    ns: dict[str, object] = {"torch": torch, "model": model}
    code = "\n".join(ln for ln in d.fix.splitlines() if not ln.lstrip().startswith("#"))
    exec(code.split("# or")[0], ns)
    _, c = model.cell(x[:, 0], (x.new_zeros(2, 8), x.new_zeros(2, 8)))
    assert c.dtype == torch.float32 and torch.isfinite(c).all()


class _RMS(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(4, 8), _RMS()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x) * 400.0)


def test_hidden_float16_overflow_fix_casts_outputs_back_with_a_tree_map() -> None:
    torch.manual_seed(0)
    model = _Normed().half()
    with (
        pytest.warns(nanwatch.NanwatchWarning),
        nanwatch.watch(model, mode="forensic") as nw,
    ):
        model(torch.randn(4, 4).half()).float().sum().backward()
        nw.step()
    d = next(d for d in nw.report.diagnoses if d.code == "NW105")
    assert d.fix.startswith("model.norm.float()")
    assert "lambda m, args, out: torch.utils._pytree.tree_map(" in d.fix
    assert "out.to(" not in d.fix
    # the pasted fix (its first three lines) runs: float32 inside, float16 output
    model = _Normed().half()
    exec("\n".join(d.fix.splitlines()[:3]), {"model": model, "torch": torch})
    out = model(torch.randn(4, 4).half())
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


# ----------------------------------- 3: a power of ordinary operands is not "exploded"


class _Weibull(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.lin(x).unbind(-1)
        return a.exp(), b.exp()


def test_power_with_ordinary_base_and_exponent_says_bound_the_exponent() -> None:
    torch.manual_seed(0)
    model = _Weibull()
    with torch.no_grad():
        model.lin.bias.copy_(torch.tensor([0.0, 3.5]))
    x, t = torch.randn(16, 3) * 0.1, torch.rand(16) * 30 + 20
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model, mode="forensic") as nw:
        lam, k = model(x)
        z = t / lam
        (z**k - torch.log(k)).mean().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101" and d.op.startswith("aten.pow")
    t_ = " ".join([*d.evidence, d.explanation])
    assert "exploded" not in t_ and "LayerNorm" not in d.fix
    assert "raised bases up to" in t_ and "Neither operand" in d.explanation
    assert d.fix.startswith("k = k.clamp(max=")
    assert "k * torch.log(z)" in d.fix


# ------------------- 4: exp of a cumulative sum grows with the length, not an explosion


class _Decay(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logdecay = torch.nn.functional.logsigmoid(self.g(x))
        cs = torch.cumsum(logdecay, dim=1)
        kd = x * torch.exp(-cs)
        return (x * torch.exp(cs)) @ kd.transpose(1, 2)


def test_exp_of_a_cumsum_says_length_and_segsum_not_a_clamp() -> None:
    torch.manual_seed(0)
    model = _Decay()
    with torch.no_grad():
        model.g.bias.fill_(-3.0)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model) as nw:
        model(torch.randn(1, 64, 4)).sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101" and d.op == "aten.exp"
    t = " ".join([*d.evidence, d.explanation])
    assert "cumulative sum" in t and "values themselves exploded" not in t
    assert "cs = torch.cumsum(logdecay, dim=1)" in t
    assert ".clamp(" not in d.fix
    assert "seg = cs.unsqueeze(2) - cs.unsqueeze(1)" in d.fix and "shorter chunks" in d.fix


# ------------- 5: a backward cast of a .float()'s gradient never prints NaN as a size


def test_backward_cast_of_a_float_gradient_names_the_loss_scale_not_nan() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4)).half()
    x = torch.randn(8, 4).half()
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model) as nw:
        (model(x).float().sum() * 2.0**24).backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101" and "to_copy" in (d.op or "")
    t = " ".join([*d.evidence, d.explanation])
    assert "NaN" not in t and "= nan" not in t.lower()
    assert "cast the float32 gradient of a .float()" in t
    assert "loss scale too large" in d.explanation
    assert "call to_copy on .float() inputs" not in d.fix and "GradScaler" in d.fix


# ---------- 6: a fixed large constant in the graph is no case for a GradScaler


class _Render(nn.Module):
    def forward(self, sigma: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        delta = t[..., 1:] - t[..., :-1]
        delta = torch.cat([delta, 1e10 * torch.ones_like(delta[..., :1]).float()], -1)
        return (1 - torch.exp(-sigma * delta)).sum(-1)


def test_structural_backward_overflow_of_a_large_constant_is_not_a_gradscaler_fix() -> None:
    torch.manual_seed(0)
    field, ren = nn.Sequential(nn.Linear(3, 1), nn.ReLU()).half(), _Render()
    with torch.no_grad():
        field[0].bias.fill_(-5.0)  # sigma == 0: the last interval's gradient is 1e10
    x = torch.randn(4, 6, 3).half()
    t = torch.linspace(2, 6, 6).half().expand(4, 6)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(field, ren) as nw:
        ren(field(x).squeeze(-1), t).float().mean().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101"
    assert "scaler = torch.amp.GradScaler()" not in d.fix
    assert "x.float() * c" in d.fix and "not a GradScaler" in d.fix
    # (the replay of the root's own backward now pins the backward product whose other
    # operand holds the 1e10: the explanation says "likely" no longer from the values alone)
    assert "large constant in the graph" in d.explanation
