"""`nanwatch demo`: the gallery of real failures, each shown as one compact panel (what went
wrong and where, the diagnosis, the evidence, the fix), listed, chosen by name, saved as full
reports, and an exit code that says whether every scenario was diagnosed as expected."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import re
from pathlib import Path

import pytest
from rich.console import Console

import nanwatch
from nanwatch import cli, scenarios
from nanwatch.render import demo_summary
from nanwatch.report import Report
from nanwatch.scenarios import Expected, Outcome, Scenario

SCENARIO_DIR = str(Path(scenarios.__file__).resolve().parent)
_PANEL_TOP = re.compile(r"^╭─ (?P<name>\S+)(?: · .*?)? ─+╮$")
_PANEL_BOTTOM = re.compile(r"^╰─+ (?P<verdict>.+?) · (?P<seconds>[\d.]+) s ─╯$")
_RICH_ENV = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "NO_COLOR", "JUPYTER_COLUMNS")


@dataclasses.dataclass
class Panel:
    name: str
    lines: list[str]  #: the rows between the borders, border characters stripped
    verdict: str
    seconds: float

    @property
    def text(self) -> str:
        """The rows joined, labels and wrapping undone: phrases can be searched whole."""
        return " ".join(" ".join(ln.split()) for ln in self.lines)

    def row(self, label: str) -> str:
        """The text of the row with this label and the unlabeled lines after it (its wrapped
        continuation, and a diagnosis' evidence or the fix's "… more lines")."""
        out: list[str] = []
        for ln in self.lines:
            head, body = ln[:7].strip(), ln[7:].strip()
            if out and head:
                break
            if head == label or out:
                out.append(body)
        return " ".join(out)


def panels(output: str) -> list[Panel]:
    """The demo's panels, in the order printed."""
    found: list[Panel] = []
    current: tuple[str, list[str]] | None = None
    for line in output.splitlines():
        top = _PANEL_TOP.match(line)
        bottom = _PANEL_BOTTOM.match(line)
        if top:
            current = (top["name"], [])
        elif bottom and current is not None:
            found.append(Panel(current[0], current[1], bottom["verdict"], float(bottom["seconds"])))
            current = None
        elif current is not None and line.startswith("│ ") and line.endswith(" │"):
            current[1].append(line[2:-2])
    return found


def _plain_console_env(monkeypatch: pytest.MonkeyPatch, columns: int) -> None:
    for name in _RICH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", str(columns))


def render(outcome: Outcome, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None, highlight=False)
    console.print(demo_summary(outcome))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def _source_line(scenario: str, code: str) -> int:
    """The line number of ``code`` in the scenario's module (never hard-coded)."""
    module = importlib.import_module(scenarios.get(scenario).module)
    lines = Path(str(module.__file__)).read_text(encoding="utf-8").splitlines()
    return next(i + 1 for i, ln in enumerate(lines) if ln.strip() == code)


