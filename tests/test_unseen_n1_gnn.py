"""Graph neural networks written with plain torch (index_add_, sparse.mm, scatter).

A two-layer GCN whose symmetric normalization D^-1/2 A D^-1/2 meets a node without
edges: ``deg.pow(-0.5)`` is inf there, and the aggregation's 0 times it is NaN, in l1's
output first. l2 makes its own NaN at the same node by the same code (l1's NaN row is
never read by l2's aggregation, which gathers only along edges), so the root's output
was made of l2's inf alone: sentinel, which replays the root, named l2 where watch named
l1. The replay now counts what a child returned, as watch mode's records do.

A GAT layer whose attention softmax masks non-edges with -inf: a node without neighbours
has a row of -inf (NW402). Sentinel named the layer (g1) yet said "the module that ran
the softmax is not known; watch mode names it", with attention-style advice watch did not
give. The module a replay found is now known to the rule.

And a sentinel run that recovered from a first anomaly (the bad batch's update skipped)
and whose last update broke the weights (a learning rate gone inf) ended with inf weights
and no word of them: the read at detach was skipped whenever any anomaly had been told.

An edge index whose node ids start at 1 (or are a sampled subgraph's global ids) crashes
``index_add_`` / ``h[src]`` with "index out of range in self": the post-mortem said to
check class targets and token ids. It now names the index on the raising line, its range
and the size of the dimension it indexes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)

MODES = ("sentinel", "watch", "forensic")


class _GcnConv(nn.Module):
    def __init__(self, cin: int, cout: int, *, fixed: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(cin, cout)
        self.fixed = fixed

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        deg = torch.zeros(x.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0]))
        if self.fixed:
            deg = deg.clamp_min(1)  # the fix NW112 gives: an isolated node's messages are 0
        dinv = deg.pow(-0.5)
        h = self.lin(x) * dinv[:, None]
        out = torch.zeros_like(h).index_add_(0, dst, h[src])
        return out * dinv[:, None]


class _Gcn(nn.Module):
    def __init__(self, *, fixed: bool = False) -> None:
        super().__init__()
        self.l1 = _GcnConv(8, 16, fixed=fixed)
        self.l2 = _GcnConv(16, 3, fixed=fixed)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.l2(F.relu(self.l1(x, edge_index)), edge_index)


# a ring over nodes 0..4, both directions; node 5 has no edge at all
EDGES = torch.tensor([[0, 1, 2, 3, 4, 1, 2, 3, 4, 0], [1, 2, 3, 4, 0, 0, 1, 2, 3, 4]])


def _train_gcn(mode: str, *, fixed: bool = False) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = _Gcn(fixed=fixed)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            F.cross_entropy(model(x, EDGES), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_an_isolated_node_in_a_two_layer_gcn_is_born_in_the_first_layer(mode: str) -> None:
    nw = _train_gcn(mode)
    a = nw.first_anomaly
    assert a is not None and a.step == 0
    assert a.path == "l1", a.summary
    assert a.op is not None and a.op.op == "aten.pow.Tensor_Scalar" and a.op.path == "l1"
    d = nw.report.diagnoses[0]
    assert (d.code, d.path, d.op) == ("NW112", "l1", "aten.pow.Tensor_Scalar")
    assert "dinv = deg.pow(-0.5)" in " ".join(d.evidence)
    assert d.fix.splitlines()[0].startswith("dinv = deg.clamp_min(1).pow(-0.5)")


@pytest.mark.parametrize("mode", MODES)
def test_the_gcn_with_degrees_clamped_trains_clean(mode: str) -> None:
    nw = _train_gcn(mode, fixed=True)
    assert nw.first_anomaly is None
    assert not nw.report.diagnoses


class _GatLayer(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.lin = nn.Linear(cin, cout, bias=False)
        self.a_src = nn.Parameter(torch.randn(cout) * 0.1)
        self.a_dst = nn.Parameter(torch.randn(cout) * 0.1)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        e = F.leaky_relu((h @ self.a_dst)[:, None] + (h @ self.a_src)[None, :], 0.2)
        e = e.masked_fill(adj == 0, float("-inf"))
        alpha = torch.softmax(e, dim=1)
        return alpha @ h


class _Gat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g1 = _GatLayer(8, 16)
        self.g2 = _GatLayer(16, 3)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.g2(F.elu(self.g1(x, adj)), adj)


@pytest.mark.parametrize("mode", MODES)
def test_a_gat_node_without_neighbours_is_told_alike_in_every_mode(mode: str) -> None:
    torch.manual_seed(0)
    model = _Gat()
    adj = torch.zeros(6, 6)
    adj[EDGES[1], EDGES[0]] = 1.0  # node 5: no neighbour, its row all -inf
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        F.cross_entropy(model(x, adj), y).backward()
        nw.step()
    d = nw.report.diagnoses[0]
    assert (d.code, d.path, d.op) == ("NW402", "g1", "aten._softmax")
    assert d.title == "Fully masked softmax row: no valid choice left"
    assert "not known" not in d.explanation and "watch mode names it" not in d.explanation
    assert "each row keeps at least one allowed entry" in d.fix


def _recovered_then_broken(mode: str, *, lr_at_end: float) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(6):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            if step == 2:
                x[3, 1] = float("nan")  # a corrupt sample: its update is skipped below
            if step == 5:
                opt.param_groups[0]["lr"] = lr_at_end
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if torch.isfinite(loss):
                opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_weights_the_last_update_broke_after_a_recovered_anomaly_are_told(mode: str) -> None:
    nw = _recovered_then_broken(mode, lr_at_end=float("inf"))
    assert nw.first_anomaly is not None and nw.first_anomaly.step == 2
    codes = {d.code: d for d in nw.report.diagnoses}
    assert set(codes) == {"NW401", "NW301"}, list(codes)
    d = codes["NW301"]
    assert d.title == "Non-finite learning rate"
    assert any("learning rate was inf at the update of step 5" in e for e in d.evidence)


@pytest.mark.parametrize("mode", MODES)
def test_a_recovered_anomaly_and_a_clean_last_update_say_only_the_anomaly(mode: str) -> None:
    nw = _recovered_then_broken(mode, lr_at_end=0.1)
    assert [d.code for d in nw.report.diagnoses] == ["NW401"]
    assert [a.step for a in nw.anomalies] == [2]


class _SumConv(nn.Module):
    """Message passing by gather and scatter: ``h[src]`` summed into ``dst``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        h = self.lin(x)
        msg = h[src]
        return torch.zeros_like(h).index_add_(0, dst, msg)


