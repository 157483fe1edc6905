"""The post-mortem's advice for a distribution parameter that must be > 0 offers to predict
its log in the parameter's own name: a Dirichlet's concentration was told
``log_std.clamp(-20, 2).exp()``, a std's name and a bound of e^2 that would cap
concentrations a Dirichlet needs (10, 50). A Normal's scale keeps the std form."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.distributions import Dirichlet, Gamma, Normal

from nanwatch.postmortem import classify


def _advice(make: Callable[[], object]) -> str:
    with pytest.raises(ValueError, match="to satisfy the constraint") as info:
        make()
    found = classify(info.value)
    assert found["class"] == "distribution-constraint"
    return str(found["advice"])


def test_a_raw_concentration_is_predicted_as_its_own_log() -> None:
    advice = _advice(lambda: Dirichlet(torch.tensor([1.0, -0.5, 2.0]), validate_args=True))
    assert "concentration = F.softplus(raw) + 1e-5" in advice
    assert advice.endswith("or predict its log: log_concentration.clamp(-20, 20).exp().")
    assert "log_std" not in advice


def test_a_relu_made_concentration_gets_its_own_log_too() -> None:
    raw = torch.tensor([-1.0, 2.0], requires_grad=True)
    advice = _advice(lambda: Gamma(torch.relu(raw), torch.ones(2), validate_args=True))
    assert "it was made by a relu" in advice
    assert advice.endswith("or predict its log: log_concentration.clamp(-20, 20).exp().")


def test_a_normal_scale_keeps_the_std_form() -> None:
    advice = _advice(
        lambda: Normal(torch.zeros(3), torch.tensor([-0.2, 0.1, 0.0]), validate_args=True)
    )
    assert advice.endswith("or predict its log: log_std.clamp(-20, 2).exp().")
