"""A loop that takes its gradients with torch.autograd.grad (no backward()): an op of a
backward is placed at the autograd.grad() call, not at a "backward()"."""

from __future__ import annotations

import pytest
import torch

import nanwatch


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        (x,) = ctx.saved_tensors
        return g / (x - x)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 1)
        self.hit = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.hit:
            h = _Fn.apply(h)
        return self.b(torch.relu(h))


def _train(mode: str, bad: bool, use_grad: bool) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = _Net()
    params = list(model.parameters())
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            model.hit = bad and step == 2
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if use_grad:
                grads = torch.autograd.grad(loss, params)  # the gradient call
            else:
                loss.backward()  # the gradient call
                grads = tuple(p.grad for p in params)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p.sub_(0.01 * g)
                    p.grad = None
            nw.step()
    return nw


def _line(marker: str) -> str:
    import inspect

    src, start = inspect.getsourcelines(_train)
    n = next(i for i, s in enumerate(src) if marker in s and "# the gradient call" in s)
    return f"{__file__.rsplit('/', 1)[-1]}:{start + n}"


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_custom_backward_names_the_autograd_grad_call(mode: str) -> None:
    a = _train(mode, bad=True, use_grad=True).first_anomaly
    assert a is not None and (a.step, a.kind) == (2, nanwatch.AnomalyKind.BACKWARD)
    assert "custom autograd.Function _Fn" in a.summary
    assert "autograd.grad() at " in a.summary
    assert "backward() at" not in a.summary.replace("autograd.grad() at", "")


_LATE_LINE = pytest.mark.accelerator_weaker(
    reason="the custom Function's event is made when the step's reads land, after the "
    "update began: the line running then is named, not the autograd.grad call"
)


@pytest.mark.parametrize("mode", [pytest.param("watch", marks=_LATE_LINE), "forensic"])
def test_custom_backward_names_the_autograd_grad_line(mode: str) -> None:
    a = _train(mode, bad=True, use_grad=True).first_anomaly
    assert a is not None and f"autograd.grad() at {_line('autograd.grad(')}" in a.summary.replace(
        __file__.rsplit("/", 1)[0] + "/", ""
    )


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_backward_loop_still_says_backward(mode: str) -> None:
    a = _train(mode, bad=True, use_grad=False).first_anomaly
    assert a is not None and "custom autograd.Function _Fn" in a.summary
    assert "autograd.grad()" not in a.summary


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_healthy_autograd_grad_loop_reports_nothing(mode: str) -> None:
    assert _train(mode, bad=False, use_grad=True).first_anomaly is None
