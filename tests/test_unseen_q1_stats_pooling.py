"""Speaker embeddings: attentive statistics pooling takes a std as sqrt(E[x²] - mu²); a
silent utterance makes every frame equal, and the difference rounds to -2e-9: NaN. The fix
was a generic ``y = torch.sqrt(v.clamp_min(0) + 1e-12)``; it is now the user's own line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


class ASP(nn.Module):
    def __init__(self, floored: bool = False) -> None:
        super().__init__()
        self.floored = floored
        self.tdnn = nn.Conv1d(16, 32, 5, padding=2)
        self.att = nn.Conv1d(32, 32, 1)
        self.fc = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.tdnn(x))
        w = torch.softmax(self.att(h), dim=-1)
        mu = (h * w).sum(-1)
        if self.floored:
            sg = torch.sqrt(((h**2 * w).sum(-1) - mu**2).clamp_min(0) + 1e-5)
        else:
            sg = torch.sqrt((h**2 * w).sum(-1) - mu**2)
        return self.fc(torch.cat([mu, sg], 1))


def _train(model: nn.Module, mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:  # type: ignore[arg-type]
        for i in range(3):
            x = torch.randn(4, 16, 50)
            if i == 1:
                x[1] = 0.0  # a silent utterance: every frame of h is relu(bias)
            loss = F.cross_entropy(model(x), torch.randint(0, 8, (4,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_a_std_of_a_silent_utterance_gets_the_floor_on_the_users_line(mode: str) -> None:
    torch.manual_seed(0)
    nw = _train(ASP(), mode)
    d = nw.report.diagnoses[0]
    assert d.code == "NW112"
    line = d.fix.splitlines()[0].split("   #")[0]
    assert line == "sg = torch.sqrt(((h**2 * w).sum(-1) - mu**2).clamp_min(0) + 1e-5)"
    assert "v.clamp_min" not in d.fix
    # pasted: finite, with a finite gradient, on a constant input
    h = torch.full((2, 3, 7), 0.3, requires_grad=True)
    w = torch.softmax(torch.randn(2, 3, 7), -1)
    mu = (h * w).sum(-1)
    ns = {"torch": torch, "h": h, "w": w, "mu": mu}
    exec(line, ns)
    ns["sg"].sum().backward()
    assert bool(torch.isfinite(ns["sg"]).all()) and h.grad is not None
    assert bool(torch.isfinite(h.grad).all())


def test_the_floored_pooling_trains_clean_on_silence() -> None:
    nw = _train(ASP(floored=True), "watch")
    assert not nw.report.diagnoses
