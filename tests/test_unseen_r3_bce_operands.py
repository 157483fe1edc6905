"""A binary cross-entropy written by hand from ``p = torch.sigmoid(<logits>)`` under
``nanwatch run --mode forensic``, whose loss line is read: NW110's fix writes
binary_cross_entropy_with_logits with the user's own operands (``model(xb), yb``; the
sigmoid's argument and the factor of log(p)), not the placeholders ``logits, y``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from nanwatch import cli
from nanwatch.errors import AnomalyError
from nanwatch.rules.domain import _bce_target

_SCRIPT = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr={lr})
xb = torch.randn(64, 4) * {scale}
yb = (xb[:, :1] > 0).float()
for step in range(6):
    p = torch.sigmoid(model(xb))
    loss = -(yb * torch.log(p) + (1 - yb) * torch.log(1 - p)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _run(tmp_path: Path, *, lr: float, scale: float) -> list[dict[str, object]]:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(lr=lr, scale=scale))
    out = tmp_path / "r"
    argv = ["run", "--mode", "forensic", "--report-dir", str(out), str(script)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if scale > 1:
            with pytest.raises(AnomalyError):
                cli.main(argv)
        else:
            assert cli.main(argv) == 0
    reports = sorted(out.glob("*.json")) if out.exists() else []
    if not reports:
        return []
    diagnoses = json.loads(reports[-1].read_text())["diagnoses"]
    assert isinstance(diagnoses, list)
    return diagnoses


def test_the_bce_fix_names_the_users_logits_and_targets(tmp_path: Path) -> None:
    found = _run(tmp_path, lr=5.0, scale=10.0)
    fix = next(str(d["fix"]) for d in found if d.get("code") == "NW110")
    lines = fix.splitlines()
    # before: "loss = ...binary_cross_entropy_with_logits(logits, y)   # p = torch.sigmoid(logits)"
    # the user's operands in the loss call (this once came as "p = model(xb)   # first, at
    # ..." in the whole suite: linecache read another test's train.py by the same relative
    # name; see tests/test_frames_linecache.py)
    assert lines[0].startswith(
        "loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)   # in "
        "place of the hand-written one: from the logits, not p = torch.sigmoid(model(xb))"
    ), fix
    assert "(logits, y)" not in fix


def test_a_healthy_hand_written_bce_reports_nothing(tmp_path: Path) -> None:
    assert _run(tmp_path, lr=0.01, scale=0.5) == []


@pytest.mark.parametrize(
    ("stmt", "q", "expected"),
    [
        ("loss = -(yb * torch.log(p) + (1 - yb) * torch.log(1 - p)).mean()", "p", ("loss", "yb")),
        ("self.loss = -(torch.log(p) * t[:, 0] + (1 - t[:, 0]) * (1 - p).log()).sum()", "p",
         ("self.loss", "t[:, 0]")),
        ("l = -(y * p.log() + (1 - y) * (1 - p).log())", "p", ("l", "y")),
        ("loss = -torch.log(1 - p).mean()", "p", None),  # no product with log(p)
        ("return -(y * torch.log(p)).mean()", "p", None),  # not an assignment
    ],
)  # fmt: skip
def test_the_targets_are_the_factor_of_log_p(
    stmt: str, q: str, expected: tuple[str, str] | None
) -> None:
    assert _bce_target(stmt, q) == expected
