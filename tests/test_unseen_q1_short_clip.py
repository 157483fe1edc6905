"""Audio front-ends given a clip shorter than one window: ``wav.unfold(-1, 400, 160)`` of
320 samples, ``torch.stft`` of 100 samples with n_fft=400 (center=True pads 200 by
reflection; center=False needs 400). Each raised a RuntimeError whose post-mortem said only
"the last modules that ran are listed"; it now says the clip is shorter than a window, with
the sizes and the tensor's name, and how to pad or drop it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.postmortem import classify


class FrameNet(nn.Module):
    def __init__(self, pad: bool = False) -> None:
        super().__init__()
        self.pad = pad
        self.proj = nn.Linear(400, 32)
        self.out = nn.Linear(32, 5)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        if self.pad:
            wav = torch.nn.functional.pad(wav, (0, max(0, 400 - wav.shape[-1])))
        frames = wav.unfold(-1, 400, 160)  # (N, n_frames, 400)
        h = torch.tanh(self.proj(frames))
        return self.out(h.mean(dim=1))


class SpecNet(nn.Module):
    def __init__(self, center: bool) -> None:
        super().__init__()
        self.center = center
        self.register_buffer("win", torch.hann_window(400))
        self.out = nn.Linear(201, 5)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(audio, 400, 160, window=self.win, center=self.center, return_complex=True)
        return self.out(spec.abs().mean(-1))


def _error(tmp_path: Path, model: nn.Module, length: int) -> dict[str, str]:
    with (
        pytest.raises(RuntimeError),
        nanwatch.watch(model, report_dir=str(tmp_path)),
    ):
        model(torch.randn(1, length)).sum().backward()
    (path,) = sorted(tmp_path.glob("*.json"))
    err = json.loads(path.read_text())["error"]
    assert err["class"] == "shorter-than-window"
    return err


def test_unfold_of_a_clip_shorter_than_a_window(tmp_path: Path) -> None:
    advice = _error(tmp_path, FrameNet(), 320)["advice"]
    first = advice.split(". ", 1)[0]
    assert first == (
        "wav has 320 values along dimension 1, fewer than one window of the unfold (400): "
        "no frame fits"
    )
    assert "collate_fn" in advice
    pad = advice.splitlines()[1].split("   #")[0]
    assert pad == "wav = torch.nn.functional.pad(wav, (0, max(0, 400 - wav.shape[-1])))"


def test_the_padded_clip_trains_clean() -> None:
    torch.manual_seed(0)
    m = FrameNet(pad=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanwatch.watch(m, postmortem=False) as nw:
        for n in (1600, 320, 400):
            loss = F.cross_entropy(m(torch.randn(2, n)), torch.tensor([0, 3]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert not nw.report.diagnoses


def test_stft_of_a_clip_shorter_than_half_a_window(tmp_path: Path) -> None:
    advice = _error(tmp_path, SpecNet(center=True), 100)["advice"]
    assert advice.startswith(
        "audio has 100 samples, but torch.stft(center=True) pads n_fft // 2 = 200 on each "
        "side by reflection"
    )
    assert "more than 200 samples" in advice


def test_stft_without_centre_of_a_clip_shorter_than_n_fft(tmp_path: Path) -> None:
    advice = _error(tmp_path, SpecNet(center=False), 100)["advice"]
    assert advice.startswith("audio has 100 samples, fewer than n_fft = 400")


def test_a_reflect_pad_elsewhere_is_not_called_a_clip() -> None:
    try:
        F.pad(torch.randn(1, 3, 4, 4), (5, 5, 5, 5), mode="reflect")
    except RuntimeError as e:
        info = classify(e)
    assert info["class"] == "shorter-than-window"
    assert "A reflect padding of 5 needs more than 5 values" in info["advice"]
    assert "clip" not in info["advice"] and "stft" not in info["advice"]
