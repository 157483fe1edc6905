"""nanwatch run as python runs a script: __file__, argv, a script that changes directory,
-m MODULE; the advice to silence a code under the CLI; a report directory that cannot be
written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nanwatch import cli, postmortem
from nanwatch.errors import AnomalyError
from nanwatch.rules.base import Diagnosis

_NAN_SCRIPT = (
    "import torch\n"
    "torch.manual_seed(0)\n"
    "m = torch.nn.Linear(3, 1)\n"
    "x = torch.randn(4, 3)\n"
    "x[1, 0] = float('nan')\n"
    "m(x).pow(2).mean().backward()\n"
    "print('done')\n"
)

_SHOW = (
    "import json, os, sys\n"
    "print(json.dumps({'file': __file__, 'argv': sys.argv, 'name': __name__}), "
    "file=open(os.environ['NW_OUT'], 'w'))\n"
)


def _shown(out: Path) -> dict[str, object]:
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_run_gives_the_script_an_absolute_file_and_argv0_as_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "cfg.json").write_text('{"lr": 0.5}')
    (tmp_path / "proj" / "show.py").write_text(
        "import json, os\nfrom pathlib import Path\n"
        "os.makedirs('outputs/run0', exist_ok=True)\nos.chdir('outputs/run0')  # Hydra-style\n"
        "cfg = json.loads((Path(__file__).parent / 'cfg.json').read_text())\n" + _SHOW
    )
    out = tmp_path / "shown.json"
    monkeypatch.setenv("NW_OUT", str(out))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "proj/show.py", "x"]) == 0
    shown = _shown(out)
    assert shown["file"] == str(tmp_path / "proj" / "show.py")
    assert shown["argv"] == ["proj/show.py", "x"]
    assert shown["name"] == "__main__"


def test_run_keeps_a_double_dash_among_the_scripts_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "argv.py"
    script.write_text(_SHOW)
    out = tmp_path / "shown.json"
    monkeypatch.setenv("NW_OUT", str(out))
    assert cli.main(["run", str(script), "--", "a"]) == 0
    assert _shown(out)["argv"] == [str(script), "--", "a"]
    assert cli.main(["run", "--mode", "sentinel", str(script), "a", "--mode", "x", "-m"]) == 0
    assert _shown(out)["argv"] == [str(script), "a", "--mode", "x", "-m"]
    assert cli.main(["run", "--report-dir=r", "--", str(script), "--", "b"]) == 0
    assert _shown(out)["argv"] == [str(script), "--", "b"]


def test_run_writes_reports_where_nanwatch_started_when_the_script_changes_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os\nos.makedirs('runs/exp1', exist_ok=True)\nos.chdir('runs/exp1')\n" + _NAN_SCRIPT
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AnomalyError) as info:
        cli.main(["run", "--report-dir", "reps", "train.py"])
    reports = tmp_path / "reps"
    assert sorted(p.suffix for p in reports.iterdir()) == [".html", ".json"]
    assert not (tmp_path / "runs" / "exp1" / "reps").exists()
    assert f"full report: in {reports} " in str(info.value)  # valid from any directory


def test_run_says_how_to_silence_a_code_with_the_cli_and_the_saved_report_keeps_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(_NAN_SCRIPT)
    reports = tmp_path / "reps"
    code = cli.main(["run", "--on-anomaly", "record", "--report-dir", str(reports), str(script)])
    assert code == 0
    assert "ignore=[" not in capsys.readouterr().err
    (saved,) = reports.glob("*.json")
    assert cli.main(["report", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "nanwatch run --ignore NW" in out and "ignore=[" not in out
    # in the user's own process the advice stays the watch() option
    assert Diagnosis("NW111", "Division by zero", "error").silence == (
        'nanwatch.watch(..., ignore=["NW111"])'
    )


def test_full_report_line_says_when_the_report_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = postmortem.full_report_line(blocker / "reports")
    assert "not written" in line and "--report-dir" in line and str(blocker) in line
    assert postmortem.unwritable(tmp_path / "new" / "reports") is None
    assert postmortem.full_report_line(tmp_path / "ok") == (
        f"  full report: in {tmp_path / 'ok'} (nanwatch report <file>.json)"
    )


def test_run_m_runs_a_module_with_relative_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "nwcli3pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "util.py").write_text("VALUE = 3\n")
    (pkg / "train.py").write_text("from .util import VALUE\nassert VALUE == 3\n" + _SHOW)
    out = tmp_path / "shown.json"
    monkeypatch.setenv("NW_OUT", str(out))
    monkeypatch.chdir(tmp_path)
    saved_path0 = sys.path[0]
    try:
        assert cli.main(["run", "-m", "nwcli3pkg.train", "--", "a"]) == 0
    finally:
        for name in [n for n in sys.modules if n.startswith("nwcli3pkg")]:
            del sys.modules[name]
    shown = _shown(out)
    assert shown["argv"] == [str(pkg / "train.py"), "--", "a"]
    assert shown["name"] == "__main__"
    assert sys.path[0] == saved_path0


def test_run_m_of_a_missing_module_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["run", "-m", "no_such_module_nw"]) == 2
    assert "no module named 'no_such_module_nw'" in capsys.readouterr().err
