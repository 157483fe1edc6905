"""nanwatch run as python runs a script: __file__, argv, a script that changes directory,
-m MODULE; the advice to silence a code under the CLI; a report directory that cannot be
written."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import nanwatch
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


# ------------- forensic steps found automatically (nanwatch run): ops before the first call

_GRPO = (
    "import torch\n"
    "torch.manual_seed(0)\n"
    "m = torch.nn.Linear(3, 1)\n"
    "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
    "for s in range(3):\n"
    "    r = torch.rand(2, 4)\n"
    "    if s == 1:\n"
    "        r[0] = 1.0\n"
    "    adv = ((r - r.mean(1, keepdim=True)) / r.std(1, keepdim=True)).view(-1)\n"
    "    x = torch.randn(8, 3)\n"
    "    loss = (m(x).squeeze(-1) * adv[:, None].squeeze(-1) * 2).mean()\n"
    "    loss.backward(); opt.step(); opt.zero_grad()\n"
)


def test_cli_forensic_names_the_division_made_before_the_steps_first_call(
    tmp_path: Path,
) -> None:
    # the advantages are divided before the model's call: with no nw.step(), that op
    # belongs to the step the call begins, not to the one the optimizer ended
    script = tmp_path / "grpo.py"
    script.write_text(_GRPO)
    with pytest.raises(AnomalyError) as info:
        cli.main(["run", "--mode", "forensic", "--report-dir", str(tmp_path / "r"), str(script)])
    err = info.value
    assert err.anomaly.step == 1
    assert err.anomaly.op is not None and err.anomaly.op.op == "aten.div.Tensor"
    assert (err.anomaly.op.source or "").endswith("grpo.py:9")
    d = next(d for d in err.diagnoses if d.code == "NW111")
    assert "0/0" in d.title
    fixed = next(ln for ln in d.fix.splitlines() if ln.lstrip().startswith("adv ="))
    ast.parse(fixed.strip())
    healthy = tmp_path / "healthy.py"
    healthy.write_text(_GRPO.replace(_GRPO.splitlines()[8], "    " + fixed.strip()))
    assert cli.main(["run", "--mode", "forensic", str(healthy)]) == 0


def test_watch_forensic_without_step_keeps_the_ops_before_the_call_in_their_step() -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanwatch.watch(m, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        for s in range(3):
            r = torch.rand(2, 4)
            if s == 1:
                r[0] = 1.0
            adv = ((r - r.mean(1, keepdim=True)) / r.std(1, keepdim=True)).view(-1)
            loss = (m(torch.randn(8, 3)).squeeze(-1) * adv).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    steps = {t.step: t for t in nw.history}
    assert not [e for e in steps[0].ops if e.op == "aten.div.Tensor"]
    assert [e.born for e in steps[1].ops if e.op == "aten.div.Tensor"] == ["NaN"]
    assert steps[1].diagnoses[0].code == "NW111"


# --------------- forensic NW100 NaN: the op ran outside the traced ops, never "run forensic"


def _numpy_nan_weight(mode: str) -> Diagnosis:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    a = np.full(8, 1000.0, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        w = torch.from_numpy(np.exp(a) - np.exp(a))  # inf - inf, made by numpy
    x = torch.randn(8, 3)
    watched = nanwatch.watch(m, mode=mode, postmortem=False)  # type: ignore[arg-type]
    with pytest.raises(AnomalyError) as info, watched:
        out = m(x).squeeze(-1)
        (torch.exp(out) * w[:]).mean().backward()
    return next(d for d in info.value.diagnoses if d.code == "NW100")


def test_forensic_nan_without_gradients_says_its_op_ran_outside_the_traced_ops() -> None:
    d = _numpy_nan_weight("forensic")
    assert "forensic" not in d.fix
    assert "outside the traced ops" in d.fix and "numpy" in d.fix
    first = d.fix.splitlines()[0]
    assert first.startswith("assert torch.isfinite(w[:]).all()")
    ast.parse(first)
    # watch mode still sends the user to forensic mode
    assert "mode='forensic'" in _numpy_nan_weight("watch").fix


# ------------------ acosh at its endpoint in watch mode: the exact endpoint hits are counted


def test_watch_acosh_backward_counts_the_inputs_exactly_at_one() -> None:
    class Dist(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.acosh(x)

    x = torch.full((40,), 1.0 + 2**-20)
    x[:7] = 1.0  # acosh's derivative 1/sqrt(x² - 1) is infinite there
    model = Dist()
    with pytest.raises(AnomalyError) as info, nanwatch.watch(model, postmortem=False):
        model(x.requires_grad_(True)).sum().backward()
    d = next(d for d in info.value.diagnoses if d.code == "NW114")
    line = next(e for e in d.evidence if e.startswith("backward input self"))
    assert "(40 values); 7 exactly at an edge" in line
