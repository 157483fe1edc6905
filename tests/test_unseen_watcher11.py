"""Unseen-model checks of the watcher's own work after a diagnosis (stop 24)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


def test_a_helpers_own_model_argument_is_not_renamed_to_the_watched_models_name() -> None:
    """FedAvg: a client trains a deepcopy of the watched global model in a helper whose
    argument is called ``model``; an empty client batch makes its cross-entropy NaN. The
    fix rewrites the helper's line, whose ``model`` is the helper's: renaming it to the
    watched ``gmodel`` (a name found in an outer frame) would train the global model."""
    torch.manual_seed(0)
    gmodel = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))

    def local_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    x, y = torch.randn(8, 6), torch.randint(0, 2, (8,))
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(gmodel) as nw:
        for rnd in range(3):
            xs, ys = (x[:0], y[:0]) if rnd == 2 else (x, y)
            local_train(copy.deepcopy(gmodel), xs, ys)
            with torch.no_grad():
                gmodel(x)
            nw.step()
    fixes = "\n".join(d.fix for d in info.value.diagnoses if d.fix)
    assert "cross_entropy(model(x)" in fixes, fixes
    assert "gmodel(x)" not in fixes, fixes
    # the post-mortem's report, made after the helper returned, says the same
    saved = "\n".join(d.fix for d in nw.report.diagnoses if d.fix)
    assert "cross_entropy(model(x)" in saved, saved
