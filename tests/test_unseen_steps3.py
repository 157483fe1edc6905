"""Steps of loops whose backward trains nothing watched: LBFGS optimizing an input image
through a frozen watched model (each closure evaluation was a step, and the first
nw.step() did not fold them: a NaN of outer iteration 1 was "step 4"), and a FedAvg server
that trains deepcopied clients, loads the average into the watched model and evaluates it
under no_grad (the first nw.step() left step_index at 2). Tiny loops on CPU."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import AnomalyKind


def _frozen() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval()


def _lbfgs_run(explicit: bool, bad_at: int = -1) -> tuple[nanwatch.Watcher, list[int]]:
    """Style-transfer shape: the image is the only parameter, LBFGS evaluates its closure
    several times per outer iteration; ``bad_at``: the outer iteration whose loss takes a
    sqrt at exact zeros (a NaN gradient born in the loss code)."""
    net = _frozen()
    target = torch.rand(1, 4, 8, 8)
    img = torch.rand(1, 3, 8, 8).requires_grad_(True)
    opt = torch.optim.LBFGS([img], lr=1, max_iter=3)
    seen: list[int] = []
    with nanwatch.watch(net, on_anomaly="record", postmortem=False) as nw:
        for it in range(3):

            def closure(it: int = it) -> torch.Tensor:
                opt.zero_grad()
                loss = F.mse_loss(net(img), target)
                if it == bad_at:
                    loss = loss + (img - img.detach()).pow(2).sum().sqrt()  # sqrt at 0
                loss.backward()
                return loss

            opt.step(closure)
            with torch.no_grad():
                img.clamp_(0, 1)
            seen.append(nw.step_index)
            if explicit:
                nw.step()
                seen.append(nw.step_index)
    return nw, seen


def test_lbfgs_closure_evaluations_of_an_optimized_input_are_one_step() -> None:
    nw, seen = _lbfgs_run(explicit=True)
    assert seen == [0, 1, 1, 2, 2, 3]
    assert [t.step for t in nw.history] == [0, 1, 2]
    # without nw.step(): one step per optimizer.step(closure) too
    nw, seen = _lbfgs_run(explicit=False)
    assert seen == [0, 1, 2]


def test_lbfgs_nan_of_outer_iteration_one_is_named_step_one() -> None:
    nw, _ = _lbfgs_run(explicit=True, bad_at=1)
    a = nw.first_anomaly
    assert a is not None and a.step == 1
    assert [d.step for d in nw.history[1].diagnoses][:1] == [1]  # named in its own step
    assert not nw.history[0].diagnoses


def test_fedavg_eval_after_load_state_dict_does_not_begin_a_step() -> None:
    """Clients are deepcopies (unwatched) trained with their own optimizers; the watched
    global model only gets load_state_dict and a no_grad evaluation before nw.step()."""
    torch.manual_seed(0)
    gmodel = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    data = [(torch.randn(n, 6), torch.randint(0, 2, (n,))) for n in (20, 12, 30)]
    seen = []
    with nanwatch.watch(gmodel, on_anomaly="record", postmortem=False) as nw:
        for rnd in range(4):
            states = []
            for x, y in data:
                local = copy.deepcopy(gmodel)
                opt = torch.optim.SGD(local.parameters(), lr=0.05)
                loss = F.cross_entropy(local(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                states.append(local.state_dict())
            avg = {k: sum(s[k] for s in states) / 3 for k in states[0]}
            if rnd == 2:
                avg["0.weight"][0, 0] = float("nan")  # a poisoned average in round 2
            gmodel.load_state_dict(avg)
            with torch.no_grad():
                gmodel(data[0][0])
            nw.step()
            seen.append(nw.step_index)
    assert seen[:2] == [1, 2]
    a = nw.first_anomaly
    assert a is not None and a.step == 2
    assert a.kind in (AnomalyKind.PARAMETER, AnomalyKind.FORWARD, AnomalyKind.INPUT)
