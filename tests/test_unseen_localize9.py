"""A bad gradient at a module's output that a float32 Linear consumer cannot have made is
born in the producer's own code that used that output; a container (a Sequential) given
the same tensor as its first child is not the consumer, the child is; a custom
``autograd.Function`` the parent's code applied to a child's output is named."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


class _XLogX(torch.autograd.Function):
    """x * log(x) with a hand-written backward log(x) + 1: -inf at x == 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.xlogy(x, x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * (torch.log(x) + 1)


class _Gate(nn.Module):
    def __init__(self, summed: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.summed = summed

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = F.relu(self.fc(h))
        ent = _XLogX.apply(p)
        return p, ent.sum(-1) if self.summed else ent


class _Net(nn.Module):
    def __init__(self, summed: bool) -> None:
        super().__init__()
        self.gate = _Gate(summed)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p, ent = self.gate(x)
        return self.head(p), ent


def _run_gate(summed: bool) -> nanwatch.Anomaly:
    torch.manual_seed(0)
    model = _Net(summed)
    with torch.no_grad():
        model.gate.fc.bias.fill_(-100.0)  # every p is exactly 0
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        out, ent = model(torch.randn(2, 4))
        (out.pow(2).mean() + ent.mean()).backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None
    return a


def test_producer_code_that_used_its_own_output_not_the_float32_linear() -> None:
    a = _run_gate(summed=True)
    assert a.kind is nanwatch.AnomalyKind.BACKWARD
    assert a.path == "gate"
    # the replay of gate's own backward names the Function that made the -inf (it was
    # "code in gate that used its own output[0]" before that replay reached it)
    assert "-inf gradient born in the backward of custom autograd.Function _XLogX" in a.summary
    assert "born in the backward of head" not in a.summary


def test_custom_function_among_the_producers_later_outputs_is_named() -> None:
    a = _run_gate(summed=False)
    assert a.kind is nanwatch.AnomalyKind.BACKWARD
    assert a.path == "gate"
    assert "the backward of custom autograd.Function _XLogX in gate" in a.summary


class _RMSNormFn(torch.autograd.Function):
    """Forward guarded with eps, backward divides by the raw rms: NaN on all-zero rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        ctx.save_for_backward(x, rms)
        return x / (rms + 1e-6)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        x, rms = ctx.saved_tensors
        xhat = x / rms
        return (g - xhat * (g * xhat).mean(-1, keepdim=True)) / rms


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(_RMSNormFn.apply(x))


class _Chain(nn.Module):
    """No code of its own: what its children return, given what it got."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Block(), _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class _Lm(nn.Module):
    def __init__(self, blocks: nn.Module) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4, padding_idx=0)
        self.blocks = blocks
        self.head = nn.Linear(4, 5)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(t)))


def _run_lm(blocks: nn.Module) -> nanwatch.Anomaly:
    torch.manual_seed(0)
    model = _Lm(blocks)
    t = torch.tensor([[1, 2, 0], [3, 4, 0]])  # padding rows: an all-zero embedding
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(t).pow(2).mean().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None
    assert a.kind is nanwatch.AnomalyKind.BACKWARD
    return a


def test_sequential_given_the_same_tensor_gives_way_to_its_first_child() -> None:
    a = _run_lm(nn.Sequential(_Block(), _Block()))
    assert a.path == "blocks.0"
    assert "NaN gradient born in the backward of the code in blocks.0" in a.summary
    assert "custom autograd.Function _RMSNormFn" in a.summary
    assert "backward of blocks:" not in a.summary


def test_module_whose_children_account_for_it_gives_way_to_its_first_child() -> None:
    a = _run_lm(_Chain())
    assert a.path == "blocks.a"
    assert "custom autograd.Function _RMSNormFn" in a.summary


class _GaussSpike(torch.autograd.Function):
    """A spike with a Gaussian surrogate gradient of width sigma: 0/0 at sigma == 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sigma: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.sigma = sigma
        return (x >= 0).float()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        s = ctx.sigma
        return g * torch.exp(-(x**2) / (2 * s**2)) / s, None


class _Lif(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.sigma = 0.0

    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mem = 0.8 * mem + self.fc(x)
        s = _GaussSpike.apply(mem - 1.0, self.sigma)
        return s, mem - s


class _Snn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = _Lif()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mem = torch.zeros(x.shape[1], 4)
        acc = torch.zeros(x.shape[1], 2)
        for t in range(x.shape[0]):
            s, mem = self.l1(x[t], mem)
            acc = acc + self.out(s)
        return acc


def test_custom_function_the_parent_applied_to_a_childs_output_is_named() -> None:
    torch.manual_seed(0)
    model = _Snn()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.rand(2, 3, 3)).pow(2).mean().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None
    assert a.kind is nanwatch.AnomalyKind.BACKWARD
    assert a.path == "l1"
    assert "NaN gradient born in the backward of custom autograd.Function _GaussSpike" in (
        a.summary
    )
    assert "in l1, in code that used the output of l1.fc" in a.summary


class _CkptBlock(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        out: torch.Tensor = checkpoint(super().forward, x, use_reentrant=True)
        return out


def test_reentrant_checkpoint_is_not_called_a_custom_function() -> None:
    a = _run_lm(nn.Sequential(_CkptBlock(), _CkptBlock()))
    assert a.path == "blocks.0"
    assert "the backward of blocks.0, its forward rerun by torch.utils.checkpoint" in a.summary
    assert "custom autograd.Function CheckpointFunction" not in a.summary
