"""Two inputs the watcher used to leave unexplained: a -inf the parent's code made from the
data (log of a zero time gap) and passed to a GRU, whose backward turned it into a NaN
weight gradient (the input is now measured, and the parent's code is replayed once the
call is over); and a loss input computed from a watched weight outside every forward (a
temperature of 0), which is not bad data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import AnomalyKind
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


class EventModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(3, 4)
        self.rnn = nn.GRU(5, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, times: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
        dt = torch.diff(times, dim=1, prepend=torch.zeros_like(times[:, :1]))
        feat = torch.cat([torch.log(dt).unsqueeze(-1), self.emb(marks)], -1)
        return self.head(self.rnn(feat)[0]).squeeze(-1)


def _events() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    times = torch.rand(4, 6, generator=g).add(0.1).cumsum(1)
    times[2, 3] = times[2, 2]  # a duplicated timestamp: a gap of exactly 0
    return times, torch.randint(0, 3, (4, 6), generator=g)


def test_a_neginf_the_parents_code_fed_a_gru_is_named_at_its_log() -> None:
    torch.manual_seed(0)
    m = EventModel()
    times, marks = _events()

    def run() -> None:
        m(times, marks).pow(2).mean().backward()

    err = _raises(m, run, "watch")
    a = err.anomaly
    assert a is not None and a.kind is AnomalyKind.FORWARD
    assert a.op is not None and a.op.op == "aten.log.default", a.summary
    assert err.diagnosis is not None and err.diagnosis.code == "NW110"
    assert "dt.clamp_min(" in err.diagnosis.fix


def test_the_floor_it_suggests_leaves_every_gradient_finite() -> None:
    torch.manual_seed(0)
    m = EventModel()
    times, marks = _events()
    dt = torch.diff(times, dim=1, prepend=torch.zeros_like(times[:, :1])).clamp_min(1e-6)
    feat = torch.cat([torch.log(dt).unsqueeze(-1), m.emb(marks)], -1)
    m.head(m.rnn(feat)[0]).pow(2).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


class Calibrated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(6, 4)
        self.temperature = nn.Parameter(torch.zeros(1))  # meant: torch.ones(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.base(x))

    def scale(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.temperature


def test_a_loss_input_made_from_a_watched_weight_is_not_bad_data() -> None:
    torch.manual_seed(0)
    m = Calibrated()
    crit = nn.CrossEntropyLoss()
    with torch.no_grad():
        logits = m.base(torch.randn(8, 6))  # cached once, as calibration code does
    y = torch.randint(0, 4, (8,))
    with (
        pytest.warns(RuntimeWarning, match="not the data"),
        nanwatch.watch(m, crit, on_anomaly="warn") as nw,
    ):
        crit(m.scale(logits), y).backward()
        nw.step()
    a = nw.report.first_anomaly
    assert a is not None
    assert a.kind is not AnomalyKind.INPUT, a.summary
    assert "not the data" in a.summary
    assert all(d.code != "NW401" for d in nw.report.diagnoses)
    assert F.cross_entropy(logits / 1.0, y).isfinite()
