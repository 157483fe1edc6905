"""Unseen-model follow-ups for NW111: a loss divided by a Python int count of 0 (gradient
accumulation over a short last batch) is no integer tensor and is fixed with max(n, 1);
a denominator made from exp() terms that underflowed is told from the autograd graph in
watch mode too, where the line is unknown."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import ops


def _diag(run) -> nanwatch.Diagnosis:
    with pytest.raises(nanwatch.AnomalyError) as info:
        run()
    return info.value.diagnoses[0]


def _accumulate(mode: str, *, healthy: bool = False) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    crit = nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    micro_bs = 4
    X, Y = torch.randn(10, 4), torch.randn(10, 1)
    with nanwatch.watch(model, crit, mode=mode) as nw:
        for s in range(0, 10, 8):  # the last batch has 2 rows
            xb, yb = X[s : s + 8], Y[s : s + 8]
            n_micro = -(-len(xb) // micro_bs) if healthy else len(xb) // micro_bs
            for xm, ym in zip(xb.split(micro_bs), yb.split(micro_bs), strict=True):
                loss = crit(model(xm), ym) / n_micro
                loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_a_python_int_count_of_zero_is_no_integer_tensor_and_gets_max_1(mode: str) -> None:
    d = _diag(lambda: _accumulate(mode))
    assert d.code == "NW111"
    text = "\n".join(d.evidence)
    assert "Python int (a count), not a tensor" in text
    assert "integer tensor" not in text
    assert "count" in d.explanation and "micro-batches" in d.explanation
    assert "clamp_min" not in d.fix  # an int has no .clamp_min: AttributeError when pasted
    if mode == "forensic":  # the line is known: the user's names
        line = d.fix.split("   #")[0]
        assert line == "loss = crit(model(xm), ym) / max(n_micro, 1)"
        crit, model = nn.MSELoss(), nn.Linear(4, 1)
        xm, ym, n_micro = torch.randn(2, 4), torch.randn(2, 1), 0
        scope = {"crit": crit, "model": model, "xm": xm, "ym": ym, "n_micro": n_micro}
        exec(line, scope)
        assert torch.isfinite(scope["loss"])
    else:
        assert "max(d, 1)" in d.fix and 'mode="forensic"' in text


def test_accumulation_with_a_ceiling_count_stays_silent() -> None:
    _accumulate("watch", healthy=True)


def test_the_graph_tells_a_python_number_from_a_0_dim_tensor() -> None:
    x = torch.ones(3, requires_grad=True)
    y = x.sum() / 0
    ev = ops.graph_evidence(y.grad_fn, output=y)[1][0]
    assert ev.scalars["other"] == 0 and isinstance(ev.scalars["other"], int)
    y = x.sum() / torch.tensor(0)  # an integer tensor: told among the other inputs
    ev = ops.graph_evidence(y.grad_fn, output=y)[1][0]
    assert "other" not in ev.scalars and [n for n, _ in ev.other_inputs] == ["other"]
    y = x.sum() / torch.tensor(0.0, dtype=torch.float64)
    ev = ops.graph_evidence(y.grad_fn, output=y)[1][0]
    assert "other" not in ev.scalars


def _sinkhorn(x: torch.Tensor, y: torch.Tensor, eps: float = 0.01) -> torch.Tensor:
    C = torch.cdist(x, y) ** 2
    a = torch.full((x.shape[0],), 1.0 / x.shape[0])
    b = torch.full((y.shape[0],), 1.0 / y.shape[0])
    K = torch.exp(-C / eps)
    u, v = torch.ones_like(a), torch.ones_like(b)
    for _ in range(2):
        u = a / (K @ v)
        v = b / (K.t() @ u)
    return (u[:, None] * K * v[None, :] * C).sum()


def _ot(mode: str) -> None:
    torch.manual_seed(0)
    gen = nn.Linear(4, 2)
    with nanwatch.watch(gen, mode=mode) as nw:
        loss = _sinkhorn(gen(torch.randn(6, 4)), torch.randn(6, 2) * 2 + 3)
        loss.backward()
        nw.step()


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_an_underflowed_exp_kernel_is_named_in_both_modes(mode: str) -> None:
    d = _diag(lambda: _ot(mode))
    assert d.code == "NW111" and "exp() underflowed to 0" in d.title
    text = "\n".join(d.evidence)
    assert "clamp_min(eps)" not in d.fix.split("not .clamp_min")[0]
    if mode == "forensic":
        assert "K = torch.exp(-C / eps)" in text and "log_K = -C / eps" in d.fix
        return
    assert "MvBackward0 < ExpBackward0" in text
    assert re.search(r"(\d+ of its|every one of its) 36 values (is|are) 0", text)
    # the pasted fix, its names bound: the log-domain quotient is exact where exp does not
    # underflow, and finite where it does
    torch.manual_seed(0)
    num, v = torch.rand(5) + 0.1, torch.rand(7) + 0.1
    for x in (torch.randn(5, 7), torch.randn(5, 7) - 300.0):
        scope = {"torch": torch, "x": x, "v": v, "num": num}
        exec(d.fix, scope)
        assert torch.isfinite(scope["log_y"]).all()
        if x.max() > -50:
            assert torch.allclose(scope["log_y"], torch.log(num / (torch.exp(x) @ v)), atol=1e-5)


def test_a_zero_denominator_not_made_by_summing_exps_is_no_underflow() -> None:
    """exp(x) - 1 is 0 at x == 0: the exp did not underflow."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)

    def run() -> None:
        with nanwatch.watch(lin) as nw:
            z = lin(torch.randn(2, 3)) * 0.0
            loss = (z.sum(-1) / (torch.exp(z) - 1).sum(-1)).sum()
            loss.backward()
            nw.step()

    d = _diag(run)
    assert d.code == "NW111" and "underflowed" not in d.title
