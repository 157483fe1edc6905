"""Float16 gradients that underflow layer after layer towards the loss (NW304) are one
finding, said once, with the steps it held for: not a new finding each step the front
moves to the next layer. A second NW304 about modules that were never dead together with
the first stays its own finding."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch


def _fading(mode: str, steps: int = 20) -> tuple[Any, list[str]]:
    """A float16 MLP whose loss shrinks each step, so that its gradients underflow to 0
    first in the layers far from the loss, then in the nearer ones."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(16, 1)).half()
    opt = torch.optim.SGD(model.parameters(), 1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, mode=mode, on_anomaly="warn") as nw:
            for i in range(steps):
                loss = model(torch.randn(8, 16).half()).float().pow(2).mean()
                loss = loss * 10 ** (-2 - 0.4 * i)
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step(loss)
    said = [str(w.message) for w in caught if issubclass(w.category, nanwatch.NanwatchWarning)]
    return nw, said


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_underflow_that_spreads_to_the_next_layers_is_one_finding(mode: str) -> None:
    nw, said = _fading(mode)
    report = nw.report
    found = [d for d in report.diagnoses if d.code == "NW304"]
    assert len(found) == 1, [(d.path, d.step) for d in found]
    d = found[0]
    last = next(x for x in nw.history[-1].diagnoses if x.code == "NW304")
    assert last.path == d.path  # the finding keeps its module while it stays dead
    # the steps it held for, from the first to the last
    assert report.steps_of(d) == nw.history[-1].step - d.step + 1
    assert report.steps_of(d) >= 5
    assert "float16" in " ".join(d.evidence) and "GradScaler" in d.fix
    assert sum("NW304" in s for s in said) == 1


def test_the_last_step_names_every_dead_layer() -> None:
    """What changes (more layers dead) is still said in the step's own evidence."""
    nw, _ = _fading("watch")
    first = next(d for t in nw.history for d in t.diagnoses if d.code == "NW304")
    last = next(x for x in nw.history[-1].diagnoses if x.code == "NW304")
    assert len(last.evidence[0]) > len(first.evidence[0])
    assert last.evidence[0].startswith("12, 10, 8, 6, 4, 2"), last.evidence[0]
