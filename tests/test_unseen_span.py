"""A fix rewrites the call that failed, not the first call of the same op on the line: the
op checker's line knows the columns its frame was running (Python 3.11's instruction
positions), and the line rewriter picks the call inside them."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from nanwatch import _frames
from nanwatch.rules._evidence import call_argument, rewrite_call
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


class TwoRoots(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, ok: bool) -> torch.Tensor:
        p = torch.softmax(self.fc(x), -1)
        q = torch.relu(self.fc(x))
        return torch.sqrt(p) if ok else torch.sqrt(q - 1)


@pytest.mark.parametrize("mode", ["forensic", "watch"])
def test_the_fix_rewrites_the_call_that_made_the_nan(mode: str) -> None:
    torch.manual_seed(0)
    m = TwoRoots()

    def run() -> None:
        m(torch.randn(8, 4), False).sum().backward()

    err = _raises(m, run, mode)
    d = err.diagnosis
    assert d is not None and d.code == "NW112"
    line = d.fix.splitlines()[0].split("   #")[0]
    assert line.startswith("return torch.sqrt(p) if ok else torch.sqrt("), line
    assert "q - 1" in line.split(" else ", 1)[1]


def _frame_running_second_call() -> _frames.CodeLine:
    def probe(_: object) -> _frames.CodeLine:
        _, code = _frames.describe_frame(__import__("sys")._getframe(1))
        assert isinstance(code, _frames.CodeLine)
        return code

    def f(ok: bool) -> _frames.CodeLine:
        return probe(1) if ok else probe(2)

    return f(False)


def test_a_code_line_knows_the_part_that_ran_and_pickles_as_a_plain_string() -> None:
    code = _frame_running_second_call()
    assert code == "return probe(1) if ok else probe(2)"
    assert code.span is not None and code[code.span[0] : code.span[1]] == "probe(2)"
    back = pickle.loads(pickle.dumps(code))
    # a checkpoint holding it loads with torch.load(weights_only=True): no class in it
    assert back == code and type(back) is str


def test_rewrite_call_picks_the_call_inside_the_span() -> None:
    text = "d = torch.sqrt(a) + torch.sqrt(b)"
    code = _frames.CodeLine(text, (text.index("torch.sqrt(b)"), len(text)))
    assert rewrite_call(code, ["sqrt"], lambda e: f"{e}.clamp_min(0)") == (
        "d = torch.sqrt(a) + torch.sqrt(b.clamp_min(0))"
    )
    assert call_argument(code, ["sqrt"]) == "b"
    # a plain string (a saved report): the first call, as before
    assert rewrite_call(text, ["sqrt"], lambda e: f"{e}.clamp_min(0)") == (
        "d = torch.sqrt(a.clamp_min(0)) + torch.sqrt(b)"
    )
