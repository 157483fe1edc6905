"""Post-mortem advice for three failures of recurrent and language-model loops that were
told only "the last modules that ran are listed": a hidden state carried to the next batch
with its graph (backward through a freed graph), a length of 0 given to
pack_padded_sequence, and a perplexity math.exp(loss) that overflowed a Python float."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import nanwatch
from nanwatch.postmortem import classify
from nanwatch.report import Report


def _report(tmp_path: Path) -> Report:
    (path,) = sorted(tmp_path.glob("*.json"))
    return Report.load(path)


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.rnn = nn.GRU(6, 6, batch_first=True)
        self.out = nn.Linear(6, 10)

    def forward(
        self, x: torch.Tensor, h: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = self.rnn(self.emb(x), h)
        return self.out(y), h


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_hidden_state_not_detached_is_named_and_the_error_unchanged(
    tmp_path: Path, mode: str
) -> None:
    torch.manual_seed(0)
    m = _LM()
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    h = None
    with (
        pytest.raises(RuntimeError, match="backward through the graph a second time"),
        nanwatch.watch(m, crit, mode=mode, report_dir=str(tmp_path)) as nw,
    ):
        for _ in range(3):
            x = torch.randint(0, 10, (2, 5))
            logits, h = m(x, h)  # truncated BPTT without hidden = hidden.detach()
            loss = crit(logits.reshape(-1, 10), x.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    report = _report(tmp_path)
    assert report.error is not None and report.error["class"] == "graph-freed"
    assert report.headline.startswith("RuntimeError (backward through a freed graph)")
    advice = report.error["advice"]
    assert "hidden = hidden.detach()" in advice
    assert advice.index("detach") < advice.index("retain_graph=True"), "detach first"
    assert "not the fix" in advice


def test_the_advice_for_a_detached_hidden_state_works() -> None:
    torch.manual_seed(0)
    m = _LM()
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    h = None
    with nanwatch.watch(m, crit) as nw:
        for _ in range(3):
            x = torch.randint(0, 10, (2, 5))
            logits, h = m(x, h)
            h = h.detach()  # the advice
            loss = crit(logits.reshape(-1, 10), x.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert not nw.report.diagnoses


def test_a_length_of_zero_in_packing(tmp_path: Path) -> None:
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(4, 4, batch_first=True)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            return self.rnn(packed)[1][0]

    m = Tagger()
    with (
        pytest.raises(RuntimeError, match="Length of all samples"),
        nanwatch.watch(m, report_dir=str(tmp_path)),
    ):
        m(torch.randn(3, 5, 4), torch.tensor([5, 0, 3])).sum().backward()
    report = _report(tmp_path)
    assert report.error is not None and report.error["class"] == "packing-length"
    assert "a length of 0" in report.error["advice"]
    assert "lengths.clamp_min(1)" in report.error["advice"]


def test_perplexity_overflow_names_the_float64_limit() -> None:
    loss = 2 * math.log(torch.finfo(torch.float64).max)
    with pytest.raises(OverflowError) as info:
        math.exp(loss)
    out = classify(info.value)
    assert out["class"] == "python-overflow"
    limit = f"{math.log(torch.finfo(torch.float64).max):.2f}"
    assert limit in out["advice"], "the largest x math.exp takes"
    assert "math.exp(min(loss, 700))" in out["advice"]
    assert math.isfinite(math.exp(min(loss, 700)))


def test_unrelated_errors_keep_their_classes() -> None:
    assert classify(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))["class"] == (
        "shape-mismatch"
    )
    assert classify(OverflowError("int too large to convert to float"))["class"] == "other"


class EarlyStop(Exception):
    """A control-flow exception of the training script."""


def test_an_exception_class_of_the_users_code_is_not_called_a_crash(tmp_path: Path) -> None:
    m = nn.Linear(4, 1)
    with (
        pytest.raises(EarlyStop),
        nanwatch.watch(m, report_dir=str(tmp_path)) as nw,
    ):
        for i in range(3):
            m(torch.randn(2, 4)).pow(2).mean().backward()
            nw.step()
            if i == 1:
                raise EarlyStop("patience")
    report = _report(tmp_path)
    assert report.error is not None and report.error["class"] == "user-raised"
    assert report.headline.startswith("EarlyStop (raised by your code)")
    assert "nothing here needs fixing" in report.error["advice"]
    # Python's and torch's own errors keep their classes
    assert classify(ValueError("bad value"))["class"] == "other"
    assert classify(RuntimeError("boom"))["class"] == "other"


class _Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)  # the data is grayscale: 1 channel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean()


@pytest.mark.parametrize(
    ("model", "x", "said"),
    [
        (
            lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(6, 1)),
            torch.randn(2, 4),
            "2 (Linear) was built for in_features 6, but its input (shape [2, 8], the output "
            "of 1 (ReLU)) has 8: build it as nn.Linear(8, 1) where the model creates 2",
        ),
        (
            _Convs,
            torch.randn(2, 1, 8, 8),
            "conv (Conv2d) was built for in_channels 3, but its input (shape [2, 1, 8, 8]) has "
            "1: build it as nn.Conv2d(1, 8, kernel_size=(3, 3))",
        ),
        (  # a norm is watched from its forward hook alone: read from the traceback
            lambda: nn.Sequential(nn.Linear(4, 12), nn.LayerNorm(16)),
            torch.randn(2, 4),
            "1 (LayerNorm) was built for normalized_shape 16, but its input (shape [2, 12]) "
            "has 12: build it as nn.LayerNorm(12)",
        ),
    ],
)
@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_layer_built_for_another_size_is_named_with_both_sizes(  # type: ignore[no-untyped-def]
    tmp_path: Path, model, x, said, mode: str
) -> None:
    m = model()
    with pytest.raises(RuntimeError), nanwatch.watch(m, mode=mode, report_dir=str(tmp_path)):
        m(x)
    if mode == "sentinel":  # only the root's call is recorded: no producer is named
        said = said.replace(", the output of 1 (ReLU))", ")")
    report = _report(tmp_path)
    assert report.error is not None and report.error["class"] == "shape-mismatch"
    assert said in report.error["advice"]


def test_a_shape_error_elsewhere_keeps_the_general_advice(tmp_path: Path) -> None:
    m = nn.Linear(4, 3)
    with pytest.raises(RuntimeError), nanwatch.watch(m, report_dir=str(tmp_path)):
        m(torch.randn(2, 4)) @ torch.randn(4, 2)  # the user's own matmul, no layer's input
    report = _report(tmp_path)
    assert report.error is not None and report.error["class"] == "shape-mismatch"
    assert report.error["advice"].startswith("Two tensors' shapes do not fit.")


def test_the_sizes_each_layer_fixes() -> None:
    # norms are watched from their forward hook alone (no call is open when they raise):
    # the sizes are still told apart, for a layer whose call is recorded
    from nanwatch.watcher import _size_mismatch

    assert _size_mismatch(nn.LayerNorm(16), (2, 5, 12)) == (
        "normalized_shape",
        16,
        12,
        "nn.LayerNorm(12)",
    )
    assert _size_mismatch(nn.BatchNorm1d(8), (4, 6)) == ("num_features", 8, 6, "nn.BatchNorm1d(6)")
    assert _size_mismatch(nn.Linear(6, 1, bias=False), (3, 4))[3] == "nn.Linear(4, 1, bias=False)"
    assert _size_mismatch(nn.Conv1d(2, 4, 5), (3, 10)) == (
        "in_channels",
        2,
        3,
        "nn.Conv1d(3, 4, kernel_size=(5,))",
    )
    assert _size_mismatch(nn.Linear(6, 1), (2, 6)) is None
    assert _size_mismatch(nn.ReLU(), (2, 6)) is None
