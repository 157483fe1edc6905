"""Integration with the code around the model: a module that calls a collective is not
replayed on one rank of a distributed run (it blocked until the process group timed out); a
NaN another rank's gradient brought through DDP's all-reduce is named as such, not this
rank's optimizer state (NW301); a reset through ``.data`` (``p.grad.data.zero_()``) is a
reset (NW307); SAM's neighbourhood radius ``rho`` is no running-average decay (NW306)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nanwatch

ROOT = Path(__file__).resolve().parent.parent


def _fake_world(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    """torch.distributed as one rank of ``world`` sees it (no process group is made)."""
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: world)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: rank)


# ---------------------------------------------------------------------- replays

_RUNS: list[int] = []


class _Ratio(nn.Module):
    """A loss with a 0/0 when a class has no positive (SupCon's mean over positives).
    ``calls``: its forwards, replays included, counted in a list the module does not hold
    (a replay puts back what the module holds: a counter attribute of its own included)."""

    def __init__(self) -> None:
        super().__init__()
        _RUNS.clear()

    @property
    def calls(self) -> int:
        return len(_RUNS)

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        _RUNS.append(1)
        mask = (labels[:, None] == labels[None, :]).float() - torch.eye(len(labels))
        return -((mask * z.log_softmax(1)).sum(1) / mask.sum(1)).mean()


def _ratio_run() -> tuple[_Ratio, nanwatch.AnomalyError]:
    torch.manual_seed(0)
    model, crit = nn.Linear(8, 4), _Ratio()
    with pytest.raises(nanwatch.AnomalyError) as info:  # noqa: SIM117
        with nanwatch.watch(model, crit, postmortem=False):
            crit(model(torch.randn(4, 8)), torch.tensor([0, 0, 1, 2])).backward()
    return crit, info.value


def test_a_module_is_not_replayed_on_one_rank_of_a_distributed_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A module may call a collective (a gather layer, SyncBatchNorm): replayed on one rank
    alone it waited for the other ranks until the process group timed out."""
    _fake_world(monkeypatch, rank=1, world=2)
    crit, err = _ratio_run()
    assert crit.calls == 1  # its forward ran once: no replay
    assert err.diagnosis.op is None
    first = str(err).splitlines()[0]
    assert "NaN born in the forward of _Ratio" in first
    assert (
        "(not replayed: in a distributed run a replay on one rank could block in a collective; "
        "run this rank's step with mode='forensic' or reproduce it in one process)"
    ) in first
    # nor does the diagnosis send the user to nw.replay, which would block the same way
    said = "\n".join([*err.diagnosis.evidence, err.diagnosis.fix])
    assert "nw.replay" not in said and "could block in a collective" in said


def test_a_module_is_replayed_in_a_single_process_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_world(monkeypatch, rank=0, world=1)
    crit, err = _ratio_run()
    assert crit.calls == 2  # replayed, every op checked: the division is named
    assert "not replayed" not in str(err)
    assert err.diagnosis.op is not None and "div" in err.diagnosis.op


# ---------------------------------------------------------------------- NW301 and DDP


def _all_reduced_nan(momentum: float, rank: int = 0) -> tuple[Any, nn.Module, Any]:
    """One rank of two: its own batches are clean; at step 2 DDP's all-reduce copies a
    gradient averaged with the other rank's NaN into its .grad (in place, after backward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    crit = nn.MSELoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
            for step in range(4):
                optimizer.zero_grad()
                crit(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
                if step == 2:  # what the reducer writes: (own + other's) / world
                    for p in model.parameters():
                        other = torch.full_like(p.grad, float("nan"))
                        p.grad.copy_((p.grad + other) / 2)
                optimizer.step()
    d = next(d for t in nw.history for d in t.diagnoses if d.code == "NW301")
    return d, model, optimizer


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_another_ranks_nan_through_the_all_reduce_is_not_this_ranks_optimizer(
    monkeypatch: pytest.MonkeyPatch, momentum: float
) -> None:
    """Rank 0 blamed its optimizer state ('load_state_dict of a checkpoint', s.clear()) or
    a 0/0 in SGD's update for a NaN that another rank's batch made."""
    _fake_world(monkeypatch, rank=0, world=2)
    d, model, optimizer = _all_reduced_nan(momentum)
    assert d.title == "Non-finite weights from another rank's gradient (distributed all-reduce)"
    ev = "\n".join(d.evidence)
    assert "rank 0 of 2 (torch.distributed): every gradient of this rank was finite" in ev
    assert "-rank1- in the file name" in ev
    assert "DDP averages every rank's gradients" in d.explanation
    assert "0/0" not in d.explanation and "load_state_dict" not in d.explanation
    assert "s.clear()" not in d.fix and "lr" not in d.fix
    assert d.fix.splitlines()[0].startswith("# read the other ranks' reports (-rank1-")
    # the pasted fix skips an update whose averaged gradient is NaN
    for p in model.parameters():
        with torch.no_grad():
            p.fill_(0.5)
        p.grad = torch.full_like(p, float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    exec(d.fix, {"model": model, "optimizer": optimizer, "torch": torch})
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_a_nan_update_in_a_single_process_is_still_the_update() -> None:
    d, _, _ = _all_reduced_nan(0.0)
    assert "another rank" not in d.title and "rank" not in d.explanation


_DDP_SCRIPT = r"""
import datetime, json, os, sys, warnings
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import nanwatch

class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)
    @staticmethod
    def backward(ctx, *grads):  # this rank's share only (SimCLR's GatherLayer)
        return grads[dist.get_rank()]

