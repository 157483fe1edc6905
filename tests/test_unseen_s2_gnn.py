"""Graph neural networks in plain torch, seen by nanwatch (stop 41, s2).

A GCN that keeps its normalized adjacency as a sparse tensor (``torch.sparse_coo_tensor``
of ``dinv[src] * dinv[dst]``, then ``torch.sparse.mm``) on a directed graph: a node with
out-edges and no in-edge has degree 0, ``deg.pow(-0.5)`` is inf there, and the inf goes
into the sparse tensor's values. The op checker read no value of a sparse tensor, so the
inf seemed born in ``aten._sparse_addmm`` from "a buffer or a tensor the code captured,
made outside the traced ops", with advice about inverse-frequency class weights
(sentinel, watch). It now reads a sparse tensor's stored values, and the ``pow`` is named
with the degree fix, as for a dense GCN.

A CUDA device-side assert raised after a layer's ``index_add_(0, dst, h[src])`` with a
node id past the graph's nodes: the post-mortem said class targets or token ids. No GPU
value can be read then, but the source, names and shapes can: the advice now names the
indices the code passed, the dims and their sizes, and the check to add. The assert is
emulated on the CPU by raising CUDA's own message from the op that met it (the next op:
kernels run asynchronously)."""

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

# a ring over nodes 0..4, both directions, and node 5 -> 0: node 5 has no in-edge
EDGES = torch.tensor([[0, 1, 2, 3, 4, 1, 2, 3, 4, 0, 5], [1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 0]])


class _SparseGcn(nn.Module):
    def __init__(self, *, fixed: bool = False, layout: torch.layout = torch.sparse_coo) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 3)
        self.fixed = fixed
        self.layout = layout

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        src, dst = edge_index
        deg = torch.zeros(n).index_add_(0, dst, torch.ones(dst.numel()))
        if self.fixed:
            deg = deg.clamp_min(1)
        dinv = deg.pow(-0.5)
        w = dinv[src] * dinv[dst]
        adj = torch.sparse_coo_tensor(torch.stack([dst, src]), w, (n, n))
        if self.layout is torch.sparse_csr:
            adj = adj.to_sparse_csr()
        h = F.relu(torch.sparse.mm(adj, self.l1(x)))
        return torch.sparse.mm(adj, self.l2(h))


def _train(mode: str, **kw: object) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = _SparseGcn(**kw)  # type: ignore[arg-type]
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            F.cross_entropy(model(x, EDGES), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("mode", MODES)
def test_an_inf_in_a_sparse_adjacency_is_named_where_the_degree_made_it(mode: str) -> None:
    nw = _train(mode)
    a = nw.first_anomaly
    assert a is not None and a.step == 0
    assert a.op is not None and a.op.op == "aten.pow.Tensor_Scalar", a.summary
    d = nw.report.diagnoses[0]
    assert (d.code, d.op) == ("NW112", "aten.pow.Tensor_Scalar"), d.headline
    assert "dinv = deg.pow(-0.5)" in " ".join(d.evidence)
    assert d.fix.splitlines()[0].startswith("dinv = deg.clamp_min(1).pow(-0.5)")
    said = " ".join(t for x in nw.report.diagnoses for t in (*x.evidence, x.explanation, x.fix))
    assert "outside the traced ops" not in said and "counts.clamp_min" not in said


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_an_inf_in_a_csr_adjacency_is_named_where_the_degree_made_it() -> None:
    nw = _train("watch", layout=torch.sparse_csr)
    d = nw.report.diagnoses[0]
    assert (d.code, d.op) == ("NW112", "aten.pow.Tensor_Scalar"), d.headline


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("mode", MODES)
def test_the_sparse_gcn_with_degrees_clamped_trains_clean(mode: str) -> None:
    nw = _train(mode, fixed=True)
    assert nw.first_anomaly is None
    assert not nw.report.diagnoses


class _Norm(nn.Module):
    """The op after the scatter: where an asynchronous CUDA error surfaces."""

    def __init__(self, emulate: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.emulate = emulate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emulate:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return self.ln(x)


class _SumConv(nn.Module):
    def __init__(self, emulate: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = _Norm(emulate)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        h = self.lin(x)
        out = torch.zeros_like(h).index_add_(0, dst, h[src])
        return self.norm(out)


def _advice(tmp_path: Path, mode: str, edges: torch.Tensor, *, emulate: bool = True) -> dict:
    model = _SumConv(emulate)
    with (
        pytest.raises(RuntimeError, match="device-side assert triggered") as info,
        nanwatch.watch(model, mode=mode, report_dir=str(tmp_path)),
    ):
        model(torch.randn(6, 8), edges).sum().backward()
    assert type(info.value) is RuntimeError  # torch's own error, unchanged
    (path,) = sorted(tmp_path.glob("*.json"))
    err: dict = json.loads(path.read_text())["error"]
    assert err["class"] == "cuda-device-assert"
    return err


@pytest.mark.parametrize("mode", MODES)
def test_a_device_assert_after_a_scatter_names_the_edge_indices(tmp_path: Path, mode: str) -> None:
    advice = _advice(tmp_path, mode, torch.tensor([[0, 1, 2, 3], [4, 1, 5, 2]]))["advice"]
    assert advice.startswith(
        "The assert most likely came from an index this code passed: src, the index into h "
        "along dim 0 (6 entries) and dst, the index of index_add_ along dim 0 (6 entries), at "
        "test_unseen_s2_gnn.py:"
    ), advice
    assert "(out = torch.zeros_like(h).index_add_(0, dst, h[src]))" in advice
    assert "assert 0 <= int(dst.min()) and int(dst.max()) < 6" in advice
    assert "class target outside" not in advice
    assert advice.endswith("The CUDA context is now unusable: restart the process after the fix.")


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin(x)
        raise RuntimeError("CUDA error: device-side assert triggered")


def test_a_device_assert_with_no_index_in_sight_keeps_the_general_advice(tmp_path: Path) -> None:
    model = _Plain()
    with (
        pytest.raises(RuntimeError, match="device-side assert"),
        nanwatch.watch(model, report_dir=str(tmp_path)),
    ):
        model(torch.randn(2, 8))
    (path,) = sorted(tmp_path.glob("*.json"))
    advice = json.loads(path.read_text())["error"]["advice"]
    assert advice.startswith("A CUDA kernel's assertion failed, most often an index out of range")
