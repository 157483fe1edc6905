"""Autograd's "modified by an inplace operation" error names an autograd node
(``SigmoidBackward0``), a shape and two version numbers: NW403 runs the model's forward once
more under a TorchFunctionMode and names the user's line that made the tensor and the line
(or the library module) that then wrote it in place, with that line made out of place."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch._inplace import bare, rewrite

HERE = os.path.basename(__file__)
MODES = ["sentinel", "watch"]


def _line(fn: Callable[..., Any], marker: str) -> str:
    """``test_inplace_lines.py:N`` of the line of ``fn`` that holds ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{HERE}:{start + offset}"


def _diagnose(model: nn.Module, mode: str, loss_of: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    nw = nanwatch.watch(model, mode=mode, postmortem=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"), nw:
        loss_of(model(x)).backward()
    return next(d for d in nw.report.diagnoses if d.code == "NW403")


class ExpClamped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(self.fc(x))  # made
        e.clamp_(max=10.0)  # written
        return self.out(e)


class TanhMasked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))  # made
        h[h < 0] = 0  # written
        return self.out(h)


class Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).sigmoid()  # made
        h += 1  # written
        return self.out(h)


class FunctionalRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.fc(x))
        h = F.relu(h, inplace=True)  # written
        return self.out(h)


class LibraryRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 8), nn.Sigmoid(), nn.ReLU(inplace=True), nn.Linear(8, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TwoSigmoids(nn.Module):
    """Two tensors of the same node and shape: only the second is written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.drop(torch.sigmoid(self.fc(x)))
        b = torch.sigmoid(self.fc(x))  # made
        b.mul_(2)  # written
        return self.out(a) + self.out(b)


def _sum(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


@pytest.mark.parametrize("mode", MODES)
def test_the_method_written_in_place_is_named_and_made_out_of_place(mode: str) -> None:
    d = _diagnose(ExpClamped(), mode, _sum)
    written = _line(ExpClamped.forward, "# written")
    made = _line(ExpClamped.forward, "# made")
    assert d.source is not None and d.source.endswith(written)
    text = " | ".join(d.evidence)
    assert "`e = torch.exp(self.fc(x))`" in text and made in text
    assert "`e.clamp_(max=10.0)`" in text and written in text and "(clamp_)" in text
    assert d.fix.startswith("e = e.clamp(max=10.0)   # ")
    assert "set_detect_anomaly" not in text  # the lines are known: no advice to find them


@pytest.mark.parametrize("mode", MODES)
def test_a_boolean_mask_assignment_becomes_masked_fill(mode: str) -> None:
    d = _diagnose(TanhMasked(), mode, _sum)
    assert d.source is not None and d.source.endswith(_line(TanhMasked.forward, "# written"))
    assert d.fix.startswith("h = h.masked_fill(h < 0, 0)   # ")
    assert "instead of h[h < 0] = 0" in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_an_augmented_assignment_becomes_a_plain_one(mode: str) -> None:
    d = _diagnose(Shifted(), mode, _sum)
    assert d.fix.startswith("h = h + 1   # ") and "instead of h += 1" in d.fix
    assert "# written" not in d.fix  # the line's own comment is left out


def test_a_functional_inplace_true_becomes_false() -> None:
    d = _diagnose(FunctionalRelu(), "sentinel", _sum)
    assert d.fix.startswith("h = F.relu(h, inplace=False)   # ")


@pytest.mark.parametrize("mode", MODES)
def test_a_library_module_built_inplace_is_named_by_its_path(mode: str) -> None:
    d = _diagnose(LibraryRelu(), mode, _sum)
    text = " | ".join(d.evidence)
    assert "net.1 (Sigmoid) made it with sigmoid" in text
    assert "net.2 (ReLU, inplace=True) then wrote it in place" in text
    assert d.fix.startswith("nn.ReLU(inplace=False)   # net.2")


@pytest.mark.parametrize("mode", MODES)
def test_the_write_at_the_saved_version_is_told_among_tensors_of_one_node(mode: str) -> None:
    d = _diagnose(TwoSigmoids(), mode, _sum)
    assert d.source is not None and d.source.endswith(_line(TwoSigmoids.forward, "# written"))
    assert d.fix.startswith("b = b.mul(2)   # ")
    assert "1 more tensors of that node and shape were made" in " | ".join(d.evidence)


def test_a_write_after_the_forward_names_the_line_that_made_the_tensor() -> None:
    class Exp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.exp(self.fc(x))  # made

    def loss_of(y: torch.Tensor) -> torch.Tensor:
        y[:, 0] = 0  # the loss code writes the model's output
        return y.sum()

    d = _diagnose(Exp(), "sentinel", loss_of)
    text = " | ".join(d.evidence)
    assert "`return torch.exp(self.fc(x))`" in text
    assert "nothing in the forward wrote it in place" in text
    assert d.fix.startswith("# the tensor: `return torch.exp(self.fc(x))`")


def test_the_replay_leaves_the_models_state_and_the_users_error_as_they_were() -> None:
    class Counting(ExpClamped):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return super().forward(x)

    m = Counting()
    nw = nanwatch.watch(m, mode="sentinel", postmortem=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info, nw:
        m(torch.randn(4, 8)).sum().backward()
    assert isinstance(info.value, RuntimeError)
    assert float(m.calls) == 1.0  # the replay's own call was undone
    assert any(d.code == "NW403" and d.source for d in nw.report.diagnoses)


def test_rewrite_and_bare() -> None:
    assert bare("h += 1   # shift") == "h += 1"
    assert bare('s = "#"') == 's = "#"'
    assert rewrite("x.add_(y)") == "x = x.add(y)"
    assert rewrite("self.h *= 2") == "self.h = self.h * 2"
    assert rewrite("h[i] = 0") == "h = h.clone(); h[i] = 0"
    assert rewrite("h[m] = 0", mask=True) == "h = h.masked_fill(m, 0)"
    assert rewrite("y = f(x)") is None
    assert rewrite(None) is None
