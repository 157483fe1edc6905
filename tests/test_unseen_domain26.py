"""Domain fixes found by user testing: a mean loss over an empty selection is fixed on the
user's own ``return`` line (no invented names, no ``continue`` in a function); a masked
infinity's explanation follows the fill's sign; an inf fix is never empty."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nanwatch.records import OpEvent, Phase
from nanwatch.rules._evidence import InfSource, inf_explanation, inf_fix
from tests._diagnoses import counted
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: NW113, a returned loss call over no positive ROI


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pred = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pred(x)


def _mask_loss(mask_logits: torch.Tensor, labels: torch.Tensor, gt_masks: torch.Tensor):  # type: ignore[no-untyped-def]
    idx = torch.arange(labels.numel())
    return F.binary_cross_entropy_with_logits(mask_logits[idx, labels], gt_masks)


_ce = nn.CrossEntropyLoss()


def _cls_loss(logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor):  # type: ignore[no-untyped-def]
    return _ce(logits[keep], labels[keep])


def _as_function(fix: str) -> str:
    """The fix's code as the body of a function with the user's parameters."""
    body = "\n".join("    " + ln for ln in fix.splitlines())
    return "def f(mask_logits, labels, gt_masks, logits, keep, idx, _ce):\n" + body + "\n"


def test_an_empty_mask_head_loss_is_fixed_on_the_users_return_line() -> None:
    head = _Head()

    def run() -> None:
        n = 0
        out = head(torch.randn(n, 4, 6, 6))
        _mask_loss(out, torch.randint(1, 3, (n,)), torch.rand(n, 6, 6)).backward()

    d = _first(_raises(head, run, "forensic"), "NW113")
    assert "pred" not in d.fix.replace(".pred", "") and "continue" not in d.fix
    assert d.fix.startswith(
        "return F.binary_cross_entropy_with_logits(mask_logits[idx, labels], gt_masks, "
        "reduction='sum') / max(mask_logits[idx, labels].numel(), 1)"
    )
    ast.parse(_as_function(d.fix))  # valid inside a function: no bare continue
    # the fix gives 0 (with a graph) on the empty batch and the mean otherwise
    scope: dict[str, object] = {"F": F, "torch": torch}
    exec(_as_function(d.fix), scope)
    f = scope["f"]
    for n in (0, 5):
        ml = torch.randn(n, 3, 6, 6, requires_grad=True)
        lab, gt = torch.randint(1, 3, (n,)), torch.rand(n, 6, 6)
        got = f(ml, lab, gt, None, None, torch.arange(n), None)  # type: ignore[operator]
        assert torch.isfinite(got)
        got.backward()
        if n:
            want = F.binary_cross_entropy_with_logits(ml[torch.arange(n), lab], gt)
            assert torch.allclose(got, want)


def test_an_empty_loss_module_call_returned_is_guarded_by_an_early_return() -> None:
    fc = nn.Linear(3, 4)

    def run() -> None:
        x = torch.randn(6, 3)
        _cls_loss(fc(x), torch.randint(0, 4, (6,)), torch.zeros(6, dtype=torch.bool)).backward()

    d = _first(_raises(fc, run, "forensic"), "NW113")
    assert "continue" not in d.fix and "pred" not in d.fix
    assert "model" not in d.fix  # _ce is a loss module the file made, not a model
    assert "    return logits[keep].sum() * 0\n" in d.fix
    assert d.fix.endswith("\nreturn _ce(logits[keep], labels[keep])")
    scope: dict[str, object] = {"torch": torch}
    exec(_as_function(d.fix), scope)
    f = scope["f"]
    labels = torch.randint(0, 4, (6,))
    for keep in (torch.zeros(6, dtype=torch.bool), torch.ones(6, dtype=torch.bool)):
        logits = torch.randn(6, 4, requires_grad=True)
        got = f(None, labels, None, logits, keep, None, _ce)  # type: ignore[operator]
        assert torch.isfinite(got)
        got.backward()
        assert torch.allclose(got, _ce(logits[keep], labels[keep]) if keep.any() else got * 0)


# ------------------------------ 2: a masked +inf's words; an inf fix is never empty


def _ev(op: str, code: str, born: str = "NaN") -> OpEvent:
    s = counted(0.0, 1.0, numel=4)
    inf = counted(-1.0, float("inf"), numel=4, posinf=1)
    return OpEvent(op, Phase.FORWARD, "m", born, s, [("self", inf), ("other", s)], code=code)


def test_values_masked_to_plus_inf_are_explained_with_finfo_max() -> None:
    fill = _ev("aten.masked_fill.Scalar", "d = d.masked_fill(k, float('inf'))", born="+inf")
    src = InfSource("mask", (fill,), None)
    text = inf_explanation(_ev("aten.sub.Tensor", "y = d - e"), src)
    assert "masked to +inf" in text and "finfo(dtype).max" in text
    assert "-inf" not in text and "finfo(dtype).min" not in text


def test_an_inf_fix_with_nothing_better_asserts_the_operand_that_held_the_inf() -> None:
    fill = _ev("aten.masked_fill.Scalar", "a = a.masked_fill(k, big)", born="+inf")
    src = InfSource("mask", (fill,), None)
    fix = inf_fix(_ev("aten.add.Tensor", "y = a + b"), src, forensic=True)
    assert fix.startswith("assert torch.isfinite(a).all()")
    assert "isfinite(b)" not in fix
    ast.parse(fix)


# ------------------------------ 3: the shared restore of a one-line compound header


def test_a_rewritten_statement_keeps_its_else_header_through_the_shared_helper(
    tmp_path: Path,
) -> None:
    from nanwatch.rules._evidence import on_its_line, statements

    src = tmp_path / "m.py"
    src.write_text("if k:\n    pass\nelse: score = a / b; n += 1  # div\n")
    line = f"{src}:3"
    assert statements("else: score = a / b; n += 1") == ["score = a / b", "n += 1"]
    fixed = on_its_line(line, "score = a / b.clamp_min(1e-12)   # b is 0 somewhere")
    assert fixed == "else: score = a / b.clamp_min(1e-12); n += 1   # b is 0 somewhere"
    assert on_its_line(line, "# a comment stays") == "# a comment stays"
