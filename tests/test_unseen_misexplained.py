"""Faults the last hunt found told as something else: a complex log of 0 in watch mode
told as infinities from untraced code, a NaN the user's own code computed in a step the
user marked told as an adversarial attack's, and a zero divisor that is an entry of a
ParameterList or ParameterDict left unnamed. Tiny real models on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import OpEvent

from ._diagnoses import code_lines, text, top


# ---------------------------------------------------------------- complex log of 0
class _Spectrum(nn.Module):
    """An rfft of a zero signal: every bin is a complex 0, and its log is -inf + 0j."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.h = nn.Linear(10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.fft.rfft(self.l(x))
        lz = torch.log(z)
        return self.h(torch.view_as_real(lz).flatten(1))


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_complex_log_of_zero_is_named_in_every_mode(mode: str) -> None:
    """Watch mode said NW100 at h, "the infinities came from code nanwatch did not trace":
    complex tensors are measured by |z|, so the log's event holds +inf, and only a -inf
    was looked for where the -inf that reached h was made."""
    torch.manual_seed(0)
    model = _Spectrum()
    with torch.no_grad():
        model.l.weight.zero_()
        model.l.bias.zero_()
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(4, 8)).mean().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW110", text(d)
    assert d.op == "aten.log"
    assert "lz = torch.log(z)" in text(d)
    assert "did not trace" not in text(d)


# ---------------------------------------------------------------- NaN in user-marked steps
class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 8)
        self.h = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x, h0)
        return self.h(out[-1])


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_nan_computed_in_a_step_the_user_marked_is_not_an_attack(mode: str) -> None:
    """No optimizer, nw.step() after each step, an h0 the user's code computed as 0/0 in
    the second: the step boundary is the user's, so the earlier call of the model was the
    step before, not the clean input of an attack within this step."""
    torch.manual_seed(0)
    model = _Recurrent()
    x, h = torch.randn(5, 2, 4), torch.zeros(1, 2, 8)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for i in range(2):
            h0 = h / torch.zeros(1) if i == 1 else h
            model(x, h0).mean().backward()
            model.zero_grad()
            nw.step()
    d = top(nw)
    assert d.code == "NW401", text(d)
    assert d.step == 1
    assert "between two calls" not in d.title
    assert "adversarial" not in text(d)
    assert "your code that ran on it before the call made it" in text(d)


def test_an_attack_in_an_automatic_step_is_still_told_as_one() -> None:
    """Without nw.step() the automatic step rule ends a step at the attack's backward():
    the input computed after it is still told as the attack's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        x_adv = x.clone().requires_grad_(True)
        torch.nn.functional.cross_entropy(model(x_adv), y).backward()
        g = torch.zeros_like(x)  # an input gradient of 0: its norm is 0
        model.zero_grad()
        model(x + 0.1 * g / g.norm(dim=1, keepdim=True))
    d = top(nw)
    assert d.code == "NW401", text(d)
    assert "between two calls" in d.title


# ---------------------------------------------------------------- a zero parameter divisor
class _Heads(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 2)})
        self.kind = kind
        if kind == "list":
            self.scales: nn.Module = nn.ParameterList(
                [nn.Parameter(torch.ones(2)) for _ in range(2)]
            )
        else:
            self.scales = nn.ParameterDict(
                {"a": nn.Parameter(torch.ones(2)), "b": nn.Parameter(torch.ones(2))}
            )

    def scale(self, key: str) -> nn.Parameter:
        s = self.scales
        if isinstance(s, nn.ParameterList):
            return s[0 if key == "a" else 1]
        assert isinstance(s, nn.ParameterDict)
        return s[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ya = self.heads["a"](x) * self.scale("a")
        yb = self.heads["b"](x) / self.scale("b")
        return ya + yb


@pytest.mark.parametrize(
    ("kind", "qual", "owner", "access"),
    [
        ("list", "scales.1", "ParameterList", "model.scales[1]"),
        ("dict", "scales.b", "ParameterDict", 'model.scales["b"]'),
    ],
)
@pytest.mark.parametrize("mode", ["watch", "sentinel", "forensic"])
def test_a_zero_divisor_held_in_a_parameter_container_is_named(
    mode: str, kind: str, qual: str, owner: str, access: str
) -> None:
    """NW111 showed the line but not which parameter held the 0: the op's input is known
    by identity as the watched parameter, and the fix acts on it."""
    torch.manual_seed(0)
    model = _Heads(kind)
    with torch.no_grad():
        model.scale("b").zero_()
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(4, 4)).mean().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW111", text(d)
    assert f"the denominator is the parameter {qual} ({owner}), which holds 0" in d.evidence[0]
    assert qual in d.title
    pasted = code_lines(d.fix)
    assert f"{access}.fill_(1.0)" in pasted
    assert ".detach()" in pasted  # a floor that keeps the parameter's gradient


def test_an_op_event_keeps_the_parameters_it_read_through_json() -> None:
    ev = OpEvent(
        op="aten.div.Tensor",
        phase=nanwatch.Phase.FORWARD,
        path="",
        born="+inf",
        output=nanwatch.TensorStat(float("-inf"), float("inf"), 8),
        params=[("other", "scales.1", "ParameterList")],
    )
    assert OpEvent.from_dict(ev.to_dict()).params == [("other", "scales.1", "ParameterList")]
