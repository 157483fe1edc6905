"""Hunt 30f: a Dice ratio of two empty sets is advised smoothing, not a count's clamp; a
gradient penalty's sqrt at 0 is reported as the value it made first."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)


class Dice(nn.Module):
    """1 - Dice over each sample, the ratio written on one line; nothing is named a count."""

    def forward(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        inter = (p * t).sum((1, 2, 3)); return (1 - 2 * inter / (p.sum((1, 2, 3)) + t.sum((1, 2, 3)))).mean()  # noqa: E501, E702  # fmt: skip


class SplitDice(nn.Module):
    """The same loss over three lines, the denominator held in a name."""

    def forward(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        inter = (p * t).sum((1, 2, 3))
        den = p.sum((1, 2, 3)) + t.sum((1, 2, 3))
        return (1 - 2 * inter / den).mean()


class Seg(nn.Module):
    """A one-channel mask head whose ReLU is dead: it predicts an all-zero mask."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


def _dice_run(crit: nn.Module | None = None) -> nanwatch.Watcher:
    torch.manual_seed(0)
    seg, crit = Seg(), crit or Dice()
    with torch.no_grad():
        seg.conv.bias.fill_(-20.0)
    x = torch.randn(2, 3, 6, 6)
    t = torch.zeros(2, 1, 6, 6)
    t[0, :, :2, :2] = 1  # sample 1's mask is empty, like its prediction
    with nanwatch.watch(seg, crit, on_anomaly="record") as nw:
        crit(seg(x), t).backward()
        nw.step()
    return nw


class _Loss(nn.Module):
    def __init__(self, fn: object) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        assert callable(self.fn)
        out = self.fn(p, t)
        assert isinstance(out, torch.Tensor)
        return out


@pytest.mark.parametrize("loss", [Dice, SplitDice])
def test_dice_of_two_empty_masks_is_smoothed_not_clamped_as_a_count(loss: type[nn.Module]) -> None:
    nw = _dice_run(loss())
    d = next(d for h in nw.history for d in h.diagnoses)
    assert d.code == "NW111"
    assert "overlap score" in d.title
    assert not any("a count" in e for e in d.evidence)
    assert "clamp_min(1)" not in d.fix
    # the loss's forward with the diagnosed line replaced by the advised one: quiet, and 0
    # for an empty prediction of an empty mask
    code, first = inspect.getsourcelines(loss.forward)
    at = int(d.source.rpartition(":")[2]) - first
    body = [ln.strip() for ln in code[1:at]] + [d.fix.split("   #", 1)[0].strip()]
    scope: dict[str, object] = {"torch": torch}
    exec("def fixed(p, t):\n" + "".join(f"    {ln}\n" for ln in body), scope)
    fixed = scope["fixed"]
    assert callable(fixed)
    empty = torch.zeros(1, 1, 6, 6, requires_grad=True)
    with torch.autograd.detect_anomaly():
        value = fixed(empty, torch.zeros(1, 1, 6, 6))
        value.backward()
    assert value.item() == 0.0
    assert empty.grad is not None and torch.isfinite(empty.grad).all()
    # and in the run that raised it, watched: quiet
    assert _dice_run(_Loss(fixed)).first_anomaly is None


class Critic(nn.Module):
    """A critic whose first ReLU is dead: its gradient with respect to the input is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        with torch.no_grad():
            self.net[0].bias.fill_(-50.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_gradient_penalty_sqrt_at_zero_is_reported_as_the_value_it_made_first() -> None:
    from nanwatch.localize import summarize
    from nanwatch.report import anomaly_headline

    torch.manual_seed(0)
    critic = Critic()
    real, fake = torch.randn(8, 4), torch.randn(8, 4)
    with nanwatch.watch(critic, on_anomaly="record", postmortem=False) as nw:
        xi = (0.5 * real + 0.5 * fake).requires_grad_(True)
        (g,) = torch.autograd.grad(critic(xi).sum(), xi, create_graph=True)
        gp = ((g.pow(2).sum(1).sqrt() - 1) ** 2).mean()
        (critic(fake).mean() - critic(real).mean() + 10 * gp).backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.born == "-inf"
    assert a.record.stat is not None and a.record.stat.kinds() == "NaN"
    # the headline and "Where it went wrong" both open with the -inf the sqrt's backward made
    assert anomaly_headline(a).startswith("-inf gradient born in the backward of (loss)")
    assert a.summary.startswith("-inf gradient born in the backward of (loss)")
    # named by the line that made the sqrt (the statement that assigned gp), not backward()
    assert "(then NaN) [op aten.sqrt in the backward of " in a.summary
    assert a.op.code is not None and a.op.code.startswith("gp = ")
    assert summarize(a) == a.summary  # summarizing again changes nothing
    text = " ".join(str(nw.report).split())
    assert "step 0: -inf gradient born in the backward of (loss)" in text
    assert "NaN gradient born" not in text
