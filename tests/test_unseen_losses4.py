"""Loss code nanwatch had not seen: a loss on a leaf rebuilt from an argmax
(``.requires_grad_()``) or from ``.item()`` sums, so the model gets no gradient (NW209); a
negative per-element BCE weight (NW517); a hand-weighted focal loss whose alpha above 1
rewards the errors of the negatives (NW210); and loss lines with several loss calls, whose
fixes must rewrite the call that was diagnosed (NW202, NW205, NW209)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import GuardError
from nanwatch.rules.base import Diagnosis

MODES = ("watch", "sentinel")


def _run(
    model: nn.Module,
    step: Callable[[int], torch.Tensor],
    *crits: nn.Module,
    mode: str = "watch",
    steps: int = 5,
    lr: float = 0.1,
) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, *crits, mode=mode, on_anomaly="record", postmortem=False) as nw:
            for i in range(steps):
                loss = step(i)
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    return nw


def _diag(nw: Any, code: str) -> Diagnosis:
    return next(d for d in nw.report.diagnoses if d.code == code)


def _codes(nw: Any) -> set[str]:
    return {d.code for d in nw.report.diagnoses}


def _mlp(out: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, out))


# ------------------------------------------------ 1: a loss on a rebuilt leaf (NW209)


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_on_an_argmax_made_a_leaf_again_is_named(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _mlp(), nn.MSELoss()

    def step(i: int) -> torch.Tensor:
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,)).float()
        pred = model(x).argmax(1).float().requires_grad_()
        return crit(pred, y)

    nw = _run(model, step, crit, mode=mode)
    d = _diag(nw, "NW209")
    assert d.path == "MSELoss" and d.step == 0
    assert d.evidence[0] == (
        "MSELoss's input (values 0 to 3) requires grad but has no autograd node and is no "
        "parameter: a new leaf, made by .requires_grad_() (or torch.tensor(..., "
        "requires_grad=True)) from values without a graph"
    )
    assert "no watched parameter got a nonzero gradient" in d.evidence[1]
    assert "F.cross_entropy(logits, y)" in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_rebuilt_from_item_sums_is_named(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _mlp(), nn.CrossEntropyLoss()

    def step(i: int) -> torch.Tensor:
        total = 0.0
        for _ in range(2):  # gradient accumulation gone wrong: the numbers, not the tensors
            x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
            total += crit(model(x), y).item()
        return torch.tensor(total / 2, requires_grad=True)

    d = _diag(_run(model, step, crit, mode=mode), "NW209")
    assert d.path == "(loss)" and d.step == 0
    assert d.evidence[0].startswith("backward() ran on a loss with no autograd node")
    assert d.fix.splitlines()[1] == (
        "loss = torch.stack(losses).mean()   # its graph reaches the model"
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_on_a_parameter_or_on_the_scores_is_not_a_rebuilt_leaf(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _mlp(), nn.CrossEntropyLoss()
    prototypes = nn.Parameter(torch.randn(16, 4))

    def step(i: int) -> torch.Tensor:
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        return crit(model(x), y) + F.mse_loss(prototypes, torch.zeros(16, 4))

    nw = _run(model, step, crit, mode=mode)
    assert "NW209" not in _codes(nw)
    # a leaf of the user's own as the only loss input, and a model that ran without
    # gradients (an evaluation): nothing the model should have learned from
    z = torch.randn(16, 4, requires_grad=True)

    def probe(i: int) -> torch.Tensor:
        with torch.no_grad():
            model(torch.randn(16, 8))
        return crit(z, torch.randint(0, 4, (16,)))

    assert "NW209" not in _codes(_run(model, probe, crit, mode=mode))


# ------------------------------------------------ 2: a negative BCE weight (NW517)


def test_a_negative_per_element_bce_weight_is_stopped() -> None:
    torch.manual_seed(0)
    net = nn.Linear(8, 3)
    x, y = torch.randn(4, 8), torch.tensor([[1.0, 0.0, 1.0]] * 4)
    w = torch.ones(4, 3)
    w[1, 2] = -0.5
    with pytest.raises(GuardError) as info, nanwatch.watch(net, postmortem=False):
        F.binary_cross_entropy_with_logits(net(x), y, weight=w)
    err = info.value
    assert err.code == "NW517" and err.positions == ((1, 2),)
    assert (
        "weight holds -0.5 at 1 position (of 12): a negative weight rewards the loss of its "
        "element instead of penalizing it (the optimizer makes those predictions worse, and "
        "the loss falls without bound); F.binary_cross_entropy_with_logits needs weights >= 0"
    ) in str(err)
    assert err.fix.startswith(
        "F.binary_cross_entropy_with_logits(net(x), y, weight=w.clamp_min(0))"
    )
    assert "a negative weight makes the term negative" in err.diagnosis.explanation


def test_a_negative_label_weight_of_a_bce_module_is_stopped_and_zeros_pass() -> None:
    net = nn.Linear(8, 3)
    x, y = torch.randn(4, 8), torch.rand(4, 3).round()
    crit = nn.BCELoss(weight=torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(GuardError) as info, nanwatch.watch(net, crit, postmortem=False):
        crit(torch.sigmoid(net(x)), y)
    assert info.value.code == "NW517"
    assert "BCELoss.weight holds -1 at 1 position (of 3)" in str(info.value)
    assert info.value.fix.startswith("crit.weight = crit.weight.clamp_min(0)")
    healthy = nn.BCELoss(weight=torch.tensor([1.0, 0.0, 2.0]))
    with nanwatch.watch(net, healthy, postmortem=False) as nw:
        healthy(torch.rand(4, 3), y)
        F.mse_loss(net(x), y, weight=torch.tensor([0.0, 1.0, 1.0]).expand(4, 3))
    assert not [n for n in nw.trace.notes if n.kind == "guard"]


# ------------------------------------------- 3: a focal alpha above 1 (NW210)


def _focal(alpha: float) -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
    torch.manual_seed(0)
    model = _mlp(out=1)

    def step(i: int) -> torch.Tensor:
        x, y = torch.randn(16, 8), (torch.rand(16, 1) > 0.5).float()
        logits = model(x)
        ce = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
        p = torch.sigmoid(logits)
        p_t = p * y + (1 - p) * (1 - y)
        alpha_t = alpha * y + (1 - alpha) * (1 - y)
        return (alpha_t * (1 - p_t) ** 2 * ce).mean()

    return model, step


@pytest.mark.parametrize("mode", MODES)
def test_a_focal_alpha_above_one_maximizes_the_negatives_loss(mode: str) -> None:
    model, step = _focal(4.0)
    nw = _run(model, step, mode=mode)
    d = _diag(nw, "NW210")
    assert d.path == "F.binary_cross_entropy_with_logits" and d.step == 1
    assert d.evidence[0].startswith(
        "F.binary_cross_entropy_with_logits(..., reduction='none') has terms >= 0, but the "
        "total loss sent a negative gradient to every term of target 0: "
    )
    assert d.evidence[0].endswith("terms over the last 2 steps, none spared")
    assert d.fix.startswith(
        "return (alpha_t * (1 - p_t) ** 2 * ce).mean()   # every factor of ce here must be "
        ">= 0: one is negative for target 0"
    )
    assert "0 <= alpha <= 1" in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_a_focal_alpha_below_one_a_mask_and_a_policy_gradient_stay_silent(mode: str) -> None:
    model, step = _focal(0.25)
    assert "NW210" not in _codes(_run(model, step, mode=mode))
    torch.manual_seed(0)
    policy = _mlp(out=1)

    def reinforce(i: int) -> torch.Tensor:
        # a Bernoulli policy: the sampled action is the target, weighted by a signed
        # advantage (noisy returns: action 1 pays more on average, not in every sample)
        x = torch.randn(16, 8)
        logits = policy(x)
        a = torch.bernoulli(torch.sigmoid(logits)).detach()
        r = a + torch.randn(16, 1)
        adv = (r - r.mean()) / (r.std() + 1e-8)
        mask = (torch.rand(16, 1) > 0.3).float()
        nll = F.binary_cross_entropy_with_logits(logits, a, reduction="none")
        masked = F.binary_cross_entropy_with_logits(logits, a, reduction="none") * mask
        return (nll * adv).mean() + masked.sum() / mask.sum().clamp(min=1)

    nw = _run(policy, reinforce, mode=mode, steps=8, lr=0.01)
    assert "NW210" not in _codes(nw)


# ----------------------- 4: a line with several loss calls: the fix rewrites the right one


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.cls = nn.Linear(16, 4)
        self.reg = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.cls(h), self.reg(h)


def _two_heads(line: Callable[..., torch.Tensor], *crits: nn.Module) -> Any:
    torch.manual_seed(0)
    model = _TwoHeads()

    def step(i: int) -> torch.Tensor:
        x, y, y2 = torch.randn(16, 8), torch.randint(0, 4, (16,)), torch.randn(16, 2)
        logits, r = model(x)
        return line(logits, r, y, y2)

    return _run(model, step, *crits, steps=3)


def test_nll_on_raw_scores_beside_another_loss_call_rewrites_the_nll() -> None:
    mse, nll = nn.MSELoss(), nn.NLLLoss()

    def line(logits: Any, r: Any, y: Any, y2: Any) -> torch.Tensor:
        return 0.5 * mse(r, y2) + 0.5 * nll(logits, y)

    d = _diag(_two_heads(line, mse, nll), "NW205")
    assert d.fix.startswith(
        "return 0.5 * mse(r, y2) + 0.5 * nll(logits.log_softmax(1), y)   # log_softmax"
    )


def test_bce_with_logits_after_a_sigmoid_beside_another_sigmoid_unwraps_its_own() -> None:
    mse, bce = nn.MSELoss(), nn.BCEWithLogitsLoss()

    def line(logits: Any, r: Any, y: Any, y2: Any) -> torch.Tensor:
        t = F.one_hot(y, 4).float()
        return 0.5 * mse(torch.sigmoid(r), y2) + 0.5 * bce(torch.sigmoid(logits), t)

    d = _diag(_two_heads(line, mse, bce), "NW205")
    assert d.fix.startswith(
        "return 0.5 * mse(torch.sigmoid(r), y2) + 0.5 * bce(logits, t)   # the logits"
    )


def test_a_sigmoid_on_the_loss_line_is_removed_there_not_in_the_model() -> None:
    def line(logits: Any, r: Any, y: Any, y2: Any) -> torch.Tensor:
        t, w = F.one_hot(y, 4).float(), torch.rand(16, 4)
        return torch.mean(F.binary_cross_entropy(torch.sigmoid(logits), t, reduction="none") * w)

    d = _diag(_two_heads(line), "NW202")
    assert d.fix == (
        'return torch.mean(F.binary_cross_entropy_with_logits(logits, t, reduction="none") * w)'
        "   # on the logit: BCEWithLogits applies the sigmoid inside, stably"
    )
    mse, bce = nn.MSELoss(), nn.BCELoss()

    def modules(logits: Any, r: Any, y: Any, y2: Any) -> torch.Tensor:
        t = F.one_hot(y, 4).float()
        return 0.5 * mse(torch.sigmoid(r), y2) + bce(torch.sigmoid(logits), t)

    d = _diag(_two_heads(modules, mse, bce), "NW202")
    assert d.fix.splitlines() == [
        "bce = nn.BCEWithLogitsLoss()   # in place of the nn.BCELoss (keep its weight=, if any): "
        "the sigmoid inside, stably",
        "return 0.5 * mse(torch.sigmoid(r), y2) + bce(logits, t)   # on the logit",
    ]


def test_a_detached_loss_input_is_undone_in_the_loss_call_not_elsewhere_on_the_line() -> None:
    ce = nn.CrossEntropyLoss()

    def line(logits: Any, r: Any, y: Any, y2: Any) -> torch.Tensor:
        return r.mean().detach() * ce(logits.detach(), y) + 0 * logits.sum()

    d = _diag(_two_heads(line, ce), "NW209")
    assert d.fix == (
        "return r.mean().detach() * ce(logits, y) + 0 * logits.sum()   # on the output itself, "
        "with its autograd graph"
    )


def test_a_softmax_on_the_loss_line_is_dropped_or_made_log_there() -> None:
    mse, nll = nn.MSELoss(), nn.NLLLoss()

    def ce_line(logits: Any, r: Any, y: Any, y2: Any) -> torch.Tensor:
        return 0.5 * F.mse_loss(r, y2) + F.cross_entropy(logits.softmax(-1), y)

    d = _diag(_two_heads(ce_line), "NW203")
    assert d.fix == (
        "return 0.5 * F.mse_loss(r, y2) + F.cross_entropy(logits, y)   # on the logits: "
        "CrossEntropyLoss applies log_softmax itself"
    )

    def nll_line(logits: Any, r: Any, y: Any, y2: Any) -> torch.Tensor:
        return 0.5 * mse(r.softmax(-1), y2) + nll(torch.softmax(logits, 1), y)

    d = _diag(_two_heads(nll_line, mse, nll), "NW204")
    assert d.fix == (
        "return 0.5 * mse(r.softmax(-1), y2) + nll(torch.log_softmax(logits, 1), y)   # "
        "NLLLoss takes log-probabilities"
    )
