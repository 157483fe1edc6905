"""Fixes are written in the user's names: the rules say ``model``, ``optimizer`` and
``criterion`` where they cannot know better, and the watcher puts in the names the user's
code holds the watched model, its optimizer and its loss under."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.watcher import _renamed


def _diverging_fix(define_model: bool) -> str:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e38)  # the update overflows the weights
    if define_model:
        model = "a name the user's code uses for something else"  # noqa: F841
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with nanwatch.watch(net, postmortem=False) as nw, pytest.raises(nanwatch.AnomalyError) as info:
        for _ in range(5):
            loss = ((net(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = info.value.diagnosis
    assert d is not None and d.fix
    return d.fix


def test_the_fix_uses_the_users_name_for_the_model() -> None:
    fix = _diverging_fix(define_model=False)
    assert "net.parameters()" in fix and "model." not in fix.split("#")[0]


def test_a_generic_name_the_users_code_defines_is_left_alone() -> None:
    assert "model.parameters()" in _diverging_fix(define_model=True)


def test_names_are_replaced_in_code_only_and_never_as_attributes_or_keywords() -> None:
    renames = {"model": "net", "optimizer": "opt"}
    assert _renamed("model.float()  # the model in float32", renames) == (
        "net.float()  # the model in float32"
    )
    assert _renamed("f(model=model, x=self.model, y=my_model)", renames) == (
        "f(model=net, x=self.model, y=my_model)"
    )
    assert _renamed('g = optimizer.param_groups[0]  # "#" in a string', renames) == (
        'g = opt.param_groups[0]  # "#" in a string'
    )
    assert _renamed('print("model # optimizer")', renames) == 'print("model # optimizer")'


def test_with_two_watched_models_model_keeps_its_generic_name() -> None:
    """A backbone and a head watched apart: the rules' ``model`` is their composition,
    which has no name in the user's code, so it is not renamed to either."""
    torch.manual_seed(0)
    backbone, head = nn.Linear(4, 8), nn.Linear(8, 1)
    opt = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=1e38)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    nw = nanwatch.watch(backbone, head, postmortem=False)
    with nw, pytest.raises(nanwatch.AnomalyError) as info:
        for _ in range(5):
            ((head(backbone(x)) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = info.value.diagnosis
    assert d is not None and d.fix
    code = "\n".join(line.split("#")[0] for line in d.fix.splitlines())
    assert "backbone." not in code and "head." not in code
