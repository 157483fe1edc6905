"""nanwatch's AnomalyError (``on_anomaly="raise"``) comes out with a traceback that runs from
the user's line through torch's frames: nanwatch's own frames (its hooks, its wrapper of
``backward``, the step end that raised) are left out, under ``python script.py``,
``nanwatch run script.py`` and ``nw.step()``. The user's own exception keeps every frame."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import cli

_PKG = os.path.dirname(os.path.abspath(nanwatch.__file__)) + os.sep
_SCENARIOS = os.path.join(_PKG, "scenarios") + os.sep


def _own(exc: BaseException) -> list[str]:
    """The frames of nanwatch's own code in ``exc``'s traceback."""
    return [
        f"{f.filename}:{f.lineno} in {f.name}"
        for f in traceback.extract_tb(exc.__traceback__)
        if f.filename.startswith(_PKG) and not f.filename.startswith(_SCENARIOS)
    ]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.log(self.fc(x)))  # log of a negative: NaN


class SqrtAtZero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.fc(x) * 0).sum(1)  # sqrt'(0) = inf in backward


def test_a_forward_anomaly_leaves_nanwatchs_frames_out() -> None:
    torch.manual_seed(0)
    model = Net()
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(model, on_anomaly="raise", postmortem=False),
    ):
        for _ in range(2):
            model(torch.randn(8, 4)).pow(2).mean().backward()
    # before: nanwatch/watcher.py's pre_hook, _pre, _handle_trigger, _act came last
    assert _own(info.value) == []
    names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert names[0] == "test_a_forward_anomaly_leaves_nanwatchs_frames_out"


def test_a_backward_anomaly_at_nw_step_leaves_nanwatchs_frames_out() -> None:
    torch.manual_seed(0)
    model = SqrtAtZero()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(model, on_anomaly="raise", postmortem=False) as nw,
    ):
        for _ in range(2):
            model(torch.randn(8, 4)).mean().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    assert _own(info.value) == []
    assert info.value.anomaly is not None


def test_the_users_own_exception_keeps_its_frames() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("the user's own bug")

    broken = Broken()
    with (
        pytest.raises(KeyError) as info,
        nanwatch.watch(broken, on_anomaly="raise", postmortem=False),
    ):
        broken(torch.randn(2))
    plain = traceback.extract_tb(info.value.__traceback__)
    assert plain[-1].name == "forward"  # unchanged: torch's call machinery, then the forward


_HEAD = """\
import torch
from torch import nn
import nanwatch

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=5.0)
xb = torch.randn(64, 4) * 10.0
yb = (xb[:, :1] > 0).float()
"""
_LOOP = """\
for step in range(6):
    p = torch.sigmoid(model(xb))
    loss = -(yb * torch.log(p) + (1 - yb) * torch.log(1 - p)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _frames_printed(stderr: str) -> list[str]:
    tb = stderr[stderr.index("Traceback (most recent call last):") :]
    return [line.strip() for line in tb.splitlines() if line.strip().startswith('File "')]


@pytest.mark.parametrize("how", ["python", "nanwatch run"])
def test_the_printed_traceback_ends_at_torchs_backward(tmp_path: Path, how: str) -> None:
    script = tmp_path / "train.py"
    if how == "python":
        opened = f"with nanwatch.watch(model, report_dir={str(tmp_path / 'r')!r}):\n"
        text = _HEAD + opened + "".join(f"    {line}\n" for line in _LOOP.splitlines())
        argv = [str(script)]
    else:
        text = _HEAD + _LOOP
        argv = ["-m", "nanwatch", "run", "--report-dir", str(tmp_path / "r"), str(script)]
    script.write_text(text)
    root = Path(cli.__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [sys.executable, *argv],
        env=env,
        capture_output=True,
        text=True,
        cwd=root,
        timeout=240,
        check=False,
    )
    assert out.returncode == 1, out.stderr
    frames = _frames_printed(out.stderr)
    # before: nanwatch/watcher.py's _tapped, _on_backward, ..., _act followed torch's
    assert not [f for f in frames if f"{os.sep}nanwatch{os.sep}" in f], out.stderr
    assert frames[0].startswith(f'File "{script}", line '), frames
    assert frames[-1].startswith('File "' + os.path.dirname(torch.__file__)), frames
    assert "nanwatch.AnomalyError: nanwatch: step" in out.stderr
