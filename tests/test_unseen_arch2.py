"""Findings the report must not hide, and architectures the hooks had not met: one rule code
found in two places across steps (two problems, two diagnoses), and NaN/inf faults in
recurrent, checkpointed, weight-tied and attention models.

Each is a tiny real model run under ``nanwatch.watch`` with ``on_anomaly="record"`` on CPU;
assertions read what a user reads: ``nw.report`` and ``str(nw.report)``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.report import Report

# ---------------------------------------------------------------- one code, two places


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class _TwoLogs(nn.Module):
    """Two log branches feeding one head: a zero in either branch's slice is a log(0)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _Log()
        self.b = _Log()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.a(x[:, :2]), self.b(x[:, 2:])], -1))


def _two_origins() -> Report:
    torch.manual_seed(0)
    m = _TwoLogs()
    batches = [torch.tensor([[0.0, 1.0, 1.0, 1.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])]
    with nanwatch.watch(m, on_anomaly="record") as nw:
        for x in batches:
            m(x).mean().backward()
            nw.step()
    return nw.report


def test_one_code_from_two_origins_is_two_findings(tmp_path: Path) -> None:
    """Step 0's inf in ``head`` grew out of a log(0) in ``a``, step 1's out of one in ``b``:
    the same code at the same module, two problems. Both stay in the report, each counted
    in the one step it was found in; the printed report names both origins."""
    report = _two_origins()
    found = [d for d in report.diagnoses if d.severity == "error"]
    assert [d.step for d in found] == [0, 1], [d.headline for d in found]
    first, second = found
    assert first.code == second.code, "one code (NW110; NW100 where the log is not traced)"
    # at head, fed by a / by b; or, where the log was traced, at a / at b
    assert first.path == "a" or "in a (forward, output)" in " ".join(first.evidence)
    assert second.path == "b" or "in b (forward, output)" in " ".join(second.evidence)
    assert report.steps_of(first) == report.steps_of(second) == 1
    assert report.diagnosis_steps[first.code] == 2, "by code: fired in both steps"
    out = str(report)
    assert "Diagnoses (2)" in out
    assert "in 2 steps" not in out, "neither finding recurred"
    later = next(line for line in out.splitlines() if line.startswith("Later anomalies"))
    assert later in (
        "Later anomalies: step 1 at head (from -inf in b)",
        "Later anomalies: step 1 at b",
    ), later
    # a saved and reloaded report keeps both, and their counts
    loaded = Report.load(report.save(tmp_path / "run.json"))
    again = [d for d in loaded.diagnoses if d.severity == "error"]
    assert [(d.code, d.step) for d in again] == [(first.code, 0), (first.code, 1)]
    assert [loaded.steps_of(d) for d in again] == [1, 1]

    # the same log(0) in ``a`` every step is one problem: one diagnosis, "in 3 steps"
    torch.manual_seed(0)
    m = _TwoLogs()
    x = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    with nanwatch.watch(m, on_anomaly="record") as nw:
        for _ in range(3):
            m(x).mean().backward()
            nw.step()
    report = nw.report
    found = [d for d in report.diagnoses if d.severity == "error"]
    assert len(found) == 1, [d.headline for d in found]
    assert report.steps_of(found[0]) == 3
    out = str(report)
    assert "in 3 steps" in out
    assert "(from -inf in" not in out, "the same origin every step is not news"


# ---------------------------------------------------------------- one problem, seen again


class _Scaled(nn.Module):
    """Two heads in a ModuleDict, scaled by a ParameterList: the divisor's scale is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 2)})
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(2)) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["a"](x) * self.scales[0] + self.heads["b"](x) / self.scales[1]


class _Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        out, _ = self.att(x, x, x, key_padding_mask=pad)
        return self.head(out)


def test_a_problem_seen_again_untraced_is_the_explained_finding() -> None:
    """Watch mode pinpoints the op once: the next step's same anomaly is seen without it.
    The report keeps the explained finding (division by zero at the ParameterList's zero
    scale; a fully masked key_padding_mask row), counted in both steps, with no catch-all
    "no specific rule matches" NW100 and no second copy beside it."""
    torch.manual_seed(0)
    m = _Scaled()
    with torch.no_grad():
        m.scales[1].zero_()
    x = torch.randn(4, 4)
    with nanwatch.watch(m, on_anomaly="record") as nw:
        for _ in range(2):
            m(x).mean().backward()
            m.zero_grad()
            nw.step()
    report = nw.report
    assert [d.code for d in report.diagnoses if d.severity == "error"] == ["NW111"]
    assert report.steps_of(report.diagnoses[0]) == 2
    assert "NW100" not in str(report).split("Where it went wrong")[0]

    torch.manual_seed(0)
    a = _Attend()
    x = torch.randn(2, 5, 8)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1] = True  # the second sequence is all padding
    with nanwatch.watch(a, on_anomaly="record") as nw:
        for _ in range(2):
            a(x, pad).mean().backward()
            a.zero_grad()
            nw.step()
    report = nw.report
    found = [d for d in report.diagnoses if d.severity == "error"]
    assert [d.code for d in found] == ["NW402"], [d.headline for d in found]
    assert found[0].path == "att" and report.steps_of(found[0]) == 2


# ---------------------------------------------------------------- torch.compile


class _LogHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.log(torch.relu(self.body(x))))  # log(0) where relu is 0


@pytest.mark.gpu_bound_weaker(
    reason="nothing has landed when backward begins: the loss's graph is not walked, so its "
    "CompiledFunction node is not seen"
)
def test_nan_inside_a_compiled_model_says_so() -> None:
    """The model runs under torch.compile, which traces the hooks away: the NaN reaches the
    loss with no watched module run. The diagnosis says the NaN is inside the compiled
    model (the loss's graph holds its CompiledFunction), not in the loss code, and that the
    eager module is the one to run while debugging (forensic mode cannot trace it either)."""
    import shutil
    import warnings

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    for mode in ("watch", "sentinel"):
        torch.manual_seed(0)
        m = _LogHead()
        compiled = torch.compile(m, mode="default")
        x = torch.randn(4, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", nanwatch.NanwatchWarning)
            with nanwatch.watch(m, mode=mode, on_anomaly="record") as nw:
                for _ in range(2):
                    compiled(x).mean().backward()
                    m.zero_grad()
                    nw.step()
        top = nw.report.top
        assert top is not None, mode
        assert "torch.compile'd model" in top.title, (mode, top.headline)
        assert "CompiledFunctionBackward" in " ".join(top.evidence)
        assert "_orig_mod" in top.fix and "forensic" not in top.fix


# ---------------------------------------------------------------- two births, one step


class _TwoBranches(nn.Module):
    """A log of a relu in two branches: both are 0 somewhere, in the same step."""

    def __init__(self) -> None:
        super().__init__()
        self.la = nn.Linear(4, 4)
        self.lb = nn.Linear(4, 4)
        self.a = _Log()
        self.b = _Log()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left = self.a(torch.relu(self.la(x)))
        right = self.b(torch.relu(self.lb(x)))
        return self.head(torch.cat([left, right], -1))


def test_a_second_birth_in_the_same_step_is_named(tmp_path: Path) -> None:
    """``a`` and ``b`` each take a log(0) from finite inputs in the same step: the report
    follows the first (a's -inf, NaN in head) and names b's too, a separate problem that
    fixing a alone would only uncover; in the terminal and in the HTML."""
    torch.manual_seed(0)
    m = _TwoBranches()
    x = torch.randn(8, 4)
    with nanwatch.watch(m, on_anomaly="record") as nw:
        m(x).mean().backward()
        nw.step()
    report = nw.report
    first = report.first_anomaly
    assert first is not None
    blamed = first.neginf_source.path if first.neginf_source is not None else first.path
    other = "b" if blamed == "a" else "a"
    out = " ".join(str(report).split())
    line = (
        "Also born in step 0, from finite inputs (a separate problem, not fed by this one): "
        f"-inf in the output of {other}."
    )
    assert line in out
    html = report.save(tmp_path / "run.html").read_text()
    assert f"-inf in the output of {other}." in html
