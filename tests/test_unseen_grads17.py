"""NW301 for weights written after the optimizer step: a ``.data =`` renormalization is
said to replace the weight's tensor (not to change its version), and in forensic mode the
diagnosis points at the op and line that wrote the NaN, with a fix at that line (a TransE
renorm of an all-zero padding row gets its norm guarded)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)


def _nw301(model: nn.Module, step: Callable[[], Any], mode: str) -> Any:
    """The NW301 diagnosis of two calls of ``step`` with ``model`` watched in ``mode``."""
    try:
        with nanwatch.watch(model, mode=mode) as nw:
            for _ in range(2):
                step()
                nw.step()
    except nanwatch.AnomalyError as e:
        return next(d for d in e.diagnoses if d.code == "NW301")
    raise AssertionError("no anomaly")


def _renorm(replace: bool) -> tuple[nn.Embedding, Callable[[], Any]]:
    """TransE's unit-norm renormalization after each SGD step, the padding row 0 all zeros:
    0 / 0 = NaN, written by assigning ``.data`` or in place."""
    torch.manual_seed(0)
    emb = nn.Embedding(6, 4, padding_idx=0)
    opt = torch.optim.SGD(emb.parameters(), lr=1e-2)

    def step() -> None:
        loss = emb(torch.tensor([1, 2, 3])).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            if replace:
                emb.weight.data = emb.weight.data / emb.weight.data.norm(dim=1, keepdim=True)
            else:
                emb.weight.div_(emb.weight.norm(dim=1, keepdim=True))

    return emb, step


def _line(fix: str, marker: str) -> str:
    """The line of ``fix`` that holds ``marker``, its comment dropped."""
    line = next(s for s in fix.splitlines() if marker in s)
    return line.split("   # ")[0].removeprefix("# or: ")


# ------------------------------ 1: a .data assignment replaced the tensor, no version moved


def test_a_data_assignment_is_said_to_replace_the_tensor_not_to_change_its_version() -> None:
    emb, step = _renorm(replace=True)
    d = _nw301(emb, step, "watch")
    ev = " ".join(d.evidence)
    assert "SGD updated weight and left it finite" in ev
    assert (
        "its tensor was replaced after that update (a .data assignment, which moves no version)"
        in ev
    )
    assert "its version changed" not in ev
    # no op known (not forensic): the row the NaN filled whole tells a per-row division
    assert "the NaN fill 1 whole row of weight (row 0 of 6)" in ev
    assert "w /= w.norm(dim=1, keepdim=True).clamp_min(torch.finfo(w.dtype).eps)" in d.fix
    compile(d.fix, "<fix>", "exec")


def test_an_in_place_write_after_the_update_still_says_its_version_changed() -> None:
    emb, step = _renorm(replace=False)
    d = _nw301(emb, step, "watch")
    ev = " ".join(d.evidence)
    assert "it was written again after that update (its version changed)" in ev
    assert "a .data assignment" not in ev


# ------------------------------ 2: forensic: the op's line, and a fix at that line


@pytest.mark.parametrize("replace", [True, False])
def test_forensic_fixes_the_renorm_line_and_the_fix_keeps_the_weights_finite(
    replace: bool,
) -> None:
    emb, step = _renorm(replace)
    d = _nw301(emb, step, "forensic")
    assert d.source is not None and "test_unseen_grads17.py:" in d.source
    op = "aten.div.Tensor" if replace else "aten.div_.Tensor"
    assert any(
        e.startswith(f"{op} made NaN at {d.source}: ")
        and "norm(dim=1, keepdim=True)" in e
        and e.endswith("(the write after the update)")
        for e in d.evidence
    ), d.evidence
    assert "bad = [n for n, p in" not in d.fix  # not the generic scan
    assert "padding" in d.fix and "emb.weight[1:]" in d.fix
    compile(d.fix, "<fix>", "exec")
    guarded = _line(d.fix, "in place of yours")
    assert ".clamp_min(torch.finfo(emb.weight" in guarded
    normalize = _line(d.fix, "torch.nn.functional.normalize(")
    # pasted in place of the user's line: the padding row stays 0, the others are unit rows
    for fix in (guarded, normalize):
        w = torch.randn(6, 4)
        w[0] = 0
        table = nn.Embedding(6, 4, padding_idx=0)
        with torch.no_grad():
            table.weight.copy_(w)
            exec(fix, {"torch": torch, "emb": table})
        out = table.weight.detach()
        assert torch.isfinite(out).all(), fix
        assert torch.equal(out[0], torch.zeros(4))
        torch.testing.assert_close(out[1:], w[1:] / w[1:].norm(dim=1, keepdim=True))


def test_forensic_names_an_op_that_is_no_division_by_a_norm_with_its_hint() -> None:
    """A log of a weight after the update (a log-space reparametrization): log(0) = -inf."""
    lin = nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=1e-2)

    def step() -> None:
        opt.zero_grad()
        lin(torch.ones(4, 3)).sum().backward()
        opt.step()
        with torch.no_grad():
            lin.weight.data = torch.log(lin.weight.data - lin.weight.data)

    d = _nw301(lin, step, "forensic")
    assert d.source is not None and "test_unseen_grads17.py:" in d.source
    assert any("aten.log.default made -inf at" in e for e in d.evidence), d.evidence
    assert "a log of 0: clamp its argument" in d.fix
    assert "torch.isfinite(lin.weight).all()" in d.fix
    compile(d.fix, "<fix>", "exec")
