"""A one-hot (integer) target given to a class-index loss: NW503 says the rows are one-hot
and converts them back to class indices (or, for cross_entropy, to class probabilities),
where it used to say only "give the target the shape (N,)"."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.errors import GuardError

_X = torch.randn(16, 8)
_Y = torch.randint(0, 5, (16,))


def _failure(loss_of: object) -> tuple[str, str]:
    torch.manual_seed(0)
    model = nn.Linear(8, 5)
    nw = nanwatch.watch(model, mode="sentinel", postmortem=False)
    with pytest.raises(GuardError) as info, nw:
        loss_of(model(_X))  # type: ignore[operator]
    d = next(d for d in nw.report.diagnoses if d.code == "NW503")
    assert str(info.value)
    return " | ".join(d.evidence), d.fix


def test_a_one_hot_target_to_cross_entropy_becomes_indices_or_probabilities() -> None:
    evidence, fix = _failure(lambda out: F.cross_entropy(out, F.one_hot(_Y, 5)))
    assert "one-hot rows, not class indices" in evidence
    assert "F.cross_entropy(out, F.one_hot(_Y, 5).argmax(1))" in fix
    assert "F.one_hot(_Y, 5).float(), read as class probabilities" in fix


def test_a_one_hot_target_to_the_module_loss_is_fixed_in_its_call() -> None:
    criterion = nn.CrossEntropyLoss()
    onehot = F.one_hot(_Y, 5)

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return criterion(out, onehot)

    evidence, fix = _failure(loss_of)
    assert "one-hot rows" in evidence and "criterion(out, onehot.argmax(1))" in fix


def test_nll_loss_takes_no_probabilities_so_none_are_offered() -> None:
    evidence, fix = _failure(lambda out: F.nll_loss(F.log_softmax(out, 1), F.one_hot(_Y, 5)))
    assert "one-hot rows" in evidence and ".argmax(1)" in fix
    assert "probabilities" not in fix


def test_the_fixed_targets_pass_the_guard() -> None:
    model = nn.Linear(8, 5)
    with nanwatch.watch(model, mode="sentinel") as nw:
        out = model(_X)
        (
            F.cross_entropy(out, F.one_hot(_Y, 5).argmax(1))
            + F.cross_entropy(out, F.one_hot(_Y, 5).float())
        ).backward()
        nw.step()
    assert nw.report.diagnoses == []


def test_a_loss_module_not_handed_to_watch_is_fixed_on_the_users_line() -> None:
    """nn.CrossEntropyLoss calls F.cross_entropy, whose guard used to word the fix on
    torch's own line: F.cross_entropy(input, target.squeeze(1), weight=weight, ...)."""
    model = nn.Conv2d(3, 5, 1)
    criterion = nn.CrossEntropyLoss()
    x, y = torch.randn(2, 3, 4, 4), torch.randint(0, 5, (2, 1, 4, 4))
    nw = nanwatch.watch(model, mode="sentinel", postmortem=False)
    with pytest.raises(GuardError, match="CrossEntropyLoss"), nw:
        out = model(x)
        loss = criterion(out, y)
        loss.backward()
    d = next(d for d in nw.report.diagnoses if d.code == "NW503")
    assert d.fix == "loss = criterion(out, y.squeeze(1))"
