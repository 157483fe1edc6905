"""Rendering found by user testing: the one-line fix of a post-mortem shows code, not a
comment that introduces it; a NaN in a module's input is not called bad data when the
user's own code may have made it; a NaN made between the model's output and a check
points to mode='forensic'."""

from __future__ import annotations

import ast
import io
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

import nanwatch
from nanwatch.render import key_line, report_summary
from nanwatch.report import Report, anomaly_headline

torch.set_num_threads(1)


def _console() -> Console:
    return Console(width=1000, color_system=None, file=io.StringIO())


def _summary(nw: nanwatch.Watcher) -> str:
    c = _console()
    c.print(report_summary(nw.report, ["run.json"]))
    return str(c.file.getvalue())  # type: ignore[attr-defined]


# ------------------------------ 1: a comment that introduces code is shown with the code


def test_a_comment_only_fix_shows_the_code_its_first_comment_introduces() -> None:
    fix = (
        "# std of a single value is NaN; where x is normalized by its std:\n"
        "# (x - x.mean()) / (x.std(correction=0) + 1e-8)   # N = 1 gives std 0\n"
        "# or skip batches of 1 (DataLoader(drop_last=True), if len(batch) > 1)"
    )
    line = key_line(fix)
    assert line.endswith(": (x - x.mean()) / (x.std(correction=0) + 1e-8)")
    ast.parse(line.split(": ", 1)[1])
    # a commented-out line of code without an introduction is shown alone
    assert key_line("# or clamp it\n# y = x.clamp_min(1e-6)") == "# y = x.clamp_min(1e-6)"


@pytest.mark.filterwarnings("ignore:std")
def test_the_post_mortem_line_of_a_no_grad_std_of_one_value_shows_code() -> None:
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    x = torch.randn(1, 3)
    with nanwatch.watch(m, mode="watch", on_anomaly="record") as nw:
        with torch.no_grad():
            reward = m(x).squeeze(1)
        adv = (reward - reward.mean()) / (reward.std() + 1e-8)
        loss = -(adv[:, None] * m(x)).mean()
        loss.backward()
        nw.step()
    out = _summary(nw)
    assert "NW100" in out, out
    fix_line = next(ln for ln in out.splitlines() if "; fix: " in ln)
    shown = fix_line.split("; fix: ", 1)[1].rstrip(" …")
    assert not shown.endswith(":"), fix_line
    assert "x.numel() > 1 else 1.0" in shown, fix_line  # the guard, the first code line


# ------------------------------ 2: a whole sample divided by 0 before the call: not "bad data"


def _parked_car(mode: str) -> nanwatch.AnomalyError:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(8, 2))
    x = torch.randn(6, 4, 2)
    x[3] = 0.0  # a parked car: speed 0
    speed = (x[:, -1] - x[:, -2]).norm(dim=-1, keepdim=True)
    try:
        with nanwatch.watch(enc, mode=mode):
            enc(x / speed[:, :, None]).sum().backward()
    except nanwatch.AnomalyError as e:
        return e
    raise AssertionError("no anomaly")


def test_a_sample_divided_by_zero_before_the_call_is_not_asserted_to_be_bad_data() -> None:
    err = _parked_car("watch")
    head = str(err).splitlines()[0]
    assert "bad data" not in head and "in the input data" not in head, head
    assert "input[0] of Sequential in sample 3" in head, head
    assert "the batch, or your code that ran on it before the model's call" in head, head
    assert "mode='forensic'" in head, head
    assert err.anomaly is not None and err.anomaly.origin == "data-or-code"
    line = anomaly_headline(err.anomaly)
    assert line.endswith(
        "(input[0] of Sequential): the batch, or your code before the call, step 0"
    )
    # the mode it points to names the op
    d = _parked_car("forensic").diagnoses[0]
    assert d.code == "NW111"


def test_a_missing_value_of_a_loaded_batch_is_still_bad_data() -> None:
    enc = nn.Linear(4, 2)
    x = torch.randn(5, 4)
    x[2, 1] = float("nan")
    with pytest.raises(nanwatch.AnomalyError) as caught, nanwatch.watch(enc):
        enc(x).sum().backward()
    assert "(bad data, not a layer)" in str(caught.value).splitlines()[0]


# ------------------------------ 3: a check refused a NaN no watched value held: name the op


def _sample(mode: str, tmp_path: Path) -> tuple[Report, str]:
    torch.manual_seed(0)
    m = nn.Linear(4, 5)
    x = torch.randn(2, 4)
    watch = nanwatch.watch(m, mode=mode, report_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="probability tensor"), watch as nw:
        m(x).sum().backward()
        nw.step()
        with torch.no_grad():
            probs = (m(x) / 0.0).softmax(-1)  # temperature 0
            torch.multinomial(probs, 1)
    (path,) = tmp_path.glob("*.json")
    report = Report.load(path)
    c = _console()
    c.print(report_summary(report, [path.name]))
    return report, str(c.file.getvalue())  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_refused_nan_made_after_the_model_points_to_forensic_mode(
    mode: str, tmp_path: Path
) -> None:
    report, out = _sample(mode, tmp_path)
    err = report.error
    assert err is not None and err["class"] == "non-finite"
    advice = str(err["advice"])
    first = advice[: advice.find(". ") + 1]
    assert "made by your code between the model's output and this check" in first
    assert 'mode="forensic"' in first and "nw.replay(step_fn)" in first, first
    hint = next(ln for ln in out.splitlines() if ln.startswith("  → "))
    assert 'mode="forensic"' in hint and "nw.replay(step_fn)" in hint, out


def test_forensic_mode_names_the_op_and_is_not_told_to_run_forensic(tmp_path: Path) -> None:
    report, out = _sample("forensic", tmp_path)
    assert report.error is not None and 'mode="forensic"' not in str(report.error["advice"])
    assert "NW111" in out, out


# ------------------------------ 4: sqrt(0) is 0 in the forward: the log of it made the -inf


def test_the_forward_op_of_a_loss_is_the_log_of_a_sqrt_of_zero_not_the_sqrt() -> None:
    from nanwatch.localize import forward_birth
    from nanwatch.ops import graph_evidence

    out = torch.randn(4, requires_grad=True)
    r = torch.full((4,), 20.0, requires_grad=True)
    one_m = 1 - torch.tanh(r) ** 2  # 0 in float32: rho saturated
    loss = torch.log(2 * math.pi * out.exp() * torch.sqrt(one_m)).mean()
    _, events = graph_evidence(loss.grad_fn, output=loss)
    ops = [ev.op for ev in events]
    assert ops.index("aten.sqrt") < ops.index("aten.log"), ops  # nearest the inputs first
    ev = forward_birth(events)
    assert ev is not None and ev.op == "aten.log" and ev.born == "-inf"
    assert ev.output.neginf == 4