class GatheredRatio(nn.Module):  # SupCon's shape: a mean over positives of all ranks
    def forward(self, z, labels):
        allz = torch.cat(Gather.apply(z))
        lab = [torch.zeros_like(labels) for _ in range(dist.get_world_size())]
        dist.all_gather(lab, labels)
        alll = torch.cat(lab)
        n, r = z.shape[0], dist.get_rank()
        own = torch.zeros(n, allz.shape[0], dtype=torch.bool)
        own[torch.arange(n), torch.arange(n) + r * n] = True
        logp = (z @ allz.T).masked_fill(own, -1e9).log_softmax(1)
        mask = (labels[:, None] == alll[None, :]) & ~own
        return -((mask * logp).sum(1) / mask.sum(1)).mean()

def worker(rank, out, port):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=45))
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)))
    crit = GatheredRatio()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(ddp, crit, on_anomaly="record", postmortem=False) as nw:
            for step in range(4):
                labels = torch.tensor([0, 0, 1, 1])
                if rank == 1 and step == 2:
                    labels = torch.tensor([0, 0, 1, 7])  # class 7: no positive anywhere
                opt.zero_grad()
                crit(ddp(torch.randn(4, 8, generator=g)), labels).backward()
                opt.step()
    first = next(t for t in nw.history if t.diagnoses)
    d = first.diagnoses[0]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"step": first.step, "code": d.code, "title": d.title,
                   "evidence": d.evidence, "fix": d.fix}, f)
    dist.barrier()  # both ranks done with their collectives before the group goes
    dist.destroy_process_group()

