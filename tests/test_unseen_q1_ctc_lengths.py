"""ASR with a strided front-end: CTC's input_lengths given as the feature frames, before the
model's time downsampling, make torch raise "Expected input_lengths to have value at most
20, but got value 40"; the post-mortem said only "the last modules that ran are listed".
It now names the argument, T, the downsampling factor, and the lengths to pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.postmortem import classify


class ASR(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = nn.Conv1d(16, 32, 3, stride=2, padding=1)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.sub(x.transpose(1, 2))).transpose(1, 2)
        h, _ = self.rnn(h)
        return self.out(h).log_softmax(-1)


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(3, 40, 16)
    lengths = torch.tensor([40, 36, 30])  # feature frames
    y = torch.randint(1, 8, (3, 6))
    ylen = torch.tensor([6, 5, 4])
    return x, lengths, y, ylen


def _advice(tmp_path: Path, mode: str, lengths: torch.Tensor | None = None) -> dict[str, str]:
    torch.manual_seed(0)
    m, ctc = ASR(), nn.CTCLoss(blank=0)
    x, feat_lengths, y, ylen = _batch()
    lengths = feat_lengths if lengths is None else lengths
    with (
        pytest.raises(RuntimeError, match="input_lengths to have value at most"),
        nanwatch.watch(m, ctc, mode=mode, report_dir=str(tmp_path)),  # type: ignore[arg-type]
    ):
        lp = m(x)
        loss = ctc(lp.transpose(0, 1), y, lengths, ylen)
        loss.backward()
    (path,) = sorted(tmp_path.glob("*.json"))
    err = json.loads(path.read_text())["error"]
    assert err["class"] == "ctc-input-lengths"
    return err


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_lengths_before_the_downsampling_get_the_lengths_after_it(
    tmp_path: Path, mode: str
) -> None:
    advice = _advice(tmp_path, mode)["advice"]
    first = advice.split(". ", 1)[0]
    assert "input_lengths (lengths) go up to 40 frames" in first
    assert "lp.transpose(0, 1) has T = 20" in first
    assert "((lengths + 1) // 2).clamp(max=lp.transpose(0, 1).shape[0])" in first
    code = advice.splitlines()[1:]
    assert code == [
        "out_lengths = ((lengths + 1) // 2).clamp(max=lp.transpose(0, 1).shape[0])",
        "loss = ctc(lp.transpose(0, 1), y, out_lengths, ylen)",
    ]


def test_the_lengths_it_gives_train_clean() -> None:
    torch.manual_seed(0)
    m, ctc = ASR(), nn.CTCLoss(blank=0)
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    with nanwatch.watch(m, ctc, postmortem=False) as nw:
        for _ in range(2):
            x, lengths, y, ylen = _batch()
            lp = m(x)
            out_lengths = ((lengths + 1) // 2).clamp(max=lp.transpose(0, 1).shape[0])
            assert out_lengths.tolist() == [20, 18, 15]  # the conv's own output lengths
            loss = ctc(lp.transpose(0, 1), y, out_lengths, ylen)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert not nw.report.diagnoses
    assert torch.isfinite(loss)


def test_lengths_one_frame_too_long_get_no_factor(tmp_path: Path) -> None:
    advice = _advice(tmp_path, "watch", torch.tensor([21, 20, 20]))["advice"]
    assert "go up to 21 frames" in advice and "T = 20" in advice
    assert "//" in advice and "clamp them to T" in advice
    assert "x2" not in advice and "out_lengths" not in advice


def test_the_message_alone_gets_the_class_advice() -> None:
    msg = "Expected input_lengths to have value at most 20, but got value 40"
    info = classify(RuntimeError(msg))
    assert info["class"] == "ctc-input-lengths"
    assert "after its time downsampling" in info["advice"]
