"""torch.where(mask, -1e9, scores) in float16 does not raise (the python scalar becomes
-inf in float16, where masked_fill raises): a fully masked row is then NaN after softmax.
NW402 names the constant and rewrites the line with finfo.min in all three modes; the
clamp after adding a mask is only said where the line adds one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.errors import AnomalyError


class Attn(nn.Module):
    def __init__(self, d: int = 16, additive: bool = False, finite: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.additive = additive
        self.finite = finite

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 4.0
        mask = (attention_mask[:, None, :] == 0).expand_as(scores)
        if self.finite:
            scores = torch.where(mask, torch.finfo(scores.dtype).min, scores)
        elif self.additive:
            scores = scores + mask.to(scores.dtype) * -1e9
        else:
            scores = torch.where(mask, -1e9, scores)
        attn = torch.softmax(scores, dim=-1)
        return self.out(attn @ v)


def _run(model: nn.Module, mode: str = "watch") -> nanwatch.Diagnosis:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16).half()
    am = torch.ones(2, 8, dtype=torch.long)
    am[0] = 0  # a sample with no real token
    with pytest.raises(AnomalyError), nanwatch.watch(model, mode=mode, postmortem=False) as nw:
        model(x, am)
    d = nw.report.diagnoses[0]
    assert d.code == "NW402"
    return d


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_where_with_a_python_scalar_in_float16(mode: str) -> None:
    torch.manual_seed(0)
    d = _run(Attn().half(), mode)
    assert d.fix.startswith(
        "scores = torch.where(mask, torch.finfo(torch.float16).min, scores)   # not -1e9: it "
        "is -inf in float16"
    )
    assert "after adding the mask" not in d.fix


def test_an_added_mask_keeps_the_clamp() -> None:
    torch.manual_seed(0)
    d = _run(Attn(additive=True).half())
    assert "after adding the mask" in d.fix


def test_finfo_min_in_float16_runs_clean() -> None:
    torch.manual_seed(0)
    model = Attn(finite=True).half()
    x = torch.randn(2, 8, 16).half()
    am = torch.ones(2, 8, dtype=torch.long)
    am[0, 5:] = 0
    with nanwatch.watch(model, postmortem=False) as nw:
        out = model(x, am)
        out.float().pow(2).mean().backward()
        nw.step()
    assert torch.isfinite(out).all()
    assert not nw.report.diagnoses
