"""A -inf that a later op turns into +inf or NaN is traced to where it was born; an op's
own kinds are said when the record holds more; a norm whose output only a functional op
read is named when its statistics overflow."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


class _Coupling(nn.Module):
    """RealNVP's affine coupling, ``z1 = x1 * exp(s) + t``, with an unbounded scale."""

    def __init__(self) -> None:
        super().__init__()
        self.s_net = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0, x1 = x.chunk(2, dim=1)
        z1 = x1 * torch.exp(self.s_net(x0))
        return torch.cat([z1, x0], 1)


class _Next(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s_net = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0, _ = x.chunk(2, dim=1)  # a view: the watcher measures no such input
        return self.s_net(x0)


class _Flow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = _Coupling()
        self.c2 = _Next()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.c1(x))


def _flow() -> _Flow:
    flow = _Flow()
    with torch.no_grad():
        flow.c1.s_net.weight.fill_(0.0)
        flow.c1.s_net.bias.fill_(200.0)  # exp(200) overflows float32: x1 * inf = -inf
        flow.c2.s_net.weight.copy_(torch.tensor([[1.0, -1.0], [-1.0, 1.0]]))
        flow.c2.s_net.bias.fill_(0.0)
    return flow


def _run(model: nn.Module, x: torch.Tensor, **kw: object) -> nanwatch.Watcher:
    with nanwatch.watch(model, on_anomaly="record", postmortem=False, **kw) as nw:  # type: ignore[arg-type]
        model(x).sum().backward()
        nw.step()
    return nw


def test_an_exp_overflow_grown_into_inf_in_the_next_linear_is_born_in_the_coupling() -> None:
    x = torch.tensor([[1.0, 1.0, -1.0, -2.0], [0.5, 0.5, -3.0, -1.0]])  # x1 < 0: -inf
    nw = _run(_flow(), x)
    a = nw.first_anomaly
    assert a is not None
    assert a.neginf_source is not None and a.neginf_source.path == "c1"
    assert a.path == "c1"
    assert a.summary.startswith("-inf born in the forward of c1 (_Coupling)")
    assert "it became" in a.summary and "in c2.s_net (forward, output)" in a.summary
    assert a.op is not None and a.op.chain()[0].op.startswith("aten.exp")
    d = nw.report.diagnoses[0] if nw.report.diagnoses else None
    assert d is not None and d.code == "NW101"


class _Mask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x < 0, float("-inf"))  # a mask, written on purpose


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask = _Mask()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.mask(x))


def test_a_mask_grown_into_inf_in_a_linear_leaves_the_anomaly_on_the_linear() -> None:
    torch.manual_seed(0)
    model = _Masked()
    with torch.no_grad():
        model.fc.weight.copy_(-torch.eye(4))
    nw = _run(model, torch.tensor([[-1.0, 1.0, 2.0, 3.0]]))
    a = nw.first_anomaly
    assert a is not None and a.path == "fc"


class _Gcn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, deg: torch.Tensor) -> torch.Tensor:
        norm = deg.pow(-0.5)  # a degree of 0: +inf
        return self.lin(x) * norm.unsqueeze(-1)  # times negative features: -inf too


class _Enc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = _Gcn()

    def forward(self, x: torch.Tensor, deg: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.c1(x, deg)) - self.c1(x, deg)


def _gcn_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor([[1.0, -1.0, 2.0, -2.0]]).repeat(3, 1)
    return x, torch.tensor([1.0, 0.0, 2.0])  # a node of degree 0


def _gcn() -> _Gcn:
    model = _Gcn()
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(4))
        model.lin.bias.fill_(0.0)
    return model


def test_an_op_that_made_only_plus_inf_is_said_so_when_the_record_holds_both() -> None:
    x, deg = _gcn_inputs()
    model = _gcn()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(x, deg).sum().backward()
        nw.step()
    a = nw.first_anomaly
    # what the op made, then what the record came to hold, in the summary as in the headline
    assert a is not None and a.summary.startswith("+inf born in the forward of _Gcn")
    assert " (then +inf, -inf) [" in a.summary, a.summary
    assert "aten.pow.Tensor_Scalar" in a.summary and ", which made +inf;" in a.summary
    from nanwatch.report import anomaly_headline

    head = anomaly_headline(a)
    assert head.startswith("+inf born in the forward of _Gcn by aten.pow"), head
    assert "(then +inf, -inf)" in head


class _Mid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(8, 8)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv1(F.silu(self.norm1(x))) + x  # the norm's output only F.silu reads


class _Unet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(1, 8, 8)
        self.mid = _Mid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mid(self.down(x))


def test_a_groupnorm_whose_variance_overflows_before_a_functional_silu_is_named() -> None:
    torch.manual_seed(0)
    model = _Unet()
    with torch.no_grad():
        model.down.weight.mul_(1e21)  # activations near 1e22: x * x overflows float32
    nw = _run(model, torch.randn(4, 1, 8, 8))
    a = nw.first_anomaly
    assert a is not None and a.op is not None
    assert a.op.op.startswith("aten.native_group_norm") and a.op.path == "mid.norm1"
    assert a.path == "mid.norm1" and a.origin == "module"
    assert a.summary.startswith("NaN born in the forward of mid.norm1, then passed by the code")
