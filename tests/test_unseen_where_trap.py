"""The torch.where gradient trap: ``torch.where(z > 0, torch.log(z), 0)`` with exact zeros
in ``z``. The forward is finite (where drops log(0) = -inf), but where's backward sends the
dropped entries a 0 gradient and the log's backward divides it by 0: 0 / 0 = NaN in the
gradient. NW110 must name the torch.where and give the double where, which trains; and
the weights SGD then writes NaN are step 0's gradient applied (NW301's consequence), not a
write between two forwards, though the model's output stayed finite (where hid the NaN)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

import nanwatch
from nanwatch.records import OpEvent, Phase, TensorStat

_SOURCE = """
import torch
from torch import nn


class LogCounts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 1)

    def forward(self, counts):
        z = counts * self.gain
        {line}
        return self.head(feats)
"""

_TRAP = "feats = torch.where(z > 0, torch.log(z), 0)"


def _load(tmp_path: Path, name: str, line: str) -> ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(_SOURCE).format(line=line))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[name]
    return mod


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    counts = torch.poisson(torch.full((32, 8), 0.7))  # many exact zeros
    return counts, torch.randn(32, 1)


def _train(model: torch.nn.Module, mode: str, steps: int = 3) -> nanwatch.Watcher:
    counts, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            F.mse_loss(model(counts), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_log_under_where_names_the_where_and_its_double_where_trains(
    tmp_path: Path, mode: str
) -> None:
    torch.manual_seed(0)
    model = _load(tmp_path, f"trap_{mode}", _TRAP).LogCounts()
    nw = _train(model, mode)
    d = next((d for d in nw.history[0].diagnoses if d.code == "NW110"), None)
    assert d is not None, [(x.code, x.title) for x in nw.history[0].diagnoses]
    assert "torch.where" in d.title, d.title
    assert not any("exp(-inf)" in e for e in d.evidence), d.evidence
    first = d.fix.splitlines()[0].split("   #")[0]
    assert first == "feats = torch.where(z > 0, torch.log(torch.where(z > 0, z, 1.0)), 0)", d.fix

    fixed = _load(tmp_path, f"fixed_{mode}", first).LogCounts()
    trap = _load(tmp_path, f"again_{mode}", _TRAP).LogCounts()
    fixed.load_state_dict(trap.state_dict())
    counts, _ = _data()
    with torch.no_grad():  # the same function: log(z) where z > 0, 0 elsewhere
        assert torch.equal(fixed(counts), trap(counts))
    clean = _train(fixed, mode)
    assert clean.first_anomaly is None, clean.first_anomaly.summary
    assert all(torch.isfinite(p).all() for p in fixed.parameters())


@pytest.mark.gpu_bound_weaker(
    reason="nothing has landed when backward begins: each step is NW302, and the NaN "
    "weights get no NW301"
)
@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_weights_sgd_wrote_from_a_nan_gradient_are_not_a_write_between_forwards(
    tmp_path: Path, mode: str
) -> None:
    """Step 1's forward ran with gain NaN and gave a finite output (where dropped every
    entry): that output does not show gain finite, and SGD's step-0 update applied a NaN
    gradient of gain."""
    torch.manual_seed(0)
    nw = _train(_load(tmp_path, f"weights_{mode}", _TRAP).LogCounts(), mode)
    diags = [d for t in list(nw.history)[1:] for d in t.diagnoses if d.code == "NW301"]
    assert diags, [(d.code, d.title) for t in nw.history for d in t.diagnoses]
    assert not any("in place" in d.title or "between" in d.title for d in diags), [
        d.title for d in diags
    ]
    d = diags[0]
    assert d.title == "Non-finite weights (a consequence of an earlier anomaly)", d.title
    assert any("gradient of gain applied" in e and "step 0" in e for e in d.evidence), d.evidence


def _log_event(code: str) -> OpEvent:
    nan = TensorStat(float("nan"), float("nan"), 16, nan=7)
    x = TensorStat(0.0, 4.0, 16, zeros=7)
    return OpEvent("aten.log", Phase.BACKWARD, "M", "NaN", nan, [("self", x)], code=code,
                   node="LogBackward0")  # fmt: skip


@pytest.mark.parametrize(
    ("line", "by", "fixed"),
    [
        (
            "feats = torch.log(z).masked_fill(z <= 0, 0.0)",
            "masked_fill",
            "feats = torch.log(z.masked_fill(z <= 0, 1.0)).masked_fill(z <= 0, 0.0)",
        ),
        (
            "feats = torch.log(z)[z > 0].sum()",
            "the index",
            "feats = torch.log(z[z > 0]).sum()",
        ),
    ],
)
def test_log_dropped_by_masked_fill_or_an_index_gets_its_input_selected(
    line: str, by: str, fixed: str
) -> None:
    from nanwatch.rules.domain import _discarded_log

    d = _discarded_log(_log_event(line))
    assert d is not None and d.by == by and d.line == fixed, d
    z = torch.poisson(torch.full((16,), 0.7)).requires_grad_()
    scope = {"torch": torch, "z": z}
    exec(d.line, scope)
    scope["feats"].sum().backward()
    assert z.grad is not None and torch.isfinite(z.grad).all(), z.grad


def test_a_log_no_op_on_its_line_discards_keeps_the_generic_words() -> None:
    from nanwatch.rules.domain import _discarded_log

    assert _discarded_log(_log_event("loss = -(y * torch.log(p)).sum()")) is None
