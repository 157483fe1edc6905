"""Fixes that must run when pasted (found on unseen recommenders, probabilistic heads and
graph models): padding that shares its row with a real item, GaussianNLLLoss's var, a
sparse adjacency holding inf, and modules that return ``torch.distributions`` objects."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import (
    Categorical,
    Independent,
    MixtureSameFamily,
    Normal,
)

import nanwatch
from nanwatch import AnomalyError, GuardError

torch.set_num_threads(1)


# -- NW513: padding written as -1 with padding_idx=-1 --------------------------------------
class SeqRec(nn.Module):
    def __init__(self, n: int, d: int, *, rows: int, padding_idx: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, d, padding_idx=padding_idx)
        self.out = nn.Linear(d, n)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(seq).mean(1))


def _histories(n: int) -> torch.Tensor:
    torch.manual_seed(0)
    seq = torch.randint(0, n - 1, (16, 8))
    seq[:, :3] = -1  # left padding, the data team's convention
    seq[0, 5] = n - 1  # the last item is a real item too
    return seq


def test_padding_on_a_row_that_is_a_real_id_gets_a_row_of_its_own() -> None:
    """padding_idx=-1 is row n-1 to torch, a real item of this batch: mapping -1 there
    merges padding with that item, which then never trains."""
    n = 50
    model = SeqRec(n, 8, rows=n, padding_idx=-1)
    seq = _histories(n)
    with pytest.raises(GuardError) as info, nanwatch.watch(model):
        model(seq)
    e = info.value
    assert e.code == "NW513" and e.path == "emb"
    assert "padding row (49) is also a real id here (1 position)" in str(e)
    assert "self.emb = nn.Embedding(51, 8, padding_idx=50)" in e.fix
    assert "self.emb(seq.masked_fill(seq < 0, 50))" in e.fix
    assert "masked_fill(seq < 0, 49)" not in e.fix
    # the pasted fix: a table with a row for padding alone, and every item trains
    model.emb = nn.Embedding(51, 8, padding_idx=50)
    model(seq.masked_fill(seq < 0, 50)).sum().backward()
    assert model.emb.weight.grad is not None
    assert model.emb.weight.grad[49].abs().sum() > 0


def test_functional_negative_padding_idx_names_its_row() -> None:
    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(10, 4))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return F.embedding(ids, self.w, padding_idx=-1)

    m = Table()
    with pytest.raises(GuardError) as info, nanwatch.watch(m):
        m(torch.tensor([[1, 3, -1, -1]]))  # 9 does not occur: the negative padding_idx says
    e = info.value
    assert e.code == "NW513"
    assert "padding_idx=-1 means row 9 to torch (10 - 1)" in str(e)
    assert "F.embedding(ids.masked_fill(ids < 0, 10), self.w, padding_idx=10)" in e.fix
    assert e.fix.endswith("# once self.w has 11 rows: 10 for padding")


def test_padding_row_kept_for_padding_still_maps_to_it() -> None:
    """A table with a row set aside for padding (padding_idx=n, ids 0..n-1): the padding
    row is not a real id, so -1 is simply mapped onto it."""
    n = 50
    model = SeqRec(n, 8, rows=n + 1, padding_idx=n)
    seq = _histories(n)
    with pytest.raises(GuardError) as info, nanwatch.watch(model):
        model(seq)
    e = info.value
    assert e.code == "NW513"
    assert e.fix.startswith("return self.out(self.emb(seq.masked_fill(seq < 0, 50)).mean(1))")
    assert "row of its own" not in str(e).splitlines()[0]


def test_healthy_padding_row_stays_silent() -> None:
    n = 50
    model = SeqRec(n, 8, rows=n + 1, padding_idx=0)
    seq = (_histories(n) + 1).clamp(min=0)  # shifted ids, padding 0
    with nanwatch.watch(model) as nw:
        model(seq).sum().backward()
        nw.step()
    assert not nw.report.diagnoses


# -- NW506: GaussianNLLLoss's var is sized by the input ---------------------------------
def _gaussian_head() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(3, 2), torch.randn(32, 3), torch.randn(32)


def test_gaussian_nll_broadcast_fix_unsqueezes_the_target() -> None:
    net, xb, yb = _gaussian_head()
    crit = nn.GaussianNLLLoss()
    with pytest.raises(GuardError) as info, nanwatch.watch(net, crit):
        out = net(xb)
        mu, var = out[:, :1], out[:, 1:].exp()
        loss = crit(mu, yb, var)
    e = info.value
    assert e.code == "NW506"
    assert e.fix == "loss = crit(mu, yb.unsqueeze(-1), var)"
    assert "neither warns nor errs" in e.diagnosis.explanation
    assert "only warns" not in e.diagnosis.explanation
    # the pasted fix runs, and compares each prediction with its own target only
    out = net(xb)
    mu, var = out[:, :1], out[:, 1:].exp()
    loss = crit(mu, yb.unsqueeze(-1), var)
    assert loss.shape == ()


def test_mse_broadcast_still_squeezes_the_input_and_says_pytorch_warns() -> None:
    net, xb, yb = _gaussian_head()
    crit = nn.MSELoss()
    with pytest.raises(GuardError) as info, nanwatch.watch(net, crit):
        pred = net(xb)[:, :1]
        loss = crit(pred, yb)
        loss.backward()
    e = info.value
    assert e.code == "NW506" and e.fix == "loss = crit(pred.squeeze(-1), yb)"
    assert "only warns" in e.diagnosis.explanation


def test_gaussian_nll_same_shapes_stay_silent() -> None:
    net, xb, yb = _gaussian_head()
    crit = nn.GaussianNLLLoss()
    with nanwatch.watch(net, crit) as nw:
        out = net(xb)
        loss = crit(out[:, 0], yb, out[:, 1].exp())
        loss.backward()
        nw.step()
    assert not nw.report.diagnoses


# -- NW401: a sparse adjacency holding inf ---------------------------------------------
class GCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(adj, self.lin(x))


def _graph() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    n = 6
    row, col = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([1, 2, 3, 4, 5])
    deg = torch.zeros(n).index_add_(0, row, torch.ones(5))  # node 5 has no out-edge
    d = deg.pow(-0.5)  # 0 ** -0.5 = inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # sparse invariant checks
        adj = torch.sparse_coo_tensor(torch.stack([row, col]), d[row] * d[col], (n, n))
    return torch.randn(n, 4), adj.coalesce()


def _pasted(fix: str, **names: torch.Tensor) -> dict[str, object]:
    scope: dict[str, object] = {"torch": torch, **names}
    exec(fix, scope)  # the fix runs as printed
    return scope


@pytest.mark.parametrize("keyword", [False, True])
def test_sparse_input_fix_checks_the_bad_input_through_its_values(keyword: bool) -> None:
    x, adj = _graph()
    model = GCN()
    with pytest.raises(AnomalyError) as info, nanwatch.watch(model):
        (model(x, adj=adj) if keyword else model(x, adj)).sum().backward()
    d = info.value.diagnosis
    assert d.code == "NW401"
    name = "adj"  # by keyword, or positional: the forward's parameter name
    assert f"v = {name}.coalesce()" in d.fix
    assert "isfinite(x)" not in d.fix  # x, the node features, is clean
    if not keyword:
        assert "# adj: the 2nd argument you pass to GCN (its forward's `adj`)" in d.fix
    scope = _pasted(d.fix, **{name: adj})
    fixed = scope[name]
    assert isinstance(fixed, torch.Tensor) and fixed.is_sparse
    assert torch.isfinite(fixed.coalesce().values()).all()


def test_dense_second_input_is_named_not_x() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 2), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(feats)

    torch.manual_seed(0)
    x, feats = torch.randn(8, 4), torch.randn(8, 3)
    feats[2, 1] = float("nan")
    model = Two()
    with pytest.raises(AnomalyError) as info, nanwatch.watch(model):
        model(x, feats).sum().backward()
    d = info.value.diagnosis
    assert d.code == "NW401"
    assert "bad = ~torch.isfinite(feats).flatten(1).all(dim=1)" in d.fix
    assert "feats = torch.nan_to_num(feats" in d.fix


def test_healthy_sparse_graph_stays_silent() -> None:
    x, adj = _graph()
    adj = torch.sparse_coo_tensor(
        adj.indices(), torch.nan_to_num(adj.values(), posinf=0.0), adj.shape
    ).coalesce()
    model = GCN()
    with nanwatch.watch(model) as nw:
        model(x, adj).sum().backward()
        nw.step()
    assert not nw.report.diagnoses


# -- distributions returned by a module -------------------------------------------------
class GaussianHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> Normal:
        out = self.lin(x)
        return Normal(out[:, 0], F.softplus(out[:, 1]) + 1e-3)


class MixtureHead(nn.Module):
    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.k = k
        self.lin = nn.Linear(4, 3 * k)

    def forward(self, x: torch.Tensor) -> MixtureSameFamily:
        logits, mu, s = self.lin(x).split(self.k, dim=-1)
        comp = Independent(Normal(mu.unsqueeze(-1), F.softplus(s).unsqueeze(-1) + 1e-3), 1)
        return MixtureSameFamily(Categorical(logits=logits), comp)


@pytest.mark.parametrize("head", [GaussianHead, MixtureHead])
def test_distribution_output_is_watched_without_a_warning(head: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = head()
    x, y = torch.randn(16, 4), torch.randn(16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model) as nw:
            dist = model(x)
            target = y if head is GaussianHead else y.unsqueeze(-1)
            loss = -dist.log_prob(target).mean()
            loss.backward()
            nw.step()
    assert torch.isfinite(loss)
    assert not [w for w in caught if "nanwatch" in str(w.message)]
    assert not nw.report.diagnoses
    if head is MixtureHead:
        assert "probs" not in vars(dist.mixture_distribution)  # lazy: never computed


@pytest.mark.cpu_path(
    reason="a raise inside the forward; the accelerator path raises once the value is read"
)
def test_nan_in_a_distribution_parameter_is_caught_in_the_forward() -> None:
    """The head's own code makes the scale NaN (sqrt of a negative): the Normal it returns
    is read when the head returns, before any loss, and the op and line are named."""

    class SqrtHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> Normal:
            out = self.lin(x)
            return Normal(out[:, 0], torch.sqrt(out[:, 1]), validate_args=False)

    torch.manual_seed(0)
    model = SqrtHead()
    x = torch.randn(16, 4)
    returned = []
    with pytest.raises(AnomalyError) as info, nanwatch.watch(model):
        returned.append(model(x))
    assert not returned  # stopped as the head returned
    d = info.value.diagnosis
    assert d.code == "NW112" and d.path == "SqrtHead"
    assert "torch.sqrt(out[:, 1])" in " ".join(d.evidence)
