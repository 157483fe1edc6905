"""NW304 and modules that got no samples: a step where a module's input (or output) had 0
elements (a detection head run on ``feats[pos]`` with no positive, an MoE expert routed
no token) is not a zero-gradient step for it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nanwatch


class _Det(nn.Module):
    def __init__(self, dead: bool = False) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.cls_head = nn.Linear(16, 1)
        self.box_head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
        if dead:
            with torch.no_grad():
                self.box_head[0].bias.fill_(-1e4)  # its ReLU never fires: dead units

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.backbone(x)
        return self.cls_head(f).squeeze(-1), self.box_head(f[pos])


def _det_run(mode: str, empty: int, steps: int, dead: bool = False) -> list[str]:
    """Codes and paths of the NW304 diagnoses and warnings of a run whose first ``empty``
    batches hold no positive (box_head gets a 0-row input)."""
    torch.manual_seed(0)
    m = _Det(dead)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(steps, 16, 6, generator=g)
    boxes = torch.randn(steps, 16, 4, generator=g)
    pos = torch.rand(steps, 16, generator=g) > 0.5
    pos[:empty] = False
    pos[empty:, 0] = True
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with nanwatch.watch(m, mode=mode) as nw:
            for step in range(steps):
                logit, pb = m(x[step], pos[step])
                n = max(1, int(pos[step].sum()))
                loss = F.binary_cross_entropy_with_logits(logit, pos[step].float())
                loss = loss + F.smooth_l1_loss(pb, boxes[step][pos[step]], reduction="sum") / n
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    found = [f"{d.code} {d.path}" for t in nw.history for d in t.diagnoses if d.code == "NW304"]
    found += [str(x.message) for x in w if "NW304" in str(x.message)]
    return found


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_empty_input_steps_are_not_vanishing(mode: str) -> None:
    # box_head sees 0 rows for 6 steps, then learns normally: nothing vanished
    assert _det_run(mode, empty=6, steps=9) == []


def test_never_given_samples_stays_silent() -> None:
    assert _det_run("watch", empty=8, steps=8) == []


def test_dead_units_after_empty_steps_still_found() -> None:
    # empty steps do not hide units that are dead while they do get samples
    found = _det_run("watch", empty=3, steps=9, dead=True)
    assert any("box_head" in f for f in found), found


class _MoE(nn.Module):
    def __init__(self, d: int = 8, e: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, e)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.router(x).softmax(-1)
        idx = p.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = (idx == e).nonzero(as_tuple=True)[0]
            if e == len(self.experts) - 1:
                sel = sel[:0]  # the last expert is routed no token
            out = out.index_add(0, sel, expert(x[sel]) * p[sel, e : e + 1])
        return out


def test_starved_expert_is_not_vanishing() -> None:
    torch.manual_seed(0)
    m, head = _MoE(), nn.Linear(8, 1)
    opt = torch.optim.AdamW([*m.parameters(), *head.parameters()], lr=1e-2)
    x, y = torch.randn(24, 8), torch.randn(24, 1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with nanwatch.watch(m, head) as nw:
            for _ in range(8):
                loss = F.mse_loss(head(m(x)), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    assert not [d for t in nw.history for d in t.diagnoses if d.code == "NW304"]
    assert not [x for x in w if "NW304" in str(x.message)]
