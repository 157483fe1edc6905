"""Multi-task training code between and around modules: a gradient-reversal layer (a custom
autograd.Function, as a module or called in the parent), a user's full backward hook on a
head, a tensor or parameter hook that normalizes a zero gradient, and a loss weight with its
own optimizer (GradNorm) that went NaN at an earlier step."""

from __future__ import annotations

import torch
from torch import nn

import nanwatch
from nanwatch.records import AnomalyKind


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lambd):  # type: ignore[no-untyped-def]
        ctx.lambd = lambd
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g.neg() * ctx.lambd, None


class GRL(nn.Module):
    def __init__(self, lambd: float) -> None:
        super().__init__()
        self.lambd = lambd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GradReverse.apply(x, self.lambd)  # type: ignore[no-any-return,no-untyped-call]


class DANN(nn.Module):
    def __init__(self, lambd: float, *, module: bool) -> None:
        super().__init__()
        self.lambd = lambd
        self.features = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.label_head = nn.Linear(16, 3)
        self.grl = GRL(lambd) if module else None
        self.domain_head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(x)
        r = self.grl(f) if self.grl is not None else GradReverse.apply(f, self.lambd)  # type: ignore[no-untyped-call]
        return self.label_head(f), self.domain_head(r)


def _dann_step(model: DANN) -> nanwatch.Watcher:
    torch.manual_seed(1)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    d = torch.cat([torch.zeros(8, 1), torch.ones(8, 1)])
    ce, bce = nn.CrossEntropyLoss(), nn.BCEWithLogitsLoss()
    with nanwatch.watch(model, ce, bce, on_anomaly="record", postmortem=False) as nw:
        yl, yd = model(x)
        (ce(yl, y) + bce(yd, d)).backward()
        nw.step()
    return nw


def test_a_grl_module_with_an_infinite_lambda_is_named_not_its_parent() -> None:
    torch.manual_seed(0)
    nw = _dann_step(DANN(float("inf"), module=True))
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD
    assert a.path == "grl"
    assert "custom autograd.Function GradReverse in grl" in a.summary
    assert "sent back to features.1's output" in a.summary  # the tensor grl was given
    assert "code in features" not in a.summary


def test_a_functional_grl_is_not_blamed_on_the_label_head() -> None:
    torch.manual_seed(0)
    model = DANN(float("inf"), module=False)
    nw = _dann_step(model)
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD
    assert a.path == "DANN" and a.origin == "between-children"
    # its own backward, replayed, names the Function that made it (as nw.replay does)
    assert "born in the backward of custom autograd.Function GradReverse" in a.summary
    assert "label_head" not in a.summary.split(" [")[0]
    d = nw.report.diagnoses[0]
    # the op inside its backward, replayed, and the factor it multiplies by: lambd
    assert "min(ctx.lambd, 1e3)" in d.fix, d.fix


def test_a_replay_names_the_custom_backward_in_the_headline() -> None:
    torch.manual_seed(0)
    model = DANN(float("inf"), module=False)
    torch.manual_seed(1)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    d = torch.cat([torch.zeros(8, 1), torch.ones(8, 1)])
    ce, bce = nn.CrossEntropyLoss(), nn.BCEWithLogitsLoss()

    def step_fn() -> None:
        yl, yd = model(x)
        (ce(yl, y) + bce(yd, d)).backward()

    with nanwatch.watch(model, ce, bce, on_anomaly="record", postmortem=False) as nw:
        step_fn()
        nw.step()
        nw.replay(step_fn)
    a = nw.first_anomaly
    assert a is not None and a.op is not None
    # what the custom backward made, then what the gradient came to hold, as the headline says
    assert a.summary.startswith(
        "-inf gradient born in the backward of custom autograd.Function GradReverse"
    ), a.summary
    assert " (then +inf, -inf) [" in a.summary, a.summary
    from nanwatch.report import anomaly_headline

    head = anomaly_headline(a)
    assert head.startswith("-inf gradient born in the backward of "), head
    assert "(then +inf, -inf), step 0" in head, head


