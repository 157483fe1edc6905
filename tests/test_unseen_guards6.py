"""NW517 on a class weight holding inf (1 / counts with a class absent from the split): the
run stops, and the message tells the truth about this batch: finite here when no target
is that class (ignore_index respected), inf or NaN now when one is or label smoothing
spreads the weight over every class."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.errors import GuardError

torch.set_num_threads(1)

LATENT = "finite here only because no target in this batch is class 3"
NOW = "gives an inf or NaN loss with it"


def watch(*modules: nn.Module, **kw: Any) -> nanwatch.Watcher:
    kw.setdefault("postmortem", False)
    kw.setdefault("on_anomaly", "raise")
    return nanwatch.watch(*modules, **kw)


def _weights(*, healthy: bool) -> torch.Tensor:
    counts = torch.tensor([10.0, 10.0, 10.0, 0.0])  # class 3 absent from the split
    return counts.sum() / (4 * (counts.clamp_min(1) if healthy else counts))


def test_absent_class_weight_is_named_as_latent_when_no_target_is_that_class() -> None:
    torch.manual_seed(0)
    net, crit = nn.Linear(5, 4), nn.CrossEntropyLoss(weight=_weights(healthy=False))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    assert torch.isfinite(crit(net(x), y))  # plain torch: finite in this batch
    with pytest.raises(GuardError) as info, watch(net, crit):
        crit(net(x), y)
    err = info.value
    assert err.code == "NW517" and "weight[3] = inf (of 4 classes)" in str(err)
    assert LATENT in str(err) and "the first batch with one makes it inf or NaN" in str(err)
    assert NOW not in str(err)
    assert err.fix.startswith("crit.weight = crit.weight.nan_to_num(")


def test_a_target_of_that_class_makes_the_loss_inf_or_nan_now() -> None:
    torch.manual_seed(0)
    net, crit = nn.Linear(5, 4), nn.CrossEntropyLoss(weight=_weights(healthy=False))
    x, y = torch.randn(8, 5), torch.tensor([0, 1, 2, 3, 0, 1, 2, 0])
    assert not torch.isfinite(crit(net(x), y))
    with pytest.raises(GuardError) as info, watch(net, crit):
        crit(net(x), y)
    assert info.value.code == "NW517" and NOW in str(info.value)
    assert LATENT not in str(info.value)


def test_ignored_targets_of_that_class_keep_it_latent() -> None:
    torch.manual_seed(0)
    net, w = nn.Linear(5, 4), _weights(healthy=False)
    x, y = torch.randn(8, 5), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    assert torch.isfinite(F.cross_entropy(net(x), y, weight=w, ignore_index=3))
    with pytest.raises(GuardError) as info, watch(net):
        F.cross_entropy(net(x), y, weight=w, ignore_index=3)
    assert info.value.code == "NW517" and LATENT in str(info.value)


def test_label_smoothing_uses_every_class_weight_so_the_loss_is_bad_now() -> None:
    torch.manual_seed(0)
    crit = nn.CrossEntropyLoss(weight=_weights(healthy=False), label_smoothing=0.1)
    net, x, y = nn.Linear(5, 4), torch.randn(8, 5), torch.randint(0, 3, (8,))
    assert not torch.isfinite(crit(net(x), y))
    with pytest.raises(GuardError) as info, watch(net, crit):
        crit(net(x), y)
    assert info.value.code == "NW517" and NOW in str(info.value)


def test_clamped_counts_stay_silent() -> None:
    torch.manual_seed(0)
    net, crit = nn.Linear(5, 4), nn.CrossEntropyLoss(weight=_weights(healthy=True))
    with watch(net, crit) as nw:
        for _ in range(2):
            loss = crit(net(torch.randn(8, 5)), torch.randint(0, 4, (8,)))
            loss.backward()
            nw.step()
    assert not nw.report.diagnoses


def _bce_fix(labels: torch.Tensor) -> str:
    logits = torch.randn(labels.shape[0], requires_grad=True)
    lin = torch.nn.Linear(1, 1)
    with nanwatch.watch(lin, postmortem=False), pytest.raises(nanwatch.GuardError) as info:
        F.binary_cross_entropy_with_logits(logits, labels)
    return info.value.fix


def test_minus_one_among_zero_one_anchor_labels_is_an_ignore_marker() -> None:
    """Anchor labels 1 (object), 0 (background), -1 (ignored): (labels + 1) / 2 would train
    the ignored anchors as background and the background at 0.5. The fix leaves them out."""
    labels = torch.tensor([1.0, 0.0, -1.0, 0.0, 1.0, -1.0])
    fix = _bce_fix(labels)
    assert "(labels + 1) / 2" not in fix
    logits = torch.randn(6)
    ns = {"F": F, "logits": logits, "labels": labels}
    exec(fix, ns)
    keep = labels != -1
    want = F.binary_cross_entropy_with_logits(logits[keep], labels[keep])
    assert torch.allclose(ns["loss"], want)


def test_labels_of_minus_one_and_one_are_still_mapped_to_zero_and_one() -> None:
    assert "(labels + 1) / 2" in _bce_fix(torch.tensor([1.0, -1.0, 1.0, -1.0]))
