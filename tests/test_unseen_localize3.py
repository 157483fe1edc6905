"""Localization past a NaN input the model absorbs itself (``torch.nan_to_num(x)`` first
thing in ``forward``): a later NaN made elsewhere (a NaN-padded target that survives
``* mask``) is not the input's."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import nanwatch
from nanwatch.localize import first_trigger, localize
from nanwatch.records import AnomalyKind, Phase, StepTrace

torch.set_num_threads(1)


class _Clean(nn.Module):  # imputes its own missing values
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.nan_to_num(x))


class _Raw(nn.Module):  # reads its input as it is
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Hide(nn.Module):  # the NaN goes through lin, a torch.where hides it afterwards
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.where(torch.isnan(h), torch.zeros_like(h), h)


def _series(model: nn.Module, *, nan_target: bool, on_anomaly: str = "warn") -> StepTrace:
    """One step on NaN-padded series: the input's padding is NaN; the target's too when
    ``nan_target`` (the loss multiplies it by the mask: NaN * 0 is NaN)."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(4, 30)
    if nan_target:
        x[1, 27:] = float("nan")  # series 1 is 3 steps shorter
    inp, y = x[:, :24].clone(), x[:, 24:]
    inp[2, 20:] = float("nan")
    mask = ~torch.isnan(y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, on_anomaly=on_anomaly, postmortem=False) as nw:  # type: ignore[arg-type]
            loss = ((model(inp) - y) ** 2 * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw.history[-1]


def test_nan_target_is_not_blamed_on_an_input_the_model_cleaned() -> None:
    trace = _series(_Clean(), nan_target=True)
    trig = first_trigger(trace)
    assert trig is not None and trig.phase is not Phase.INPUT
    a = localize(trace)
    assert a is not None
    assert a.kind is AnomalyKind.FORWARD and a.path == "(loss)" and a.origin == "loss-code"
    assert "input data" not in a.summary


def test_input_nan_the_model_reads_is_still_bad_data() -> None:
    for model in (_Raw(), _Hide()):  # reaches the output / only a child's output
        trace = _series(model, nan_target=False)
        a = localize(trace)
        assert a is not None and a.kind is AnomalyKind.INPUT, type(model).__name__
        assert a.path == type(model).__name__ and a.record.role == "input[0]"


def test_input_nan_the_model_reads_raises_nw401() -> None:
    try:
        _series(_Raw(), nan_target=False, on_anomaly="raise")
    except nanwatch.AnomalyError as e:
        d = next(d for d in e.diagnoses if d.code == "NW401")
        assert d.path == "_Raw" and "sample 2" in " ".join(d.evidence)
        assert "inp = torch.nan_to_num(inp" in d.fix  # the user's name for the batch
    else:
        raise AssertionError("no anomaly")


def test_absorbed_input_alone_stays_a_warning() -> None:
    trace = _series(_Clean(), nan_target=False, on_anomaly="raise")  # no error
    assert trace.anomaly is None
    assert [d.code for d in trace.diagnoses] == ["NW406"]
