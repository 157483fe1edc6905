"""Guards on models nanwatch had never seen: a loss weight holding inf/NaN (NW517) and a
cross-entropy whose target logit was masked to -inf (NW518) are stopped before the kernel,
with the argument, the positions and a fix in the user's names; healthy twins pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.errors import GuardError
from tests._guard_reads import count_reads_and_syncs


def watch(*modules: nn.Module, **kw: Any) -> nanwatch.Watcher:
    kw.setdefault("postmortem", False)
    kw.setdefault("on_anomaly", "raise")
    return nanwatch.watch(*modules, **kw)


# ------------------------------------------------------------------ NW517: weights
def _pos_weight(y: torch.Tensor, *, healthy: bool) -> torch.Tensor:
    n_pos = y.sum(0)
    return (len(y) - n_pos) / (n_pos.clamp_min(1) if healthy else n_pos)


def _labels() -> torch.Tensor:
    torch.manual_seed(0)
    y = (torch.rand(32, 4) < 0.3).float()
    y[:, 3] = 0  # label 3 never positive in this split
    return y


def test_module_pos_weight_inf_is_named_with_its_label_and_a_fix_that_runs() -> None:
    y = _labels()
    net = nn.Linear(10, 4)
    crit = nn.BCEWithLogitsLoss(pos_weight=_pos_weight(y, healthy=False))
    x = torch.randn(32, 10)
    with pytest.raises(GuardError) as info, watch(net, crit):
        loss = crit(net(x), y)
    err = info.value
    assert err.code == "NW517" and err.check == "weight"
    assert "BCEWithLogitsLoss.pos_weight holds pos_weight[3] = inf (of 4 labels)" in str(err)
    assert "has no sample" in str(err) and err.positions == ((3,),)
    assert err.fix.startswith("crit.pos_weight = crit.pos_weight.nan_to_num(")
    assert ".clamp_min(1)" in err.fix
    namespace = {"crit": crit}
    exec(err.fix, namespace)  # the pasted fix works
    with watch(net, crit):
        loss = crit(net(x), y)
    assert torch.isfinite(loss)


def test_functional_pos_weight_inf_is_stopped_on_the_users_line() -> None:
    y = _labels()
    net = nn.Linear(10, 4)
    x = torch.randn(32, 10)
    pos_weight = _pos_weight(y, healthy=False)
    with pytest.raises(GuardError) as info, watch(net):
        loss = F.binary_cross_entropy_with_logits(net(x), y, pos_weight=pos_weight)
    err = info.value
    assert err.code == "NW517" and "pos_weight holds pos_weight[3] = inf" in str(err)
    assert err.source_line is not None and "pos_weight=pos_weight" in err.source_line
    assert "pos_weight=pos_weight.nan_to_num(" in err.fix
    assert err.diagnosis is not None and err.diagnosis.code == "NW517"
    loss = eval(err.fix.split("  #")[0].removeprefix("loss = "))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_class_weight_inf_from_an_absent_class(label_smoothing: float) -> None:
    torch.manual_seed(0)
    y_train = torch.randint(0, 4, (200,))  # class 4 never occurs
    counts = torch.bincount(y_train, minlength=5).float()
    w = counts.sum() / (5 * counts)
    crit = nn.CrossEntropyLoss(weight=w, label_smoothing=label_smoothing)
    net = nn.Linear(10, 5)
    with pytest.raises(GuardError) as info, watch(net, crit):
        crit(net(torch.randn(16, 10)), y_train[:16])
    err = info.value
    assert err.code == "NW517"
    assert "CrossEntropyLoss.weight holds weight[4] = inf (of 5 classes)" in str(err)
    # a functional nll_loss with a NaN weight (0 / 0) and a negative one
    with pytest.raises(GuardError) as info, watch(net):
        F.nll_loss(
            net(torch.randn(4, 10)).log_softmax(1),
            torch.tensor([0, 1, 2, 3]),
            weight=torch.tensor([1.0, float("nan"), 1.0, 1.0, 1.0]),
        )
    assert info.value.code == "NW517" and "weight[1] = nan" in str(info.value)


def test_negative_class_weight_is_stopped_but_zero_weights_pass() -> None:
    net = nn.Linear(10, 3)
    x, y = torch.randn(8, 10), torch.randint(0, 3, (8,))
    with pytest.raises(GuardError) as info, watch(net):
        F.cross_entropy(net(x), y, weight=torch.tensor([1.0, -2.0, 1.0]))
    assert info.value.code == "NW517" and "weight[1] = -2" in str(info.value)
    assert "clamp_min(0)" in info.value.fix
    with watch(net):  # finite weights with zeros: fine for this guard
        F.cross_entropy(net(x), y, weight=torch.tensor([1.0, 0.0, 1.0]))
        nn.BCEWithLogitsLoss(pos_weight=torch.tensor([0.0, 2.0, 1.0]))(
            net(x), torch.rand(8, 3).round()
        )


def test_a_constant_weight_is_read_once_and_a_changed_one_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads, syncs = count_reads_and_syncs(monkeypatch)
    crit = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    with watch(crit):
        for _ in range(3):
            crit(x, y)
        assert [("weight_bad" in keys) for keys in reads] == [True, False, False]
        assert len(reads) == 3 and syncs == []  # the weight is counted in the guard's one read
        crit.weight[2] = float("inf")  # an in-place change: read again, and caught
        with pytest.raises(GuardError) as info:
            crit(x, y)
    assert info.value.code == "NW517" and "weight[2] = inf" in str(info.value)


def test_healthy_weights_from_clamped_counts_stay_silent() -> None:
    y = _labels()
    net = nn.Linear(10, 4)
    crit = nn.BCEWithLogitsLoss(pos_weight=_pos_weight(y, healthy=True))
    with watch(net, crit) as nw:
        for _ in range(2):
            loss = crit(net(torch.randn(32, 10)), y)
            loss.backward()
            nw.step()
    assert not nw.report.diagnoses


# ------------------------------------------------------------------ NW518: target logit -inf
def _nt_xent_logits(*, keep_positive: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    n = 8
    z = F.normalize(torch.randn(2 * n, 4, requires_grad=True), dim=1)
    lab = torch.randint(0, 3, (n,)).repeat(2)
    tgt = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    same = lab[:, None] == lab[None, :]  # includes the diagonal and the positive
    if keep_positive:
        same[torch.arange(2 * n), tgt] = False
    logits = (z @ z.t() / 0.1).masked_fill(same, float("-inf"))
    return logits, tgt


def test_masked_target_logit_is_named_with_the_users_mask() -> None:
    torch.manual_seed(0)
    n = 8
    z = F.normalize(torch.randn(2 * n, 4, requires_grad=True), dim=1)
    lab = torch.randint(0, 3, (n,)).repeat(2)
    tgt = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    same = lab[:, None] == lab[None, :]
    logits = (z @ z.t() / 0.1).masked_fill(same, float("-inf"))
    with pytest.raises(GuardError) as info, watch(nn.Identity()):
        F.cross_entropy(logits, tgt)
    err = info.value
    assert err.code == "NW518" and err.check == "target-logit"
    assert "logits is -inf at the target class in 16 of 16 rows" in str(err)
    assert "masked_fill" in str(err) and "+inf" in str(err)
    assert err.positions[0] == (0,)
    assert err.fix.startswith("same = same & ~F.one_hot(tgt, same.shape[1]).bool()")
    exec(err.fix, globals() | {"same": same, "tgt": tgt}, ns := {})
    fixed = (z @ z.t() / 0.1).masked_fill(ns["same"], float("-inf"))
    with watch(nn.Identity()):
        assert torch.isfinite(F.cross_entropy(fixed, tgt))


def test_module_and_nll_forms_and_an_all_inf_row() -> None:
    logits, tgt = _nt_xent_logits(keep_positive=False)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(GuardError) as info, watch(crit):
        crit(logits, tgt)
    # the mask was built in another function: its name is not known here
    assert info.value.code == "NW518" and "mask & ~F.one_hot(tgt, 16).bool()" in info.value.fix
    scores = torch.tensor([[0.0, 1.0, 2.0], [float("-inf")] * 3, [0.0, 1.0, 2.0]])
    with pytest.raises(GuardError) as info, watch(nn.Identity()):
        F.cross_entropy(scores, torch.tensor([0, 1, 2]))
    err = info.value
    assert err.code == "NW518" and "1 of 3 rows" in str(err)
    assert "-inf in every class: NaN" in str(err) and err.positions == ((1,),)
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], requires_grad=True)
    with pytest.raises(GuardError) as info, watch(nn.Identity()):
        F.nll_loss(probs.log(), torch.tensor([2, 0]))
    err = info.value
    assert err.code == "NW518" and "log of a probability of 0" in str(err)
    assert "F.log_softmax" in err.fix


def test_healthy_masks_and_ignored_rows_stay_silent() -> None:
    logits, tgt = _nt_xent_logits(keep_positive=True)  # the diagonal stays -inf: fine
    crit = nn.CrossEntropyLoss()
    with watch(crit) as nw:
        assert torch.isfinite(crit(logits, tgt))
        assert torch.isfinite(F.cross_entropy(logits, tgt))
        # a row whose target logit is -inf but whose target is ignored
        scores = torch.tensor([[0.0, float("-inf"), 2.0], [0.0, 1.0, float("-inf")]])
        assert torch.isfinite(F.cross_entropy(scores, torch.tensor([-100, 1])))
        # reduction='none': the program may drop the +inf rows itself
        bad_logits, bad_tgt = _nt_xent_logits(keep_positive=False)
        per_row = F.cross_entropy(bad_logits, bad_tgt, reduction="none")
        notes = [n for n in nw.trace.notes if n.kind == "loss_input"]
    assert torch.isinf(per_row).all()
    assert not [d for d in nw.report.diagnoses if d.code.startswith("NW5")]
    assert notes[-1].data["target_neginf"] == 16  # what the note tells the rules
