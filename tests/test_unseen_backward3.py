"""Backward origins found by user testing: a module's own backward replayed on inputs its
root makes again (a checkpointed block's freed input), the loss code's node named in
sentinel mode, gradients written from torch.func said to be unwatched."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

import nanwatch
from tests._diagnoses import raises as _raises
from tests._diagnoses import text as _text

torch.set_num_threads(1)


# ------------------------------ 1: sqrt(0) in a block's own backward, its input freed


class _RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        return self.g * x / (rms + 1e-6)


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = _RMSNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))  # the residual: x's gradient sums two uses


class _Net(nn.Module):
    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        self.emb, self.block, self.head, self.ckpt = (
            nn.Embedding(10, 8),
            _Block(8),
            nn.Linear(8, 3),
            ckpt,
        )

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        h = self.emb(tok) * (tok != 0).unsqueeze(-1)  # padding rows zeroed by the root's code
        h = checkpoint(self.block, h, use_reentrant=False) if self.ckpt else self.block(h)
        return self.head(h)


@pytest.mark.parametrize("ckpt", [False, True])
def test_a_sqrt_in_a_blocks_own_backward_is_named_when_its_input_was_freed(ckpt: bool) -> None:
    torch.manual_seed(0)
    m = _Net(ckpt)
    tok = torch.tensor([[1, 2, 3, 0, 0]])

    def run() -> None:
        m(tok).sum().backward()

    err = _raises(m, run, "watch")
    d = err.diagnoses[0]
    assert d.code == "NW112", _text(d)
    assert "SqrtBackward0" in _text(d)
    assert "rms = x.pow(2).mean(-1, keepdim=True).sqrt()" in _text(d)
    compile(d.fix.split("#")[0].strip() or "pass", "<fix>", "exec")


# ------------------------------ 2: a functional loss in sentinel mode: its node, no loss module


def test_sentinel_names_the_functional_losss_node_and_asks_for_no_loss_module() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    x, gt = torch.randn(6, 4), torch.randn(6, 2)

    def run() -> None:
        with torch.no_grad():
            gt[:3] = m(x[:3])  # predictions equal to the target: the distance is 0
        d = m(x) - gt
        torch.sqrt((d**2).sum(1)).mean().backward()

    err = _raises(m, run, "sentinel")
    t = "\n".join(_text(d) for d in err.diagnoses)
    assert "watch the loss module" not in t
    assert err.diagnoses[0].code == "NW112", t
    assert "SqrtBackward0" in t


def test_sentinel_after_output_without_a_named_node_says_loss_code_and_modes() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    x, gt = torch.randn(6, 4), torch.randn(6, 2)

    def run() -> None:
        with torch.no_grad():
            gt[:3] = m(x[:3])
        s = ((m(x) - gt) ** 2).sum(1)
        # two nodes, side by side, each given the 0 where its derivative is infinite:
        # the power, made last, runs first in backward, where watch's hook names it
        (torch.sqrt(s) + s**0.5).mean().backward()

    err = _raises(m, run, "sentinel")
    t = "\n".join(_text(d) for d in err.diagnoses)
    assert "watch the loss module" not in t
    assert err.diagnoses[0].code == "NW112", t
    assert "PowBackward0" in t and "SqrtBackward0" not in t
    a = _raises(m, run, "watch").anomaly
    assert a is not None and a.op is not None and a.op.node == "PowBackward0"


# ------------------------------ 3: per-sample gradients from torch.func written into .grad


class _Standardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


@pytest.mark.filterwarnings("ignore")
def test_gradients_from_torch_func_say_the_transformed_calls_are_not_watched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Standardize(), nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return crit(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

    ps_grad = vmap(grad(loss_fn), in_dims=(None, 0, 0))
    x, y = torch.randn(4, 5), torch.tensor([0, 1, 2, 0])
    x[1] = 0.5  # a constant row: std 0, 0/0 for that sample
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, mode="watch") as nw:
        for _ in range(2):
            params = {k: v.detach() for k, v in model.named_parameters()}
            g = ps_grad(params, x, y)
            for n, p in model.named_parameters():
                p.grad = g[n].sum(0)
            opt.step()
            opt.zero_grad()
            nw.step()
    d = info.value.diagnoses[0]
    t = _text(d)
    assert d.code == "NW301", t
    assert "torch.autograd.grad results" not in t
    assert "torch.func transform" in t and "not watch" in t
