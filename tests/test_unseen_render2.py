"""What the report shows where nanwatch knows less than a full count, a row mixes tensors,
a backward() call stands in for an op's line, or a check raised on non-finite gradients."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import Phase, StepTrace, TensorStat
from nanwatch.render import report_html, tree_rows


def _report_of(run: object) -> nanwatch.Report:
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(*run.modules, postmortem=False) as nw:  # type: ignore[attr-defined]
        run()  # type: ignore[operator]
    return nw.report


# ------------------------------------------------------------ 1. a stat never counted
def test_an_op_output_never_read_is_not_shown_as_zero_counts_of_zero_values() -> None:
    s = TensorStat(math.nan, math.nan, 0, nan=0, posinf=0, neginf=0, zeros=0)
    assert not s.counted and s.has_nan and s.kinds() == "NaN"
    assert not TensorStat.from_dict(s.to_dict()).counted
    empty = TensorStat(0.0, 0.0, 0, nan=0, posinf=0, neginf=0, zeros=0)  # a real empty tensor
    assert empty.counted

    net = nn.Linear(4, 2)

    def run() -> None:
        out = net(torch.randn(3, 4))
        active = torch.zeros(3, dtype=torch.bool).long().sum()  # no active row: a count of 0
        (0.9 * (out.sum() / active) + 0.1).backward()  # the division is not the loss

    run.modules = (net,)  # type: ignore[attr-defined]
    report = _report_of(run)
    text = str(report)
    assert "of 0" not in text
    assert re.search(r"output +\+inf \(values not counted\)", text)
    assert "of 0" not in report_html(report)


# ------------------------------------------------------------ 2. one tensor per tree row
class _Norm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x * x).sum(-1))  # finite at 0, its gradient there is not


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.norm = _Norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x) * 0)


@pytest.mark.accelerator_weaker(reason="the input gradient's NaN count is freed before the read")
def test_a_gradient_row_holds_one_tensor_and_the_input_gradient_gets_its_own() -> None:
    torch.manual_seed(0)
    net = _Net()

    def run() -> None:
        for _ in range(2):
            net(torch.randn(5, 3)).sum().backward()

    run.modules = (net,)  # type: ignore[attr-defined]
    report = _report_of(run)
    rows, phase = tree_rows(report)
    assert phase == "backward"
    culprit = next(r for r in rows if r.culprit)
    assert culprit.stat is not None
    assert culprit.stat.shape == "(5)" and culprit.stat.nan == 0  # the output's gradient
    sent = [r for r in rows if r.name.startswith("↳ input")]
    assert sent and sent[0].stat is not None
    assert sent[0].stat.shape == "(5, 3)" and sent[0].stat.nan == 15


# ------------------------------------------------------------ 3. backward() call site
class _Triplet(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1)).mean()


def test_a_backward_call_site_is_labelled_as_such_never_as_the_ops_line() -> None:
    torch.manual_seed(0)
    net, crit = nn.Linear(4, 4), _Triplet()

    def run() -> None:
        e = net(torch.randn(6, 4))
        loss = crit(e, e.detach().clone())
        loss.backward()

    run.modules = (net, crit)  # type: ignore[attr-defined]
    report = _report_of(run)
    a = report.first_anomaly
    assert a is not None and a.op is not None
    op = a.op
    if not (op.phase is Phase.BACKWARD and op.backward_at and op.source == op.backward_at):
        pytest.skip("the watcher knew the op's forward line here")
    text = str(report)
    assert "backward() called at" in text
    for line in text.splitlines():  # the call site is never a `line` row
        assert not (line.strip().startswith("line") and op.source in line)
    html = report_html(report)
    assert "backward() called at" in html
    assert f"<th>line</th><td><code>{op.source}" not in html


# ------------------------------------------------------------ 4. non-finite check raised
def test_clip_grad_norm_raising_under_a_grad_scaler_says_the_step_is_skipped_normally() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    x, y = torch.randn(16, 8) * 4, torch.randint(0, 4, (16,))
    watch = nanwatch.watch(model, postmortem=False)
    with pytest.raises(RuntimeError, match="non-finite"), watch as nw:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    err = nw.report.error
    assert err is not None and err["class"] == "non-finite"
    first = err["advice"].split(". ")[0]
    assert "GradScaler" in first and "error_if_nonfinite=False" in first
    assert "scaler.unscale_" in first


def test_a_non_finite_check_without_a_scaler_names_the_bad_gradients() -> None:
    from nanwatch.postmortem import classify, step_advice

    info = classify(RuntimeError("The total norm of order 2.0 for gradients is non-finite"))
    assert info["class"] == "non-finite"
    trace = StepTrace(step=4, grad_norm=math.nan)
    step_advice(info, trace, scaler=False)
    assert "Step 4's parameter gradients were not finite" in info["advice"]
    assert "GradScaler" not in info["advice"]
