"""A module that returns the softmax of logits its own code gave a -inf (a policy's illegal
actions filled with ``masked_fill`` or ``torch.where``, an additive mask of 0 and -inf,
Gumbel noise by hand, -log(-log(u)) at a draw u = 0), and loss code that takes the log of
it (``p * p.log()``, an entropy): the softmax is exactly 0 there by construction, so
``F.log_softmax(logits)`` is -inf there too. Watch mode proves it from the child output the
softmax was taken of; sentinel measures no child output, and now reads the autograd graph
below the watched output's node (by name: ``made_from``'s ``below:`` ops) and says the same,
with the same fix. A softmax of logits far apart (no -inf) keeps the underflow story."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import ops

torch.set_num_threads(1)

MODES = ["watch", "sentinel"]
MASKED_FIX = "logp = F.log_softmax(z, dim=-1).masked_fill(mask, 0.0)   #"
NOISE_FIX = "u = torch.rand_like(z).clamp_min(torch.finfo(z.dtype).tiny), or F.gumbel_softmax"


def _train(
    model: nn.Module, step: Callable[[], torch.Tensor], mode: str, steps: int = 2
) -> nanwatch.Watcher:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            step().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


class _Policy(nn.Module):
    """Illegal actions' logits set to -inf, by ``masked_fill`` or by ``torch.where``."""

    def __init__(self, fill: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 5))
        self.fill = fill
        self.fixed = False
        self.logp = torch.empty(0)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        if self.fill == "masked_fill":
            z = self.net(obs).masked_fill(~legal, float("-inf"))
        else:
            z = torch.where(legal, self.net(obs), float("-inf"))
        if self.fixed:  # the diagnosis's fix, in this code's names
            self.logp = F.log_softmax(z, dim=-1).masked_fill(~legal, 0.0)
        return F.softmax(z, -1)


