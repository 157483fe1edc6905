"""Found by user testing (speech models): sentinel mode, which records only the root
module's call, said 'no valid choice' for a hand-written attention's fully masked row that
watch mode fixes with finfo.min; a -inf loss target made by a log in the training loop was
sent to the dataset with a fix naming a ``y`` the user never wrote."""

from __future__ import annotations

import ast
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first

torch.set_num_threads(1)


def _raises(model: nn.Module, run: Callable[[], object], mode: str) -> nanwatch.AnomalyError:
    try:
        with nanwatch.watch(model, mode=mode, postmortem=False) as nw:  # type: ignore[arg-type]
            run()
            nw.step()
    except nanwatch.AnomalyError as e:
        return e
    raise AssertionError("no anomaly")


# ------------------------------ 1: a masked softmax in a submodule, seen from the root only


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Linear(4, 1)

    def forward(self, query: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor):  # type: ignore[no-untyped-def]
        e = self.v(torch.tanh(query[:, None] + memory)).squeeze(-1)
        e = e.masked_fill(~mask, float("-inf"))
        return torch.softmax(e, dim=-1)


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.align = _Attention()

    def forward(self, h: torch.Tensor, memory: torch.Tensor, lengths: torch.Tensor):  # type: ignore[no-untyped-def]
        mask = torch.arange(memory.size(1))[None] < lengths[:, None]
        return torch.bmm(self.align(h, memory, mask)[:, None], memory).squeeze(1)


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_sentinel_agrees_with_watch_on_a_hand_written_attention_row(mode: str) -> None:
    m = _Decoder()
    h, memory, lengths = torch.randn(3, 4), torch.randn(3, 5, 4), torch.tensor([5, 3, 0])
    d = _first(_raises(m, lambda: m(h, memory, lengths).sum().backward(), mode), "NW402")
    assert d.title == "Fully masked attention row"
    assert "no valid choice" not in d.explanation + d.fix
    assert "no fill value makes it right" not in d.explanation
    fixed = d.fix.splitlines()[0].split("   #", 1)[0]
    assert fixed == "e = e.masked_fill(~mask, torch.finfo(e.dtype).min)"
    e = torch.randn(3, 5)
    mask = torch.arange(5)[None] < lengths[:, None]
    env = {"torch": torch, "e": e, "mask": mask}
    exec(fixed, env)
    assert torch.isfinite(torch.softmax(env["e"], dim=-1)).all()


class _Pick(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def forward(self, h: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        logits = self.lin(h).masked_fill(~allowed, float("-inf"))
        return torch.softmax(logits, dim=-1)


class _Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = _Pick()

    def forward(self, h: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return self.head(h, allowed)


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_sentinel_agrees_with_watch_on_a_choice_in_a_submodule_its_replay_named(mode: str) -> None:
    """Only the root's call is recorded in sentinel, but its replay names the submodule
    whose forward ran the softmax (head, a _Pick): its path and class are known, as in
    watch mode, and it is no attention (it said "the module that ran the softmax is not
    known; watch mode names it" while naming head)."""
    m = _Policy()
    allowed = torch.ones(3, 5, dtype=torch.bool)
    allowed[1] = False
    d = _first(_raises(m, lambda: m(torch.randn(3, 4), allowed).sum().backward(), mode), "NW402")
    assert d.path == "head"
    assert d.title == "Fully masked softmax row: no valid choice left"
    assert "not known" not in d.explanation and "sentinel" not in d.explanation
    lines = code_lines(d.fix).splitlines()
    assert lines[0].startswith('assert allowed.any(dim=-1).all(), "a row with')
    with pytest.raises(AssertionError):  # the check finds the row with nothing allowed
        exec(lines[0], {"allowed": allowed})
    ast.parse(code_lines(d.fix))


# ------------------------------ 2: a -inf target made by a log in the training loop


def test_a_log_of_a_zero_duration_made_in_the_loop_names_the_users_line() -> None:
    m = nn.Linear(3, 1)
    x = torch.randn(6, 3)
    dur = torch.tensor([3, 1, 0, 2, 5, 4])

    def run() -> None:
        log_t = torch.log(dur.float())
        F.mse_loss(m(x).squeeze(-1), log_t).backward()

    d = _first(_raises(m, run, "watch"), "NW401")
    fix_lines = d.fix.splitlines()
    assert fix_lines[0].startswith("log_t = torch.log1p(dur.float())")
    assert "torch.log(dur.float().clamp_min(1e-5))" in fix_lines[0]
    assert fix_lines[1].startswith("assert torch.isfinite(log_t).all()")
    assert "sales" not in d.explanation and "prices" not in d.explanation
    assert "Dataset" not in d.fix and "torch.isfinite(y)" not in d.fix
    assert "wherever dur is 0" in d.explanation
    assert any("1 -inf" in e for e in d.evidence)
    made = [e for e in d.evidence if e.startswith("the target is made in your code at ")]
    assert made and "torch.log(dur.float())" in made[0]
    env = {"torch": torch, "dur": dur}
    exec(code_lines(d.fix), env)  # the fixed line, then its check, pass
    assert torch.isfinite(env["log_t"]).all()


def _log_power(wav: torch.Tensor) -> torch.Tensor:
    power = wav.pow(2)
    return torch.log(power)


def test_a_log_power_target_made_by_a_function_gets_a_floor_in_that_function() -> None:
    m = nn.Linear(3, 4)
    x = torch.randn(2, 3)
    wav = torch.randn(2, 4)
    wav[1, 2] = 0.0

    def run() -> None:
        target = _log_power(wav)
        F.l1_loss(m(x), target).backward()

    d = _first(_raises(m, run, "sentinel"), "NW401")
    first = d.fix.splitlines()[0]
    assert first.startswith("return torch.log(power.clamp_min(1e-5))")
    assert "torch.log1p(power)" in first
    assert "assert torch.isfinite(target).all()" in d.fix
    assert "wherever power is 0" in d.explanation and "sales" not in d.explanation
    assert any("torch.log(power)" in e and "made in your code" in e for e in d.evidence)
    body = first.split("   #", 1)[0]
    env: dict[str, object] = {"torch": torch}
    exec(f"def f(power):\n    {body}\n", env)
    assert torch.isfinite(env["f"](wav.pow(2))).all()  # type: ignore[operator]
