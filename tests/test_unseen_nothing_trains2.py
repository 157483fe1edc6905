"""Nothing trains, told in sentinel mode too and by what the records show: float16
gradients that underflow under autocast (sentinel records no layer's own gradient), a
module or op that zeroes its whole output (``nn.Dropout(p=1.0)``, a mask of zeros,
``x * 0``), a loss already 0 when a watch begun mid-training starts (NW304), and NW312's fix
in the user's own names for the optimizer and the scheduler."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.base import Diagnosis

MODES = ("watch", "sentinel")


def _diags(nw: Any, code: str) -> list[Diagnosis]:
    return [d for t in nw.history for d in t.diagnoses if d.code == code]


def _watched(
    model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor], mode: str
) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
            for _ in range(8):
                loss_fn().backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    return nw


# ------------------------------- NW304: float16 gradients underflow, told in sentinel too


@pytest.mark.parametrize("mode", MODES)
def test_float16_gradients_that_underflow_under_autocast_are_told_in_both_modes(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))

    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        return F.cross_entropy(out.float(), y) * 1e-6  # its gradients underflow float16

    found = _diags(_watched(model, opt, step, mode), "NW304")
    assert found, "no NW304"
    d = found[0]
    assert d.path == "0"
    assert d.evidence[0] == "0: every gradient exactly 0 for the last 5 steps"
    assert any(
        "values under 2.98e-08 round to exactly 0; no GradScaler was given" in e for e in d.evidence
    )
    if mode == "sentinel":
        # the weights' own .grad is float32: the root's output gradient tells the dtype
        assert any(
            e.startswith("backward runs in float16 (the gradient of Sequential's output is")
            for e in d.evidence
        )
    assert "In float16 small gradients underflow to 0" in d.explanation
    assert d.fix.splitlines()[0] == "scaler = torch.amp.GradScaler('cpu')"


# ------------------------------- NW304: a module or op that zeroes its whole output


class _ZeroMask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.zeros_like(x)  # a mask that keeps nothing


class _TimesZero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * 0)  # an op between the two layers


def _zeroing(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "dropout_after_relu":
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(p=1.0), nn.Linear(64, 4))
    if kind == "dropout_before_relu":
        return nn.Sequential(nn.Linear(32, 64), nn.Dropout(p=1.0), nn.ReLU(), nn.Linear(64, 4))
    if kind == "mask":
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), _ZeroMask(), nn.Linear(64, 4))
    return _TimesZero()


def _classify(model: nn.Module, mode: str) -> Diagnosis:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    found = _diags(_watched(model, opt, lambda: F.cross_entropy(model(x), y), mode), "NW304")
    assert found, "no NW304"
    return found[0]


@pytest.mark.parametrize(
    ("kind", "maker", "relu"),
    [("dropout_after_relu", "2", "1"), ("dropout_before_relu", "1", "2")],
)
def test_a_dropout_with_p_one_is_named_as_what_zeroes_everything(
    kind: str, maker: str, relu: str
) -> None:
    d = _classify(_zeroing(kind), "watch")
    assert d.title == "Zero gradients: a module's output is exactly 0 whatever its input"
    assert d.path == maker
    assert any(
        e.startswith("3's weight gradient (3.weight) is exactly 0 while 3.bias's gradient is not")
        and e.endswith("so 3's input is exactly 0")
        for e in d.evidence
    )
    line = next(e for e in d.evidence if e.startswith(f"{maker} (Dropout)'s output is that 0"))
    assert "0's output, spans -1.791 to 1.969" in line
    assert f"{relu} (ReLU) zeroes only the values below 0" in line
    assert d.explanation.startswith(f"{maker} (Dropout) returns exactly 0 for every value")
    assert d.fix.splitlines()[-1] == "nn.Dropout(p=0.1)   # p < 1"


def test_a_module_whose_output_is_zero_behind_a_relu_is_named() -> None:
    d = _classify(_zeroing("mask"), "watch")
    assert d.path == "2"
    assert any(
        e == "2's output is exactly 0 everywhere (shape [16, 64]) while its input spans -1.791 "
        "to 1.969: its output does not depend on its input"
        for e in d.evidence
    )
    assert d.fix.startswith("# in 2 (_ZeroMask)'s forward: find what makes its output 0")


def test_an_op_between_modules_that_zeroes_a_layers_input_is_named() -> None:
    d = _classify(_zeroing("times_zero"), "watch")
    assert d.title == "Zero gradients: an op sets a layer's whole input to exactly 0"
    assert d.path == "_TimesZero"
    assert any(
        e == "b's input is exactly 0 everywhere (shape [16, 64]), made by MulBackward0 in "
        "_TimesZero's own forward, not by a module"
        for e in d.evidence
    )


@pytest.mark.parametrize("kind", ["dropout_after_relu", "mask", "times_zero"])
def test_sentinel_tells_which_layer_gets_an_input_of_zero(kind: str) -> None:
    d = _classify(_zeroing(kind), "sentinel")
    taker = "b" if kind == "times_zero" else "3"
    assert d.title == "Zero gradients: a layer's input is exactly 0 at every step"
    assert d.path == taker
    assert any(f"so {taker}'s input is exactly 0" in e for e in d.evidence)
    assert d.fix.splitlines()[-1].startswith('nanwatch.watch(model, mode="watch")')


# ---------------------------------- NW304: a watch begun mid-training on a loss at 0


def _hinge_trained(optim: str) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], Any]]:
    """A hinge written in plain code, trained unwatched until every margin is met."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if optim == "sgd"
        else torch.optim.Adam(model.parameters(), lr=1e-2)
    )
    x = torch.randn(64, 4)
    y = torch.where(x[:, 0] > 0, 1.0, -1.0)
    x[:, 0] += 3 * y

    def loss() -> torch.Tensor:
        return torch.relu(1 - y * model(x).squeeze(-1)).mean()

    for _ in range(500):
        value = loss()
        if value.item() == 0:
            break
        value.backward()
        opt.step()
        opt.zero_grad()
    assert loss().item() == 0
    return model, opt, loss


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_at_zero_when_a_watch_begins_mid_training_is_not_called_zero_from_the_start(
    mode: str,
) -> None:
    model, opt, loss = _hinge_trained("sgd")  # SGD keeps no step count: the past is unseen
    d = _diags(_watched(model, opt, loss, mode), "NW304")[0]
    assert d.title == (
        "Zero gradients: the loss is 0 at every step since the watch began (step 0), it does "
        "not move"
    )
    assert "from the first step" not in d.title
    assert any(
        e == "the loss is exactly 0 at every step since the watch began (steps 0 to 4): no "
        "update since then moved it"
        for e in d.evidence
    )
    assert "it started there" not in " ".join(d.evidence)
    assert "The steps before the watch began are not seen" in d.explanation
    assert "it did not reach a minimum" not in d.explanation
    # a one-output layer's bias is no learned logit scale to clamp
    assert "clamp" not in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_an_optimizer_that_stepped_before_the_watch_tells_the_loss_came_down(mode: str) -> None:
    model, opt, loss = _hinge_trained("adam")
    d = _diags(_watched(model, opt, loss, mode), "NW304")[0]
    assert d.severity == "info"
    assert d.title == "Zero gradients: the loss reached its minimum (0), nothing is left to learn"
    line = next(e for e in d.evidence if e.startswith("Adam made "))
    assert line.endswith(
        "updates before the watch began (its state's step count is "
        f"{int(opt.state[opt.param_groups[0]['params'][0]]['step'].item()) - 3}, 5 of them "
        "watched): the loss came down to 0 before the watch could see it"
    )