def test_a_finite_grl_stays_silent() -> None:
    torch.manual_seed(0)
    nw = _dann_step(DANN(1.0, module=True))
    assert nw.first_anomaly is None
    torch.manual_seed(0)
    nw = _dann_step(DANN(1.0, module=False))
    assert nw.first_anomaly is None


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head1 = nn.Linear(16, 1)
        self.head2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.head1(h), self.head2(h)


def test_a_full_backward_hook_on_a_head_is_named() -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    handle = model.head2.register_full_backward_hook(
        lambda m, gi, go: (gi[0] / gi[0].norm(),)  # type: ignore[index]  # 0/0 when the head's task is absent
    )
    try:
        with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
            p1, p2 = model(torch.randn(16, 8))
            (p1.pow(2).mean() + 0.0 * p2.sum()).backward()
            nw.step()
    finally:
        handle.remove()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD and a.path == "head2"
    assert "backward hook of head2 (register_full_backward_hook)" in a.summary
    assert "code in trunk" not in a.summary


class HookedTrunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        if h.requires_grad:
            h.register_hook(lambda g: g / g.norm())
        return self.head(h)  # type: ignore[no-any-return]


def test_a_replay_names_the_tensor_hook_not_the_head() -> None:
    torch.manual_seed(0)
    model = HookedTrunk()
    x = torch.randn(16, 8)

    def step_fn() -> None:
        (model(x) * 0.0).sum().backward()  # the task is absent: a zero gradient

    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        step_fn()
        nw.step()
        nw.replay(step_fn)
    a = nw.first_anomaly
    assert a is not None and a.op is not None
    assert "tensor hook you registered (register_hook)" in a.summary
    assert "on trunk.2's output" in a.summary
    assert "backward of head" not in a.summary


def test_forensic_names_a_hook_on_a_parameter() -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    handle = model.head2.weight.register_hook(lambda g: g / g.norm())  # type: ignore[no-untyped-call]
    try:
        with nanwatch.watch(model, mode="forensic", on_anomaly="record", postmortem=False) as nw:
            p1, p2 = model(torch.randn(16, 8))
            (p1.pow(2).mean() + 0.0 * p2.sum()).backward()
            nw.step()
    finally:
        handle.remove()
    a = nw.first_anomaly
    assert a is not None and a.path == "head2"
    assert "hook you registered (register_hook)" in a.summary
    assert "on parameter head2.weight" in a.summary
    assert "(loss), the loss code" not in a.summary


def _gradnorm(mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = TwoHeads()
    weights = nn.Parameter(torch.ones(2))
    opt_w = torch.optim.SGD([weights], lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(2):
            p1, p2 = model(torch.randn(16, 8))
            L = torch.stack([p1.pow(2).mean(), p2.pow(2).mean()])
            (weights * L).sum().backward()  # type: ignore[no-untyped-call]
            if step == 0:
                weights.grad = torch.full_like(weights, float("nan"))  # a 0/0 ratio
                opt_w.step()
            opt_w.zero_grad()
            nw.step()
    return nw


def test_a_nan_loss_weight_from_its_own_optimizer_is_named_a_leaf() -> None:
    for mode in ("watch", "forensic"):
        nw = _gradnorm(mode)
        a = nw.first_anomaly
        assert a is not None and a.step == 1
        assert "NaN in weights, a tensor your code passes to the loss: a leaf" in a.summary
        assert "of shape (2,) that already held NaN" in a.summary
        d = nw.history[-1].diagnoses[0]
        assert d.code == "NW100"
        assert "forensic" not in d.fix
        assert 'weights_module.register_parameter("weights", weights)' in d.fix
        assert "opt_w.step()" in d.fix
        # the fix's guard runs as pasted
        weights = nn.Parameter(torch.ones(2))
        opt_w = torch.optim.SGD([weights], lr=0.1)
        weights.grad = torch.full_like(weights, float("nan"))
        exec(d.fix, {"torch": torch, "weights": weights, "opt_w": opt_w})
        assert torch.isfinite(weights).all()
