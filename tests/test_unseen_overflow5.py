"""NW101 on an exp summed per segment by index (a graph's per-node softmax by index_add_)
subtracts each segment's own max, not one over the whole dim; the cause it gives an exp
is backed by evidence (a parameter's size alone is none; an exp in a module's forward is
of that module's values and the model's lr); an overflow inside a watched loss module
(torch's GaussianNLLLoss) is mended by calling the loss on float32 inputs, and one in
the loss code by computing it in float32, not by model.float()."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanwatch

pytestmark = pytest.mark.filterwarnings("ignore::nanwatch.NanwatchWarning")


def _code(fix: str) -> list[str]:
    return [line for line in fix.splitlines() if line and not line.startswith("#")]


# ------------------------------------------------------------- a softmax per segment


class _NeighbourSoftmax(nn.Module):
    """A GAT-style attention normalized over each destination node's incoming edges."""

    def __init__(self, stable: bool = False) -> None:
        super().__init__()
        self.stable = stable

    def forward(self, e: torch.Tensor, dst: torch.Tensor, n: int) -> torch.Tensor:
        if self.stable:
            m = torch.full((n,), float("-inf")).scatter_reduce(0, dst, e, "amax")
            w = (e - m[dst]).exp()
        else:
            w = e.exp()
        denom = torch.zeros(n).index_add_(0, dst, w)
        return w / denom[dst]


def _edges() -> tuple[torch.Tensor, torch.Tensor]:
    dst = torch.tensor([0, 0, 1, 1, 2, 2])
    e = torch.tensor([95.0, 90.0, -30.0, -20.0, 1.0, 2.0], requires_grad=True)
    return e, dst


def test_segment_softmax_fix_subtracts_each_segments_max_and_runs() -> None:
    torch.set_num_threads(1)
    e, dst = _edges()
    m = _NeighbourSoftmax()
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(m, postmortem=False):
        m(e, dst, 3).sum().backward()
    d = info.value.diagnosis
    assert d.code == "NW101" and d.op is not None and "exp" in d.op
    assert any("w = e.exp()" in x for x in d.evidence)
    lines = _code(d.fix)
    assert lines[0].startswith("m = torch.full((n,), float('-inf')).scatter_reduce(0, dst, e,")
    assert lines[1].startswith("w = (e - m[dst]).exp()")
    assert "amax(dim=-1" not in lines[0] + lines[1] and "torch.softmax(x, dim=-1)" not in d.fix
    assert any("index_add_(0, dst, w)" in x for x in d.evidence)
    # pasted, it gives each node's softmax, finite, where the whole-graph max made 0/0
    ns = {"torch": torch, "e": e.detach(), "dst": dst, "n": 3}
    exec("\n".join(x.split("  #")[0] for x in lines[:2]), ns)
    w = ns["w"]
    probs = w / torch.zeros(3).index_add_(0, dst, w)[dst]
    assert torch.isfinite(probs).all()
    assert torch.allclose(torch.zeros(3).index_add_(0, dst, probs), torch.ones(3))


def test_segment_softmax_stable_twin_is_silent() -> None:
    torch.set_num_threads(1)
    e, dst = _edges()
    m = _NeighbourSoftmax(stable=True)
    with nanwatch.watch(m, postmortem=False) as nw:
        m(e, dst, 3).sum().backward()
    assert not nw.report.diagnoses


class _DenseSoftmax(nn.Module):
    def forward(self, s: torch.Tensor) -> torch.Tensor:
        w = s.exp()
        return w / w.sum(-1, keepdim=True)


def test_dense_softmax_keeps_the_row_max_fix() -> None:
    torch.set_num_threads(1)
    s = torch.tensor([[95.0, 1.0], [0.0, 1.0]], requires_grad=True)
    m = _DenseSoftmax()
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(m, postmortem=False):
        m(s).sum().backward()
    d = info.value.diagnosis
    assert d.code == "NW101"
    assert _code(d.fix)[0].startswith("w = (s - s.amax(dim=-1, keepdim=True)).exp()")
    assert "scatter_reduce" not in d.fix


# ------------------------------------------------------------- what the exp's cause is


