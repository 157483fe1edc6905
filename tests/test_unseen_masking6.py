"""Masking and loss fixes found by user testing: a top-p filter that removes every token gets
the shift that keeps the top one, a fully banned row before sampling gets a guard that
unbans it (not an assert), a NaN hidden by a mask has its own code (NW407), and the BCE
fixes name the module that made the sigmoid and the user's own criterion."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.report import Report
from nanwatch.rules import REGISTRY
from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


def _confident() -> nn.Linear:
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    with torch.no_grad():
        model.bias[0] = 20.0  # the top token alone holds more than any top_p
    return model


def _sampling_diagnosis(model: nn.Module, draw: Callable[[], Any]) -> nanwatch.Diagnosis:
    """The NW402 diagnosis of the post-mortem when torch.multinomial refuses NaN probs."""
    with nanwatch.watch(model, mode="forensic", postmortem=False) as nw:  # noqa: SIM117
        with pytest.raises(RuntimeError, match="probability tensor") as err:
            with torch.no_grad():
                draw()
    return next(d for d in Report.from_watcher(nw, err.value).diagnoses if d.code == "NW402")


def _code(fix: str) -> list[str]:
    """The fix's code lines without their trailing comments: what runs."""
    return [ln.split("   #", 1)[0].rstrip() for ln in code_lines(fix).splitlines()]


def _patched(fn: Callable[..., Any], after: str, lines: list[str]) -> Callable[..., Any]:
    """``fn`` rebuilt from its source with ``lines`` put in after its line ``after``."""
    src = textwrap.dedent(inspect.getsource(fn)).splitlines()
    at = next(i for i, ln in enumerate(src) if ln.strip() == after)
    indent = src[at][: len(src[at]) - len(src[at].lstrip())]
    src[at + 1 : at + 1] = [indent + ln for ln in lines]
    scope: dict[str, Any] = {"torch": torch}
    exec("\n".join(src), scope)
    return scope[fn.__name__]  # type: ignore[no-any-return]


# ------------------------------ 1: top-p that removes every token: the shift, not an assert


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    remove = cum > top_p
    remove = remove.scatter(1, sorted_idx, remove)
    return logits.masked_fill(remove, float("-inf"))


def test_a_top_p_cut_that_removes_every_token_gets_the_shift_that_keeps_the_top_one() -> None:
    model, x = _confident(), torch.randn(2, 4)

    def draw(filt: Callable[..., torch.Tensor] = _top_p_filter) -> torch.Tensor:
        probs = F.softmax(filt(model(x), 0.5), dim=-1)
        return torch.multinomial(probs, 1)

    d = _sampling_diagnosis(model, draw)
    assert "assert" not in d.fix
    assert "top-p" in d.fix and "remove = cum > top_p" in d.fix
    code = _code(d.fix)
    assert code == [
        "remove = cum > top_p",
        "remove[..., 1:] = remove[..., :-1].clone()",
        "remove[..., 0] = False",
    ]
    fixed = _patched(_top_p_filter, "remove = cum > top_p", code[1:])
    probs = F.softmax(fixed(model(x).detach(), 0.5), dim=-1)
    assert bool(torch.isfinite(probs).all())
    assert torch.multinomial(probs, 1).shape == (2, 1)


# ------------------------------ 1b: every token banned before sampling: a guard that unbans


def _ban(logits: torch.Tensor, banned_ids: list[int]) -> torch.Tensor:
    banned = torch.zeros_like(logits, dtype=torch.bool)
    banned[:, banned_ids] = True
    return logits.masked_fill(banned, float("-inf"))


def test_a_row_with_every_token_banned_before_sampling_gets_an_unban_guard() -> None:
    model, x = _confident(), torch.randn(2, 4)

    def draw() -> torch.Tensor:
        probs = F.softmax(_ban(model(x), list(range(6))), dim=-1)
        return torch.multinomial(probs, 1)

    d = _sampling_diagnosis(model, draw)
    assert "assert" not in d.fix and "top-p" not in d.fix
    assert "end-of-sequence" in d.fix and "at least one token allowed" in d.fix
    code = _code(d.fix)
    assert code[0] == "banned = banned & ~banned.all(dim=-1, keepdim=True)"
    assert code[1] == 'return logits.masked_fill(banned, float("-inf"))'
    fixed = _patched(_ban, "banned[:, banned_ids] = True", code[:1])
    probs = F.softmax(fixed(model(x).detach(), list(range(6))), dim=-1)
    assert bool(torch.isfinite(probs).all())
    # a row that keeps a token is untouched
    kept = F.softmax(fixed(model(x).detach(), [1, 2]), dim=-1)
    assert torch.equal(kept[:, 1:3], torch.zeros(2, 2))