def _crash_advice(tmp_path: Path, edges: torch.Tensor, mode: str) -> dict:
    model = _SumConv()
    with (
        pytest.raises((IndexError, RuntimeError)) as info,  # torch raises either
        nanwatch.watch(model, mode=mode, report_dir=str(tmp_path)),
    ):
        model(torch.randn(6, 8), edges).sum().backward()
    assert "out of" in str(info.value)  # torch's own error, unchanged
    (path,) = sorted(tmp_path.glob("*.json"))
    err: dict = json.loads(path.read_text())["error"]
    assert err["class"] == "index-out-of-range"
    return err


@pytest.mark.parametrize("mode", MODES)
def test_one_based_node_ids_are_named_in_the_post_mortem(tmp_path: Path, mode: str) -> None:
    """Node ids read from a file numbered from 1: the largest is 6 for 6 nodes."""
    edges = torch.tensor([[1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 1]])
    advice = _crash_advice(tmp_path, edges, mode)["advice"]
    assert advice.startswith(
        "src, the index into h along dim 0, holds 1 to 6, but that dimension has 6 entries "
        "(0 to 5): 1 of 6 out of range."
    ), advice
    assert "need src - 1" in advice and "class targets" not in advice


def test_a_subgraphs_global_ids_are_named_in_the_post_mortem(tmp_path: Path) -> None:
    """A sampled subgraph whose edges keep the whole graph's node ids: src is in range by
    chance, dst is not; index_add_'s size comes from the zeros_like it writes into."""
    edges = torch.tensor([[0, 1, 2, 3], [4, 17, 5, 40]])
    advice = _crash_advice(tmp_path, edges, "watch")["advice"]
    assert advice.startswith(
        "dst, the index of index_add_ along dim 0, holds 4 to 40, but that dimension has 6 "
        "entries (0 to 5): 2 of 4 out of range."
    ), advice
    assert "renumbered" in advice and "- 1" not in advice


def test_renumbered_node_ids_train_clean(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _SumConv()
    edges = torch.tensor([[1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 1]]) - 1
    with nanwatch.watch(model, report_dir=str(tmp_path)) as nw:
        model(torch.randn(6, 8), edges).sum().backward()
        nw.step()
    assert nw.first_anomaly is None and not list(tmp_path.glob("*.json"))
