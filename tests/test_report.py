"""Report: built from the watcher (host data only), versioned JSON that round-trips, files
by suffix, the Jupyter and print() displays."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import nn

import nanwatch
from nanwatch import scenarios
from nanwatch.errors import ReportFormatError
from nanwatch.records import Phase, Record, StepTrace, TensorStat
from nanwatch.report import SCHEMA_VERSION, Report
from nanwatch.rules.base import Diagnosis
from tests import _report_fixtures as fx
from tests.test_postmortem import NoTensorOps


def _text(report: Report) -> str:
    console = Console(width=100, color_system=None, file=io.StringIO())
    console.print(report)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


@pytest.fixture(scope="module")
def explode() -> scenarios.Outcome:
    """lr-explode with a 12-step ring: 14 steps run, the first 2 dropped."""
    return scenarios.run(scenarios.get("lr-explode"), ring_size=12)


def test_report_from_a_scenario_holds_the_flight_recorder(explode: scenarios.Outcome) -> None:
    assert explode.watcher is not None
    report = explode.watcher.report
    last = explode.watcher.step_index - 1
    assert [t.step for t in report.steps] == list(range(last - 11, last + 1)), "the last 12"
    assert report.config["ring_size"] == 12
    a = report.first_anomaly
    assert a is not None and a.parameter == "proj.weight"
    assert report.steps[0].step < a.step, "the steps before the failure are kept"
    assert report.anomaly_count == len(explode.watcher.anomalies) > 1
    assert report.headline == f"-inf in the weights proj.weight after an update, step {a.step}"
    assert report.status in ("error", "anomaly")
    env = report.environment
    assert env.torch == torch.__version__ and env.mode == "watch"
    assert env.devices == ["cpu"] and env.amp_dtypes == ["float16"]
    assert env.dtype_limits["float16"] == 65504.0
    assert env.modules == len(explode.watcher.module_paths)
    assert env.rank is None
    # the drift before the failure is in the recorder, step by step
    before = [t.max_logit or 0.0 for t in report.steps if t.step < a.step]
    assert before[-1] > 5 * before[0] > 11.09  # logits past float16's exp bound, growing
    codes = [d.code for d in report.diagnoses]
    assert len(codes) == len(set(codes)), "each diagnosis once"
    assert all(report.diagnosis_steps[c] >= 1 for c in codes)


def test_json_round_trip_renders_identically(tmp_path: Path, explode: scenarios.Outcome) -> None:
    assert explode.watcher is not None
    report = explode.watcher.report
    path = report.save(tmp_path / "run.json")
    loaded = Report.load(path)
    assert loaded.to_dict() == json.loads(report.to_json())
    assert _text(loaded) == _text(report)
    assert loaded.to_html() == report.to_html()


def test_json_is_strict_and_nan_travels_as_strings(explode: scenarios.Outcome) -> None:
    assert explode.watcher is not None
    report = explode.watcher.report
    report.config["odd"] = {"nested": [math.nan, math.inf]}  # anything a rule may leave
    text = report.to_json()

    def refuse(name: str) -> Any:
        raise AssertionError(f"bare {name} in the JSON")

    data = json.loads(text, parse_constant=refuse)
    assert data["schema_version"] == SCHEMA_VERSION == "1.0"
    assert data["config"]["odd"] == {"nested": ["NaN", "Infinity"]}
    assert '"NaN"' in text, "non-finite statistics are kept, as strings"
    last = Report.from_dict(data).steps[-1]
    assert last.loss is not None and math.isnan(last.loss)


def test_loader_rejects_another_major_version_and_names_the_fix(tmp_path: Path) -> None:
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"schema_version": "2.1", "environment": {"nanwatch": "3.0"}}))
    with pytest.raises(ReportFormatError, match=r"schema version 2\.1") as info:
        Report.load(future)
    message = str(info.value)
    assert "nanwatch 3.0" in message and "1.x" in message and "pip install -U nanwatch" in message
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema_version": "0.9"}))
    with pytest.raises(ReportFormatError, match="render it with the nanwatch version that wrote"):
        Report.load(old)


def test_loader_reads_a_newer_minor_version_and_ignores_unknown_fields(tmp_path: Path) -> None:
    data = Report(steps=[StepTrace(step=3, loss=1.5)]).to_dict()
    data["schema_version"] = "1.7"
    data["something_new"] = {"x": 1}
    data["steps"][0]["also_new"] = True
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(data))
    report = Report.load(path)
    assert report.steps[0].step == 3 and report.steps[0].loss == 1.5
    assert report.schema_version == "1.7"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "holds a list"),
        ('{"steps": []}', "no schema_version"),
        ('{"schema_version": "1.0", "steps": [{"records": []}]}', "damaged"),
    ],
)
def test_loader_explains_a_file_that_is_not_a_report(
    tmp_path: Path, content: str, match: str
) -> None:
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(ReportFormatError, match=match):
        Report.load(path)


def test_loader_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ReportFormatError, match=r"cannot read report .*missing\.json"):
        Report.load(tmp_path / "missing.json")


def test_save_chooses_the_format_by_suffix(tmp_path: Path) -> None:
    report = fx.load("healthy-fp16")
    assert json.loads(report.save(tmp_path / "a.json").read_text())["schema_version"] == "1.0"
    for name in ("b.html", "c.HTM"):
        assert report.save(tmp_path / name).read_text().startswith("<!DOCTYPE html>")
    with pytest.raises(ReportFormatError, match=r"'\.txt'.*\.json.*\.html"):
        report.save(tmp_path / "d.txt")
    assert not (tmp_path / "d.txt").exists()
    json_path, html_path = report.save_all(tmp_path / "new" / "dir", stem="run-7")
    assert json_path == tmp_path / "new" / "dir" / "run-7.json" and json_path.exists()
    assert html_path == tmp_path / "new" / "dir" / "run-7.html" and html_path.exists()
    leftovers = [p.name for p in (tmp_path / "new" / "dir").iterdir()]
    assert sorted(leftovers) == ["run-7.html", "run-7.json"], "no temporary files left"


def test_building_a_report_touches_no_tensor() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with nanwatch.watch(model, on_anomaly="record") as nw:
        for _ in range(3):
            model(torch.randn(5, 4)).sum().backward()
            nw.step()
        model(torch.randn(5, 4))  # a step in progress
        with NoTensorOps(strict=True) as forbid:
            forbid.armed = True
            report = Report.from_watcher(nw, RuntimeError("boom"))
            text = _text(report)
            page = report.to_html(standalone=True)
            forbid.armed = False
        assert forbid.violations == []
    assert report.partial_step == 3 and "in progress" in text
    assert "<html" in page


def test_a_step_in_progress_shows_unknown_not_nan_for_pending_statistics() -> None:
    """On accelerators statistics wait on the device until the step's flush; a report made
    before it (SIGTERM mid-step) must not read the placeholders as NaN."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with nanwatch.watch(model, on_anomaly="record") as nw:
        nw._defer_cpu = True  # the accelerator path, on CPU
        model(torch.randn(5, 4))
        report = Report.from_watcher(nw)
        assert nw.trace.records and nw._pending, "the watcher has statistics pending"
    partial = report.steps[-1]
    assert report.partial_step == partial.step == 0
    assert all(r.stat is None for r in partial.records), "pending statistics are unknown"
    assert report.status == "ok" and report.first_anomaly is None


