"""A fix is written with generic names (``model``, ``optimizer``, ``criterion``) and then
given the user's own: every use of the name, and a statement that assigns it
(``model = Net()``), but not a keyword argument of that name, an attribute, or a comment."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.watcher import _renamed


@pytest.mark.parametrize(
    ("code", "want"),
    [
        ("model.float()  # the model in float32", "net.float()  # the model in float32"),
        ("f(model=model, x=self.model)", "f(model=net, x=self.model)"),
        ("model = model.float()", "net = net.float()"),
        ("    model = Net()", "    net = Net()"),
        ("if model == other: pass", "if net == other: pass"),
        ("x = 'model'", "x = 'model'"),
        ("models = [model]", "models = [net]"),
        ("a, b = f(model=model)", "a, b = f(model=net)"),
        # code that does not parse is read line by line: ``model=`` in brackets stays
        (
            "f(model=model, x=self.model)\nfor x in loader:",
            "f(model=net, x=self.model)\nfor x in loader:",
        ),
    ],
)
def test_a_generic_name_is_renamed_where_it_is_a_name(code: str, want: str) -> None:
    assert _renamed(code, {"model": "net"}) == want


@pytest.mark.parametrize(
    ("code", "want"),
    [
        ("logits, model = build(cfg)", "logits, net = build(cfg)"),
        (
            "model, optimizer = fabric.setup(model, optimizer)",
            "net, opt = fabric.setup(net, opt)",
        ),
        ("head, *model = parts", "head, *net = parts"),
        ("best = model = Net()", "best = net = Net()"),
        (
            "for step in range(3):\n    out, model = model(x), model  # model: the net",
            "for step in range(3):\n    out, net = net(x), net  # model: the net",
        ),
        # a lambda's parameter is not the user's model
        ("scale = lambda model: model.float()", "scale = lambda model: model.float()"),
        # a template that does not parse as a whole (a loop with its body left out)
        (
            "model, optimizer = ...   # a pattern\nfor x, y in loader:",
            "net, opt = ...   # a pattern\nfor x, y in loader:",
        ),
    ],
)
def test_the_targets_a_tuple_unpacks_are_renamed(code: str, want: str) -> None:
    """``a, model = ...`` was taken for a keyword argument ``model=`` (text before the
    name), and the user's code kept assigning the generic name its fix never used."""
    assert _renamed(code, {"model": "net", "optimizer": "opt"}) == want


def test_the_fix_for_a_model_built_again_assigns_the_users_own_names() -> None:
    """NW315's fix builds the model again and then the optimizer on it: with the model
    called ``net``, ``model = Net()`` left the user's ``net`` untouched (fixed nothing)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    net = copy.deepcopy(net)  # sgd holds the old tensors
    with nanwatch.watch(net, on_anomaly="record", postmortem=False) as nw:
        for _ in range(8):
            (net(torch.randn(32, 8)) - 1).pow(2).mean().backward()
            sgd.step()
            sgd.zero_grad()
            nw.step()
    d = next(d for d in nw.report.diagnoses if d.code == "NW315")
    lines = [ln.split("  #", 1)[0].strip() for ln in (d.fix or "").splitlines()]
    assert lines[0] == "net = Net()"
    assert lines[1].endswith("(net.parameters(), lr=0.1)")