# ---------------------------------------------------------------------- the whole gallery
@pytest.fixture(scope="module")
def gallery(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str]:
    """`nanwatch demo` on the whole gallery, once, at 80 columns, from a scratch directory."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        _plain_console_env(mp, 80)
        mp.chdir(tmp_path_factory.mktemp("gallery"))
        with contextlib.redirect_stdout(out):
            code = cli.main(["demo"])
    return code, out.getvalue()


@pytest.mark.slow
def test_the_whole_gallery_is_diagnosed_as_expected_and_exits_0(gallery: tuple[int, str]) -> None:
    code, out = gallery
    shown = panels(out)
    assert [p.name for p in shown] == scenarios.names()
    assert [p.verdict for p in shown] == ["✓ as expected"] * len(shown), out
    assert code == 0


@pytest.mark.slow
def test_each_panel_names_the_expected_diagnosis_once_with_a_fix(
    gallery: tuple[int, str],
) -> None:
    _, out = gallery
    by_name = {p.name: p for p in panels(out)}
    for s in scenarios.all_scenarios():
        p = by_name[s.name]
        exp = s.expected
        if exp.diagnosis is not None:
            # the code opens its own row, once: the headline is not repeated below it
            assert [ln[:7].strip() for ln in p.lines].count(exp.diagnosis) == 1, p.lines
            assert p.row("fix"), f"{s.name}: no fix shown"
        if exp.path is not None:
            assert exp.path in p.row("what"), f"{s.name}: {p.row('what')!r}"
        if exp.op is not None:
            assert exp.op in p.row("at"), f"{s.name}: {p.row('at')!r}"
        if exp.healthy:
            assert "No anomaly" in p.row("what")
            assert p.row("fix") == ""


@pytest.mark.slow
def test_the_gallery_is_readable_at_80_columns(gallery: tuple[int, str]) -> None:
    _, out = gallery
    assert SCENARIO_DIR not in out  # source paths are short: file.py:line
    assert "nanwatch/scenarios/" not in out
    assert "…" not in re.sub(r"… \d+ more lines? in the full report", "", out)  # nothing cut
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 80
    # a fix's line of code is never broken in two: its comment moved above it instead
    fix = "return (x - lo) / (hi - lo).clamp_min(torch.finfo(hi.dtype).eps)"
    assert any(ln.strip(" │") == fix for ln in lines)  # the user's line, kept off 0
    assert any("# 0/eps = 0 where the denominator is 0" in ln for ln in lines)


@pytest.mark.slow
def test_the_fp16_panel_shows_the_early_warning_before_the_overflow(
    gallery: tuple[int, str],
) -> None:
    _, out = gallery
    p = next(p for p in panels(out) if p.name == "fp16-seg-overflow")
    # the exp made +inf, a division after it NaN: what was born first, then what it became
    what = re.search(
        r"step (\d+): \+inf born in the forward of SegLoss \(SegLoss\) \(then NaN\)", p.text
    )
    warned = re.search(r"NW103 .* \(step (\d+), (\d+) steps before\)", p.row("warned"))
    assert what is not None and warned is not None, p.text
    overflow, first = int(what[1]), int(warned[1])
    assert first < overflow and int(warned[2]) == overflow - first
    assert "aten.exp" in p.row("at")
    assert "float16 segmentation head" in p.text  # the title, inside: too long for the border
    assert "logits.float()" in p.row("fix")


# ---------------------------------------------------------------------- the command
def test_list_names_every_scenario_and_runs_none(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _plain_console_env(monkeypatch, 120)

    def must_not_run(*args: object, **kwargs: object) -> Outcome:
        raise AssertionError("--list ran a scenario")

    monkeypatch.setattr(scenarios, "run", must_not_run)
    assert cli.main(["demo", "--list"]) == 0
    listed = [ln.split()[0] for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert listed == scenarios.names()


def test_demo_name_runs_only_that_scenario_and_shows_op_line_diagnosis_and_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _plain_console_env(monkeypatch, 80)
    assert cli.main(["demo", "div-by-zero"]) == 0
    out = capsys.readouterr().out
    (p,) = panels(out)
    assert p.name == "div-by-zero" and p.verdict == "✓ as expected"
    line = _source_line("div-by-zero", "return (x - lo) / (hi - lo)")
    assert "NaN born in the forward of norm (MinMaxScale)" in p.row("what")
    at = p.row("at")
    assert "aten.div" in at and f"div_by_zero.py:{line}" in at
    assert "return (x - lo) / (hi - lo)" in at
    assert p.lines[2].startswith("NW111  Division by zero")
    assert "denominator holds 1 exact zero" in p.text  # the evidence, with its numbers
    assert "return (x - lo) / (hi - lo).clamp_min(torch.finfo(hi.dtype).eps)" in p.row("fix")
    assert p.text.count("Division by zero") == 1


def test_a_guard_error_shows_its_whole_message_and_the_one_line_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _plain_console_env(monkeypatch, 80)
    assert cli.main(["demo", "target-255"]) == 0
    (p,) = panels(capsys.readouterr().out)
    what = p.row("what")
    assert what.startswith("step 0: GuardError")
    assert what.endswith("did you mean ignore_index=255?")
    line = _source_line("target-255", "loss = criterion(model(images), masks)")
    assert f"target_255.py:{line}" in what and os.sep + "target_255.py" not in what
    assert p.row("at") == "loss = criterion(model(images), masks)"  # file:line said once
    assert p.row("NW501").startswith("Class target out of range first positions: (0, 1, 46)")
    assert p.row("fix") == "criterion = nn.CrossEntropyLoss(ignore_index=255)"


def test_a_diagnosis_without_nan_is_said_once_with_where_it_fired(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _plain_console_env(monkeypatch, 80)
    assert cli.main(["demo", "sigmoid-bce"]) == 0
    (p,) = panels(capsys.readouterr().out)
    assert p.text.count("Sigmoid followed by BCELoss") == 1
    assert p.text.count("NW202") == 1
    where = p.row("where")
    # a note at step 0 (healthy); the warning once the probabilities near 1 is what is shown
    assert where.startswith("BCELoss (forward), step 6 at sigmoid_bce.py:")
    assert "loss = criterion(model(x), y)" in where
    assert "within 4 × eps = 4.77e-07 of 1" in p.text  # evidence with numbers
    assert "criterion = nn.BCEWithLogitsLoss()" in p.row("fix")


def test_report_dir_writes_each_scenarios_full_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _plain_console_env(monkeypatch, 100)
    out_dir = tmp_path / "reports"
    assert cli.main(["demo", "target-255", "broadcast-mse", "--report-dir", str(out_dir)]) == 0
    assert [p.name for p in panels(capsys.readouterr().out)] == ["target-255", "broadcast-mse"]
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "broadcast-mse.html",
        "broadcast-mse.json",
        "target-255.html",
        "target-255.json",
    ]
    for name in ("target-255", "broadcast-mse"):
        report = Report.load(out_dir / f"{name}.json")
        assert report.top is not None
        assert report.top.code == scenarios.get(name).expected.diagnosis
        assert report.error is not None and report.error["type"].endswith("GuardError")
        page = (out_dir / f"{name}.html").read_text(encoding="utf-8")
        assert page.startswith("<!DOCTYPE html>") and report.top.code in page


def test_the_exit_code_is_1_when_a_scenario_is_not_diagnosed_as_expected(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _plain_console_env(monkeypatch, 100)
    real = scenarios.get("div-by-zero")
    wrong = dataclasses.replace(
        real, expected=dataclasses.replace(real.expected, diagnosis="NW112")
    )
    monkeypatch.setattr(scenarios, "get", lambda name: wrong)
    assert cli.main(["demo", "div-by-zero"]) == 1
    (p,) = panels(capsys.readouterr().out)
    assert p.verdict == "✓ localized, ✗ diagnosis differs"
    assert "top diagnosis: expected NW112, got NW111" in p.text


# ---------------------------------------------------------------------- the panel
def test_at_120_columns_op_source_and_code_share_one_line() -> None:
    outcome = scenarios.run(scenarios.get("div-by-zero"))
    out = render(outcome, 120)
    line = _source_line("div-by-zero", "return (x - lo) / (hi - lo)")
    assert re.search(
        rf"│ at +aten\.div\.Tensor at div_by_zero\.py:{line}  return \(x - lo\) / \(hi - lo\) +│",
        out,
    ), out
    assert max(len(ln) for ln in out.splitlines()) == 120
    # the fix is the user's own line, its denominator kept off 0
    assert "return (x - lo) / (hi - lo).clamp_min(torch.finfo(hi.dtype).eps)" in out


def test_the_panel_says_what_the_run_found_not_what_was_expected() -> None:
    """The panel is computed from the run: a scenario that crashes before watch() shows
    its exception, and an expectation it does not meet is marked ✗."""

    def train(watch: object) -> None:
        raise ValueError("the dataset path does not exist: /data/voc")

    broken = Scenario(
        name="broken",
        title="Crashes before training starts",
        doc="",
        expected=Expected(kind=nanwatch.AnomalyKind.FORWARD, diagnosis="NW111"),
        train=train,
        module=__name__,
    )
    outcome = scenarios.run(broken)
    (p,) = panels(render(outcome, 100))
    assert p.row("what") == "ValueError: the dataset path does not exist: /data/voc"
    assert p.verdict == "✗ differs from the expected result"
    assert p.row("✗").startswith("unexpected exception ValueError")
    assert "NW111" not in p.row("what")


@pytest.mark.slow
def test_the_gallery_ends_with_how_many_matched(gallery: tuple[int, str]) -> None:
    _, out = gallery
    n = len(scenarios.names())
    assert f"✓ {n}/{n} scenarios diagnosed as expected" in out
    assert "full reports: nanwatch demo --report-dir DIR" in out
