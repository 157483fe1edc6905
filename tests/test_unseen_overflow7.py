"""NW101 on meta-learning and recurrent models found by user testing: a MAML inner loop
whose fast weights (torch.func.functional_call) diverge is the inner update's doing, not
the initialization's or the outer optimizer's; Reptile's deepcopy of the watched model
(no hooks) trained by its own torch.optim optimizer is not "no optimizer stepped"; the
recurrent-weight fix names the module as the user's own line does, never ``model``.

Each runs a tiny real model under ``nanwatch.watch`` on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import nanwatch
from tests._diagnoses import text, top

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reports(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)


# ------------------------------------------- 1: MAML fast weights diverge in the inner loop


def _maml(inner_lr: float, outer: int = 3, warm: int = 0) -> nanwatch.Watcher:
    """Second-order MAML on a sinusoid; the first ``warm`` outer steps use a small inner lr
    (the outer Adam steps), then ``inner_lr``."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )
    meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.linspace(-5, 5, 10)[:, None]
    y = 4 * torch.sin(x)
    raises = pytest.raises(nanwatch.AnomalyError) if inner_lr > 0.1 else _nothing()
    with raises, nanwatch.watch(model) as nw:
        for it in range(outer):
            lr = 0.01 if it < warm else inner_lr
            fast = dict(model.named_parameters())
            for _ in range(10):
                loss = ((functional_call(model, fast, (x,)) - y) ** 2).mean()
                g = torch.autograd.grad(loss, list(fast.values()), create_graph=True)
                fast = {n: p - lr * gi for (n, p), gi in zip(fast.items(), g, strict=True)}
            q = ((functional_call(model, fast, (x,)) - y) ** 2).mean()
            meta_opt.zero_grad()
            q.backward()
            meta_opt.step()
            nw.step()
    return nw


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.accelerator_weaker(reason="functional_call's fast weights are gone by the late replay")
def test_maml_inner_lr_blames_the_substituted_fast_weights_not_init() -> None:
    d = top(_maml(0.4))
    assert d.code == "NW101" and d.op == "aten.addmm"
    t = text(d)
    assert "substituted at call time" in t and "functional_call" in t
    assert "no optimizer step between them" in t
    assert "the weights in fast grew in your inner loop" in d.fix  # the user's own name
    assert "inner steps" in d.fix and "clip the inner gradient" in d.fix
    assert "xavier" not in d.fix and "LayerNorm" not in d.fix
    assert "param_groups" not in d.fix and "the initial weights or the inputs" not in t


@pytest.mark.accelerator_weaker(reason="functional_call's fast weights are gone by the late replay")
def test_maml_inner_lr_after_outer_steps_does_not_lower_the_meta_lr() -> None:
    d = top(_maml(0.4, outer=4, warm=2))
    assert d.code == "NW101" and d.step == 2
    assert "substituted at call time" in text(d)
    assert "the weights in fast grew in your inner loop" in d.fix
    assert "param_groups" not in d.fix and "Adam" not in d.fix


def test_maml_small_inner_lr_is_silent() -> None:
    nw = _maml(0.01)
    assert not nw.report.anomalies


# ---------------------------------------------- 2: Reptile trains an unwatched deepcopy


def _reptile() -> nanwatch.Diagnosis:
    torch.manual_seed(0)
    meta, crit = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1)), nn.MSELoss()
    x = torch.randn(16, 4) * 3
    y = x.sum(1, keepdim=True) * 10
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(meta, crit) as nw:
        for _ in range(3):
            fast = copy.deepcopy(meta)
            inner = torch.optim.SGD(fast.parameters(), lr=0.5)
            for _ in range(20):
                inner.zero_grad()
                crit(fast(x), y).backward()
                inner.step()
            with torch.no_grad():
                for w, q in zip(meta.parameters(), fast.parameters(), strict=True):
                    w.add_(0.1 * (q - w))
            nw.step()
    return top(nw)


def test_reptile_deepcopy_says_the_values_came_from_unwatched_code() -> None:
    d = _reptile()
    assert d.code == "NW101" and d.path == "MSELoss"
    t = text(d)
    assert "no torch.optim optimizer stepped" not in t
    assert "p -= lr * p.grad" not in d.fix and "right before your own update" not in d.fix
    assert "nanwatch does not watch" in d.fix and "copy.deepcopy" in d.fix
    assert "nanwatch.watch(clone)" in d.fix


def test_hand_written_update_of_the_watched_model_still_says_so() -> None:
    torch.manual_seed(0)
    model, crit = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1)), nn.MSELoss()
    x = torch.randn(16, 4) * 3
    y = x.sum(1, keepdim=True) * 10
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model, crit) as nw:
        for _ in range(60):
            model.zero_grad()
            crit(model(x), y).backward()
            with torch.no_grad():
                for w in model.parameters():
                    w.sub_(0.5 * w.grad)
            nw.step()
    d = top(nw)
    assert d.code == "NW101"
    assert "nanwatch does not watch" not in text(d) and "deepcopy" not in d.fix


# ------------------------------------ 3: the recurrent fix uses the user's own names


class _LM(nn.Module):
    def __init__(s) -> None:  # the user's style: no `self`
        super().__init__()
        s.emb = nn.Embedding(30, 32)
        s.rnn = nn.RNN(32, 64, nonlinearity="relu", batch_first=True)
        s.out = nn.Linear(64, 30)
        with torch.no_grad():
            s.rnn.weight_hh_l0.copy_(torch.eye(64) * 4.0)

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        h, _ = s.rnn(s.emb(x))
        return s.out(h)


def test_rnn_overflow_fix_names_the_module_as_the_users_line_does() -> None:
    torch.manual_seed(0)
    m = _LM()
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(m) as nw:
        m(torch.randint(0, 30, (4, 80))).pow(2).mean().backward()
    d = top(nw)
    assert d.code == "NW101" and d.path == "rnn"
    assert "for name, w in s.rnn.named_parameters():" in d.fix
    assert "in __init__, after s.rnn is built" in d.fix
    assert "model.rnn" not in d.fix


def test_rnn_called_at_top_level_gets_a_comment_not_a_made_up_name() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.RNN(4, 16, nonlinearity="relu", batch_first=True))
    with torch.no_grad():
        net[0].weight_hh_l0.copy_(torch.eye(16) * 4.0)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(net) as nw:
        net(torch.rand(2, 80, 4))[0].pow(2).mean().backward()
    d = top(nw)
    assert d.code == "NW101"
    assert "named_parameters()" not in d.fix and "model[0]" not in d.fix
    assert "# for each recurrent weight (weight_hh_l*)" in d.fix
