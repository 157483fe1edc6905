"""Localization found by user testing: a -inf a module took, whose backward made NaN of it
in a weight's gradient, is blamed where the -inf was made; a loss input with an autograd
history is computed, not data; a backward op of the loss code beside a loss module is the
loss code's, not the loss module's."""

from __future__ import annotations

import ast
import math

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import LOSS_PATH, AnomalyKind, Phase
from nanwatch.rules.testing import TraceBuilder, stat
from tests._diagnoses import code_lines, first_bad, top

torch.set_num_threads(1)


# ------------------------------ 1: a -inf fed to a GRU, NaN in its weight's gradient


class _Tpp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(2, 4, batch_first=True)
        self.head = nn.Linear(4, 1)

    def forward(self, times: torch.Tensor) -> torch.Tensor:
        dt = torch.diff(times, dim=1, prepend=torch.zeros_like(times[:, :1]))
        feat = torch.stack([torch.log(dt), times], -1)
        h, _ = self.rnn(feat)
        return self.head(h)


def _times() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    t = torch.rand(2, 5, generator=g).cumsum(1)
    t[1, 3] = t[1, 2]  # a duplicated timestamp: dt = 0, log(dt) = -inf
    return t


def _run_tpp(mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = _Tpp()
    nw = nanwatch.watch(m, mode=mode, on_anomaly="record")
    with nw:
        m(_times()).sum().backward()
        nw.step()
    return nw


def test_neginf_into_a_gru_is_blamed_on_the_code_that_made_it_not_the_grus_backward() -> None:
    t = first_bad(_run_tpp("watch"))
    a = t.anomaly
    assert a is not None
    assert a.kind is AnomalyKind.FORWARD and a.origin == "between-children"
    assert a.path == "_Tpp" and a.record.path == "rnn" and a.record.role == "input[0]"
    assert a.summary.startswith("-inf born in the forward code of _Tpp itself")
    assert "rnn.weight_ih_l0" in a.summary and "born in the backward of rnn" not in a.summary


def test_forensic_names_the_log_and_its_floor_clears_the_gradient() -> None:
    nw = _run_tpp("forensic")
    t = first_bad(nw)
    assert t.anomaly is not None and t.anomaly.path == "_Tpp"
    d = top(nw)
    assert d.code == "NW110"
    fix = code_lines(d.fix).splitlines()[0]
    ast.parse(fix)
    assert "torch.log(dt.clamp_min(" in fix
    # the fix applied: the weights' gradients stay finite
    torch.manual_seed(0)
    m = _Tpp()
    times = _times()
    dt = torch.diff(times, dim=1, prepend=torch.zeros_like(times[:, :1]))
    scope = {"torch": torch, "dt": dt, "times": times}
    exec(fix.split("#")[0], scope)
    h, _ = m.rnn(scope["feat"])
    m.head(h).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


# ------------------------------ 2: a loss input with an autograd history is not data


def test_a_loss_input_with_an_autograd_history_is_computed_not_bad_data() -> None:
    b = TraceBuilder()
    loss = b.call("CrossEntropyLoss", root=True, is_loss=True)
    b.input(loss, stat(-math.inf, math.inf, counted=True), grad_fn="DivBackward0")
    b.forward(loss, stat(math.nan, math.nan, counted=True), grad_fn="NllLossBackward0")
    a = b.build().anomaly
    assert a is not None
    assert a.kind is AnomalyKind.FORWARD and a.origin == "between-roots"
    assert "bad data" not in a.summary and "input data" not in a.summary
    assert "computed by DivBackward0" in a.summary and "mode='forensic'" in a.summary


# ------------------------------ 3: an entropy term's backward is the loss code's


def _entropy_run(mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    crit = nn.CrossEntropyLoss()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)) * 300
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    nw = nanwatch.watch(m, crit, mode=mode, on_anomaly="record")
    with nw:
        logits = m(x)
        loss = crit(logits, y) - 0.1 * torch.special.entr(F.softmax(logits, -1)).sum(-1).mean()
        loss.backward()
        nw.step()
    return nw


def test_entr_gradient_is_born_in_the_loss_code_not_in_cross_entropy() -> None:
    for mode in ("watch", "forensic"):
        nw = _entropy_run(mode)
        a = first_bad(nw).anomaly
        assert a is not None
        assert a.path == LOSS_PATH and a.origin == "after-output", mode
        assert "CrossEntropyLoss" not in a.summary, mode
        assert a.op is not None and a.op.phase is Phase.BACKWARD
        assert top(nw).code == "NW110"


def test_sentinel_names_the_loss_code_beside_the_loss_module() -> None:
    a = first_bad(_entropy_run("sentinel")).anomaly
    assert a is not None
    assert "or in the backward of the loss code outside the watched modules" in a.summary
    assert "SubBackward0" in a.summary