# ------------------------------------------ NW312: the fix in the user's own names


def _regression(net: nn.Module) -> Callable[[], torch.Tensor]:
    return lambda: (net(torch.randn(32, 8)) - 1).pow(2).mean()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def test_the_lr_zero_fix_names_the_users_optimizer() -> None:
    net = _net()
    adam = torch.optim.Adam(net.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(net, on_anomaly="record", postmortem=False) as nw:
            for _ in range(6):
                _regression(net)().backward()
                adam.step()
                adam.zero_grad()
                nw.step()
    d = _diags(nw, "NW312")[0]
    assert d.fix.splitlines()[-1] == "adam = torch.optim.Adam(net.parameters(), lr=1e-3)"


def test_the_lr_zero_fix_names_an_optimizer_kept_on_self() -> None:
    class Loop:
        def __init__(self) -> None:
            self.net = _net()
            self.optim = torch.optim.SGD(self.net.parameters(), lr=0.0)

        def fit(self) -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with nanwatch.watch(self.net, on_anomaly="record", postmortem=False) as nw:
                    for _ in range(6):
                        _regression(self.net)().backward()
                        self.optim.step()
                        self.optim.zero_grad()
                        nw.step()
            return nw

    d = _diags(Loop().fit(), "NW312")[0]
    assert d.fix.splitlines()[-1] == "self.optim = torch.optim.SGD(self.net.parameters(), lr=1e-3)"


def test_a_scheduler_kept_in_a_list_is_named_not_taken_for_lr_zero() -> None:
    net = _net()
    adam = torch.optim.Adam(net.parameters(), lr=1e-3)
    scheds = [torch.optim.lr_scheduler.LambdaLR(adam, lambda s: 0.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(net, on_anomaly="record", postmortem=False) as nw:
            for _ in range(6):
                _regression(net)().backward()
                adam.step()
                for sched in scheds:  # the loop's variable is not the user's name for it
                    sched.step()
                adam.zero_grad()
                nw.step()
    d = _diags(nw, "NW312")[0]
    assert any(
        e == "LambdaLR (scheds[0]) sets it, from the base lr 1e-3 (initial_lr)" for e in d.evidence
    )
    assert d.fix.startswith("print(scheds[0].get_last_lr())")
    assert "made with lr=0" not in d.fix


def test_the_lr_zero_fix_assigns_no_name_the_user_may_not_have() -> None:
    # read where no user frame holds the optimizer (a saved report, a post-mortem): the fix
    # makes it with an lr, and assigns no placeholder name
    from nanwatch.config import Thresholds
    from nanwatch.records import Note, StepTrace
    from nanwatch.rules.base import REGISTRY, RuleContext
    from nanwatch.rules.gradients import _lr_zero_diagnosis

    n = Note("optimizer", "Adam", {"groups": [{"group": 0, "params": 4, "lr": 0.0}], "ident": 1})
    t = StepTrace(step=4, notes=[n])
    ctx = RuleContext(trace=t, history=[], thresholds=Thresholds(), rule=REGISTRY["NW312"])
    d = _lr_zero_diagnosis(ctx, n, [(t, 1.0)] * 5, None)
    assert d.fix.splitlines()[-1] == (
        "torch.optim.Adam(model.parameters(), lr=1e-3)   # where you make it, not lr=0"
    )


# ------------------ a stale zero .grad of an unused head is no vanishing gradient


class _WithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.aux = nn.Linear(16, 3)  # trained once before, unused now

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_an_unused_heads_stale_zero_grad_is_not_vanishing(mode: str) -> None:
    """zero_grad(set_to_none=False) leaves the unused head a .grad of zeros every step:
    sentinel, which records no forward of the head, took it for a dead layer (NW304)."""
    torch.manual_seed(0)
    m = _WithUnusedHead()
    m.aux(torch.randn(2, 16)).sum().backward()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def loss() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        return F.cross_entropy(m(torch.randn(32, 8)), torch.randint(0, 4, (32,)))

    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(12):
            loss().backward()
            opt.step()
            nw.step()
    assert [d.code for d in nw.report.diagnoses if d.severity != "info"] == []
