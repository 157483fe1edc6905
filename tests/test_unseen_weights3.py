"""Weights: a -inf constraint a weight came with is no anomaly (its NaN, +inf and any new
-inf are); a weight written in place between two forwards of a step is not blamed on the
optimizer; a gradient fix names the user's model, not a parameter-free loss module."""

from __future__ import annotations

import ast
import warnings

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import AnomalyKind
from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first

torch.set_num_threads(1)


# ----------------------- 1: -inf constraints stored in a Parameter are not an anomaly


class _Tagger(nn.Module):
    """Emission scores plus a learnable transition matrix whose -inf forbids a transition."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 4)
        t = torch.randn(4, 4)
        t[0, 3] = float("-inf")  # tag 3 may not follow tag 0
        self.trans = nn.Parameter(t)

    def forward(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.out(x) + self.trans[prev]


def _train(m: _Tagger, nw: object, steps: int, after_step=None) -> None:  # type: ignore[no-untyped-def]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    for s in range(steps):
        x = torch.randn(8, 6, generator=g)
        prev = torch.randint(0, 4, (8,), generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        crit(m(x, prev), y).backward()
        opt.step()
        if after_step is not None:
            after_step(s)
        nw.step()  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["watch", "sentinel", "forensic"])
def test_neginf_constraint_a_parameter_came_with_is_no_anomaly(mode: str) -> None:
    torch.manual_seed(0)
    m = _Tagger()
    with nanwatch.watch(m, mode=mode) as nw:
        _train(m, nw, 3)
    assert nw.first_anomaly is None
    assert not [d for t in nw.history for d in t.diagnoses if d.code == "NW301"]
    assert torch.isneginf(m.trans).sum().item() == 1  # the constraint is still there


@pytest.mark.parametrize(
    ("value", "what"), [(float("-inf"), "-inf"), (float("nan"), "NaN"), (float("inf"), "+inf")]
)
def test_a_new_non_finite_value_in_a_constrained_weight_is_an_anomaly(
    value: float, what: str
) -> None:
    """A -inf more than it came with, a NaN or a +inf: written after step 1's update."""
    torch.manual_seed(0)
    m = _Tagger()

    def spoil(s: int) -> None:
        if s == 1:
            with torch.no_grad():
                m.trans[1, 2] = value

    with nanwatch.watch(m, on_anomaly="record") as nw:
        _train(m, nw, 3, spoil)
    a = nw.first_anomaly
    assert a is not None and a.step == 1, a
    assert (a.kind, a.parameter) == (AnomalyKind.PARAMETER, "trans")
    s = a.record.stat
    assert s is not None and not s.finite
    if what == "-inf":
        assert s.neginf == 2 and not s.nan and not s.posinf
    elif what == "NaN":
        assert s.nan == 1
    else:
        assert s.posinf == 1


# --------------- 2: a CRF with -inf in its transitions Parameter: the real failure shows

_NEG = float("-inf")
_START, _STOP, _T = 3, 4, 5


class _CRF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emit = nn.Linear(4, _T)
        self.transitions = nn.Parameter(torch.randn(_T, _T))  # [to, from]
        self.transitions.data[_START, :] = _NEG
        self.transitions.data[:, _STOP] = _NEG

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the log partition of one sentence
        feats = self.emit(x)
        alpha = torch.full((_T,), _NEG)
        alpha[_START] = 0.0
        for f in feats:
            alpha = torch.logsumexp(alpha.unsqueeze(0) + self.transitions, dim=1) + f
        return torch.logsumexp(alpha + self.transitions[_STOP], dim=0)


@pytest.mark.parametrize("mode", ["watch", "sentinel", "forensic"])
def test_crf_neginf_transitions_parameter_gets_the_logsumexp_diagnosis(mode: str) -> None:
    """The START row is all -inf: logsumexp over it has a NaN gradient at step 0. The
    -inf the Parameter was initialized with is no NW301 "loaded with it"."""
    torch.manual_seed(0)
    m = _CRF()
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(m, mode=mode) as nw:
        m(torch.randn(3, 4)).backward()
        nw.step()
    err = info.value
    assert all(d.code != "NW301" for d in err.diagnoses)
    d = _first(err, "NW402")
    assert "all -inf" in d.title and d.fix.startswith("NEG = -1e30")
    assert err.anomaly is not None and err.anomaly.kind is not AnomalyKind.PARAMETER


# ------- 3: a weight written in place between two forwards (a finite-difference step)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("mode", ["watch", "sentinel", "forensic"])
def test_a_data_write_between_two_forwards_is_not_blamed_on_the_optimizer(mode: str) -> None:
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    err = None
    try:
        with nanwatch.watch(net, mode=mode) as nw:
            for step in range(3):
                nn.functional.mse_loss(net(x), y).backward()  # a first forward: finite
                v = torch.zeros_like(net.fc.weight)  # a direction of norm 0
                r = 0.01 / v.norm()  # inf
                if step == 2:
                    net.fc.weight.data.add_(v, alpha=r.item())  # inf * 0 = NaN
                nn.functional.mse_loss(net(x), y)  # the second forward of the step
                opt.step()
                opt.zero_grad()
                nw.step()
    except nanwatch.AnomalyError as e:
        err = e
    assert err is not None and err.anomaly is not None
    assert (err.anomaly.kind, err.anomaly.parameter, err.anomaly.step) == (
        AnomalyKind.PARAMETER,
        "fc.weight",
        2,
    )
    d = _first(err, "NW301")
    assert "between two forwards" in d.title and "optimizer step" not in d.title
    assert any("ran with fc.weight finite in step 2" in e for e in d.evidence)
    assert "learning rate are not the cause" in d.explanation
    assert "state" not in d.fix  # no clearing of the optimizer's state
    code = code_lines(d.fix)
    ast.parse(code)
    assert "net.named_parameters()" in code  # the user's name for the model
    # the check the fix pastes finds the broken weight
    found: dict[str, object] = {"net": net, "torch": torch}
    with pytest.raises(AssertionError, match=r"fc\.weight"):
        exec(code, found)


# -------------- 4: a gradient fix names the model, not a parameter-free loss module


class _Loss(nn.Module):  # a loss written as a plain Module, no weights
    def forward(self, out: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((out - y) ** 2).mean()}


def test_exploding_gradient_fix_names_the_watched_model_beside_a_loss_module() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    crit = _Loss()
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(net, crit, on_anomaly="record") as nw:
            for step in range(14):
                x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
                if step == 13:
                    y = y * 1e4  # one bad batch: a loss spike
                opt.zero_grad()
                crit(net(x), y)["loss"].backward()
                opt.step()
                nw.step()
    found = [d for t in nw.history for d in t.diagnoses if d.code == "NW303"]
    assert found, "no NW303"
    fix = found[0].fix
    assert "clip_grad_norm_(net.parameters()" in fix and "model." not in code_lines(fix)
    ast.parse(code_lines(fix))


def test_a_weight_written_between_forwards_is_not_called_an_update_in_the_summary() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(net) as nw:
        for step in range(3):
            net(x).pow(2).mean().backward()
            if step == 2:
                v = torch.zeros_like(net[0].weight)
                with torch.no_grad():
                    net[0].weight.data.add_(v, alpha=float("inf"))  # inf * 0 = NaN
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    a = info.value.anomaly
    assert a is not None
    assert "written in place after" in a.summary and "not by an optimizer step" in a.summary
    assert "made non-finite by the last update" not in a.summary
    assert "written in place between forwards" in nw.report.headline
