"""The nanwatch command: help, version, run (any script unchanged), demo, rules, report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn.modules.module as module_mod

from nanwatch import cli
from nanwatch.errors import AnomalyError
from nanwatch.report import Report

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _nanwatch(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nanwatch", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=240,
        check=False,
    )


def test_help_lists_every_command_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from nanwatch.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported for --help'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    for command in ("demo", "run", "report", "rules"):
        assert command in out.stdout


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import nanwatch

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"nanwatch {nanwatch.__version__}"


def test_run_keeps_the_scripts_arguments_name_and_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = dict(module_mod._global_forward_hooks)
    code = cli.main(
        [
            "run",
            "--report-dir",
            str(tmp_path),
            str(EXAMPLES / "train_args.py"),
            "--steps",
            "2",
            "--lr",
            "0.05",
            "--exit-code",
            "3",
        ]
    )
    assert code == 3
    out = capsys.readouterr().out
    assert "argv=['--steps', '2', '--lr', '0.05', '--exit-code', '3']" in out
    assert "steps=2 lr=0.05 name=__main__" in out
    assert dict(module_mod._global_forward_hooks) == before
    assert not any(tmp_path.iterdir())  # sys.exit(3) of a healthy run is not a crash


def test_run_that_records_an_anomaly_then_exits_writes_one_report_about_the_anomaly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train_exit.py"
    script.write_text(
        (EXAMPLES / "train_nan.py").read_text(encoding="utf-8") + "\nimport sys\nsys.exit(3)\n",
        encoding="utf-8",
    )
    reports = tmp_path / "reports"
    code = cli.main(["run", "--on-anomaly", "record", "--report-dir", str(reports), str(script)])
    assert code == 3
    assert sorted(p.name for p in reports.iterdir()) == ["train_exit.html", "train_exit.json"]
    report = Report.load(reports / "train_exit.json")
    assert report.error is None and report.diagnoses[0].code == "NW110"
    assert capsys.readouterr().err.count("report written") == 1


def test_run_that_cannot_write_its_report_keeps_the_scripts_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory", encoding="utf-8")
    code = cli.main(
        [
            "run",
            "--on-anomaly",
            "record",
            "--report-dir",
            str(blocker / "reports"),
            str(EXAMPLES / "train_nan.py"),
        ]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert f"could not write the report to {str(blocker / 'reports')!r}" in err
    assert "give --report-dir a writable directory" in err


def test_run_of_a_healthy_script_exits_0_and_writes_no_report(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    code = cli.main(["run", "--report-dir", str(reports), str(EXAMPLES / "train_healthy.py")])
    assert code == 0
    assert not reports.exists() or not any(reports.iterdir())


def test_run_stops_a_script_that_goes_nan_and_leaves_a_report(tmp_path: Path) -> None:
    with pytest.raises(AnomalyError) as info:
        cli.main(["run", "--report-dir", str(tmp_path), str(EXAMPLES / "train_nan.py")])
    assert info.value.anomaly is not None
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".html", ".json"]
    # the script has no nw to print: the message points at the report file
    assert f"full report: in {tmp_path} (nanwatch report <file>.json)" in str(info.value)
    assert "print(nw.report)" not in str(info.value)


def test_run_with_record_lets_the_script_finish_and_reports_at_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        [
            "run",
            "--on-anomaly",
            "record",
            "--report-dir",
            str(tmp_path),
            str(EXAMPLES / "train_nan.py"),
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "done" in captured.out  # the script ran to its end
    assert any(p.suffix == ".json" for p in tmp_path.iterdir())
    assert "train_nan" in captured.err


def test_run_of_a_missing_script_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "no/such/script.py"]) == 2
    assert "no such script: 'no/such/script.py'" in capsys.readouterr().err


def test_python_dash_m_nanwatch_run_in_a_subprocess(tmp_path: Path) -> None:
    out = _nanwatch("run", "--report-dir", str(tmp_path), str(EXAMPLES / "train_crash.py"))
    assert out.returncode == 1
    assert "GuardError" in out.stderr
    assert "did you mean ignore_index=255" in out.stderr
    assert any(p.suffix == ".json" for p in tmp_path.iterdir())


def test_run_lets_the_scripts_own_exception_out_unchanged_and_leaves_a_report(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train_oops.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n"
        "model = nn.Linear(3, 1)\n"
        "for step in range(3):\n"
        "    model(torch.randn(4, 3)).sum().backward()\n"
        "    if step == 1:\n"
        "        raise KeyError('lr_scheduler')  # the script's own bug\n"
    )
    reports = tmp_path / "reports"
    with pytest.raises(KeyError, match="lr_scheduler") as info:
        cli.main(["run", "--report-dir", str(reports), str(script)])
    assert info.traceback[-1].path == script  # raised where the script raised it
    assert sorted(p.suffix for p in reports.iterdir()) == [".html", ".json"]
    out = _nanwatch("run", "--report-dir", str(reports), str(script))
    assert out.returncode == 1
    assert out.stderr.rstrip().endswith("KeyError: 'lr_scheduler'")
    assert 'train_oops.py", line 7' in out.stderr


@pytest.mark.parametrize(("mode", "every"), [("sentinel", "1"), ("watch", "3")])
def test_run_passes_mode_and_sample_every_to_the_watcher(
    tmp_path: Path, mode: str, every: str
) -> None:
    import json

    with pytest.raises(AnomalyError):
        cli.main(
            [
                "run",
                "--mode",
                mode,
                "--sample-every",
                every,
                "--report-dir",
                str(tmp_path),
                str(EXAMPLES / "train_nan.py"),
            ]
        )
    (saved,) = tmp_path.glob("*.json")
    data = json.loads(saved.read_text())
    assert data["config"]["mode"] == mode and data["config"]["sample_every"] == int(every)


def test_run_names_a_bad_option_by_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["run", "--sample-every", "0", str(EXAMPLES / "train_healthy.py")])
    assert code == 2
    assert "--sample-every must be an integer >= 1; got 0" in capsys.readouterr().err


def test_report_to_an_html_path_that_is_a_directory_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reports = tmp_path / "reports"
    cli.main(
        [
            "run",
            "--on-anomaly",
            "record",
            "--report-dir",
            str(reports),
            str(EXAMPLES / "train_nan.py"),
        ]
    )
    capsys.readouterr()
    code = cli.main(["report", str(reports / "train_nan.json"), "--html", str(reports)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot write {str(reports)!r}: a directory; give a file name" in err
    assert ".tmp" not in err
