"""Unseen-model follow-ups for the shared evidence: the model's outputs of a step are its
real forward, not a logging call of a submodule made under no_grad after ``nw.step()``
(NW103 stays silent); an infinity read from the module's own buffer (ALiBi with the causal
mask folded into ``dist``) is named, and the fix masks after multiplying in the user's
names, with no template line naming tensors the user never wrote."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules import _evidence as ev

torch.set_num_threads(1)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 32)
        self.out = nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids).mean(1))


def _train(*, log: bool, steps: int = 10) -> tuple[list[str], nanwatch.Watcher]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = _Net().half()
    opt = torch.optim.Adam(model.parameters(), lr=2e-2, eps=1e-4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, postmortem=False) as nw:
            for _ in range(steps):
                ids = torch.randint(0, 32, (8, 8), generator=g)
                loss = F.cross_entropy(model(ids).float(), ids[:, 0])
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
                if log:
                    with torch.no_grad():  # logging the embedding norm
                        model.emb(ids).float().norm(dim=-1).mean().item()
    return [str(w.message) for w in caught], nw


def test_nw103_silent_on_a_no_grad_logging_call_of_the_embedding() -> None:
    messages, _ = _train(log=True)
    assert not [m for m in messages if "NW103" in m], messages


def test_model_outputs_are_the_forward_not_the_side_call() -> None:
    _, nw = _train(log=True, steps=3)
    traces = list(nw.history)
    mid = traces[-2]  # the side call of the step before, then the model's forward
    assert [c.path for c in mid.calls if c.root][:2] == ["emb", "_Net"]
    outs = ev.first_root_outputs(mid)
    assert outs and all(r.shape == (8, 32) for r in outs)
    last = traces[-1]  # after the last nw.step(): only the logging call
    assert ev.first_root_outputs(last) == []


def test_model_outputs_healthy_twin_without_side_call() -> None:
    _, nw = _train(log=False, steps=3)
    outs = ev.first_root_outputs(list(nw.history)[-2])
    assert outs and all(r.shape == (8, 32) for r in outs)


def test_submodule_called_directly_with_grad_is_still_the_model() -> None:
    """A training step that calls a submodule of the watched module itself (a
    LightningModule's training_step calling self.net): its outputs are the model's."""
    torch.manual_seed(0)
    model = _Net()
    with nanwatch.watch(model, postmortem=False) as nw:
        ids = torch.randint(0, 32, (8, 8))
        model.out(model.emb(ids).mean(1)).logsumexp(-1).mean().backward()
        nw.step()
    call = ev.model_call(nw.history[-1])
    assert call is not None and call.path == "emb"


class _Alibi(nn.Module):
    def __init__(self, slopes: list[float], T: int = 4) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)
        i = torch.arange(T)
        dist = (i[:, None] - i[None]).float().masked_fill(i[None] > i[:, None], float("inf"))
        self.register_buffer("dist", dist)
        self.register_buffer("slopes", torch.tensor(slopes)[:, None, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        bias = -self.slopes * self.dist
        return ((q @ k.transpose(-1, -2))[:, None] + bias).softmax(-1).sum()


_FIXED = (
    "bias = (-self.slopes * self.dist.nan_to_num(posinf=0.0)).masked_fill("
    "self.dist.isposinf(), torch.finfo(torch.float32).min)"
)


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_zero_slope_times_inf_buffer_names_the_buffer(mode: str) -> None:
    torch.manual_seed(0)
    m = _Alibi([0.5, 0.0])
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(m, mode=mode, postmortem=False),
    ):
        m(torch.randn(2, 4, 8)).backward()
    d = info.value.diagnosis
    assert d.code == "NW100" and d.op == "aten.mul.Tensor"
    assert "buffer dist holds 6 +inf and slopes holds 1 exact zero" in d.explanation
    assert "did not trace" not in d.explanation
    assert "self.dist" in " ".join(d.evidence)
    assert d.fix.splitlines()[0].split("   #")[0] == _FIXED
    for name in ("scores", "keep", "logits", "forensic"):
        assert name not in d.fix


def test_zero_slope_fix_runs_and_keeps_the_causal_mask() -> None:
    torch.manual_seed(0)
    m = _Alibi([0.5, 0.0])
    q = torch.randn(2, 4, 8)
    self = m  # noqa: F841 - the fix reads self.slopes and self.dist
    bias = eval(_FIXED.split("= ", 1)[1])
    assert torch.isfinite(bias).all()
    future = torch.ones(4, 4).triu(1).bool()
    assert (bias[:, future] == torch.finfo(torch.float32).min).all()
    assert torch.isfinite(m.qk(q)).all()


def test_nonzero_slopes_healthy_twin() -> None:
    torch.manual_seed(0)
    m = _Alibi([0.5, 0.25])
    with nanwatch.watch(m, postmortem=False):
        m(torch.randn(2, 4, 8)).backward()


_CAPTURED = torch.tensor([1.0, float("inf"), 2.0, 3.0])


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).relu() * 0.0
        return h * _CAPTURED


def test_unknown_inf_fix_has_no_template_names_the_code_lacks() -> None:
    torch.manual_seed(0)
    m = _Gate()
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(m, postmortem=False):
        m(torch.randn(2, 4)).sum().backward()
    d = info.value.diagnosis
    assert d.code == "NW100"
    for name in ("scores", "keep", "logits"):
        assert name not in d.fix


_CLAMPED = (
    "m_new = torch.maximum(m, s.amax(-1, keepdim=True)).clamp_min(torch.finfo(torch.float32).min)"
)


def _online_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fixed: bool
) -> torch.Tensor:
    """Sliding-window attention with an online softmax over key blocks: the first key block
    of the last query block lies outside the window, so its running max stays -inf."""
    T, block, window = q.shape[-2], 2, 2
    out = torch.zeros_like(q)
    for qs in range(0, T, block):
        qb = q[:, qs : qs + block]
        m = torch.full((*qb.shape[:-1], 1), float("-inf"))
        l = torch.zeros_like(m)  # noqa: E741
        acc = torch.zeros_like(qb)
        for ks in range(0, T, block):
            s = qb @ k[:, ks : ks + block].transpose(-1, -2)
            qi = torch.arange(qs, qs + block)[:, None]
            kj = torch.arange(ks, ks + block)[None]
            s = s.masked_fill((kj > qi) | (kj < qi - window), float("-inf"))
            if fixed:
                m_new = torch.maximum(m, s.amax(-1, keepdim=True)).clamp_min(
                    torch.finfo(torch.float32).min
                )
            else:
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            corr = torch.exp(m - m_new)
            l = l * corr + p.sum(-1, keepdim=True)  # noqa: E741
            acc = acc * corr + p @ v[:, ks : ks + block]
            m = m_new
        out[:, qs : qs + block] = acc / l
    return out


class _Online(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return _online_attention(q, k, v, self.fixed)


def test_online_softmax_fix_clamps_the_running_max_where_it_is_made() -> None:
    torch.manual_seed(0)
    m = _Online(fixed=False)
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(m, postmortem=False):
        m(torch.randn(2, 6, 8)).sum().backward()
    d = info.value.diagnosis
    assert d.code == "NW402" and d.op == "aten.sub.Tensor"
    lines = [ln.split("   #")[0] for ln in d.fix.splitlines()]
    assert _CLAMPED in lines, d.fix
    assert "s - m_new.clamp_min" not in d.fix  # one line only: corr = exp(m - m_new) stayed NaN


def test_online_softmax_with_the_fix_is_finite() -> None:
    torch.manual_seed(0)
    m = _Online(fixed=True)
    with nanwatch.watch(m, postmortem=False):
        out = m(torch.randn(2, 6, 8))
        out.sum().backward()
    assert torch.isfinite(out).all()
