"""Localization fixes found by user testing: a watched output passed on through
``.detach()`` is that output, not data."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.ops import OpChecker
from nanwatch.records import Phase
from tests._diagnoses import text

torch.set_num_threads(1)


# ------------------------------ 1: a generator's output detached for the discriminator


def test_a_detached_output_is_linked_to_its_module_not_blamed_on_the_batch() -> None:
    torch.manual_seed(0)
    g, d = nn.Linear(4, 8), nn.Linear(8, 1)
    with torch.no_grad():
        g.weight.fill_(1e36)  # a generator whose weights blew up
        d.weight.fill_(100.0)
    z = torch.rand(2, 4) + 0.5
    err = None
    try:
        with nanwatch.watch(g, d) as nw:
            fake = g(z)
            d(fake.detach()).sum().backward()
    except nanwatch.AnomalyError as e:
        err = e
    assert err is not None
    t = nw.history[-1]
    g_out, d_in = t.records[1], t.records[2]  # g: input, output; d: input, output
    assert (g_out.phase, d_in.phase) == (Phase.FORWARD, Phase.INPUT)
    assert d_in.source == g_out.index  # d's input is g's output, not the batch
    nw101 = [x for x in err.diagnoses if x.code == "NW101"]
    assert nw101
    words = text(nw101[0])
    assert "the batch did it" not in words
    assert "corrupt sample" not in words


# ------------------------------ 2: the op's line, once a replay found it, is not "not known"


def test_the_summary_drops_the_line_is_not_known_clause_once_a_replay_names_the_line() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    with torch.no_grad():
        m.weight.mul_(1000.0)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def step() -> None:
        p = (m(x) * 50.0).softmax(-1)
        loss = -(torch.log(p).gather(1, y[:, None])).mean()  # log(0): -inf
        loss.backward()

    nw = nanwatch.watch(m, on_anomaly="warn")
    with pytest.warns(RuntimeWarning, match="op's line is not known"), nw:
        step()
    assert nw.first_anomaly is not None
    nw.replay(step)
    summary = nw.first_anomaly.summary
    line = step.__code__.co_firstlineno + 2
    assert f"op aten.log.default at {__file__}:{line}" in summary
    assert "not known" not in summary
    assert "nw.replay(step_fn) names it" not in summary


# ------------------------------ 3: the count of modules that passed it on, said once final


def _nan_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(8, 8)
    x[3, 5] = float("nan")  # a corrupt row
    return m, x, torch.randint(0, 3, (8,))


@pytest.mark.landed_only(
    reason="the warning is said mid-step by the read as backward begins; GPU-bound it is said "
    "at the step end, where the count it quotes is final"
)
def test_a_warning_said_mid_step_quotes_no_count_the_step_end_changes() -> None:
    m, x, y = _nan_batch()
    nw = nanwatch.watch(m, on_anomaly="warn")
    with pytest.warns(RuntimeWarning, match="NaN in the input data") as got, nw:
        nn.functional.cross_entropy(m(x), y).backward()
    said = "\n".join(str(w.message) for w in got if "nanwatch: step 0" in str(w.message))
    assert nw.first_anomaly is not None
    assert "passed on by 3 modules" in nw.first_anomaly.summary  # Linear, ReLU, Linear
    assert "passed on by" not in said  # not "1 module": the others came after the warning


def test_check_counts_the_modules_reached_since_the_anomaly_was_found() -> None:
    m, x, y = _nan_batch()
    with nanwatch.watch(m, on_anomaly="record") as nw:
        nn.functional.cross_entropy(m(x), y).backward()
        found = nw.check()  # what a framework callback quotes before the optimizer step
        assert found is not None
        said = found.summary
    assert "passed on by 3 modules" in said
    assert nw.first_anomaly is not None and nw.first_anomaly.summary == said


# ------------------------------ 4: a weight returned as an output is not a module output


class _Reach(nn.Module):
    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(p[:, 0] ** 2 + p[:, 1] ** 2)[:, None]  # at the origin: inf gradient


class _Waypoints(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        pts = torch.rand(4, 2) + 0.5
        pts[1] = 0.0  # a waypoint at the origin
        self.wp = nn.Parameter(pts)
        self.net = nn.Sequential(_Reach(), nn.Linear(1, 2))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(self.wp), self.wp


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_weight_returned_as_an_output_is_not_blamed_on_the_loss_code(mode: str) -> None:
    torch.manual_seed(0)
    m = _Waypoints()
    with nanwatch.watch(m, mode=mode, on_anomaly="record") as nw:  # type: ignore[arg-type]
        q, wp = m()
        ((q - wp) ** 2).sum().backward()
    a = nw.first_anomaly
    assert a is not None
    assert a.origin != "after-output"
    assert "outside the watched modules" not in a.summary
    assert "loss code" not in a.summary
    if mode == "watch":  # the sqrt inside the module is named
        assert "aten.sqrt" in a.summary and "backward of net" in a.summary


# ------------------------------ 5: an inf a backward formula masks itself is no birth


def test_an_inf_masked_inside_a_backward_formula_is_not_an_event() -> None:
    x = torch.zeros(3, requires_grad=True)
    y = torch.zeros(3, requires_grad=True)
    with OpChecker() as chk:  # atan2(0, 0): its backward's 1 / (x² + y²) is inf, masked to 0
        torch.atan2(y, x).sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    assert chk.events == []
    r = torch.zeros(3, requires_grad=True)
    with OpChecker() as chk:  # sqrt(0): the inf its backward makes is the gradient
        torch.sqrt(r).sum().backward()
    assert [e.born for e in chk.events] == ["+inf"]


class _Polar(nn.Module):
    def forward(self, p: torch.Tensor) -> torch.Tensor:
        x, y = p[:, 0], p[:, 1]
        r = torch.sqrt(x**2 + y**2)  # at the origin: an inf gradient
        phi = torch.atan2(y, x)  # at the origin: gradient 0 (PyTorch masks its 1 / r²)
        return torch.stack([r, torch.cos(phi), torch.sin(phi)], -1)


def test_forensic_names_the_sqrt_not_the_reciprocal_atan2_masks() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(_Polar(), nn.Linear(3, 2))
    p = torch.rand(4, 2) + 0.5
    p[1] = 0.0
    p.requires_grad_(True)
    with nanwatch.watch(m, mode="forensic", on_anomaly="record") as nw:
        m(p).sum().backward()
    a = nw.first_anomaly
    assert a is not None and a.op is not None
    op = a.op.chain()[0]
    assert "reciprocal" not in op.op
    assert op.node == "SqrtBackward0"
    line = _Polar.forward.__code__.co_firstlineno + 2
    assert op.source is not None and op.source.endswith(f":{line}")