# ------------------------------ 2: a NaN hidden by a mask has its own code, NW407


class _Enc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _masked_ade(pred: torch.Tensor, gt: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    err = (pred - gt).norm(dim=-1)
    err = torch.where(m, err, torch.zeros_like(err))
    return err.sum() / m.sum()


def _ade_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x, y = torch.randn(8, 2), torch.randn(8, 2)
    valid = torch.ones(8, dtype=torch.bool)
    valid[[2, 5]] = False
    y[~valid] = float("nan")
    return x, y, valid


def test_a_nan_hidden_by_where_is_nw407_not_the_fully_masked_row_code() -> None:
    assert REGISTRY["NW402"].title == "Fully masked attention row"
    assert REGISTRY["NW407"].title.startswith("NaN hidden by a mask")
    assert REGISTRY["NW407"].family == "masking" and REGISTRY["NW407"].severity == "error"
    m = _Enc()
    x, y, valid = _ade_batch()
    err = _raises(m, lambda: _masked_ade(m(x), y, valid).backward(), "forensic")
    codes = [d.code for d in err.diagnoses]
    assert codes[0] == "NW407" and "NW402" not in codes, codes
    d = _first(err, "NW407")
    assert "0 × NaN" in d.explanation or "0 times NaN" in d.explanation
    # the fix is code on the user's line: the NaN input cleaned before the op
    fix = _code(d.fix)[0]
    assert fix == "err = torch.nan_to_num(pred - gt).norm(dim=-1)", d.fix
    fixed = _patched(_masked_ade, "err = (pred - gt).norm(dim=-1)", [fix])
    m.zero_grad()
    fixed(m(x), y, valid).backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None)


def test_ignoring_nw402_no_longer_silences_a_hidden_nan() -> None:
    m = _Enc()
    x, y, valid = _ade_batch()
    with (
        pytest.raises(nanwatch.AnomalyError) as err,
        nanwatch.watch(m, mode="forensic", postmortem=False, ignore=["NW402"]),
    ):
        _masked_ade(m(x), y, valid).backward()
    assert [d.code for d in err.value.diagnoses][:1] == ["NW407"]


# ------------------------------ 3: BCE fixes: the module that made the sigmoid, the user's names


class _OccNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dec = nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.dec(x)
        return torch.sigmoid(z)


def test_bce_fixes_name_the_module_with_the_sigmoid_and_the_users_criterion() -> None:
    torch.manual_seed(0)
    model = _OccNet()
    with torch.no_grad():
        model.dec.bias[:6] = 30.0  # cells predicted occupied with p == 1.0 exactly
    crit = nn.BCELoss()
    x, occ = torch.randn(8, 4), torch.zeros(8, 16)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        loss = crit(model(x), occ)
        loss.backward()
        nw.step()
    found = {d.code: d for t in nw.history for d in t.diagnoses}
    assert {"NW201", "NW202"} <= set(found), list(found)
    for code in ("NW201", "NW202"):
        fix = found[code].fix
        assert "BCELoss.forward" not in fix and "_OccNet.forward" in fix, fix
        lines = fix.splitlines()
        assert lines[0].startswith("return z   #"), fix  # the sigmoid goes, in _OccNet
        assert lines[1].startswith("crit = nn.BCEWithLogitsLoss()"), fix
        assert "criterion" not in fix and "logits, y" not in fix, fix
        ast.parse(code_lines(fix))
    # applied: the same loss line on the logits is finite and not clamped
    with torch.no_grad():
        logits = model.dec(x)
    assert float(nn.BCEWithLogitsLoss()(logits, occ)) > 0
