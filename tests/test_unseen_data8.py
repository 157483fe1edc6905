"""Tabular data fixes found by user testing: a negative category code gets an 'unknown'
row (not a padding row under an undefined name), an id the table was not sized for is
mapped to an 'unknown' row before the table is grown, and a bad model input is called by
its forward's parameter name, not ``arg1``."""

from __future__ import annotations

import ast

import pytest
import torch
from torch import nn

from nanwatch.config import Thresholds
from nanwatch.rules import evaluate
from nanwatch.rules._evidence import forward_params
from nanwatch.rules.guards import unknown_id_hint, unknown_row_fix
from tests._diagnoses import code_lines, first_bad

torch.set_num_threads(1)


class _Owner(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, 4)


def _apply(fix: str, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """Run the fix's code (its table line, then its call) on an owner of ``rows`` rows."""
    code = code_lines(fix)
    ast.parse(code)  # valid Python
    scope = {"self": _Owner(rows), "nn": nn, "torch": torch, "c": ids}
    exec(code, scope)
    return scope["h"]  # type: ignore[return-value]


# ------------------------------ 1: -1 is a missing category code: an 'unknown' row


def test_a_negative_category_code_gets_an_unknown_row_in_the_users_names() -> None:
    hint = unknown_id_hint([-1], 10, above=False)
    assert "-1 is the code of a missing or unknown category" in hint
    assert "padding" not in hint
    fix = unknown_row_fix(
        recv="c",
        rows=10,
        call=lambda e: f"h = self.emb({e})",
        grown="self.emb = nn.Embedding(11, 4)",
        below=True,
        above=False,
    )
    assert "pad_id" not in fix and "padding_idx" not in fix
    assert "'unknown'" in fix and "c.masked_fill(c < 0, 10)" in fix
    ids = torch.tensor([3, -1, 9])
    h = _apply(fix, ids, 10)
    assert h.shape == (3, 4)


# ------------------------------ 2: an unseen id: an 'unknown' row first, growing second


def test_an_id_past_the_table_maps_to_an_unknown_row_before_the_table_grows() -> None:
    fix = unknown_row_fix(
        recv="c",
        rows=45,
        call=lambda e: f"h = self.emb({e})",
        grown="self.emb = nn.Embedding(46, 4)",
        below=False,
        above=True,
        bigger="self.emb = nn.Embedding(50, 4)",
    )
    lines = fix.splitlines()
    assert lines[0].startswith("self.emb = nn.Embedding(46, 4)")
    assert "c.clamp_max(45)" in lines[1]
    assert "or, if they are new ids to learn" in lines[2] and "nn.Embedding(50, 4)" in lines[2]
    h = _apply(fix, torch.tensor([0, 44, 49]), 45)
    assert h.shape == (3, 4)
    # both kinds at once: one mask
    both = unknown_row_fix(
        recv="c",
        rows=45,
        call=lambda e: f"h = self.emb({e})",
        grown="self.emb = nn.Embedding(46, 4)",
        below=True,
        above=True,
    )
    assert _apply(both, torch.tensor([-1, 3, 47]), 45).shape == (3, 4)


# ------------------------------ 3: NW401 calls input[1] by its forward's name


class _Tab(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mlp = nn.Linear(8, 1)

    def forward(self, c: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.emb(c), feats], 1))


def test_bad_input_data_is_named_by_the_forwards_parameter() -> None:
    import nanwatch

    m = _Tab()
    assert forward_params(m) == ("c", "feats")
    num = torch.randn(8, 4)
    num[3, 1] = float("nan")
    cat = torch.randint(0, 10, (8,))
    with pytest.warns(RuntimeWarning, match="NW401"), nanwatch.watch(m, on_anomaly="warn") as nw:
        m(cat, num)
        nw.step()
    trace = first_bad(nw)
    facts = {"mode": "watch", "forward_params": {"_Tab": forward_params(m)}}
    # the user's call is known (the watcher noted it): the batch under the user's name
    found = evaluate(trace, [], Thresholds(), facts=facts)
    d = next(d for d in found if d.code == "NW401")
    assert "num = torch.nan_to_num(num" in d.fix
    # without it (a saved trace, a frame nanwatch cannot read): the forward's parameter
    trace.notes = [n for n in trace.notes if n.kind != "call_site"]
    found = evaluate(trace, [], Thresholds(), facts=facts)
    d = next(d for d in found if d.code == "NW401")
    assert "arg1" not in d.fix
    assert "# feats: the 2nd argument you pass to _Tab" in d.fix
    feats = num.clone()
    scope = {"torch": torch, "feats": feats}
    exec(code_lines(d.fix), scope)
    assert bool(torch.isfinite(scope["feats"]).all())
