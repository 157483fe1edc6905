"""Fixes name the user's model and optimizer as the training loop holds them: not as the
model's forward calls its ``self`` (``def forward(s, x)``), and also when the forward's
module holds no optimizer (the model's code in another file)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import nanwatch
from nanwatch.watcher import _name_in_frame


class _Named(nn.Module):
    """Its forward asks for the fixes' names from inside (a rule fired there)."""

    def __init__(s) -> None:
        super().__init__()
        s.a = nn.Linear(4, 4)
        s.ask: Any = None

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        s.ask()
        return s.a(x)


def test_fix_names_come_from_the_loop_not_from_forward(tmp_path: Any) -> None:
    # a fix made while the model's forward runs (its ``self`` is ``s``, its module's
    # globals hold no optimizer) names what the training loop calls them
    from nanwatch.rules.base import Diagnosis

    net = _Named()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    d = Diagnosis(
        code="NW101",
        title="t",
        severity="error",
        fix="torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        'for g in optimizer.param_groups: g["lr"] = 0.01',
    )
    with nanwatch.watch(net, report_dir=tmp_path) as nw:
        net.ask = lambda: nw._in_users_names([d])
        net(torch.randn(2, 4))
        sgd.step()
    assert d.fix == (
        "torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)\n"
        'for g in sgd.param_groups: g["lr"] = 0.01'
    )


def test_name_in_frame_skips_the_receiver_of_the_objects_own_method() -> None:
    class M(nn.Module):
        def forward(s, x: Any) -> Any:
            import sys

            return _name_in_frame(sys._getframe(), s)

    assert M()(None) is None  # ``s`` is forward's self: no name a training loop has


def test_name_in_frame_keeps_a_functions_first_argument() -> None:
    def train(model: nn.Module) -> str | None:
        import sys

        return _name_in_frame(sys._getframe(), model)

    assert train(nn.Linear(1, 1)) == "model"
