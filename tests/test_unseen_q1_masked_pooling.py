"""Keyword spotting with a stride-4 front-end: a 3-frame clip has ``lengths // 4 == 0``
output frames, so its row of the mask is empty and the masked mean pooling is 0/0 in that
row only. NW113 said "it selected nothing this step" and offered ``if not mask.any():
continue``, which never fires when the other rows select frames; it now says some rows
are empty and where such samples come from."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


class KWS(nn.Module):
    def __init__(self, floored: bool = False) -> None:
        super().__init__()
        self.floored = floored
        self.front = nn.Sequential(
            nn.Conv1d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(32, 32, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.front(feats.transpose(1, 2))  # (N, C, T/4)
        out_lengths = lengths // 4
        mask = torch.arange(h.shape[-1])[None, :] < out_lengths[:, None]
        if self.floored:
            pooled = (h * mask[:, None, :]).sum(-1) / mask.sum(-1, keepdim=True).clamp_min(1)
        else:
            pooled = (h * mask[:, None, :]).sum(-1) / mask.sum(-1, keepdim=True)
        return self.head(pooled)


def _train(model: KWS, mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:  # type: ignore[arg-type]
        for i in range(3):
            feats = torch.randn(4, 40, 16)
            lengths = torch.tensor([40, 33, 17, 3 if i == 1 else 12])
            feats[3, lengths[3] :] = 0
            loss = F.cross_entropy(model(feats, lengths), torch.randint(0, 10, (4,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_an_empty_row_of_a_per_row_mask_is_said_as_such(mode: str) -> None:
    nw = _train(KWS(), mode)
    d = nw.report.diagnoses[0]
    assert d.code == "NW113"
    assert d.title.endswith("the mask selected nothing in some rows")
    assert "counts are 0" in d.evidence[0] and "this step" not in d.evidence[0]
    first, second = d.fix.splitlines()[:2]
    assert first.startswith(
        "pooled = (h * mask[:, None, :]).sum(-1) / mask.sum(-1, keepdim=True).clamp_min(1)"
    )
    assert ".any(): continue" not in d.fix
    assert "a sample of length 0" in second and "downsampling" in second


def test_the_floored_count_trains_clean() -> None:
    nw = _train(KWS(floored=True), "watch")
    assert not nw.report.diagnoses