if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
"""


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)
def test_two_gloo_ranks_a_collective_loss_and_another_ranks_nan(tmp_path: Path) -> None:
    """Rank 1's loss (which all_gathers every rank's features) makes 0/0; rank 0's batch is
    clean. Rank 1 replayed its loss alone: its all_gather met rank 0's backward all-reduce
    and both blocked until the process group timed out. Now rank 1 names its loss without
    a replay, and rank 0 names the all-reduced gradient as the way the NaN reached it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ddp_run.py"
    script.write_text(textwrap.dedent(_DDP_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        for r in (0, 1)
    ]
    try:
        # a replay that blocked both ranks would run into the group's 45 s timeout: a
        # loaded CI machine gets that long for the ranks' real work, not a hang
        outs = [p.communicate(timeout=150) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(ranks, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r1["step"] == 2 and "not replayed: in a distributed run" in r1["evidence"][0]
    assert "GatheredRatio" in r1["evidence"][0]
    assert r0["code"] == "NW301"
    assert r0["title"] == "Non-finite weights from another rank's gradient (distributed all-reduce)"
    assert any("-rank1- in the file name" in e for e in r0["evidence"])


# ---------------------------------------------------------------------- NW307


def _loop(reset: str, steps: int, *, micro: int = 1, opt: str = "SGD") -> tuple[Any, list[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if opt == "SGD"
        else torch.optim.Adam(model.parameters(), lr=1e-3)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, nn.MSELoss(), postmortem=False) as nw:
            for _ in range(steps):
                if reset == "data before":
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.data.zero_()
                for _ in range(micro):
                    x = torch.randn(16, 8)
                    (nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)) / micro).backward()
                optimizer.step()
                if reset == "data after":
                    for p in model.parameters():
                        p.grad.data.zero_()  # type: ignore[union-attr]
                # reset == "none": forgotten
    said = [str(w.message) for w in caught if "nanwatch" in str(w.message)]
    return nw, said


@pytest.mark.parametrize(
    ("reset", "micro", "opt"),
    [("data after", 1, "SGD"), ("data before", 1, "Adam"), ("data after", 3, "SGD")],
)
def test_a_reset_through_data_is_a_reset(reset: str, micro: int, opt: str) -> None:
    """p.grad.data.zero_() moves no version counter: NW307 said 'Gradients never reset' at
    every step of a loop that reset them at every step."""
    nw, said = _loop(reset, 12, micro=micro, opt=opt)
    assert not said
    assert not [d.headline for t in nw.history for d in t.diagnoses]


def test_a_forgotten_reset_is_still_found_at_the_first_stale_step() -> None:
    nw, said = _loop("none", 4)
    (msg,) = [m for m in said if "NW307" in m]
    assert "step 1: NW307 warning: Gradients never reset" in msg
    d = next(d for d in nw.history[1].diagnoses if d.code == "NW307")
    assert d.fix.startswith("optimizer.zero_grad()")


# ---------------------------------------------------------------------- NW306


class _SAM(torch.optim.Optimizer):
    """github.com/davda54/sam, abridged: its groups hold rho (a radius) next to the base
    optimizer's settings, and the base optimizer steps on the same groups."""

    def __init__(self, params: Any, base: Any, rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, adaptive=True, **kwargs))
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        norm = torch.norm(
            torch.stack([(p.abs() * p.grad).norm() for g in self.param_groups for p in g["params"]])
        )
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.pow(2) * p.grad * g["rho"] / (norm + 1e-12))
        self.zero_grad()

    @torch.no_grad()
    def second_step(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        self.zero_grad()


@pytest.mark.parametrize("base", [torch.optim.SGD, torch.optim.Adam])
def test_sams_rho_is_its_radius_not_a_decay(base: Any) -> None:
    """ASAM's recommended rho=2.0 was 'Optimizer rho >= 1: the update grows instead of
    averaging', an error at step 1, with a fix that set it to 0.9."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    crit = nn.CrossEntropyLoss()
    kw = {"momentum": 0.9} if base is torch.optim.SGD else {}
    opt = _SAM(model.parameters(), base, rho=2.0, lr=0.05, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            for _ in range(4):
                x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
                crit(model(x), y).backward()
                opt.first_step()
                crit(model(x), y).backward()
                opt.second_step()
    assert not [str(w.message) for w in caught if "nanwatch" in str(w.message)]
    assert not [d.headline for t in nw.history for d in t.diagnoses]


def test_a_decay_of_a_subclass_of_a_torch_optimizer_is_still_checked() -> None:
    class MyAdam(torch.optim.Adam):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = MyAdam(model.parameters(), lr=1e-3)
    for g in optimizer.param_groups:
        g["betas"] = (0.9, 1.0)
    with nanwatch.watch(model, nn.MSELoss(), on_anomaly="record", postmortem=False) as nw:
        x = torch.randn(16, 8)
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        optimizer.step()
    (d,) = [d for d in nw.history[0].diagnoses if d.code == "NW306"]
    assert d.title == "Optimizer beta2 >= 1: the update grows instead of averaging"
    exec(d.fix, {"optimizer": optimizer})
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)
