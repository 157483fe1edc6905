"""A binary cross-entropy written by hand, ``-(y * log(p) + (1 - y) * log(1 - p))``, whose
``p`` is a sigmoid's output squeezed to the labels' shape (``torch.sigmoid(model(x))
.squeeze(1)``, a model that returns ``sigmoid(z).squeeze(1)``, an nn.Sigmoid's output
``.view(-1)``): in watch and sentinel mode the loss graph is read through the squeeze, also
when the squeeze is the model's own (watched) output, so the diagnosis is the hand-written
BCE from the logits, as without the squeeze -- not "the log of 1 - something"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.ops import made_from
from tests._diagnoses import text, top

torch.set_num_threads(1)

MODES = ["watch", "sentinel"]
BCE_TITLE = "Log of zero in a hand-written binary cross-entropy: the sigmoid saturated at 1"


class _Head(nn.Module):
    """Returns logits [N, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


class _SqueezedProb(_Head):
    """Returns probabilities [N]: the squeeze is the model's (watched) output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(self.body(x))).squeeze(1)


class _SigmoidModuleView(_Head):
    """An nn.Sigmoid, then a view: the view is the model's (watched) output."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(self.body(x))).view(-1)


def _probs_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(model, (_SqueezedProb, _SigmoidModuleView)):
        return model(x)
    return torch.sigmoid(model(x)).squeeze(1)


def _run(cls: type[nn.Module], mode: str, *, saturated: bool) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = cls()
    if saturated:  # logits far above 17: the sigmoid rounds to exactly 1.0 in float32
        with torch.no_grad():
            model.fc.weight.mul_(200)
            model.fc.bias.fill_(50)
    x = torch.randn(16, 4)
    y = (torch.rand(16) > 0.5).float()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            p = _probs_of(model, x)
            loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_sigmoid_then_squeeze_in_the_loop_is_a_hand_written_bce(mode: str) -> None:
    d = top(_run(_Head, mode, saturated=True))
    assert (d.code, d.title) == ("NW110", BCE_TITLE), d.headline
    assert "log <- rsub <- squeeze <- sigmoid" in text(d)
    assert d.fix.splitlines()[0].startswith("loss = ")
    assert "binary_cross_entropy_with_logits(logits, y)" in d.fix.splitlines()[0]
    assert "nn.Identity" not in d.fix  # no nn.Sigmoid module made p


@pytest.mark.parametrize("mode", MODES)
def test_a_model_returning_a_squeezed_sigmoid_is_read_through_its_output(mode: str) -> None:
    d = top(_run(_SqueezedProb, mode, saturated=True))
    assert (d.code, d.title) == ("NW110", BCE_TITLE), d.headline
    assert "p the output of a sigmoid (log <- rsub <- squeeze <- sigmoid)" in text(d)
    assert "binary_cross_entropy_with_logits(logits, y)" in d.fix
    assert "clamp_max" not in d.fix  # not the recipe for 1 - p of unknown origin


def test_an_nn_sigmoid_viewed_by_the_model_is_dropped_in_watch_mode() -> None:
    d = top(_run(_SigmoidModuleView, "watch", saturated=True))
    assert (d.code, d.title) == ("NW110", BCE_TITLE), d.headline
    assert "log <- rsub <- view <- sigmoid" in text(d)
    lines = d.fix.splitlines()
    assert lines[0].startswith("model.act = nn.Identity()")
    assert "binary_cross_entropy_with_logits(logits, y)" in lines[1]


def test_sentinel_names_the_sigmoid_of_a_viewed_nn_sigmoid() -> None:
    d = top(_run(_SigmoidModuleView, "sentinel", saturated=True))
    assert (d.code, d.title) == ("NW110", BCE_TITLE), d.headline
    assert "binary_cross_entropy_with_logits(logits, y)" in d.fix.splitlines()[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", [_Head, _SqueezedProb, _SigmoidModuleView])
def test_the_same_bce_with_moderate_logits_stays_silent(cls: type[nn.Module], mode: str) -> None:
    nw = _run(cls, mode, saturated=False)
    assert not nw.report.diagnoses, [d.headline for d in nw.report.diagnoses]


def test_made_from_walks_through_a_watched_squeeze_only_when_asked() -> None:
    z = torch.zeros(3, 1, requires_grad=True)
    p = torch.sigmoid(z).squeeze(1)
    node = torch.log(1 - p).grad_fn
    watched = {p.grad_fn}
    assert made_from(node, lambda n: n in watched) == ["rsub", "watched:squeeze"]
    assert made_from(node, lambda n: n in watched, through=True) == [
        "rsub",
        "watched:squeeze",
        "sigmoid",
        "leaf",
    ]
    # a watched output that computes (not only moves values) still ends the chain
    s = torch.sigmoid(z)
    assert made_from(torch.log(1 - s).grad_fn, lambda n: n in {s.grad_fn}, through=True) == [
        "rsub",
        "watched:sigmoid",
    ]
