"""Rendering: the terminal report against golden files, widths, colors, cuts, the HTML page
(structure in CI; a real browser when chromium is installed), the demo panels.

Golden files: ``tests/golden/<name>.txt`` is the report ``tests/golden/<name>.json``
rendered on a pinned ``Console(width=100, color_system=None)``. After an intended change,
regenerate with ``NANWATCH_REGEN_GOLDEN=1 python -m pytest tests/test_render.py`` and read
the diff (``NANWATCH_REGEN_GOLDEN=fixtures`` rebuilds the JSON inputs from the gallery).
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import re
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rich.console import Console
from rich.theme import Theme

from nanwatch import scenarios
from nanwatch.errors import ReportFormatError
from nanwatch.records import AnomalyKind, Phase, Record, StepTrace, TensorStat
from nanwatch.render import demo_summary, heatmap_data, render_report_file, report_html
from nanwatch.report import Report
from nanwatch.rules.base import Diagnosis
from tests import _report_fixtures as fx


def _pinned() -> Console:
    return Console(width=100, color_system=None, file=io.StringIO())


def _render(renderable: object, console: Console | None = None) -> str:
    c = console or _pinned()
    c.print(renderable)
    out = c.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


# ---------------------------------------------------------------------- golden files
@pytest.mark.parametrize("name", fx.NAMES)
def test_terminal_rendering_matches_the_golden_file(name: str) -> None:
    text = _render(fx.load(name))
    golden = fx.GOLDEN / f"{name}.txt"
    if fx.regen_mode() or not golden.exists():
        golden.write_text(text, encoding="utf-8")
    expected = golden.read_text(encoding="utf-8")
    if text != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                text.splitlines(keepends=True),
                "golden",
                "rendered",
            )
        )
        pytest.fail(
            f"the rendering of {name} changed; if intended, regenerate with "
            f"NANWATCH_REGEN_GOLDEN=1 python -m pytest tests/test_render.py\n{diff}"
        )


def test_golden_reports_say_what_a_user_needs() -> None:
    """The goldens are not just stable: they hold the facts the report exists for."""
    fp16 = _render(fx.load("fp16-seg-overflow"))
    assert "+inf born in the forward of SegLoss by aten.exp" in fp16
    assert "step 31" in fp16
    assert "earlier steps left out" in fp16  # 32 recorded steps, 12 shown
    assert re.search(r"31 +NaN +NaN +17\.16", fp16), "the timeline shows the logit climb"
    assert "float16" in fp16 and "low-precision dtypes" in fp16

    backward = _render(fx.load("sqrt-backward"))
    assert "gradients of the outputs" in backward and "max |grad|" in backward
    assert "distance ◀" in backward

    crash = _render(fx.load("inplace-saved"))
    assert "What ended the run: autograd in-place error" in crash
    assert "modified by an inplace operation" in crash

    cuda = _render(fx.load("cuda-assert"))
    assert "CUDA device-side assert" in cuda
    assert "kernels run asynchronously: the failing one is among these" in cuda
    assert "CUDA_LAUNCH_BLOCKING=1" in cuda
    assert "nothing was read from the GPU" in cuda

    healthy = _render(fx.load("healthy-fp16"))
    assert "✓ No anomaly in 4 recorded steps" in healthy


def test_the_culprit_sits_in_a_tree_of_its_ancestors_with_statistics() -> None:
    outcome = scenarios.run(scenarios.get("deep-nan"))
    assert outcome.watcher is not None
    text = _render(outcome.watcher.report)
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if "The module and its ancestors" in ln)
    tree = "\n".join(lines[head : head + 12])
    # ancestors, each named relative to its parent, then the culprit among its siblings
    for fragment in ("Model", "└─ encoder", "└─ blocks.3", "└─ mlp", "├─ fc1", "act ◀"):
        assert fragment in tree, (fragment, tree)
    row = next(ln for ln in lines if "act ◀" in ln)
    assert "PowerAct" in row and "float32" in row and "(4, 10, 64)" in row
    m = re.search(r"(\d+\.\d+) +(\d+) +0 *$", row)
    assert m, "max |x| over the finite values, NaN and inf counts"
    assert int(m.group(2)) > 0, "the NaN count of the culprit"


# ---------------------------------------------------------------------- widths, colors, theme
def test_width_follows_the_console() -> None:
    report = fx.load("fp16-seg-overflow")
    for width in (60, 140):
        console = Console(width=width, color_system=None, file=io.StringIO())
        text = _render(report, console)
        assert max(len(line) for line in text.splitlines()) <= width
    narrow = _render(report, Console(width=60, color_system=None, file=io.StringIO()))
    wide = _render(report, Console(width=140, color_system=None, file=io.StringIO()))
    assert max(map(len, wide.splitlines())) > 100 >= max(map(len, narrow.splitlines()))


def test_colors_follow_the_terminal_and_no_color_is_honored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    report = fx.load("fp16-seg-overflow")
    monkeypatch.delenv("NO_COLOR", raising=False)
    colored = _render(
        report,
        Console(width=100, force_terminal=True, color_system="truecolor", file=io.StringIO()),
    )
    assert re.search(r"\x1b\[[0-9;]*3[0-9]m|\x1b\[[0-9;]*38;", colored), "colors on a terminal"
    monkeypatch.setenv("NO_COLOR", "1")
    plain = _render(
        report,
        Console(width=100, force_terminal=True, color_system="truecolor", file=io.StringIO()),
    )
    assert not re.search(r"\x1b\[[0-9;]*(3[0-9]|38;|4[0-9]|48;)", plain), "NO_COLOR: no colors"
    assert "NaN born in the forward of SegLoss" in plain
    piped = _render(report, Console(width=100, file=io.StringIO()))  # not a terminal
    assert "\x1b[" not in piped


def test_theme_keys_are_namespaced_and_a_users_theme_wins() -> None:
    report = fx.load("fp16-seg-overflow")

    def nan_codes(console: Console) -> set[str]:
        text = _render(report, console)
        return set(re.findall(r"\x1b\[([0-9;]*)m *NaN\b", text))

    default = Console(width=100, force_terminal=True, color_system="standard", file=io.StringIO())
    assert any("35" in c for c in nan_codes(default)), "NaN is magenta by default"
    mine = Console(
        width=100,
        force_terminal=True,
        color_system="standard",
        file=io.StringIO(),
        theme=Theme({"nanwatch.nan": "blue"}),
    )
    codes = nan_codes(mine)
    assert any("34" in c for c in codes) and not any("35" in c for c in codes), codes
    # the theme pushed for the report is popped afterwards
    with pytest.raises(Exception, match=r"nanwatch\.nan"):
        default.get_style("nanwatch.nan")


# ---------------------------------------------------------------------- long tables
def _long_report(steps: int, diagnoses: int) -> Report:
    traces = []
    for i in range(steps):
        rec = Record(
            0,
            i,
            Phase.FORWARD,
            "Net",
            "output",
            "float32",
            "cpu",
            (2, 3),
            stat=TensorStat(-1.0 - i, 1.0 + i, 6),
            call=0,
        )
        t = StepTrace(step=i, records=[rec], loss=1.0 / (i + 1), grad_norm=0.5, max_logit=1.0 + i)
        traces.append(t)
    ds = [
        Diagnosis(
            code=f"NW9{i:02d}",
            title=f"problem {i}",
            severity="warning",
            step=steps - 1,
            evidence=[f"value {i}"],
            fix="do less",
        )
        for i in range(diagnoses)
    ]
    traces[-1].diagnoses = ds
    return Report(
        steps=traces,
        diagnoses=ds,
        diagnosis_steps={d.code: 1 for d in ds},
        config={"ring_size": steps},
    )


def test_long_tables_are_cut_and_say_how_much_was_left_out() -> None:
    text = _render(_long_report(steps=50, diagnoses=9))
    assert "38 earlier steps left out" in text
    assert re.search(r"^ +49 ", text, re.M) and not re.search(r"^ +37 ", text, re.M)
    assert "… 3 more diagnoses in the HTML and JSON report" in text
    assert "NW905" in text and "NW906" not in text
    html = report_html(_long_report(steps=50, diagnoses=9))
    assert "NW908" in html, "the HTML has every diagnosis"
    assert html.count("<tr") >= 50, "the HTML has every step"


# ---------------------------------------------------------------------- HTML
class _Structure(HTMLParser):
    VOID = frozenset({"meta", "img", "br", "hr", "input", "link", "col", "source", "wbr"})

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.ids: set[str] = set()
        self.imgs: list[dict[str, str | None]] = []
        self.text: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append(tag)
        if a.get("id"):
            self.ids.add(str(a["id"]))
        if tag == "img":
            self.imgs.append(a)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
            return
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(page: str) -> _Structure:
    p = _Structure()
    p.feed(page)
    p.close()
    assert not p.errors, p.errors[:5]
    assert not p.stack, f"unclosed tags: {p.stack}"
    return p


def test_html_page_has_every_section_and_its_plots() -> None:
    pytest.importorskip("matplotlib")
    report = fx.load("fp16-seg-overflow")
    page = report.to_html()
    assert page.startswith("<!DOCTYPE html>")
    p = _parse(page)
    assert {
        "headline",
        "diagnoses",
        "where",
        "timeline",
        "environment",
        "trends",
        "heatmap",
    } <= p.ids
    text = " ".join(p.text)
    assert "NaN born in the forward of SegLoss" in text
    assert "aten.exp.default" in text
    srcs = [str(i.get("src")) for i in p.imgs]
    assert any(s.startswith("data:image/png;base64,") for s in srcs), "the heatmap"
    assert any(s.startswith("data:image/svg+xml;base64,") for s in srcs), "the trends"
    assert all(i.get("alt") for i in p.imgs), "images say what they show"
    assert "float16 limit" in page, "the heatmap marks the dtype limit"


def test_html_escapes_what_it_shows() -> None:
    report = fx.load("inplace-saved")
    report.error = dict(report.error or {}, message="<script>alert('x')</script> & more")
    page = report.to_html()
    assert "<script>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; more" in page
    _parse(page)


def test_html_without_matplotlib_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    page = fx.load("fp16-seg-overflow").to_html()
    assert "pip install &quot;nanwatch[plot]&quot;" in page
    p = _parse(page)
    assert not p.imgs and "plots-missing" in p.ids
    assert "timeline" in p.ids, "the numbers are still there without plots"


def test_heatmap_marks_cells_near_their_own_dtype_limit() -> None:
    def rec(i: int, path: str, dtype: str, amax: float) -> Record:
        return Record(
            i,
            0,
            Phase.FORWARD,
            path,
            "output",
            dtype,
            "cpu",
            (4,),
            stat=TensorStat(-amax, amax, 4),
            call=i,
        )

    trace = StepTrace(
        step=0,
        records=[
            rec(0, "half", "float16", 40000.0),
            rec(1, "loss", "float32", 900000.0),
            rec(2, "small", "float16", 3.0),
        ],
    )
    report = Report(steps=[trace])
    report.environment.amp_dtypes = ["float16"]
    report.environment.dtype_limits = {"float16": 65504.0, "float32": 3.4028234663852886e38}
    data = heatmap_data(report)
    near = dict(zip(data.rows, (row[0] for row in data.near), strict=True))
    assert near == {"half": True, "loss": False, "small": False}
    assert data.limit == 65504.0 and data.limit_dtype == "float16"


def test_notebook_displays_the_report_as_html() -> None:
    ipython = pytest.importorskip("IPython.core.interactiveshell")
    report = fx.load("sqrt-backward")
    shell = ipython.InteractiveShell.instance()
    data, _ = shell.display_formatter.format(report)
    fragment = data["text/html"]
    assert fragment.startswith('<div class="nw"') and "<html" not in fragment
    assert "NaN gradient born in the backward of distance" in fragment
    _parse(fragment)


def _png_size_and_ink(path: Path) -> tuple[int, int, float]:
    """Width, height and the fraction of non-white pixels of an RGB(A) PNG (stdlib only)."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, ctype = 8, b"", 0, 0, 0
    while pos < len(raw):
        (length,) = struct.unpack(">I", raw[pos : pos + 4])
        kind = raw[pos + 4 : pos + 8]
        chunk = raw[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, _, ctype = struct.unpack(">IIBB", chunk[:10])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    bpp = 4 if ctype == 6 else 3
    data = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    ink = total = 0
    for y in range(height):
        f = data[y * (stride + 1)]
        line = bytearray(data[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b = prev[x]
            c = prev[x - bpp] if x >= bpp else 0
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                pr = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[x] = (line[x] + pr) & 255
        if y % 8 == 0:  # sample rows: enough to tell a page from a blank one
            for x in range(0, stride, bpp * 4):
                total += 1
                ink += min(line[x], line[x + 1], line[x + 2]) < 200
        prev = line
    return width, height, ink / max(total, 1)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium")
def test_html_page_renders_in_a_real_browser(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    page = fx.load("fp16-seg-overflow").save(tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1200,2400",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert shot.exists(), "chromium wrote no screenshot"
    width, height, ink = _png_size_and_ink(shot)
    assert (width, height) == (1200, 2400)
    assert ink > 0.03, f"the page looks blank ({ink:.1%} ink)"


# ---------------------------------------------------------------------- demo and files
def test_demo_summary_shows_the_finding_its_fix_and_the_verdict() -> None:
    outcome = scenarios.run(scenarios.get("div-by-zero"))
    text = _render(demo_summary(outcome))
    assert "div-by-zero" in text and outcome.scenario.title in text
    assert "NaN born in the forward of norm (MinMaxScale)" in text
    assert "aten.div.Tensor at div_by_zero.py:" in text  # op and line, the path made short
    verdict = "✓ as expected" if not outcome.mismatches() else "diagnosis differs"
    assert verdict in text
    assert re.search(r"\d+\.\d\d s", text), "how long it took"
    top = outcome.top
    if top is not None:
        assert top.code in text


def test_demo_summary_says_when_nanwatch_got_it_wrong() -> None:
    outcome = scenarios.run(scenarios.get("div-by-zero"))
    wrong = dataclasses.replace(
        outcome.scenario,
        expected=dataclasses.replace(outcome.scenario.expected, path="somewhere.else"),
    )
    outcome.scenario = wrong
    text = _render(demo_summary(outcome))
    assert "✗ differs from the expected result" in text
    assert "path: expected somewhere.else, got norm" in text


def test_demo_summary_of_a_healthy_control() -> None:
    outcome = scenarios.run(scenarios.get("healthy-fp16"))
    text = _render(demo_summary(outcome))
    assert "No anomaly in" in text and "✓ as expected" in text


def test_report_file_rerenders_and_writes_html(tmp_path: Path) -> None:
    source = fx.GOLDEN / "cuda-assert.json"
    console = _pinned()
    code = render_report_file(source, console, html_out=tmp_path / "out" / "page.html")
    assert code == 0
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert text.startswith((fx.GOLDEN / "cuda-assert.txt").read_text(encoding="utf-8"))
    assert "HTML report written to" in text
    page = (tmp_path / "out" / "page.html").read_text(encoding="utf-8")
    assert "CUDA device-side assert" in page
    _parse(page)


def test_report_file_of_a_future_version_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "future.json"
    bad.write_text('{"schema_version": "2.0", "steps": []}', encoding="utf-8")
    with pytest.raises(ReportFormatError, match=r"2\.0.*1\.x.*upgrade"):
        render_report_file(bad, _pinned())


def test_report_with_anomaly_kinds_renders_each_kind() -> None:
    """Every anomaly kind gets a headline naming where it was born."""
    from nanwatch.records import Anomaly
    from nanwatch.report import anomaly_headline

    rec = Record(
        0,
        5,
        Phase.INPUT,
        "Net",
        "input[0]",
        "float32",
        "cpu",
        (2,),
        stat=TensorStat(float("nan"), float("nan"), 2, nan=1, posinf=0, neginf=0),
    )
    words = {
        AnomalyKind.INPUT: "NaN in the input data (input[0] of Net), step 5",
        AnomalyKind.FORWARD: "NaN born in the forward of Net, step 5",
        AnomalyKind.BACKWARD: "NaN gradient born in the backward of Net, step 5",
        AnomalyKind.GRADIENT: "NaN in the gradient of fc.weight, step 5",
        AnomalyKind.PARAMETER: "NaN in the weights fc.weight after an update, step 5",
    }
    for kind, expected in words.items():
        a = Anomaly(
            step=5,
            kind=kind,
            path="Net",
            record=rec,
            origin="module",
            summary="",
            parameter="fc.weight",
        )
        assert anomaly_headline(a) == expected


def test_summary_of_a_report_written_at_the_end_of_a_run(tmp_path: Path) -> None:
    from nanwatch.render import print_summary

    outcome = scenarios.run(scenarios.get("lr-explode"))
    assert outcome.watcher is not None
    report = outcome.watcher.report
    paths = report.save_all(tmp_path, stem="train")
    console = Console(width=60, color_system=None, file=io.StringIO())
    print_summary(report, paths, console=console)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert text.startswith(f"nanwatch: {report.anomaly_count} steps with anomalies in steps 0-13")
    assert "-inf in the weights proj.weight after an update, step 5" in text
    for p in paths:
        assert f"  {p}\n" in text, "each path on one line of its own, never wrapped"
