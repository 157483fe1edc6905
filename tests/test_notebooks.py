"""The notebooks in notebooks/: stored without outputs, and each runs top to bottom on the CPU
with nbclient (the python3 kernel of this environment) and shows what it promises."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("quickstart", "fp16_segmentation", "lightning")
CELL_TIMEOUT = 180  #: seconds per cell; each notebook takes about 10 s on a laptop CPU
_NETWORK = re.compile(r"https?://|download=True|pip install|urlopen|requests\.get")


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


def execute(name: str, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> nbformat.NotebookNode:
    """Runs the notebook in ``workdir`` (its temporary files too); a cell that raises fails
    the test with its traceback."""
    monkeypatch.setenv("TMPDIR", str(workdir))  # the kernel inherits it: tempfile.mkdtemp()
    nb = read(name)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",  # jupyter_client starts it with this interpreter
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()
    return nb


def text_of(nb: nbformat.NotebookNode) -> str:
    """Everything the executed notebook printed or displayed as text, in order."""
    parts: list[str] = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                parts.append(out["text"])
            elif out["output_type"] in ("execute_result", "display_data"):
                parts.append(out["data"].get("text/plain", ""))
    return "\n".join(parts)


def html_of(nb: nbformat.NotebookNode) -> list[str]:
    return [
        out["data"]["text/html"]
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if out["output_type"] in ("execute_result", "display_data") and "text/html" in out["data"]
    ]


def reports_shown(nb: nbformat.NotebookNode) -> list[str]:
    """The nanwatch reports the notebook displayed inline (Report._repr_html_)."""
    return [h for h in html_of(nb) if 'id="nanwatch-report"' in h]


@pytest.mark.parametrize("name", NAMES)
def test_stored_without_outputs_and_opening_with_what_it_shows(name: str) -> None:
    nb = read(name)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}: a code cell has stored outputs"
            assert cell.execution_count is None, f"{name}: a code cell has an execution count"
            assert not _NETWORK.search(cell.source), f"{name}: a cell reaches the network"


@pytest.mark.slow
def test_quickstart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb = execute("quickstart", tmp_path, monkeypatch)
    out = text_of(nb)
    # where: the module, the op, the line
    assert "where: NaN born in the forward of norm (MinMaxScale)" in out
    assert "op:    aten.div.Tensor in float32" in out
    assert "line:  return (x - lo) / (hi - lo)" in out
    # why, and the fix
    assert "NW111 error: Division by zero" in out
    assert "denominator holds 1 exact zero" in out
    assert "return (x - lo) / (hi - lo).clamp_min(torch.finfo(hi.dtype).eps)" in out
    # the post-mortem wrote the report, and the notebook showed it inline
    assert "['.html', '.json']" in out
    (report,) = reports_shown(nb)
    assert "NW111" in report and "aten.div.Tensor" in report
    # the fix: a clean run
    assert "No anomaly in 5 recorded steps" in out


@pytest.mark.slow
def test_fp16_segmentation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb = execute("fp16_segmentation", tmp_path, monkeypatch)
    out = text_of(nb)
    assert "float16 exp overflows above 11.09" in out
    assert re.search(
        r"first anomaly: \+inf born in the forward of SegLoss .*\(then NaN\).*aten\.exp", out
    )
    assert "op: aten.exp.default in float16 | e = logits.exp()" in out

    # the climb: max |logit| at the ignored pixels, per step, from nw.history
    rows = re.findall(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(\S+)  ", out, flags=re.MULTILINE)
    run16 = {int(s): (loss, float(ign), float(trn)) for s, loss, ign, trn in rows[:36]}
    warned = {}
    for code in ("NW103", "NW206"):
        m = re.search(
            rf"{code} first fired at step (\d+), (\d+) steps before the overflow at step (\d+)",
            out,
        )
        assert m is not None, f"no early warning {code}"
        warned[code] = (int(m[1]), int(m[3]))
    first, overflow = warned["NW103"]
    assert overflow - first >= 5  # well before, not at the last moment
    assert warned["NW206"][0] < overflow
    assert run16[overflow][0] == "nan" and run16[overflow - 1][0] != "nan"
    ignored, trained = run16[overflow][1], run16[overflow][2]
    assert ignored > 11.09 > trained  # the ignored pixels crossed the bound, not the trained
    assert ignored > 3 * run16[first - 10][1]  # and they climbed to get there

    (report,) = reports_shown(nb)
    assert "NW206" in report and 'id="trends"' in report  # the report's trend plot

    # the fix: no anomaly, and the same steps with a finite loss
    assert "first anomaly: None" in out
    last = re.search(r"^\s*35\s+(\S+)\s+(\S+)\s*$", out, flags=re.MULTILINE)
    assert last is not None and last[1] == "nan" and float(last[2]) < 3
    fixed = re.search(r"^exp in float32: (.*)$", out, flags=re.MULTILINE)
    assert fixed is not None and "error" not in fixed[1]
    assert re.search(r"^exp in float16: .*'NW101', 'error'", out, flags=re.MULTILINE)


@pytest.mark.slow
def test_lightning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb = execute("lightning", tmp_path, monkeypatch)
    out = text_of(nb)
    stops = re.findall(r"stopped at step: (\S+) \| batches run: (\d+) of (\d+)", out)
    assert len(stops) == 2, out
    (stopped, ran, total), (clean_stop, clean_ran, _) = stops
    assert stopped != "None" and int(ran) < int(total)  # the callback stopped the run
    assert "weights finite: True" in out  # and dropped the update that would break them
    assert "NW110 error: Log of zero" in out and "aten.log" in out
    assert "nanwatch-" in out and ".json" in out and "metrics.csv" in out
    assert "'nanwatch/anomalies'" in out  # the callback's figures, logged by Lightning
    (report,) = reports_shown(nb)
    assert "NW110" in report
    # the fix: trained to the end, no anomaly; the raw samples' gradient spike is a warning,
    # said once and reported, which never stops the run
    assert clean_stop == "None" and clean_ran == total
    assert re.search(r"anomalies: 0 \| reports: \[\S+\.json'\)\]", out), out
    assert "NW303 warning: Exploding gradients" in out
