"""Post-mortems of everyday crashes that said only "the last modules are listed": a
``.view()`` of a tensor a permute or transpose left non-contiguous (the user's call, the
op that reordered it, the call rewritten with ``.reshape``), and a recurrent module built
with ``batch_first=False`` given a (batch, steps, features) batch (the hidden state it
refuses, or the batch sizes a loss later finds differ)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import _frames
from nanwatch.postmortem import ADVICE, batch_sizes_named, classify
from nanwatch.report import Report


def _error(run: Callable[[], None], roots: tuple[nn.Module, ...], tmp_path: Path) -> dict[str, Any]:
    """The post-mortem's error of ``run`` under watch (the exception goes on: torch's
    RuntimeError, or a guard's ValueError)."""
    with (
        pytest.raises((RuntimeError, ValueError)),
        nanwatch.watch(*roots, report_dir=str(tmp_path)) as nw,
    ):
        run()
        nw.step()
    files = sorted(tmp_path.glob("*.json"))
    assert files, "no post-mortem report written"
    report = Report.load(str(files[-1]))
    assert report.error is not None
    return report.error


class _PatchHead(nn.Module):
    """Channels moved last for a per-pixel Linear, then flattened with view."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.conv(x).permute(0, 2, 3, 1)
        feats = feats.view(-1, 8)
        return self.fc(feats)


class _PatchHeadFixed(_PatchHead):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.conv(x).permute(0, 2, 3, 1)
        feats = feats.reshape(-1, 8)
        return self.fc(feats)


class _Heads(nn.Module):
    """Attention heads merged back with view right after the transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1) / 2.0).softmax(-1)
        y = att @ v
        return self.proj(y.transpose(1, 2).view(b, t, c))


