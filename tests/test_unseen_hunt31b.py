"""A ``torch.compile``'d submodule: sentinel mode watches around it, the other modes refuse
it with the line that unwraps it in the user's own names. A gradient penalty computed
outside every module (WGAN-GP): its backward op is named by the forward line that made it,
not by the ``backward()`` call, in watch mode too."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import LOSS_PATH, AnomalyKind, Phase

HERE = os.path.basename(__file__)


def _line(fn: Callable[..., Any], marker: str) -> str:
    """``test_unseen_hunt31b.py:N`` of the line of ``fn`` that holds ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{HERE}:{start + offset}"


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN where x < 0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Log(), nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _compiled_net() -> _Net:
    torch.manual_seed(0)
    net = _Net()
    net.blocks[2] = torch.compile(net.blocks[2], backend="eager")  # type: ignore[assignment]
    return net


@pytest.mark.slow
def test_sentinel_watches_a_model_whose_submodule_is_compiled() -> None:
    net = _compiled_net()
    net.blocks[0] = torch.compile(net.blocks[0], backend="eager")  # type: ignore[assignment]
    with nanwatch.watch(net, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        net(torch.rand(3, 4) + 1).mean().backward()  # log of positive values: finite
        nw.step()
        net.zero_grad()
        net(-torch.ones(3, 4) * 100).mean().backward()  # the compiled log of a negative
        nw.step()
    # its weights are named as the user's model names them, not through the wrapper
    weights = [r.role for r in nw.history[0].records if r.phase is Phase.GRADIENT]
    assert "blocks.2.weight" in weights and not [w for w in weights if "_orig_mod" in w]
    assert nw.history[0].anomaly is None
    a = nw.first_anomaly
    assert a is not None and a.step == 1 and a.kind is AnomalyKind.FORWARD
    # found at the root, whose replay names the child the op ran in, compiled or eager
    assert a.path == "blocks.0"
    # and its replay names the op inside the compiled submodule, at its line
    assert a.op is not None and a.op.op.startswith("aten.log")
    assert a.op.source is not None and a.op.source.endswith(_line(_Log.forward, "x < 0"))


def test_watch_refuses_a_compiled_submodule_with_the_users_own_names() -> None:
    net = _compiled_net()
    with pytest.raises(nanwatch.ConfigError, match=r"torch\.compile") as info:
        nanwatch.watch(net).attach()
    message = str(info.value)
    assert "model." not in message  # a name the user's code does not have
    fix = "net.blocks[2] = net.blocks[2]._orig_mod"
    assert fix in message and 'mode="sentinel"' in message
    exec(fix, {"net": net})  # the fix runs when pasted, and watching works after it
    with nanwatch.watch(net, postmortem=False):
        net(torch.rand(3, 4) + 1)


class _Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"a-b": nn.Linear(2, 2)})
        self.add_module("odd-name", nn.Linear(2, 2))


def test_the_unwrapping_line_runs_for_names_that_are_not_attributes() -> None:
    holder = _Named()
    holder.heads["a-b"] = torch.compile(holder.heads["a-b"], backend="eager")
    with pytest.raises(nanwatch.ConfigError) as info:
        nanwatch.watch(holder).attach()
    fix = "holder.heads['a-b'] = holder.heads['a-b']._orig_mod"
    assert fix in str(info.value)
    exec(fix, {"holder": holder})
    setattr(holder, "odd-name", torch.compile(getattr(holder, "odd-name"), backend="eager"))
    with pytest.raises(nanwatch.ConfigError) as info:
        nanwatch.watch(holder).attach()
    fix = "setattr(holder, 'odd-name', getattr(holder, 'odd-name')._orig_mod)"
    assert fix in str(info.value)
    exec(fix, {"holder": holder})
    nanwatch.watch(holder, postmortem=False).attach().detach()


def test_a_compiled_model_with_no_name_in_the_users_code_is_not_given_one() -> None:
    with pytest.raises(nanwatch.ConfigError) as info:
        nanwatch.watch(_compiled_net()).attach()
    message = str(info.value)
    assert "model." not in message and " = " not in message
    assert "set blocks.2 of the _Net you watch to its ._orig_mod" in message
    compiled = torch.compile(nn.Linear(2, 2), backend="eager")
    with pytest.raises(nanwatch.ConfigError, match=r"compiled = compiled\._orig_mod"):
        nanwatch.watch(compiled)


def _flat_critic() -> nn.Module:
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        critic[0].weight.zero_()  # flat in its input: the gradient penalty's rows are 0
    return critic


def _wgan_gp_step(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> None:
    eps = torch.rand(real.shape[0], 1)
    x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
    d_out = critic(x_hat)
    grad = torch.autograd.grad(d_out.sum(), x_hat, create_graph=True)[0]
    gp = ((grad.pow(2).sum(1).sqrt() - 1) ** 2).mean()  # the norm
    loss = critic(fake).mean() - critic(real).mean() + 10 * gp
    loss.backward()  # the backward call


def test_a_gradient_penalty_outside_the_modules_is_named_by_its_forward_line() -> None:
    critic = _flat_critic()
    with nanwatch.watch(critic, on_anomaly="record", postmortem=False) as nw:
        _wgan_gp_step(critic, torch.randn(6, 4), torch.randn(6, 4))
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None
    op = a.op
    assert (op.phase, op.path, op.node) == (Phase.BACKWARD, LOSS_PATH, "SqrtBackward0")
    assert op.source is not None and op.source.endswith(_line(_wgan_gp_step, "# the norm"))
    assert op.code is not None and ".sqrt()" in op.code
    assert op.backward_at is not None
    assert op.backward_at.endswith(_line(_wgan_gp_step, "# the backward call"))
    assert f"in the backward of {op.source}" in a.summary
    assert "mode='forensic' names the line" not in a.summary
    fix = next(d.fix for d in nw.history[-1].diagnoses if d.code == "NW112")
    assert fix is not None and "gp = (((grad.pow(2).sum(1) + 1e-12).sqrt() - 1) ** 2).mean()" in fix


def _penalty(grad: torch.Tensor) -> torch.Tensor:
    return ((grad.pow(2).sum(1).sqrt() - 1) ** 2).mean()


def _wgan_gp_step_with_a_helper(critic: nn.Module, real: torch.Tensor) -> None:
    x_hat = real.clone().requires_grad_(True)
    grad = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)[0]
    gp = _penalty(grad)
    (critic(real).mean() + gp).backward()  # the backward call


def test_a_line_that_does_not_write_the_op_is_not_named_as_its_line() -> None:
    """The penalty's sqrt ran in a helper: the line that called it holds no sqrt and is
    not named; the helper's line that wrote the sqrt is, found by following the call."""
    critic = _flat_critic()
    with nanwatch.watch(critic, on_anomaly="record", postmortem=False) as nw:
        _wgan_gp_step_with_a_helper(critic, torch.randn(6, 4))
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.node == "SqrtBackward0"
    backward = _line(_wgan_gp_step_with_a_helper, "# the backward call")
    assert a.op.backward_at is not None and a.op.backward_at.endswith(backward)
    assert a.op.source is not None and a.op.source.endswith(_line(_penalty, ".sqrt()"))
    assert a.op.code is not None and ".sqrt()" in a.op.code
