"""``clip_grad_norm_`` under a watcher: its rescale keeps finite gradients finite, so the
optimizer pre-hook does not read them a second time (a pass over every gradient, each
step of every clipping loop on the CPU); a write after the clip, or a NaN max_norm, is
still read and told."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import watcher as watcher_mod


def _loop(monkeypatch: pytest.MonkeyPatch, after_clip: Any = None, max_norm: float = 1.0) -> Any:
    read: list[int] = []
    real = watcher_mod.Watcher._bad_in_place

    def counted(self: Any, in_place: dict[str, torch.Tensor]) -> Any:
        read.append(len(in_place))
        return real(self, in_place)

    monkeypatch.setattr(watcher_mod.Watcher, "_bad_in_place", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            nn.functional.mse_loss(model(x), y).backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # a generator
            if after_clip is not None:
                after_clip(model)
            opt.step()
            opt.zero_grad()
            nw.step()
    return read, nw


@pytest.mark.cpu_path(reason="counts the host reads the CPU path makes")
def test_a_clip_is_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    read, nw = _loop(monkeypatch)
    assert read == []  # nothing written since backward but the clip's rescale
    assert nw.anomalies == []
    assert not getattr(nn.utils.clip_grad_norm_, "_nanwatch_tap", False)  # put back
    assert not getattr(torch.nn.utils.clip_grad.clip_grad_norm_, "_nanwatch_tap", False)


@pytest.mark.cpu_path(reason="counts the host reads the CPU path makes")
def test_a_write_after_the_clip_is_still_read_and_told(monkeypatch: pytest.MonkeyPatch) -> None:
    def project(model: nn.Module) -> None:  # an A-GEM-like projection: 0/0 in place
        g = model[2].weight.grad
        g.mul_(0).div_(g.sum())

    read, nw = _loop(monkeypatch, after_clip=project)
    assert read and read[0] == 1
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW301" and "2.weight" in " ".join(d.evidence)


def test_a_nan_max_norm_is_still_read_and_told(monkeypatch: pytest.MonkeyPatch) -> None:
    read, nw = _loop(monkeypatch, max_norm=float("nan"))
    assert read and read[0] == 4  # every gradient rescaled by NaN: read, found NaN
    assert nw.history[0].diagnoses[0].code == "NW301"
