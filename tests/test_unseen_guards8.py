"""Fixes that must paste as correct code: F.one_hot given a sentinel one past its classes
(a dropped token's expert id) among values that start at 0 is not taken for 1-based labels
(NW513), and a compound expression gets parentheses before a method is called on it; the
fix for non-finite module state (NW405) binds no name of its own (the user's model may be
called ``m``); a ratio over a spread that is 0 (a REINFORCE advantage ``(r - r.mean()) /
r.std()`` over equal rewards) gets the eps on the user's own line (NW100)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.errors import GuardError


@pytest.fixture(autouse=True)
def no_function_mode_left() -> Iterator[None]:
    yield
    assert torch._C._len_torch_function_stack() == 0, "a TorchFunctionMode was left active"


def stopped_f(call: Any) -> GuardError:
    kw: dict[str, Any] = {"postmortem": False, "on_anomaly": "record", "functional_guards": True}
    with pytest.raises(GuardError) as info, nanwatch.watch(nn.Identity(), **kw):
        call()
    return info.value


def _top(nw: Any) -> Any:
    trace = nw.first_bad_step
    assert trace is not None and trace.diagnoses
    return trace.diagnoses[0]


# ------------------------------------------------------------ 1. F.one_hot and a sentinel
def test_one_hot_sentinel_among_zero_based_ids_gets_a_drop_column() -> None:
    """Tokens over an expert's capacity get the id E (dropped); ids also hold 0: the fix was
    ``F.one_hot(idx - 1, E)``, which moves every kept token to the wrong expert."""
    n_experts = 4
    idx = torch.tensor([0, 1, 4, 3, 4, 2])
    err = stopped_f(lambda: F.one_hot(idx, n_experts).float())
    assert (err.code, err.values) == ("NW513", (4,))
    assert "0 is a class too, so these are not 1-based labels" in str(err)
    assert "idx - 1" not in err.fix
    assert err.fix.startswith(
        "err = stopped_f(lambda: F.one_hot(idx, n_experts + 1)[..., :n_experts].float())"
    )
    # the fix as pasted: dropped rows are all zeros, the others keep their own expert
    fixed = F.one_hot(idx, n_experts + 1)[..., :n_experts]
    assert fixed.tolist()[0] == [1, 0, 0, 0] and fixed[2].sum() == 0 and fixed[3, 3] == 1
    # a literal num_classes is widened as a literal
    err = stopped_f(lambda: F.one_hot(idx, 4))
    assert "F.one_hot(idx, 5)[..., :4]" in err.fix


def test_one_hot_one_based_labels_still_get_minus_one() -> None:
    labels = torch.tensor([1, 2, 4, 3])
    err = stopped_f(lambda: F.one_hot(labels, 4))
    assert "labels 1..4 need `labels - 1`" in str(err)
    assert "F.one_hot(labels - 1, 4)" in err.fix


def test_one_hot_fix_on_a_compound_expression_is_parenthesized() -> None:
    """``F.one_hot(idx - 1, E)`` with a -1: the fix appended ``.masked_fill`` to ``idx - 1``
    unparenthesized, a SyntaxError."""
    idx = torch.tensor([0, 1, 3, 2])
    err = stopped_f(lambda: F.one_hot(idx - 1, 3))
    assert err.code == "NW513"
    assert "F.one_hot((idx - 1).masked_fill((idx - 1) < 0, 0), 3)" in err.fix
    compile(err.fix.split("  #")[0].strip(), "<fix>", "exec")


# ------------------------------------------------ 2. NW405: no name bound over the user's
class _EmaBook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("embed", torch.randn(4, 3))
        self.register_buffer("size", torch.zeros(4))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + (self.embed[torch.cdist(z, self.embed).argmin(1)] - z).detach()

    @torch.no_grad()
    def update(self) -> None:
        self.embed.copy_(self.embed / self.size.unsqueeze(1))  # 0/0 -> NaN, x/0 -> inf


class _AE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.vq, self.dec = nn.Linear(5, 3), _EmaBook(), nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.vq(self.enc(x)))


def test_module_state_fix_keeps_a_model_named_m() -> None:
    """The model is called ``m``: the fix's ``m = model.vq``, renamed, read ``m = m.vq``
    and pasting it replaced the model with its submodule."""
    torch.manual_seed(0)
    m = _AE()
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            m(torch.randn(8, 5)).pow(2).mean().backward()
            m.vq.update()
            nw.step()
    d = _top(nw)
    assert (d.code, d.path) == ("NW405", "vq")
    assert "m = " not in d.fix
    assert "assert torch.isfinite(m.vq.embed).all()" in d.fix
    ns: dict[str, Any] = {"m": m, "torch": torch}
    with pytest.raises(AssertionError):
        exec(d.fix, ns)
    assert ns["m"] is m


# ------------------------------------------------------ 3. NW100: 0/0 over a zero spread
def _reinforce(normalize: str) -> Any:
    torch.manual_seed(0)
    policy = nn.Linear(3, 2)
    with nanwatch.watch(policy, on_anomaly="record", postmortem=False) as nw:
        logp = torch.log_softmax(policy(torch.randn(6, 3)), -1)[:, 0]
        reward = torch.zeros(6)  # a sparse-reward batch: every reward equal
        ret = reward - reward.mean()
        if normalize == "std":
            adv = (reward - reward.mean()) / reward.std()
        elif normalize == "norm":
            adv = ret / ret.norm()
        else:  # the same name made two ways: which one ran is unknown from the text
            adv = ret / ret.std() if normalize == "ambiguous" else ret
        loss = -(logp * adv).mean()
        loss.backward()
        nw.step()
    return _top(nw)


def _reinforce_loop() -> Any:
    torch.manual_seed(0)
    policy = nn.Linear(3, 2)
    with nanwatch.watch(policy, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            logp = torch.log_softmax(policy(torch.randn(6, 3)), -1)[:, 0]
            reward = torch.zeros(6)
            adv = (reward - reward.mean()) / reward.std()
            loss = -(logp * adv).mean()
            loss.backward()
            nw.step()
    return _top(nw)


def test_advantage_over_a_zero_std_gets_the_eps_on_the_users_line() -> None:
    d = _reinforce_loop()
    assert d.code == "NW100"
    assert any("divides by reward.std()" in e and "every value is equal" in e for e in d.evidence)
    first = d.fix.splitlines()[0]
    assert first.startswith("adv = (reward - reward.mean()) / (reward.std() + 1e-8)")
    assert "assert torch.isfinite" not in d.fix


def _reinforce_norm() -> Any:
    torch.manual_seed(0)
    policy = nn.Linear(3, 2)
    with nanwatch.watch(policy, on_anomaly="record", postmortem=False) as nw:
        logp = torch.log_softmax(policy(torch.randn(6, 3)), -1)[:, 0]
        reward = torch.zeros(6)
        ret = reward - reward.mean()
        adv = ret / ret.norm()
        loss = -(logp * adv).sum()
        loss.backward()
        nw.step()
    return _top(nw)


def test_advantage_over_a_zero_norm_gets_the_eps() -> None:
    d = _reinforce_norm()
    assert d.code == "NW100"
    assert d.fix.splitlines()[0].startswith("adv = ret / (ret.norm() + 1e-8)")
    assert "every value is 0" in d.fix


def test_a_name_assigned_in_branches_is_not_guessed() -> None:
    d = _reinforce("std")
    assert d.code == "NW100"
    assert "assert torch.isfinite(adv).all()" in d.fix and "1e-8" not in d.fix.splitlines()[0]
