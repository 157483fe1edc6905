"""Found by user testing: a LayerNorm / GroupNorm with eps=0 on a constant row is a 0 / 0
(NW111 with the eps fix in the user's constructor), not an overflow; NW303 writes a huge
gradient ratio with an exponent, not as a 30-digit integer; F.kl_div given probabilities as
input and log-probabilities as target gets the two swapped; and a warning torch raises
inside a guarded functional (F.mse_loss's broadcast warning) names the user's line, not
nanwatch's wrapper.

Each runs a tiny real model under ``nanwatch.watch`` on CPU, or a rule on built records."""

from __future__ import annotations

import re
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from tests._diagnoses import text, top

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reports(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)


# ------------------------------------- 1: a normalization with eps=0 on a constant row


def _constant_rows(model: nn.Module, x: torch.Tensor) -> nanwatch.Watcher:
    """One step whose first layer makes every row constant (zero weight, bias 0.3)."""
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(0.3)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model) as nw:
        model(x).sum().backward()
        nw.step()
    return nw


def test_layernorm_eps0_on_a_constant_row_is_a_division_by_zero_not_an_overflow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16, eps=0.0), nn.Linear(16, 3))
    d = top(_constant_rows(model, torch.randn(4, 4)))
    assert d.code == "NW111" and d.op == "aten.native_layer_norm"
    t = text(d)
    assert "not an overflow" in t and "eps=0" in t
    assert "lr" not in d.fix and "clip" not in d.fix
    assert d.fix.startswith("nn.LayerNorm(16, eps=1e-5)")


def test_groupnorm_eps0_gets_the_eps_fix_in_its_own_constructor() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.GroupNorm(4, 16, eps=0.0), nn.Linear(16, 3))
    d = top(_constant_rows(model, torch.randn(4, 4)))
    assert d.code == "NW111" and d.op == "aten.native_group_norm"
    assert "groups held equal values" in text(d)
    assert d.fix.startswith("nn.GroupNorm(4, 16, eps=1e-5)")


class _FunctionalNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(self.fc(x), (8,), eps=0.0)


def test_functional_layer_norm_eps0_fix_is_the_users_line() -> None:
    torch.manual_seed(0)
    model = _FunctionalNorm()
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.fill_(0.3)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model) as nw:
        model(torch.randn(2, 4)).sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW111"
    assert "return F.layer_norm(self.fc(x), (8,), eps=1e-5)" in d.fix


def test_layernorm_of_values_whose_square_overflows_stays_nw101() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    with torch.no_grad():
        model[0].weight.fill_(3e19)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model) as nw:
        model(torch.randn(4, 4).abs() + 1).sum().backward()
        nw.step()
    assert top(nw).code == "NW101"


# ------------------------------------- 2: NW303's ratio of a huge gradient


def _step(i: int, grad: float):  # type: ignore[no-untyped-def]
    b = TraceBuilder(i)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0, numel=32), shape=(4, 8))
    fc = b.call("fc", "Linear", parent=net)
    b.input(fc, source=x, shape=(4, 8))
    o = b.forward(fc, stat(-1.0, 1.0, numel=16), shape=(4, 4), grad_fn="AddmmBackward0")
    b.forward(net, source=o, shape=(4, 4), grad_fn="AddmmBackward0")
    b.backward(o, stat(-0.1, 0.1, numel=16))
    b.gradient("fc", "fc.weight", grad)
    return b.build(loss=1.0, grad_norm=grad)


def test_exploding_gradient_ratio_is_written_with_an_exponent() -> None:
    hist = [_step(i, 1.0 + 0.01 * i) for i in range(8)]
    found = [d for d in diagnose(_step(8, 8.8e30), hist) if d.code == "NW303"]
    assert found, "no NW303"
    t = text(found[0])
    assert re.search(r"\de\+\d\d×", t), t
    assert not re.search(r"\d{10,}×", t), t


# ------------------------------------- 3: F.kl_div with input and target swapped


def test_kl_div_swapped_arguments_get_swapped_in_the_fix() -> None:
    torch.manual_seed(0)
    student = nn.Linear(8, 10)
    teacher = nn.Linear(8, 10)
    x, T = torch.randn(4, 8), 4.0
    with pytest.raises(nanwatch.GuardError) as info, nanwatch.watch(student):
        s = student(x)
        with torch.no_grad():
            t = teacher(x)
        F.kl_div(F.softmax(s / T, dim=1), F.log_softmax(t / T, dim=1), reduction="batchmean")
    fix = info.value.diagnosis.fix
    assert (
        'F.kl_div(F.log_softmax(s / T, dim=1), F.softmax(t / T, dim=1), reduction="batchmean")'
        in fix
    ), fix
    assert "swapped" in str(info.value)


def test_kl_div_negative_target_of_log_probabilities_input_keeps_its_softmax_fix() -> None:
    torch.manual_seed(0)
    student = nn.Linear(8, 10)
    x = torch.randn(4, 8)
    target = torch.randn(4, 10)  # not log-probabilities: some values above 0
    with pytest.raises(nanwatch.GuardError) as info, nanwatch.watch(student):
        F.kl_div(F.log_softmax(student(x), dim=1), target, reduction="batchmean")
    assert "target.softmax(-1)" in info.value.diagnosis.fix


# ------------------------------------- 4: torch's warnings inside a guarded functional


def test_torch_warning_inside_a_guarded_functional_names_the_users_line() -> None:
    net = nn.Linear(4, 8)
    with warnings.catch_warnings(record=True) as seen, nanwatch.watch(net):
        warnings.simplefilter("always")
        pred = net(torch.randn(2, 4)).view(2, 4, 2)
        here = sys._getframe().f_lineno + 1
        F.mse_loss(pred, torch.randn(2, 1, 2))
    broadcast = [w for w in seen if "target size" in str(w.message)]
    assert broadcast, [str(w.message) for w in seen]
    assert broadcast[0].filename == __file__ and broadcast[0].lineno == here
    assert broadcast[0].category is UserWarning


def test_error_inside_a_guarded_functional_keeps_a_plain_traceback() -> None:
    net = nn.Linear(4, 8)
    with pytest.raises(RuntimeError) as info, nanwatch.watch(net):
        pred = net(torch.randn(2, 4)).view(2, 4, 2)
        F.mse_loss(pred, torch.randn(2, 17, 2))
    files = [str(e.path) for e in info.traceback]
    assert files.count(__file__) == 1, files  # the user's line once: no frame repeating it
    assert any(f.endswith("functional.py") for f in files)  # torch's own frames kept


def test_kl_div_on_probabilities_note_carries_the_fix_on_the_users_line() -> None:
    torch.manual_seed(0)
    student = nn.Linear(8, 10)
    x, T = torch.randn(4, 8), 2.0
    with nanwatch.watch(student) as nw:
        s = student(x)
        t = torch.randn(4, 10)
        kd = F.kl_div(F.softmax(s / T, dim=1), F.softmax(t / T, dim=1), reduction="batchmean")
        kd.backward()
        nw.step()
    fixes = [n.data.get("probabilities_fix") for t in nw.history for n in t.notes]
    assert any(
        f
        and 'F.kl_div(F.log_softmax(s / T, dim=1), F.softmax(t / T, dim=1), reduction="batchmean")'
        in f
        for f in fixes
    ), fixes
    # NW205 offers that fix, on the user's line, not a template with other names
    (d,) = [d for t in nw.history for d in t.diagnoses if d.code == "NW205"]
    assert d.fix.startswith("kd = F.kl_div(F.log_softmax(s / T, dim=1), F.softmax(t / T, dim=1)")
