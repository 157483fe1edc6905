"""Guards found by user testing on class-balanced and distillation losses: class weights
normalised by a sum that held inf (all of them 0 or NaN) are repaired where they are made;
a term without gradients subtracted before a loss *module* is named as for F.cross_entropy;
a log-target made as the log of an underflowed softmax is rewritten as a log_softmax."""

from __future__ import annotations

import ast
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines

torch.set_num_threads(1)


# ------------------------------ 1: class-balanced weights, one class with no sample


def test_weights_normalised_by_an_inf_sum_are_repaired_before_the_normalisation() -> None:
    torch.manual_seed(0)
    counts = torch.tensor([500.0, 120.0, 30.0, 4.0, 0.0])  # class 4 has no sample
    beta = 0.999
    effective_num = 1.0 - torch.pow(beta, counts)
    weights = (1.0 - beta) / effective_num
    weights = weights / weights.sum() * 5
    crit = nn.CrossEntropyLoss(weight=weights)
    model = nn.Linear(6, 5)
    x, y = torch.randn(16, 6), torch.randint(0, 4, (16,))
    with pytest.raises(nanwatch.GuardError) as info, nanwatch.watch(model, crit, postmortem=False):
        crit(model(x), y)
    err = info.value
    assert err.code == "NW517"
    msg = str(err)
    assert "every other weight is 0 (4 of 5)" in msg
    assert "0 / 0" in msg and "every batch" in msg
    assert "finite here only because" not in msg  # every target's weight is 0: NaN now
    assert err.fix is not None
    code = code_lines(err.fix)
    ast.parse(code)
    assert "crit.weight" not in code  # zeroing the NaN there leaves every weight 0
    first, second = code.split("\n")
    assert first.startswith("weights = weights.nan_to_num(")
    assert second == "weights = weights / weights.sum() * 5"
    # pasted before the normalisation, the weights are finite and the loss too
    ns: dict[str, Any] = {"torch": torch, "weights": (1.0 - beta) / effective_num}
    exec(code, ns)
    fixed = nn.CrossEntropyLoss(weight=ns["weights"])
    assert bool(torch.isfinite(ns["weights"]).all())
    assert bool(torch.isfinite(fixed(model(x), y)))


def test_a_latent_inf_weight_is_not_called_harmless_when_the_targets_weights_are_all_0() -> None:
    crit = nn.CrossEntropyLoss(weight=torch.tensor([0.0, 2.0, float("inf")]))
    model = nn.Linear(4, 3)
    with pytest.raises(nanwatch.GuardError) as info, nanwatch.watch(model, crit, postmortem=False):
        crit(model(torch.randn(6, 4)), torch.zeros(6, dtype=torch.long))  # class 0 alone
    assert info.value.code == "NW517"
    assert "finite here only because" not in str(info.value)  # 0 / 0: NaN already


# ------------------------------ 2: a term without gradients before a loss module


def _logit_adjusted(prior: torch.Tensor, mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    crit = nn.CrossEntropyLoss()
    log_prior = torch.log(prior)
    with nanwatch.watch(model, crit, mode=mode, postmortem=False):  # type: ignore[arg-type]
        logits = model(torch.randn(8, 6))
        adj = logits - 1.0 * log_prior
        crit(adj, torch.randint(0, 3, (8,))).backward()


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_term_without_gradients_subtracted_before_a_loss_module_is_named(mode: str) -> None:
    with pytest.raises(nanwatch.GuardError) as info:
        _logit_adjusted(torch.tensor([0.5, 0.3, 0.2, 0.0]), mode)  # class 3: log 0
    err = info.value
    assert (err.code, err.check) == ("NW519", "nograd-term")
    msg = str(err)
    assert "adj holds 8 +inf of 32 values" in msg
    assert "computed without gradients" in msg and "subtracted from" in msg


def test_a_finite_term_subtracted_before_a_loss_module_is_silent() -> None:
    _logit_adjusted(torch.tensor([0.4, 0.3, 0.2, 0.1]), "watch")


# ------------------------------ 3: KD log-target as the log of an underflowed softmax


def test_the_log_of_an_underflowed_softmax_target_is_rewritten_as_a_log_softmax() -> None:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        teacher[2].weight.mul_(60)
    teacher.half().eval()
    student = nn.Linear(16, 10)
    kd = nn.KLDivLoss(reduction="batchmean", log_target=True)
    x, T = torch.randn(32, 16), 4.0
    with pytest.raises(nanwatch.GuardError) as info, nanwatch.watch(student, kd, postmortem=False):
        with torch.no_grad():
            t_logp = F.softmax(teacher(x.half()) / T, dim=1).log()
        s_logp = F.log_softmax(student(x) / T, dim=1)
        kd(s_logp, t_logp)
    err = info.value
    assert (err.code, err.check) == ("NW511", "log-target-neginf")
    assert err.fix is not None
    code = code_lines(err.fix)
    assert code.startswith("t_logp = F.log_softmax(teacher(x.half()).float() / T, dim=1)")
    assert ".exp()" not in code  # kd keeps log_target=True: the target stays log-probs
    ns: dict[str, Any] = {"F": F, "teacher": teacher, "x": x, "T": T}
    with torch.no_grad():
        exec(code, ns)
    assert bool(torch.isfinite(ns["t_logp"]).all())
    assert bool(torch.isfinite(kd(s_logp, ns["t_logp"])))


def test_a_log_target_not_made_on_a_line_changes_the_constructor_with_the_call() -> None:
    student = nn.Linear(4, 3)
    kd = nn.KLDivLoss(reduction="batchmean", log_target=True)
    probs = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    x = torch.randn(2, 4)
    with pytest.raises(nanwatch.GuardError) as info, nanwatch.watch(student, kd, postmortem=False):
        kd(F.log_softmax(student(x), dim=1), torch.log(probs))
    err = info.value
    assert err.code == "NW511" and err.fix is not None
    code = code_lines(err.fix)
    ctor, call = (ln.split("  #")[0] for ln in code.split("\n"))
    assert ctor == "kd = nn.KLDivLoss(reduction='batchmean', log_target=False)"
    assert call == "kd(F.log_softmax(student(x), dim=1), torch.log(probs).exp())"
    ns: dict[str, Any] = {"nn": nn, "F": F, "torch": torch, "student": student, "x": x}
    ns["probs"] = probs
    exec(f"{ctor}\nout = {call}", ns)
    assert bool(torch.isfinite(ns["out"]))