def test_rank_comes_from_torch_distributed_or_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    model = nn.Linear(2, 2)
    with nanwatch.watch(model) as nw:
        model(torch.randn(1, 2))
    report = nw.report
    assert (report.rank, report.environment.world_size) == (3, 8)
    assert "rank 3" in _text(report)
    assert "<dt>rank</dt><dd>3 of 8</dd>" in report.to_html()


def test_diagnoses_are_gathered_once_each_with_the_anomaly_step_first() -> None:
    def diag(code: str, step: int, severity: str = "warning") -> Diagnosis:
        return Diagnosis(code=code, title=f"t{code}", severity=severity, step=step)  # type: ignore[arg-type]

    rec = Record(
        0,
        2,
        Phase.FORWARD,
        "m",
        "output",
        "float32",
        "cpu",
        (1,),
        stat=TensorStat(math.nan, math.nan, 1, nan=1, posinf=0, neginf=0),
        call=0,
    )
    steps = [StepTrace(step=i) for i in range(4)]
    steps[0].diagnoses = [diag("NW103", 0)]
    steps[1].diagnoses = [diag("NW103", 1)]
    steps[2].diagnoses = [diag("NW103", 2), diag("NW101", 2, "error")]
    steps[3].diagnoses = [diag("NW101", 3, "error")]
    from nanwatch.records import Anomaly, AnomalyKind

    steps[2].anomaly = Anomaly(
        step=2,
        kind=AnomalyKind.FORWARD,
        path="m",
        record=rec,
        origin="module",
        summary="NaN born in m",
    )
    from nanwatch.report import _gather_diagnoses

    ds, counts = _gather_diagnoses(steps, first_step=2)
    assert [(d.code, d.step) for d in ds] == [("NW101", 2), ("NW103", 2)]
    assert counts == {"NW103": 3, "NW101": 2}


def test_print_and_repr(capsys: pytest.CaptureFixture[str]) -> None:
    report = fx.load("sqrt-backward")
    print(report)
    out = capsys.readouterr().out
    assert "NaN gradient born in the backward of distance" in out
    assert "\x1b[" not in out, "no color codes when stdout is not a terminal"
    assert repr(report).startswith("<nanwatch.Report error: steps 0-2")


def test_flight_recorder_memory_is_bounded_by_the_ring() -> None:
    """A 100-module model: each recorded step costs memory, and once the ring is full the
    memory stays flat (dropped steps are freed). See benchmarks/recorder_bytes.py."""
    from benchmarks import recorder_bytes

    out = recorder_bytes.main(["--steps", "3", "--ring", "4"])
    assert out["modules"] == 100
    assert out["bytes_per_step"] > 10_000
    # a leak would keep a whole step per step; the slack is the hook-tracking fixture of
    # conftest.py, which keeps every RemovableHandle nanwatch creates (~100 a step)
    assert abs(out["flat_growth_per_step"]) < 0.25 * out["bytes_per_step"]


def test_every_error_class_the_post_mortem_names_has_a_label() -> None:
    # a class without one reads "exception" in the report's headline
    from nanwatch import postmortem
    from nanwatch.report import ERROR_LABELS

    classes = {c for c, _ in postmortem._CLASSES} | set(postmortem.ADVICE)
    assert sorted(classes - set(ERROR_LABELS)) == []
