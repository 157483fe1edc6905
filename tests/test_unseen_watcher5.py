"""Loops that change under the watcher: a training generator the caller leaves with
``break``, layers inserted into a watched model mid-run, a loss written as a loop over time
steps (thousands of autograd nodes), a GradScaler's scaled loss in the timeline."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)


def test_breaking_out_of_a_training_generator_is_a_normal_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), 0.01)

    def train() -> Iterator[float]:
        with nanwatch.watch(net, report_dir=str(tmp_path)) as nw:
            for _ in range(50):
                loss = net(torch.randn(8, 4)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
                yield loss.item()

    for i, _ in enumerate(train()):
        if i == 1:
            break  # Python closes the generator: GeneratorExit at its yield
    err = capsys.readouterr().err
    assert "GeneratorExit" not in err and "post-mortem" not in err
    assert list(tmp_path.iterdir()) == []  # no post-mortem written
    assert all(not m._forward_hooks for m in net.modules())


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN for a negative input


def test_a_layer_inserted_after_attach_is_watched_under_its_current_name() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), 0.01)
    with (
        pytest.raises(nanwatch.AnomalyError) as caught,
        nanwatch.watch(net, postmortem=False) as nw,
    ):
        for i in range(4):
            if i == 2:  # progressive growing: two layers go in before the last
                net.insert(2, _Log())
                net.insert(2, nn.Linear(8, 8))
            loss = net(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    anomaly = nw.first_anomaly
    assert anomaly is not None and anomaly.step == 2
    assert anomaly.path == "3"  # the _Log layer where it is now, not its parent
    text = str(caught.value)
    assert "forward of 3 (_Log)" in text
    assert "Sequential itself" not in text
    # every module by its current name, the one moved from 2 to 4 included: none stale
    assert sorted(nw.module_paths) == ["0", "1", "2", "3", "4", "Sequential"]


def _ctc(logp: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A hand-written CTC forward algorithm over one utterance: log-sum-exp over -inf."""
    ext = torch.zeros(2 * len(y) + 1, dtype=torch.long)
    ext[1::2] = y
    neg = float("-inf")
    alpha = torch.cat([logp[0, ext[:2]], torch.full((len(ext) - 2,), neg)])
    skip = torch.cat([torch.tensor([False, False]), (ext[2:] != 0) & (ext[2:] != ext[:-2])])
    for t in range(1, logp.shape[0]):
        a1 = torch.cat([torch.tensor([neg]), alpha[:-1]])
        a2 = torch.cat([torch.tensor([neg, neg]), alpha[:-2]])
        a2 = torch.where(skip, a2, torch.full_like(a2, neg))
        alpha = torch.logsumexp(torch.stack([alpha, a1, a2]), 0) + logp[t, ext]
    return -torch.logsumexp(alpha[-2:], 0)


def test_a_loss_loop_over_many_frames_names_its_nan_gradient_op() -> None:
    torch.manual_seed(0)
    enc, head = nn.GRU(6, 8), nn.Linear(8, 5)
    with (
        pytest.raises(nanwatch.AnomalyError) as caught,
        nanwatch.watch(enc, head, postmortem=False),
    ):
        h, _ = enc(torch.randn(40, 6))  # 40 frames: hundreds of loss-code nodes
        loss = _ctc(head(h).log_softmax(-1), torch.tensor([1, 2, 3]))
        loss.backward()
    text = str(caught.value)
    assert "LogsumexpBackward0" in text and "aten.logsumexp" in text
    assert "not traced in this mode" not in text


def test_the_timeline_shows_the_loss_a_grad_scaler_scaled_unscaled() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), 1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    losses = []
    with nanwatch.watch(model, crit, postmortem=False) as nw:
        for _ in range(3):
            loss = crit(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
            losses.append(loss.item())
    got = [t.loss for t in nw.history]
    assert got == pytest.approx(losses, rel=1e-3)
    assert all(t.scale and t.scale > 1000 for t in nw.history)  # the scale is still shown