def test_a_view_after_a_permute_names_the_line_the_permute_and_the_reshape(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = _PatchHead()
    x = torch.randn(2, 3, 4, 4)
    err = _error(lambda: model(x).sum().backward(), (model,), tmp_path)
    assert err["class"] == "view-layout", err
    line = _PatchHead.forward.__code__.co_firstlineno + 1  # the permute's; the view's next
    where, _ = _frames.describe_line(__file__, line + 1)
    assert err["advice"] == (
        f"feats.view(-1, 8) at {where} raised: feats "
        "(shape [2, 4, 4, 8]) is not contiguous in memory, made by .permute(0, 2, 3, 1) on "
        f"line {line}, which reordered its dimensions without moving the data, and view() "
        "can only regroup dimensions that are laid out one after the other. Write "
        "feats.reshape(-1, 8) (it copies only when it must), or feats.contiguous().view(-1, 8)."
    ), err["advice"]


def test_a_view_of_a_transpose_in_the_same_call_is_rewritten_whole(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Heads()
    x = torch.randn(2, 5, 16)
    err = _error(lambda: model(x).sum().backward(), (model,), tmp_path)
    assert err["class"] == "view-layout", err
    line = _Heads.forward.__code__.co_firstlineno + 6
    where, code = _frames.describe_line(__file__, line)
    assert code is not None and ".view(b, t, c)" in code
    assert err["advice"].startswith(f"y.transpose(1, 2).view(b, t, c) at {where} raised: "), err[
        "advice"
    ]
    assert (
        "raised: y.transpose(1, 2) is not contiguous in memory: .transpose(1, 2) reordered "
        "its dimensions without moving the data"
    ) in err["advice"]
    assert err["advice"].endswith(
        "Write y.transpose(1, 2).reshape(b, t, c) (it copies only when it must), or "
        "y.transpose(1, 2).contiguous().view(b, t, c)."
    ), err["advice"]


def test_a_view_error_without_the_users_source_gets_the_general_advice() -> None:
    x = torch.zeros(2, 3).t()
    with pytest.raises(RuntimeError) as raised:
        eval("x.view(-1)", {"x": x})  # no file to read the call from
    info = classify(raised.value)
    assert info["class"] == "view-layout"
    assert info["advice"] == ADVICE["view-layout"]
    assert ".reshape(...)" in info["advice"]


def test_the_reshaped_model_trains_with_nothing_to_report(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _PatchHeadFixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, report_dir=str(tmp_path)) as nw:
        for _ in range(3):
            loss = model(torch.randn(2, 3, 4, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert not nw.report.anomalies and not nw.report.diagnoses
    assert not list(tmp_path.glob("*.json"))


class _Tagger(nn.Module):
    """A sequence classifier that makes its hidden state from x.size(0), the batch."""

    def __init__(self, *, batch_first: bool) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=batch_first)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.zeros(1, x.size(0), 16)
        c0 = torch.zeros(1, x.size(0), 16)
        out, _ = self.rnn(x, (h0, c0))
        return self.fc(out[:, -1, :])


class _Regressor(nn.Module):
    """A GRU regressor that reads the last layer's final hidden state."""

    def __init__(self, *, batch_first: bool) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 16, num_layers=2, batch_first=batch_first)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h = self.gru(x)
        return self.head(h[-1])


_BATCH = torch.Generator().manual_seed(0)
_X = torch.randn(4, 10, 8, generator=_BATCH)  # (batch, steps, features)


def test_a_hidden_state_refused_by_a_seq_first_lstm_says_batch_first(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Tagger(batch_first=False)
    y = torch.tensor([0, 1, 2, 1])
    err = _error(lambda: F.cross_entropy(model(_X), y).backward(), (model,), tmp_path)
    assert err["class"] == "shape-mismatch", err
    assert err["advice"] == (
        "rnn (LSTM) has batch_first=False, so it reads its input of shape [4, 10, 8] as "
        "(steps, batch, features): 10 sequences of 4 steps, while the hidden state given "
        "with it is for a batch of 4. If the input is (batch, steps, features), build it "
        "with nn.LSTM(8, 16, batch_first=True) (its output is then batch-first too; the "
        "hidden state stays (layers, batch, hidden))."
    ), err["advice"]


def test_a_hidden_state_given_batch_first_is_told_its_layout() -> None:
    lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
    with pytest.raises(RuntimeError) as raised:
        lstm(_X, (torch.zeros(4, 2, 16), torch.zeros(4, 2, 16)))
    info = classify(raised.value)
    assert info["class"] == "shape-mismatch"
    assert info["advice"] == (
        "LSTM was given a hidden state of shape [4, 2, 16], but it takes (num_layers * "
        "num_directions, batch, hidden_size) = [2, 4, 16], also with batch_first=True "
        "(which is for the input and output only): make it torch.zeros(2, 4, 16), or pass "
        "none (zeros are the default)."
    ), info["advice"]


def test_a_hidden_state_of_a_fixed_batch_size_is_made_from_the_batch() -> None:
    lstm = nn.LSTM(8, 16, batch_first=True)
    h0 = torch.zeros(1, 32, 16)  # made once for batches of 32; the last one has 4
    with pytest.raises(RuntimeError) as raised:
        lstm(_X, (h0, h0))
    info = classify(raised.value)
    assert info["advice"] == (
        "LSTM was given a hidden state for a batch of 32, but its input has a batch of 4 "
        "(shape [4, 10, 8]): make the hidden state from each batch's size, torch.zeros(1, "
        "_X.size(0), 16), or pass none (zeros are the default); a hidden state carried from "
        "the last batch does not fit a shorter one (DataLoader(..., drop_last=True))."
    ), info["advice"]


def test_a_seq_first_gru_whose_batch_reaches_the_loss_says_batch_first(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Regressor(batch_first=False)
    crit = nn.MSELoss()
    y = torch.randn(4, 1)
    err = _error(lambda: crit(model(_X), y).backward(), (model, crit), tmp_path)
    assert err["class"] == "shape-mismatch", err
    assert err["advice"] == (
        "gru (GRU) has batch_first=False, so it reads its input of shape [4, 10, 8] as "
        "(steps, batch, features): 10 sequences of 4 steps, and what follows it gets a "
        "batch of 10 where 4 is expected (the sizes the error names). If the input is "
        "(batch, steps, features), build it with nn.GRU(8, 16, num_layers=2, "
        "batch_first=True) (its output is then batch-first too; the hidden state stays "
        "(layers, batch, hidden))."
    ), err["advice"]


def test_a_seq_first_lstm_before_a_class_loss_replaces_the_guards_same_batch_hint(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = _Regressor(batch_first=False)
    model.head = nn.Linear(16, 3)
    crit = nn.CrossEntropyLoss()
    y = torch.tensor([0, 1, 2, 1])
    err = _error(lambda: crit(model(_X), y).backward(), (model, crit), tmp_path)
    assert err["class"] == "guard", err
    assert err["advice"].startswith(
        "gru (GRU) has batch_first=False, so it reads its input of shape [4, 10, 8]"
    ), err["advice"]


def test_a_seq_first_rnn_given_steps_first_keeps_the_general_advice(tmp_path: Path) -> None:
    """Its input is (steps, batch, features) as it expects: a batch mismatch later (a
    target of another batch) is not its layout."""
    torch.manual_seed(0)
    model = _Regressor(batch_first=False)
    crit = nn.MSELoss()
    x = _X.transpose(0, 1).contiguous()  # (10 steps, 4 samples, 8)
    y = torch.randn(6, 1)
    err = _error(lambda: crit(model(x), y).backward(), (model, crit), tmp_path)
    assert err["class"] == "shape-mismatch", err
    assert "batch_first" not in err["advice"], err["advice"]


def test_the_batch_sizes_an_error_contrasts() -> None:
    assert batch_sizes_named(
        "The size of tensor a (10) must match the size of tensor b (4) at non-singleton dimension 0"
    ) == {4, 10}
    assert batch_sizes_named("Expected input batch_size (10) to match target batch_size (4).")
    assert batch_sizes_named("target contains 255 at 4 positions (of 10)") == set()


@pytest.mark.parametrize("model_cls", [_Tagger, _Regressor])
def test_batch_first_recurrent_models_train_with_nothing_to_report(
    tmp_path: Path, model_cls: type[nn.Module]
) -> None:
    torch.manual_seed(0)
    model = model_cls(batch_first=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, report_dir=str(tmp_path)) as nw:
        for _ in range(3):
            loss = model(_X).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert not nw.report.anomalies and not nw.report.diagnoses
    assert not list(tmp_path.glob("*.json"))
