"""A weight the optimizer wrote non-finite is not said to be written in place between
forwards because a later forward's output stayed finite: ``torch.where(z > 0,
torch.log(z), 0)`` turns a NaN weight into 0, so that output does not show the weight
finite. The records of the update's step (the NaN gradient it applied, its NaN learning
rate) name the update instead; a NaN gradient reset before its update (a skipped update)
was not applied, and does not hide a later write through .data."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import AnomalyKind


class _LogCounts(nn.Module):
    """log of count features under torch.where, times a learned per-feature gain; the
    root's output is its own tensor (not the head's), so the root records it too."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 1)

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        z = counts * self.gain
        feats = torch.where(z > 0, torch.log(z), 0)
        return self.head(feats).squeeze(-1)


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, counts: torch.Tensor, mode: str
) -> nanwatch.Watcher:
    y = torch.randn(counts.shape[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
            for _ in range(3):
                F.mse_loss(model(counts), y).backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    return nw


def _weights_anomaly(nw: nanwatch.Watcher) -> tuple[str, dict[str, object]]:
    """The summary of the first anomaly in the weights of gain, and its writer note."""
    for t in nw.history:
        a = t.anomaly
        if a is not None and a.kind is AnomalyKind.PARAMETER and a.parameter == "gain":
            note = next(
                n.data
                for n in t.notes
                if n.kind == "weight_writer" and n.data.get("parameter") == "gain"
            )
            return a.summary, note
    raise AssertionError([t.anomaly and t.anomaly.summary for t in nw.history])


_BY_UPDATE = (
    "NaN in the weights of gain: made non-finite by the last update (optimizer step), "
    "not by this step's computation"
)
_SINCE_0 = (
    "NaN in the weights of gain: non-finite since step 0 (read so at that step and at every "
    "step since), not made by this step"
)


@pytest.mark.gpu_bound_weaker(
    reason="nothing has landed when backward begins: each step is NW302, and the NaN "
    "weights get no NW301"
)
@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_an_update_of_a_nan_gradient_is_named_though_where_kept_the_output_finite(
    mode: str,
) -> None:
    torch.manual_seed(0)
    counts = torch.poisson(torch.full((32, 8), 0.7))  # exact zeros: log's 0 / 0 in backward
    model = _LogCounts()
    nw = _train(model, torch.optim.SGD(model.parameters(), lr=0.01), counts, mode)
    summary, note = _weights_anomaly(nw)
    # watch read the weights NaN at step 0's end already (after the update that applied
    # the NaN gradient): at step 1 they are told as NaN since then
    assert summary == (_SINCE_0 if mode == "watch" else _BY_UPDATE), summary
    assert note["read_finite_by"] is None and note["optimizer"] == "SGD", note
    diags = [d for t in nw.history for d in t.diagnoses if d.code == "NW301"]
    assert diags and not any("between" in d.title for d in diags), [d.title for d in diags]


@pytest.mark.gpu_bound_weaker(
    reason="nothing has landed when backward begins: step 1's NaN gradient of gain is "
    "NW302, and the NaN weights get no NW301"
)
def test_an_update_by_a_nan_learning_rate_is_named_though_where_kept_the_output_finite() -> None:
    """No NaN gradient here (no zero count): gain's group has a NaN learning rate, and the
    update by it is what wrote gain NaN, not a write after the next forward."""
    torch.manual_seed(0)
    counts = torch.poisson(torch.full((32, 8), 0.7)) + 1.0
    model = _LogCounts()
    opt = torch.optim.SGD(
        [{"params": [model.gain], "lr": math.nan}, {"params": model.head.parameters()}],
        lr=0.01,
    )
    nw = _train(model, opt, counts, "sentinel")
    summary, note = _weights_anomaly(nw)
    assert summary == _BY_UPDATE, summary
    assert note["read_finite_by"] is None and note["optimizer"] == "SGD", note


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_nan_gradient_whose_update_was_skipped_does_not_hide_a_later_data_write(
    mode: str,
) -> None:
    """Step 0's NaN gradient of fc.weight was reset before the update (skipped): that
    update did not write it, and the .data write after step 1's first forward did."""
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(net, mode=mode, on_anomaly="record", postmortem=False) as nw:
            for step in range(2):
                hook = net.fc.weight.register_hook(lambda g: g * math.nan) if step == 0 else None
                F.mse_loss(net(x), y).backward()
                if hook is not None:
                    hook.remove()
                if nw.check() is not None:
                    opt.zero_grad(set_to_none=True)  # skip this update
                if step == 1:  # inf * 0 = NaN, through .data: no version moves
                    net.fc.weight.data.add_(torch.zeros_like(net.fc.weight), alpha=math.inf)
                    F.mse_loss(net(x), y)  # a second forward
                opt.step()
                opt.zero_grad()
                nw.step()
    a = nw.history[1].anomaly
    assert a is not None and a.parameter == "fc.weight", a
    assert "written in place after" in a.summary, a.summary
    assert "not by an optimizer step" in a.summary, a.summary
