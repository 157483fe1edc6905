"""Localization of a bad gradient at a module's input whose tensor other code used too: the
gradient recorded there sums every use (a leaf image a total-variation term reads beside a
frozen network, a distance the parent's own code differentiates twice in force matching),
so the code that made it is named, not the module that took the tensor; and a recurrent
module fed its own state back is worded as such."""

from __future__ import annotations

import torch
from torch import nn

import nanwatch
from nanwatch.records import LOSS_PATH, AnomalyKind, StepTrace

torch.set_num_threads(1)


def _bad(nw: nanwatch.Watcher) -> StepTrace:
    return next(t for t in nw.history if t.anomaly is not None)


# ------------------------------ 1: a TV term on the optimized image, beside a frozen net


def _tv_step(mode: str, eps: float = 0.0) -> tuple[StepTrace | None, nanwatch.Watcher]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
    for p in net.parameters():
        p.requires_grad_(False)
    img = torch.rand(1, 3, 8, 8)
    img[:, :, :4] = 0.5  # a flat region: dx = dy = 0
    img.requires_grad_(True)

    def tv(x: torch.Tensor) -> torch.Tensor:
        dx = x[:, :, :-1, 1:] - x[:, :, :-1, :-1]
        dy = x[:, :, 1:, :-1] - x[:, :, :-1, :-1]
        return torch.sqrt(dx**2 + dy**2 + eps).mean()

    with nanwatch.watch(net, mode=mode, on_anomaly="record") as nw:  # type: ignore[arg-type]
        (net(img).pow(2).mean() + tv(img)).backward()
        nw.step()
    bad = [t for t in nw.history if t.anomaly is not None]
    return (bad[0] if bad else None), nw


def test_a_tv_loss_on_the_leaf_input_is_named_not_the_frozen_net() -> None:
    for mode in ("watch", "forensic"):
        trace, _ = _tv_step(mode)
        assert trace is not None
        a = trace.anomaly
        assert a is not None and a.kind is AnomalyKind.BACKWARD
        assert (a.path, a.origin, a.consumer) == (LOSS_PATH, "between-roots", "Sequential")
        assert "born in the backward of code outside the watched modules" in a.summary
        assert "sums every use of that tensor" in a.summary
        assert "born in the backward of Sequential:" not in a.summary
        assert a.op is not None and a.op.path == LOSS_PATH
        assert [d.code for d in trace.diagnoses][:1] == ["NW112"]
    fixed, _ = _tv_step("watch", eps=1e-12)  # eps inside the sqrt: clean
    assert fixed is None


def test_sentinel_does_not_claim_the_frozen_net_made_it() -> None:
    trace, _ = _tv_step("sentinel")
    assert trace is not None and trace.anomaly is not None
    s = trace.anomaly.summary
    assert "the gradient it sent back to" not in s
    assert "or of code outside it that used Sequential's input[0] too" in s
    assert "sums every use of that tensor" in s


# ------------------------------ 2: force matching, the parent's norm differentiated twice


class _RBF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mu", torch.linspace(0, 3, 8))

    def forward(self, d: torch.Tensor) -> torch.Tensor:
        return torch.exp(-((d[:, None] - self.mu) ** 2))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rbf = _RBF()
        self.head = nn.Linear(8, 1)

    def forward(self, pos: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        d = (pos[i] - pos[j]).norm(dim=-1)  # a self pair: d = 0
        return self.head(self.rbf(d)).sum()


def _force_step(mode: str) -> StepTrace:
    torch.manual_seed(0)
    net = _Net()
    i, j = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1])
    with nanwatch.watch(net, mode=mode, on_anomaly="record") as nw:  # type: ignore[arg-type]
        pos = torch.randn(2, 3).requires_grad_(True)
        e = net(pos, i, j)
        f = -torch.autograd.grad(e, pos, create_graph=True)[0]
        (e**2 + (f**2).mean()).backward()
        nw.step()
    return _bad(nw)


def test_the_double_backward_of_the_parents_norm_is_not_blamed_on_the_rbf() -> None:
    for mode in ("watch", "forensic"):
        a = _force_step(mode).anomaly
        assert a is not None and a.kind is AnomalyKind.BACKWARD
        assert a.record.path == "rbf" and a.record.role == "input[0]"
        assert a.path == "_Net", (mode, a.summary)
        assert a.consumer == "rbf"
        assert "born in the backward of rbf:" not in a.summary
        assert "sums every use of that tensor" in a.summary
    a = _force_step("watch").anomaly
    assert a is not None
    assert "double backward of _Net's code" in a.summary
    assert "_Net's LinalgVectorNorm made it" in a.summary


# ------------------------------ 4: a recurrent module given its own state back


class _Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(u)
        return (u > 0).float()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        (u,) = ctx.saved_tensors
        e = torch.exp(-25.0 * u)
        return g * 25.0 * e / (1 + e) ** 2  # inf / inf far below threshold


class _Lif(nn.Module):
    def forward(self, cur: torch.Tensor, mem: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mem = 0.9 * mem + cur
        spk = _Spike.apply(mem - 1.0)
        return spk, mem - spk


class _Snn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.lif = _Lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mem = torch.zeros(x.shape[0], 3)
        out = torch.zeros(x.shape[0], 3)
        for t in range(x.shape[1]):
            s, mem = self.lif(self.fc(x[:, t]), mem)
            out = out + s
        return out


def test_a_module_fed_its_own_state_back_is_worded_so() -> None:
    torch.manual_seed(0)
    m = _Snn()
    with torch.no_grad():
        m.fc.weight.fill_(1.0)
        m.fc.bias.fill_(-10.0)  # deep below threshold: exp(-25 u) overflows
    with nanwatch.watch(m, on_anomaly="record") as nw:
        m(torch.rand(2, 3, 4)).sum().backward()
        nw.step()
    a = _bad(nw).anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD
    assert "custom autograd.Function _Spike in lif" in a.summary
    assert "the gradient sent back to lif's inputs (fc's output, and its own output[1] from " in (
        a.summary
    )
    assert "which lif passed it on to" not in a.summary
