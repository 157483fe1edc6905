"""Found by user testing: a parameter read outside forward (temperature scaling) is not said
to be a compiled model; an optimizer's own arithmetic (LBFGS's line search) is not an op of
the model; a -inf born in the loss code names its line in forensic mode."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


class _WithTemperature(nn.Module):
    """Guo et al.'s ModelWithTemperature: the temperature is read by ``temperature_scale``,
    called on cached logits, not by ``forward``."""

    def __init__(self, model: nn.Module, t0: float, *, floored: bool) -> None:
        super().__init__()
        self.model = model
        self.temperature = nn.Parameter(torch.full((1,), t0))
        self.floored = floored

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.temperature_scale(self.model(x))

    def temperature_scale(self, logits: torch.Tensor) -> torch.Tensor:
        t = self.temperature
        if self.floored:  # NW111's fix: floored at eps in value, the gradient still flows
            t = t + (t.clamp_min(torch.finfo(t.dtype).eps) - t).detach()
        return logits / t


def _calibrate(mode: str, t0: float, *, floored: bool = False) -> list[warnings.WarningMessage]:
    """LBFGS with a strong-Wolfe line search on the temperature over cached logits; the
    warnings the run raised."""
    base = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    scaled = _WithTemperature(base, t0, floored=floored)
    nll = nn.CrossEntropyLoss()
    x = torch.randn(64, 6)
    labels = x[:, :4].argmax(1)
    with torch.no_grad():
        logits = base(x) * 3
    opt = torch.optim.LBFGS(
        [scaled.temperature],
        lr=0.01,
        max_iter=20,
        line_search_fn="strong_wolfe",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(scaled, nll, mode=mode, postmortem=False) as nw:  # type: ignore[arg-type]

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = nll(scaled.temperature_scale(logits), labels)
                loss.backward()
                return loss

            for _ in range(2):
                opt.step(closure)  # type: ignore[no-untyped-call]
                nw.step()
    return list(caught)


# ------------------------------ 1: a parameter read outside forward is no compiled model


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_temperature_scaling_is_not_said_to_run_under_torch_compile(mode: str) -> None:
    caught = _calibrate(mode, 1.5)
    said = [str(w.message) for w in caught if issubclass(w.category, nanwatch.NanwatchWarning)]
    assert not any("torch.compile" in m for m in said), said


# ------------------------------ 2: an optimizer's own arithmetic is not the model's


def test_lbfgs_line_search_overflow_is_not_an_op_of_the_model() -> None:
    """A temperature of 0, floored at eps (NW111's fix), makes the first gradient huge: the
    strong-Wolfe cubic interpolation squares it (``d1**2`` in torch/optim/lbfgs.py) past
    float32's largest value. That inf is the line search's own; nothing of the model or of
    the loss overflowed."""
    caught = _calibrate("forensic", 0.0, floored=True)
    said = [str(w.message) for w in caught if issubclass(w.category, nanwatch.NanwatchWarning)]
    assert not any("NW105" in m or "aten.pow" in m for m in said), said


def test_an_op_of_the_loss_code_inside_an_lbfgs_closure_is_still_checked() -> None:
    """What the closure LBFGS calls runs is the user's: a log of 0 there is named at its
    line, with the optimizer's step on the stack."""
    model = nn.Linear(3, 2)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    x = torch.randn(4, 3)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        out = model(x)
        loss = torch.log(out * 0).mean()  # log(0)
        loss.backward()
        return loss

    def run() -> None:
        opt.step(closure)  # type: ignore[no-untyped-call]

    err = _raises(model, run, "forensic")
    assert err.diagnosis is not None and err.diagnosis.code == "NW110"
    op = err.anomaly.op if err.anomaly is not None else None
    assert op is not None and op.op.startswith("aten.log"), err
    assert op.source is not None, op
    assert op.source.endswith(f":{closure.__code__.co_firstlineno + 3}"), op.source


# ------------------------------ 3: a -inf of the loss code is named at its line (forensic)


def test_a_log_of_zero_in_the_loss_code_is_named_at_its_line_in_forensic_mode() -> None:
    """A forward -inf is no birth on its own (a mask holds one by design): the op is read
    from the loss's autograd graph, and forensic mode keeps the line that created it."""
    model = nn.Linear(3, 2)
    first = 0

    def run() -> None:
        nonlocal first
        out = model(torch.randn(4, 3))
        scale = out[:, 1:] * 0  # a learned scale that collapsed to 0
        first = run.__code__.co_firstlineno
        z = torch.log(scale)
        z.mean().backward()

    err = _raises(model, run, "forensic")
    assert err.diagnosis is not None and err.diagnosis.code == "NW110"
    op = err.anomaly.op if err.anomaly is not None else None
    assert op is not None and op.op.startswith("aten.log"), op
    assert op.source is not None and op.source.endswith(f":{first + 5}"), op.source
    assert op.code == "z = torch.log(scale)"
    assert f":{first + 5}" in str(err)


def test_an_overflow_inside_torch_distributions_names_the_users_call() -> None:
    """The op is inside torch.distributions: the line named is the user's call into it."""
    model = nn.Linear(3, 2)
    model.bias.data[1] = -200.0  # softplus(-200) = 0 in float32: a scale of exactly 0

    def run() -> None:
        loc, raw = model(torch.randn(8, 3)).unbind(-1)
        dist = torch.distributions.Normal(loc, F.softplus(raw), validate_args=False)
        loss = -dist.log_prob(torch.zeros(8)).mean()
        loss.backward()

    err = _raises(model, run, "forensic")
    op = err.anomaly.op if err.anomaly is not None else None
    assert op is not None, err
    chain = op.chain()
    line = run.__code__.co_firstlineno + 3
    assert any(e.source is not None and e.source.endswith(f":{line}") for e in chain), [
        (e.op, e.source) for e in chain
    ]
