"""A log of 0 whose zeros come from a parameter written to exactly 0 between steps: a Poisson
NLL written out, ``rate = gain * softplus(f)``, ``gain`` projected onto ``gain >= 0`` after
each step. NW110 names the parameter, says it is exactly 0, names the statement that wrote
it (in the training loop, or in the optimizer's own ``step()``) and gives a fix that keeps
it off 0, in watch and sentinel mode."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import Diagnosis

torch.set_num_threads(1)


class _Poisson(nn.Module):
    def __init__(self, n: int = 1) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.full((n,), 0.05))
        self.feat = nn.Linear(3, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * F.softplus(self.feat(x))


class _Projected(torch.optim.SGD):
    """SGD projected onto gain >= 0 after each step."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        out = super().step(closure)
        with torch.no_grad():
            for g in self.param_groups:
                g["params"][0].clamp_(min=0.0)
        return out


def _data(n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(32, 3)
    y = torch.zeros(32, n)
    y[:1] = 1.0  # rare events: mostly zero counts push the rate down
    return x, y


def _nw110(nw: nanwatch.Watcher) -> Diagnosis:
    ds = [d for t in nw.history for d in t.diagnoses if d.code == "NW110"]
    assert ds, [d.headline for t in nw.history for d in t.diagnoses]
    return ds[0]


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    mode: str,
    project: Callable[[], None] = lambda: None,
    *,
    steps: int = 3,
    n: int = 1,
) -> nanwatch.Watcher:
    x, y = _data(n)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            rate = model(x)
            loss = (rate - y * torch.log(rate)).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            project()
            nw.step()
    return nw


def _train_nw110(*args: object, **kwargs: object) -> Diagnosis:
    return _nw110(_train(*args, **kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["watch", "sentinel", "forensic"])
def test_a_projection_in_the_loop_under_no_grad_is_named(mode: str) -> None:
    torch.manual_seed(0)
    model = _Poisson()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def project() -> None:
        with torch.no_grad():
            model.gain.clamp_(min=0.0)

    d = _train_nw110(model, opt, mode, project)
    assert d.title == "Log of 0: the parameter gain is exactly 0"
    said = " ".join(d.evidence)
    assert "gain was exactly 0 (its one value) when the forward read it" in said
    assert "through mul" in said
    assert ": model.gain.clamp_(min=0.0) (" in said  # in project(), which the loop calls
    assert "F.softplus(self.gain)" in d.fix
    assert "model.gain.clamp_(min=1e-6)" in d.fix  # the projection, with a floor above 0
    assert "ratio" not in d.fix and "log_softmax" not in d.fix  # not the generic list


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_projection_through_data_in_the_loop_is_named(mode: str) -> None:
    torch.manual_seed(0)
    model = _Poisson()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def project() -> None:
        model.gain.data.clamp_(min=0.0)

    d = _train_nw110(model, opt, mode, project)
    assert d.title == "Log of 0: the parameter gain is exactly 0"
    assert ": model.gain.data.clamp_(min=0.0) (" in " ".join(d.evidence)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_projection_in_the_optimizers_own_step_is_named(mode: str) -> None:
    torch.manual_seed(0)
    model = _Poisson()
    opt = _Projected([model.gain, *model.feat.parameters()], lr=1.0)
    d = _train_nw110(model, opt, mode)
    assert d.title == "Log of 0: the parameter gain is exactly 0"
    said = " ".join(d.evidence)
    assert "_Projected.step, your optimizer's own step(), writes the weights in place" in said
    assert 'g["params"][0].clamp_(min=0.0) (' in said
    assert 'g["params"][0].clamp_(min=1e-6)' in d.fix


def test_some_values_of_a_parameter_at_zero_are_counted() -> None:
    torch.manual_seed(0)
    model = _Poisson(4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def project() -> None:
        with torch.no_grad():
            model.gain[:2] = torch.where(model.gain[:2] > 1.0, model.gain[:2], 0.0)
            model.gain.clamp_(min=0.0)

    d = _train_nw110(model, opt, "watch", project, n=4)
    said = " ".join(d.evidence)
    assert "gain was exactly 0 at 2 of 4 values" in said


def test_the_softplus_fix_trains_without_a_log_of_zero() -> None:
    """The fix the diagnosis gives first: gain = softplus(raw), no projection."""

    class Fixed(_Poisson):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.softplus(self.gain) * F.softplus(self.feat(x))

    torch.manual_seed(0)
    model = Fixed()
    with torch.no_grad():
        model.gain.copy_(torch.log(torch.expm1(torch.tensor(0.05))))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    nw = _train(model, opt, "watch", steps=30)
    assert nw.first_anomaly is None


def test_a_zero_parameter_added_to_the_logs_input_is_not_named() -> None:
    """A parameter at 0 that is added (not multiplied) does not make the log's zeros: the
    story is not told."""

    class Added(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shift = nn.Parameter(torch.zeros(1))
            self.feat = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.feat(x) * 0.0) + self.shift

    model = Added()
    x = torch.randn(8, 3)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        torch.log(model(x)).mean().backward()
        nw.step()
    d = _nw110(nw)
    assert "shift" not in d.title and "shift" not in " ".join(d.evidence)
