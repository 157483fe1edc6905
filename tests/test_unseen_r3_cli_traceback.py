"""``nanwatch run script.py``: the traceback Python prints of the script's exception is the
one ``python script.py`` prints (from the script's first frame; nanwatch's launcher frames
and runpy's left out), the exception and the exit code unchanged; a caller of ``cli.main``
gets the exception as before, and no ``sys.excepthook`` is left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nanwatch import cli

_OOPS = """\
import torch
from torch import nn


def train(model):
    for step in range(3):
        model(torch.randn(4, 3)).sum().backward()
        if step == 1:
            raise KeyError("lr_scheduler")  # the script's own bug


train(nn.Linear(3, 1))
"""


def _tb_frames(stderr: str) -> list[str]:
    tb = stderr[stderr.index("Traceback (most recent call last):") :]
    return [line.strip() for line in tb.splitlines() if line.strip().startswith('File "')]


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=240, check=False
    )


def test_the_printed_traceback_is_the_scripts_own(tmp_path: Path) -> None:
    script = tmp_path / "train_oops.py"
    script.write_text(_OOPS)
    plain = _python(str(script), cwd=tmp_path)
    out = _python("-m", "nanwatch", "run", "--report-dir", str(tmp_path / "r"), str(script),
                  cwd=Path(cli.__file__).resolve().parent.parent)  # fmt: skip
    assert out.returncode == plain.returncode == 1
    frames = _tb_frames(out.stderr)
    # before: runpy's, nanwatch/__main__.py's and nanwatch/cli.py's frames came first
    assert frames == _tb_frames(plain.stderr), out.stderr
    assert frames[0].startswith(f'File "{script}", line 12, in <module>'), frames
    assert out.stderr.rstrip().endswith("KeyError: 'lr_scheduler'")


def test_the_scripts_exit_code_is_kept(tmp_path: Path) -> None:
    script = tmp_path / "bye.py"
    script.write_text("import sys\nsys.exit(3)\n")
    out = _python("-m", "nanwatch", "run", "--report-dir", str(tmp_path / "r"), str(script),
                  cwd=Path(cli.__file__).resolve().parent.parent)  # fmt: skip
    assert out.returncode == 3, out.stderr
    assert "Traceback" not in out.stderr


def test_a_caller_of_main_gets_the_exception_and_no_hook(tmp_path: Path) -> None:
    script = tmp_path / "train_oops.py"
    script.write_text(_OOPS)
    hook = sys.excepthook
    with pytest.raises(KeyError, match="lr_scheduler") as info:
        cli.main(["run", "--report-dir", str(tmp_path / "r"), str(script)])
    assert info.traceback[-1].path == script
    assert any(e.path == Path(cli.__file__) for e in info.traceback)  # unchanged
    assert sys.excepthook is hook