def test_loss_code_exp_is_not_blamed_on_a_parameter_of_the_same_size() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    log_table = torch.tensor([-200.0, -2.3, -1.6, -1.2])  # a constant table, finite
    model = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(model, postmortem=False) as nw,
    ):
        for step in range(3):
            x = torch.randn(64, 16)  # the exp's 64 x 16 values: 0.weight's size
            t = torch.randint(1, 4, (64,))
            t[0] = 0 if step == 1 else 1
            _, v = model(x).chunk(2, -1)
            frac = torch.sigmoid(v)
            logvar = (1 - frac) * log_table[t][:, None]
            loss = (x**2 * torch.exp(-logvar)).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = info.value.diagnosis
    assert d.code == "NW101"
    text = "\n".join(d.evidence)
    assert "0.weight" not in text and "drifted" not in text
    assert "not known" in text


class _Coupling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)
        nn.init.zeros_(self.net.weight)
        nn.init.zeros_(self.net.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.net(x)
        return x * torch.exp(s)


@pytest.mark.cpu_path(reason="a raise inside the forward, before the root's output exists")
def test_exp_in_a_modules_forward_names_its_child_and_the_models_lr() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    flow = nn.Sequential(_Coupling())
    opt = torch.optim.Adam(flow.parameters(), lr=1e-2)
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(flow, postmortem=False) as nw,
    ):
        for _ in range(40):
            with torch.no_grad():
                flow[0].net.bias += 4.0  # s drifts up
            loss = torch.tanh(flow(torch.randn(32, 4))).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = info.value.diagnosis
    assert d.code == "NW101" and d.path == "0"
    text = "\n".join(d.evidence)
    assert "no watched parameter or output" not in text and "not known" not in text
    assert "computed in 0's forward from the output of its child 0.net" in text
    assert "Adam lr 0.01" in text


# ------------------------------------------------------------- float16 in loss code


def _gnll(fp32: bool) -> tuple[nn.Module, nanwatch.AnomalyError | None]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Linear(6, 2).half()
    crit = nn.GaussianNLLLoss()
    x = torch.randn(32, 6).half()
    y = (250 + 60 * torch.randn(32, 1)).half()
    try:
        with nanwatch.watch(net, crit, postmortem=False) as nw:
            out = net(x)
            mu, var = out[:, :1], out[:, 1:].exp()
            if fp32:
                mu, y, var = mu.float(), y.float(), var.float()
            loss = crit(mu, y, var)
            loss.backward()
            nw.step()
    except nanwatch.AnomalyError as e:
        return crit, e
    return crit, None


def test_overflow_inside_a_torch_loss_module_calls_it_on_float32_inputs() -> None:
    crit, err = _gnll(False)
    assert err is not None
    d = err.diagnosis
    assert d.code == "NW101" and d.path == "GaussianNLLLoss"
    first = _code(d.fix)[0]
    assert first.startswith(
        "loss = crit(mu.float(), y.float(), var.float())  # was: loss = crit(mu, y, var)"
    )
    assert "model's forward" not in d.fix and "model.float()" not in d.fix
    assert "GaussianNLLLoss" in d.fix
    torch.manual_seed(0)
    net = nn.Linear(6, 2).half()
    x = torch.randn(32, 6).half()
    y = (250 + 60 * torch.randn(32, 1)).half()
    out = net(x)
    ns = {"crit": crit, "mu": out[:, :1], "var": out[:, 1:].exp(), "y": y}
    exec(first.split("  #")[0], ns)
    assert math.isfinite(ns["loss"].item())


def test_torch_loss_module_on_float32_inputs_is_silent() -> None:
    _, err = _gnll(True)
    assert err is None


def _fp16_sum(healthy: bool) -> nanwatch.AnomalyError | None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(256, 256).half()
    x = (torch.randn(64, 256) * 8).half()
    try:
        with nanwatch.watch(model, postmortem=False) as nw:
            z = model(x)
            zz = z.float() if healthy else z
            loss = (0.5 * zz**2 + 0.92).sum() / z.numel()
            loss.backward()
            nw.step()
    except nanwatch.AnomalyError as e:
        return e
    return None


def test_float16_overflow_in_loss_code_is_computed_in_float32_there() -> None:
    err = _fp16_sum(False)
    assert err is not None
    d = err.diagnosis
    assert d.code == "NW101" and d.path == "(loss)"
    assert "model.float()" not in d.fix
    assert d.fix.startswith("# in the loss code, compute the expression that overflowed in float32")
    assert "before the arithmetic and the reduction" in d.fix


def test_float16_loss_code_computed_in_float32_is_silent() -> None:
    assert _fp16_sum(True) is None
