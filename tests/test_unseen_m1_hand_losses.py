"""Hand-written losses and poolings whose fix was wrong or incomplete.

1. ``w = a / a.sum(-1, keepdim=True)``, attention weights renormalized after a mask removed
   every entry of one row: the sum is weights (the data flow shows a softmax), not a
   count, however whole its min and max happen to be (0 and 1): it was told "a count,
   clamp_min(1)", which changes every row whose sum is below 1. It is a renormalization,
   floored at the dtype's eps. A real count (``m.sum(1)`` of a mask) keeps clamp_min(1).
2. A model that returns ``torch.sigmoid(z).squeeze(1)`` (no nn.Sigmoid module) and a
   binary cross-entropy by hand: forensic mode's fix said "p is now the logits" and never
   said to take the sigmoid out of the model's forward; it now rewrites that line.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.rules.domain import _without_sigmoid

torch.set_num_threads(1)

MODES = ["forensic", "watch", "sentinel"]


# ------------------------------------------------------ 1: a renormalization, not a count
class _AttnPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(4, 1)
        self.head = nn.Linear(4, 2)

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        a = torch.softmax(self.score(h).squeeze(-1), dim=-1) * keep
        w = a / a.sum(-1, keepdim=True)
        return self.head((w.unsqueeze(-1) * h).sum(1))


class _AttnPoolFixed(_AttnPool):
    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        a = torch.softmax(self.score(h).squeeze(-1), dim=-1) * keep
        w = a / a.sum(-1, keepdim=True).clamp_min(torch.finfo(a.dtype).eps)
        return self.head((w.unsqueeze(-1) * h).sum(1))


def _pool(cls: type[_AttnPool], mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = cls()
    h = torch.randn(3, 5, 4)
    keep = torch.ones(3, 5)
    keep[1] = 0  # every item of sample 1 masked out
    keep[0, :3] = 0  # sample 0 keeps 2 of 5: its weights sum well below 1
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            loss = m(h, keep).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_a_renormalization_is_not_a_count(mode: str) -> None:
    d = _pool(_AttnPool, mode).report.diagnoses[0]
    assert (d.code, d.step) == ("NW111", 0), d.headline
    assert d.title == "Division by zero (0/0) in a renormalization: a row whose weights are all 0"
    text = " ".join(d.evidence)
    assert "count" not in d.evidence[0]
    assert "the line divides a by its own sum, a.sum(-1, keepdim=True)" in text
    assert "softmax" in text  # the data flow that shows weights
    assert "underflow" not in d.explanation
    assert d.fix.startswith(
        "w = a / a.sum(-1, keepdim=True).clamp_min(torch.finfo(a.dtype).eps)   # "
    )
    assert ".clamp_min(1)" not in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_the_renormalization_fix_trains_clean(mode: str) -> None:
    nw = _pool(_AttnPoolFixed, mode)
    assert nw.first_anomaly is None and nw.report.diagnoses == []
    assert all(torch.isfinite(p).all() for p in nw.roots[0].parameters())


class _MaskMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        e = self.enc(h)
        m = mask.float().unsqueeze(-1)
        pooled = (e * m).sum(1) / m.sum(1)
        return self.head(pooled)


@pytest.mark.parametrize("mode", MODES)
def test_a_real_count_keeps_clamp_min_1(mode: str) -> None:
    torch.manual_seed(0)
    mdl = _MaskMean()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    with nanwatch.watch(mdl, mode=mode, on_anomaly="record", postmortem=False) as nw:
        mdl(torch.randn(3, 5, 4), mask).sum().backward()
        nw.step()
    d = nw.report.diagnoses[0]
    assert d.code == "NW111", d.headline
    assert d.evidence[0].startswith("denominator is a count held in a float32 tensor (min 0")
    assert "the line makes it a count: m.sum(1)" in d.evidence[0]
    assert d.fix.startswith("pooled = (e * m).sum(1) / m.sum(1).clamp_min(1)   # ")


# ------------------------------------- 2: the model's own torch.sigmoid, named in the fix
class _Prob(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x)
        return torch.sigmoid(z).squeeze(1)


class _Logit(_Prob):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x)
        return z.squeeze(1)


def _bce(model: _Prob, mode: str, *, logits: bool) -> nanwatch.Watcher:
    with torch.no_grad():
        model.lin.bias.fill_(60.0)  # confident: the sigmoid rounds to exactly 1
    x = torch.randn(8, 4)
    y = torch.tensor([1.0, 0, 1, 0, 1, 1, 0, 0])
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        p = model(x)
        if logits:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(p, y)
        else:
            loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
        loss.backward()
        nw.step()
    return nw


def _line(text: str) -> int:
    import inspect

    src, start = inspect.getsourcelines(_Prob.forward)
    return start + next(i for i, s in enumerate(src) if text in s)


def test_forensic_names_the_models_sigmoid_line() -> None:
    torch.manual_seed(0)
    d = _bce(_Prob(), "forensic", logits=False).report.diagnoses[0]
    assert d.code == "NW110", d.headline
    first, second = d.fix.splitlines()[:2]
    assert first == (
        f"return z.squeeze(1)   # first, at {__file__}:{_line('torch.sigmoid(z)')}: return "
        "the logit, the sigmoid taken out (was: return torch.sigmoid(z).squeeze(1))"
    )
    assert second.startswith(
        "loss = torch.nn.functional.binary_cross_entropy_with_logits(p, y)   # "
    )


@pytest.mark.parametrize("mode", MODES)
def test_the_sigmoid_fix_trains_clean(mode: str) -> None:
    torch.manual_seed(0)
    nw = _bce(_Logit(), mode, logits=True)
    assert nw.first_anomaly is None and nw.report.diagnoses == []


@pytest.mark.parametrize(
    ("code", "fixed"),
    [
        ("return torch.sigmoid(z).squeeze(1)", "return z.squeeze(1)"),
        ("p = self.fc(h).sigmoid()", "p = self.fc(h)"),
        ("p = F.sigmoid(a + b)  # probs", "p = (a + b)"),
        ("p = torch.sigmoid(a) * torch.sigmoid(b)", None),  # two: not one line to change
        ("p = torch.tanh(z)", None),
    ],
)
def test_the_sigmoid_is_taken_out_of_the_line(code: str, fixed: str | None) -> None:
    assert _without_sigmoid(code) == fixed
