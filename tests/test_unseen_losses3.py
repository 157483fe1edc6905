"""Loss code nanwatch had not seen: a cross-entropy at its floor after memorizing a float16
batch, a loss multiplied by 0 or masked to nothing, a fixed temperature that saturates the
softmax (NW304); CTCLoss(zero_infinity=True) dropping every sample (NW207); NLLLoss on raw
scores and BCEWithLogitsLoss after a sigmoid (NW205); a log_softmax over the wrong dim
(NW208); a float16 dice whose sums overflow to a constant loss (NW304)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.base import Diagnosis

MODES = ("watch", "sentinel")


def _run(
    model: nn.Module,
    step: Callable[[int], torch.Tensor],
    *crits: nn.Module,
    mode: str,
    steps: int = 6,
    lr: float = 0.1,
) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, *crits, mode=mode, on_anomaly="record", postmortem=False) as nw:
            for i in range(steps):
                loss = step(i)
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    return nw


def _diag(nw: Any, code: str) -> Diagnosis:
    return next(d for d in nw.report.diagnoses if d.code == code)


def _codes(nw: Any) -> set[str]:
    return {d.code for d in nw.report.diagnoses}


def _mlp(out: int = 4, dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, out)).to(dtype)


# ------------------------------------ 1: a float16 model that memorized its batch (NW304)


def _memorized() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A float16 classifier trained on 8 samples until cross-entropy is exactly 0 and every
    gradient with it: the logits put each target past what float32's softmax resolves."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).half()
    x, y = torch.randn(8, 8).half() * 3, torch.arange(8) % 4
    opt = torch.optim.SGD(model.parameters(), lr=3.0, momentum=0.9)
    for _ in range(300):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if loss.item() == 0.0 and all(not p.grad.any() for p in model.parameters()):
            break
        opt.step()
    assert loss.item() == 0.0
    return model, x, y


@pytest.mark.parametrize("mode", MODES)
def test_float16_cross_entropy_exactly_zero_after_memorizing_is_its_minimum(mode: str) -> None:
    model, x, y = _memorized()
    nw = _run(model, lambda i: F.cross_entropy(model(x), y), mode=mode, lr=3.0)
    d = _diag(nw, "NW304")
    assert d.severity == "info"
    assert d.title == "Zero gradients: the loss reached its minimum (0), nothing is left to learn"
    assert "does not depend on the outputs" not in d.title
    assert any("log(1/eps) of float32" in e for e in d.evidence)
    assert "probability rounds to 1" in d.explanation and "memorized" in d.explanation
    assert "label_smoothing=0.1" in d.fix.splitlines()[-1]
    assert "logit_scale" not in d.fix and "GradScaler" not in d.fix
    # the functional loss gets the functional line, and it runs
    ns: dict[str, Any] = {"F": F, "logits": model(x).float(), "target": y}
    exec(d.fix.splitlines()[-1], ns)
    assert float(ns["loss"]) > 0


# ---------------------------------- 2: a loss multiplied by 0 is not at its minimum (NW304)


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_weight_of_zero_is_named_not_called_a_minimum(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _mlp(), nn.CrossEntropyLoss()
    w = 0.0  # an auxiliary weight whose warm-up never ramps up
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))

    def step(i: int) -> torch.Tensor:
        return w * crit(model(x + 0.1 * i), y)

    d = _diag(_run(model, step, crit, mode=mode), "NW304")
    assert d.severity == "warning"
    assert d.title == "Zero gradients: the loss is multiplied by 0, not at its minimum"
    assert any(e.startswith("CrossEntropyLoss itself returns") for e in d.evidence)
    assert any("multiplies the loss by w" in e for e in d.evidence)
    assert "test_unseen_losses3.py:" in d.fix and d.fix.splitlines()[-1].startswith("print(w)")


@pytest.mark.parametrize("mode", MODES)
def test_a_mask_that_keeps_no_element_is_named_not_called_a_minimum(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _mlp(), nn.CrossEntropyLoss(reduction="none")
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    mask = torch.zeros(16)  # no labeled token in the batch

    def step(i: int) -> torch.Tensor:
        return (crit(model(x), y) * mask).sum() / mask.sum().clamp(min=1)

    d = _diag(_run(model, step, crit, mode=mode), "NW304")
    assert d.title == "Zero gradients: the loss is multiplied by 0, not at its minimum"
    assert any("CrossEntropyLoss itself returns" in e and "to" in e for e in d.evidence)
    assert d.fix.splitlines()[-1].startswith("print(mask)")


def test_a_functional_cross_entropy_whose_logits_cannot_give_zero_is_a_factor() -> None:
    # no loss module: the logits' spread (well under log(1/eps)) says CE itself is above 0
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    nw = _run(model, lambda i: F.cross_entropy(model(x), y) * 0.0, mode="watch")
    d = _diag(nw, "NW304")
    assert d.title == "Zero gradients: the loss is multiplied by 0, not at its minimum"
    assert any("within 15.94 = log(1/eps) of float32" in e for e in d.evidence)


# ------------------------------- 3: a fixed temperature that saturates the softmax (NW304)


@pytest.mark.parametrize("mode", MODES)
def test_a_tiny_fixed_temperature_is_saturation_not_convergence(mode: str) -> None:
    torch.manual_seed(0)
    model = _mlp(16, torch.float16)

    def step(i: int) -> torch.Tensor:
        x = torch.randn(32, 8).half()
        z1, z2 = F.normalize(model(x), dim=-1), F.normalize(model(x + 0.1), dim=-1)
        return F.cross_entropy(z1 @ z2.T / 0.001, torch.arange(32))

    d = _diag(_run(model, step, mode=mode), "NW304")
    assert d.severity == "warning"
    assert not any("a count or a sum taken in float16" in e for e in d.evidence)
    assert any("F.cross_entropy's input spans" in e and "past 15.94" in e for e in d.evidence)
    assert "a temperature too small" in d.explanation
    assert d.explanation.index("saturated") < d.explanation.index("divided by inf")


# --------------------------------- 4: CTCLoss(zero_infinity=True) dropping everything (NW207)


@pytest.mark.parametrize("mode", MODES)
def test_ctc_zero_infinity_that_drops_every_sample_is_not_a_minimum(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _mlp(6), nn.CTCLoss(zero_infinity=True)
    il, tl = torch.tensor([5, 5]), torch.tensor([8, 8])  # 8 labels, 5 frames

    def step(i: int) -> torch.Tensor:
        lp = model(torch.randn(5, 2, 8)).log_softmax(-1)
        return crit(lp, torch.randint(1, 6, (2, 8)), il, tl)

    nw = _run(model, step, crit, mode=mode)
    d = _diag(nw, "NW207")
    assert d.severity == "warning" and d.step == 0
    assert d.evidence[0].startswith("every one of the 2 samples of CTCLoss has a target longer")
    assert "the loss is exactly 0: nothing trains" in d.evidence
    assert "print((input_lengths - target_lengths).min())" in d.fix
    assert not any(d.code == "NW304" for d in nw.report.diagnoses)
    # one sample of four dropped is what zero_infinity is for: no word about it
    il, tl = torch.tensor([12, 12, 12, 5]), torch.tensor([4, 4, 4, 8])

    def some(i: int) -> torch.Tensor:
        lp = model(torch.randn(12, 4, 8)).log_softmax(-1)
        return crit(lp, torch.randint(1, 6, (4, 8)), il, tl)

    assert "NW207" not in _codes(_run(model, some, crit, mode=mode))


# ---------------------------------------- 5: NLLLoss on raw scores (NW205), wrong dim (NW208)


@pytest.mark.parametrize("mode", MODES)
def test_nll_loss_on_raw_logits_is_diagnosed(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _mlp(), nn.NLLLoss()
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))

    def step(i: int) -> torch.Tensor:
        return crit(model(x), y)

    d = _diag(_run(model, step, crit, mode=mode), "NW205")
    assert (
        d.title == "Raw scores where log-probabilities are expected (NLLLoss without log_softmax)"
    )
    assert "log-probabilities are never above 0" in d.evidence[0]
    assert any("a negative log-likelihood is never below 0" in e for e in d.evidence)
    assert d.fix.splitlines()[0].startswith("return crit(model(x).log_softmax(1), y)")
    assert float(crit(model(x).log_softmax(1), y)) > 0  # the fixed call: a real NLL

    def fixed(i: int) -> torch.Tensor:
        return crit(model(x).log_softmax(1), y)

    assert {"NW205", "NW208"}.isdisjoint(_codes(_run(model, fixed, crit, mode=mode)))


@pytest.mark.parametrize("mode", MODES)
def test_log_softmax_over_the_batch_dim_before_nll_is_diagnosed(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _mlp(), nn.NLLLoss()
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))

    def step(i: int) -> torch.Tensor:
        return crit(F.log_softmax(model(x), dim=0), y)

    d = _diag(_run(model, step, crit, mode=mode), "NW208")
    assert d.evidence[0] == (
        "NLLLoss's input, shape [16, 4], is a log_softmax over dim 0; NLLLoss reads the "
        "classes on dim 1 of its (N, C, ...) input"
    )
    assert d.fix == "return crit(F.log_softmax(model(x), dim=1), y)"


def test_ctc_log_softmax_without_dim_normalizes_over_time() -> None:
    torch.manual_seed(0)
    model, crit = _mlp(6), nn.CTCLoss()
    il, tl = torch.tensor([20, 20]), torch.tensor([4, 3])

    def step(i: int) -> torch.Tensor:
        lp = F.log_softmax(model(torch.randn(20, 2, 8)))  # implicit dim: 0 of a 3-D input
        return crit(lp, torch.randint(1, 6, (2, 4)), il, tl)

    d = _diag(_run(model, step, crit, mode="watch"), "NW208")
    assert "is a log_softmax over dim 0; CTCLoss reads the classes on dim 2" in d.evidence[0]
    assert "without dim= picks dim 0 for a 3-D input" in d.evidence[1]
    assert "the time frames" in d.explanation
    assert d.fix.startswith("log_probs = F.log_softmax(logits, dim=-1)")


# ------------------------------------------------- 6: BCEWithLogitsLoss after a sigmoid


@pytest.mark.parametrize("mode", MODES)
def test_bce_with_logits_after_a_sigmoid_is_diagnosed(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _mlp(1), nn.BCEWithLogitsLoss()
    x, y = torch.randn(16, 8), (torch.rand(16, 1) > 0.5).float()

    def step(i: int) -> torch.Tensor:
        return crit(torch.sigmoid(model(x)), y)

    d = _diag(_run(model, step, crit, mode=mode), "NW205")
    assert d.title.startswith("Sigmoid output where logits are expected")
    assert any("a positive costs at least 0.3133" in e for e in d.evidence)
    assert d.fix.startswith("return crit(model(x), y)   # the logits")


# ------------------------------------ 7: a float16 dice whose sums overflow (NW304)


@pytest.mark.parametrize("mode", MODES)
def test_float16_dice_with_overflowing_sums_is_a_constant_loss(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 1, 1)).half()

    def step(i: int) -> torch.Tensor:
        x = torch.randn(2, 1, 256, 256).half()
        t = (torch.rand(2, 1, 256, 256) > 0.5).half()
        p = torch.sigmoid(model(x))
        return 1 - (2 * (p * t).sum() + 1) / (p.sum() + t.sum() + 1)  # float16 sums: inf

    nw = _run(model, step, mode=mode)
    d = _diag(nw, "NW304")
    assert d.title == "Zero gradients: the loss does not depend on the outputs"
    assert any(e.endswith("at steps 0 to 4: it does not move") for e in d.evidence)
    assert "the loss is 1 step after step" in d.explanation
    assert "saturated" not in d.explanation
    assert d.fix.startswith("# a count or a sum in float16")
    assert "GradScaler" not in d.fix


# --------------------------------------------- 8: a loss on a detached output (NW209)


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_on_a_detached_output_is_named_not_dead_units(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _mlp(), nn.CrossEntropyLoss()

    def step(i: int) -> torch.Tensor:
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        # the DDP trick that keeps every parameter in the graph: 0 * p.sum()
        return crit(model(x).detach(), y) + 0.0 * sum(p.sum() for p in model.parameters())

    nw = _run(model, step, crit, mode=mode)
    d = _diag(nw, "NW209")
    assert d.step == 0 and d.severity == "warning"
    assert "output, which had an autograd node (AddmmBackward0)" in d.evidence[0]
    assert d.fix.startswith("return crit(model(x), y) + 0.0 * sum(")
    assert "NW304" not in _codes(nw)
    logged: list[float] = []

    def trained(i: int) -> torch.Tensor:
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        out = model(x)
        logged.append(float(crit(out.detach(), y)))  # a metric: no gradient wanted
        return crit(out, y)

    # the same detached loss, logged beside the one that trains: nothing to say
    assert "NW209" not in _codes(_run(model, trained, crit, mode=mode))


# ----------------------------------------------- 9: batch-first CTC log-probs (NW520)


@pytest.mark.parametrize("mode", MODES)
def test_batch_first_ctc_log_probs_are_named_with_the_transpose(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _mlp(6), nn.CTCLoss()
    il, tl = torch.full((4,), 20), torch.full((4,), 5)

    def step(i: int) -> torch.Tensor:
        lp = model(torch.randn(4, 20, 8)).log_softmax(-1)  # (N, T, C): an RNN's batch_first
        return crit(lp, torch.randint(1, 6, (4, 5)), il, tl)

    with pytest.raises(RuntimeError, match="it is batch-first") as err:
        _run(model, step, crit, mode=mode)
    assert isinstance(err.value, nanwatch.GuardError)
    assert "(N, T, C) = (4 samples, 20 frames, 6 classes)" in str(err.value)
    assert "crit(lp.transpose(0, 1), torch.randint(1, 6, (4, 5)), il, tl)" in str(err.value)
    # the fix, pasted: the loss runs
    lp = model(torch.randn(4, 20, 8)).log_softmax(-1)
    assert torch.isfinite(crit(lp.transpose(0, 1), torch.randint(1, 6, (4, 5)), il, tl))
