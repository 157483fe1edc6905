"""An optimizer stepped directly while a GradScaler scales the loss (``opt.step()``, not
``scaler.step(opt)``) is named from its first update (NW301), read from the scaler's
per-optimizer stage with no sync; ``scaler.step``, ``unscale_`` then a clip, a disabled
scaler and two optimizers sharing one scaler are not."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


def _codes(nw: Any) -> list[tuple[int, str]]:
    traces = {id(t): t for t in (*nw.history, nw._trace)}.values()
    return [(t.step, d.code) for t in traces for d in t.diagnoses]


def _run(tmp_path: Any, loop: str, *, enabled: bool = True, steps: int = 3) -> tuple[Any, str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    head = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt2 = torch.optim.SGD(head.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=enabled)
    msg = ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, head, report_dir=str(tmp_path)) as nw:
            try:
                for _ in range(steps):
                    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = F.cross_entropy(head(model(x)), y)
                    scaler.scale(loss).backward()
                    if loop == "bypass":  # scaler.update() would raise: no inf checks
                        opt.step()
                        opt.step()
                    elif loop == "scaler_step":
                        scaler.step(opt)
                        scaler.update()
                    elif loop == "unscale_clip":
                        scaler.unscale_(opt)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                        scaler.step(opt)
                        scaler.update()
                    elif loop == "two":
                        scaler.step(opt)
                        scaler.step(opt2)
                        scaler.update()
                    elif loop == "two_one_bypassed":
                        scaler.step(opt)
                        opt2.step()
                        scaler.update()
                    opt.zero_grad()
                    opt2.zero_grad()
                    nw.step()
            except nanwatch.AnomalyError as err:
                msg = str(err)
    return nw, msg


@pytest.mark.parametrize("loop", ["bypass", "two_one_bypassed"])
def test_an_optimizer_stepped_past_the_scaler_is_named_at_the_first_update(
    tmp_path: Any, loop: str
) -> None:
    nw, msg = _run(tmp_path, loop)
    assert (0, "NW301") in _codes(nw), msg
    assert "GradScaler bypassed" in msg
    assert "step 0" in msg
    # the weights are still finite: it is told from the first update, not once they overflow
    assert nw.first_anomaly is None or nw.first_anomaly.step == 0
    assert ".step(" in msg and "update()" in msg


@pytest.mark.parametrize("loop", ["scaler_step", "unscale_clip", "two"])
def test_the_scaler_used_as_meant_is_no_bypass(tmp_path: Any, loop: str) -> None:
    nw, msg = _run(tmp_path, loop)
    assert "NW301" not in [c for _, c in _codes(nw)], msg
    assert msg == ""


def test_a_disabled_scaler_is_no_bypass(tmp_path: Any) -> None:
    nw, msg = _run(tmp_path, "bypass", enabled=False)
    assert "NW301" not in [c for _, c in _codes(nw)], msg
    assert msg == ""


def _ratio_loss(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    inter = torch.minimum(p, t).sum(1)
    union = p.sum(1) + t.sum(1) - inter
    return (1 - inter / union).mean()  # 0/0 for an empty prediction and target


def test_a_nan_born_in_the_loss_forward_does_not_pass_backward_line_as_the_ops() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every output 0
    with nanwatch.watch(model, on_anomaly="record") as nw:
        loss = _ratio_loss(model(torch.randn(2, 3)), torch.zeros(2, 4))
        loss.backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "(loss)"
    assert a.op is not None and a.op.op.startswith("aten.div")
    assert "loss.backward() at " in a.summary
    assert "the op's line is not known in watch mode" in a.summary
    assert "mode='forensic'" in a.summary