def _a2c(fill: str, mode: str, fixed: bool = False) -> tuple[nn.Module, nanwatch.Watcher]:
    torch.manual_seed(0)
    pi = _Policy(fill)
    pi.fixed = fixed
    obs, adv = torch.randn(32, 8), torch.randn(32)
    legal = torch.rand(32, 5) > 0.3
    legal[:, 0] = True
    act = torch.zeros(32, 1, dtype=torch.long)

    def step() -> torch.Tensor:
        p = pi(obs, legal)
        logp = pi.logp if fixed else p.log()
        ent = -(p * logp).sum(-1).mean()
        return -(logp.gather(1, act).squeeze(1) * adv).mean() - 0.01 * ent

    return pi, _train(pi, step, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fill", ["masked_fill", "torch.where"])
def test_a_mask_in_the_modules_forward_is_said_in_both_modes_and_its_fix_trains_clean(
    fill: str, mode: str
) -> None:
    _, nw = _a2c(fill, mode)
    d = nw.report.diagnoses[0]
    assert (d.code, d.op, d.path) == ("NW110", "aten.log", "(loss)")
    assert d.title == "Log of a softmax that _Policy's own code set to 0"
    said = " ".join(d.evidence)
    assert "a probability that underflowed" not in said
    assert "F.log_softmax(logits, dim=-1)   #" not in d.fix
    assert d.fix.splitlines()[1].startswith(MASKED_FIX)
    if mode == "sentinel":  # no child output measured: the graph below the output says it
        assert f"(log <- softmax <- {fill}, from the autograd graph)" in said
        assert "exactly 0 where that put a -inf" in said
        assert NOISE_FIX not in d.fix  # a fill through a mask: no noise to suspect
        assert ("~keep" in d.fix) == (fill == "torch.where")
    pi, nw = _a2c(fill, mode, fixed=True)
    assert not nw.report.diagnoses
    assert all(torch.isfinite(p).all() for p in pi.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_the_log_of_a_picked_forbidden_action_is_said_as_the_masks(mode: str) -> None:
    torch.manual_seed(0)
    pi = _Policy("masked_fill")
    obs, adv = torch.randn(32, 8), torch.randn(32)
    legal = torch.rand(32, 5) > 0.3
    legal[:, 0] = True
    act = torch.ones(32, 1, dtype=torch.long)  # illegal in some rows: a bug in the data

    def step() -> torch.Tensor:
        p = pi(obs, legal)
        return -(torch.log(p.gather(1, act)).squeeze(1) * adv).mean()

    d = _train(pi, step, mode).report.diagnoses[0]
    assert (d.code, d.op) == ("NW110", "aten.log")
    assert d.title == "Log of a softmax that _Policy's own code set to 0"
    said = " ".join(d.evidence)
    assert "is picked from _Policy's softmax output" in said
    assert "(log <- gather <- softmax <- masked_fill, from the autograd graph)" in said
    assert "The code picks its zeros (gather): an entry the mask forbids" in d.explanation


class _Gumbel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.enc(x)
        u = torch.rand_like(logits)
        u[5, 3] = 0.0  # the draw that hits 0 (probability 2^-24 per element in float32)
        g = -torch.log(-torch.log(u))
        return F.softmax((logits + g) / 0.5, -1)


@pytest.mark.parametrize("mode", MODES)
def test_gumbel_noise_by_hand_is_the_modules_own_minus_inf_in_both_modes(mode: str) -> None:
    torch.manual_seed(0)
    m = _Gumbel()
    x = torch.randn(64, 16)

    def step() -> torch.Tensor:
        y = m(x)
        return (y[:, 0] - 1).pow(2).mean() + 0.01 * (y * torch.log(y)).sum(-1).mean()

    d = _train(m, step, mode).report.diagnoses[0]
    assert (d.code, d.op) == ("NW110", "aten.log")
    assert d.title == "Log of a softmax that _Gumbel's own code set to 0"
    assert d.fix.splitlines()[1].startswith(MASKED_FIX)
    assert NOISE_FIX in d.fix
    said = " ".join(d.evidence)
    assert "a probability that underflowed" not in said
    if mode == "sentinel":
        assert "added a tensor with no gradient to its logits" in said
        assert "(log <- softmax <- div <- add, from the autograd graph)" in said


class _Attend(nn.Module):
    """Causal attention weights with an additive mask of 0 and -inf, built in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(16, 32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(h).chunk(2, -1)
        n = h.shape[1]
        causal = torch.full((n, n), float("-inf")).triu(1)
        return F.softmax(q @ k.transpose(1, 2) / 4.0 + causal, -1)


def test_an_additive_minus_inf_mask_in_forward_is_said_in_sentinel() -> None:
    torch.manual_seed(0)
    m = _Attend()
    h = torch.randn(4, 6, 16)

    def step() -> torch.Tensor:
        a = m(h)
        return (a * a.log()).sum(-1).mean()

    d = _train(m, step, "sentinel").report.diagnoses[0]
    assert (d.code, d.op) == ("NW110", "aten.log")
    assert d.title == "Log of a softmax that _Attend's own code set to 0"
    assert "(log <- softmax <- add, from the autograd graph)" in " ".join(d.evidence)
    assert "an additive mask m: m == float('-inf')" in d.fix


class _Sharp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 5))
        with torch.no_grad():
            self.net[2].weight.mul_(300.0)  # logits far apart: exp of the low ones is 0

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.net(obs), -1)


@pytest.mark.parametrize("mode", MODES)
def test_a_softmax_of_far_apart_finite_logits_keeps_the_underflow_story(mode: str) -> None:
    torch.manual_seed(0)
    m = _Sharp()
    obs = torch.randn(32, 8)

    def step() -> torch.Tensor:
        p = m(obs)
        return (p * p.log()).sum(-1).mean()

    d = _train(m, step, mode).report.diagnoses[0]
    assert (d.code, d.op) == ("NW110", "aten.log")
    assert "own code" not in d.title
    assert "a probability that underflowed to 0" in " ".join(d.evidence)
    assert d.fix.startswith("logp = F.log_softmax(logits, dim=-1)   #")


class _SharpPlusPrior(_Sharp):
    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.net(obs) + torch.zeros(5), -1)  # a constant added: no -inf


def test_an_added_constant_is_not_said_where_the_measured_logits_can_underflow() -> None:
    torch.manual_seed(0)
    m = _SharpPlusPrior()
    obs = torch.randn(32, 8)

    def step() -> torch.Tensor:
        p = m(obs)
        return (p * p.log()).sum(-1).mean()

    d = _train(m, step, "watch").report.diagnoses[0]
    assert (d.code, d.op) == ("NW110", "aten.log")
    assert "own code" not in d.title
    assert d.fix.startswith("logp = F.log_softmax(logits, dim=-1)   #")


def test_made_below_follows_a_temperature_and_a_cast_to_the_op_that_made_the_logits() -> None:
    z = torch.zeros(2, 3, requires_grad=True)
    m = torch.tensor([[False, True, False]] * 2)
    p = torch.softmax(z.masked_fill(m, float("-inf")).double() * 2.0, -1)
    assert ops.made_below(p.grad_fn) == ["mul", "tocopy", "maskedfill"]
    assert ops.made_below(torch.softmax(z * z, -1).grad_fn) == ["mul"]  # two histories: ends
    assert ops.made_below(torch.softmax(z.exp() - torch.ones(3), -1).grad_fn) == ["sub(constant)"]
    watched = {p.grad_fn}
    chain = ops.made_from(p.log().grad_fn, lambda n: n in watched, below=True)
    assert chain == ["watched:softmax", "below:mul", "below:tocopy", "below:maskedfill"]
    assert ops.made_from(p.log().grad_fn, lambda n: n in watched) == ["watched:softmax"]
