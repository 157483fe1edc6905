"""Sentinel mode hooks only the roots given to ``watch()``. A loop that never calls the root
-- it calls a part itself: ``model.conv(x, edges)``, a LightningModule's ``self.net(x)``, a
backbone and a head one by one, a wrapper's ``model.module(x)`` -- left every module call
unwatched, and a NaN born inside a part was told as "born on the way to the loss, outside
every watched module's output". The first backward of such a step now hooks the parts
until one is called from outside, keeps those (the real roots) and says, for that step,
why no module is named.

Beside it: a value a root's forward made and kept aside (``self.aux``), which the loss
read, is named in that forward with its line (the root replayed, as forensic mode traces
it), and sentinel counts a custom autograd.Function's backward among the loss code's
suspects instead of blaming the one division it knew by name."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)

MODES = ("sentinel", "watch", "forensic")


class _MeanConv(nn.Module):
    """A graph convolution that averages over each node's incoming edges: a node with none
    divides 0 by a count of 0."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.root = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        agg = torch.zeros_like(x).index_add_(0, dst, self.lin(x)[src])
        deg = torch.zeros(x.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0]))
        agg = agg / deg.unsqueeze(-1)
        return F.relu(agg + self.root(x))


class _Holder(nn.Module):
    """A model whose forward the loop never calls: it calls ``model.conv`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = _MeanConv(8)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        return self.conv(x, edges)


X = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
RING = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0]])  # every node has an edge in
CUT = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])  # nodes 4 and 5: no incoming edge


def _run(mode: str, edges: list[torch.Tensor]) -> tuple[nanwatch.Watcher, _Holder]:
    torch.manual_seed(0)
    model = _Holder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for e in edges:
            model.conv(X, e).sum().backward()  # the part, never model(...)
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw, model


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_born_in_a_part_the_loop_calls_itself_is_named_in_that_part(mode: str) -> None:
    nw, _ = _run(mode, [RING, RING, CUT])
    d = nw.report.diagnoses[0]
    assert (d.code, d.path, d.op, d.step) == ("NW111", "conv", "aten.div.Tensor", 2), d.headline
    assert nw.first_anomaly is not None
    assert nw.first_anomaly.summary.startswith("NaN born in the forward of conv (_MeanConv)")
    assert "test_unseen_sentinel_roots.py:" in nw.first_anomaly.summary  # the op's line


def test_sentinel_says_why_no_module_is_named_in_the_first_step_a_part_ran_alone() -> None:
    nw, _ = _run("sentinel", [CUT])
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.op == "aten.div"
    assert (
        ": _Holder did not run this step (the loss reached the weights of conv alone), and "
        "sentinel mode hooks only _Holder's own call: the parts the loop calls are hooked "
        "from the next step on; to watch them from the start, pass conv to nanwatch.watch, "
        "or call _Holder (loss.backward() at "
    ) in a.summary


@pytest.mark.parametrize("mode", MODES)
def test_a_healthy_loop_calling_a_part_is_silent_and_only_that_part_stays_hooked(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = _Holder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with nanwatch.watch(model, mode=mode, on_anomaly="raise", postmortem=False) as nw:
            for _ in range(3):
                model.conv(X, RING).sum().backward()
                opt.step()
                opt.zero_grad()
                nw.step()
            hooked = {q for q, m in model.named_modules() if m._forward_hooks}
    assert [str(w.message) for w in seen] == []
    assert nw.anomalies == [] and nw.report.diagnoses == []
    assert [t.step for t in nw.history] == [0, 1, 2]
    if mode == "sentinel":  # the root, and the part the loop calls: not conv.lin, conv.root
        assert hooked == {"", "conv"}
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_loop_that_calls_the_root_after_one_call_of_a_part_keeps_no_part_hooked() -> None:
    # the parts hooked to find the one the loop calls cost a hook call each per module
    # call: once the root runs instead, they all go, and sentinel is back to its one hook
    torch.manual_seed(0)
    model = _Holder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode="sentinel", on_anomaly="raise", postmortem=False) as nw:
        for i in range(3):
            out = model.conv(X, RING) if i == 0 else model(X, RING)
            out.sum().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            if i == 0:  # hooked after the first backward, until the next one
                assert {q for q, m in model.named_modules() if m._forward_hooks} == {
                    "",
                    "conv",
                    "conv.lin",
                    "conv.root",
                }
        hooked = {q for q, m in model.named_modules() if m._forward_hooks}
    assert hooked == {""}
    assert nw.anomalies == []


class _Head(nn.Module):
    """A scale head: the log of a linear layer's output, NaN where it is negative."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h).log()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = _Head()


class _Wrapper(nn.Module):
    """DataParallel-like: the watched object holds the model as ``.module``."""

    def __init__(self) -> None:
        super().__init__()
        self.module = _Net()


@pytest.mark.parametrize("mode", MODES)
def test_a_backbone_and_a_head_called_one_by_one_through_a_wrapper_are_both_watched(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = _Wrapper()
    with torch.no_grad():
        model.module.head.lin.bias.fill_(10.0)  # log of a positive value, until step 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for i in range(3):
            if i == 2:
                with torch.no_grad():
                    model.module.head.lin.bias.fill_(-10.0)
            feats = model.module.backbone(x)
            model.module.head(feats).sum().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    a = nw.first_anomaly
    assert a is not None and a.step == 2
    assert a.summary.startswith("NaN born in the forward of module.head (_Head)"), a.summary
    assert a.op is not None and a.op.op == "aten.log.default"


@pytest.mark.parametrize("bad_batch", [0, 2])
def test_lightning_sentinel_names_the_part_training_step_calls(
    tmp_path: Path, bad_batch: int
) -> None:
    pytest.importorskip("lightning.pytorch")
    import lightning.pytorch as L
    from nanwatch.callbacks import NanWatchCallback
    from torch.utils.data import DataLoader, TensorDataset

    from tests.test_lightning import fit

    class Graph(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.conv = _MeanConv(8)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.conv(x[:6], CUT if batch_idx == bad_batch else RING).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            return DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=8)

    torch.manual_seed(0)
    cb = NanWatchCallback(mode="sentinel", on_anomaly="skip")
    fit(tmp_path, Graph(), cb, batches=4)
    assert cb.watcher is not None
    a = cb.watcher.first_anomaly
    assert a is not None and a.step == bad_batch
    # the replay of the batch names the op in conv; its output was never seen by sentinel
    # at batch 0 (conv is watched from batch 1 on), so it is not "a value it did not return"
    start = (
        "NaN born in the forward of conv, called by the loop without Graph [op aten.div"
        if bad_batch == 0
        else "NaN born in the forward of conv (_MeanConv) [op aten.div"
    )
    assert a.summary.startswith(start), a.summary


class _NanInBackward(torch.autograd.Function):
    """Identity in forward; a NaN gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * float("nan")


def test_sentinel_counts_a_custom_functions_backward_among_the_loss_codes_suspects() -> None:
    # the loss code holds a division and a custom Function: sentinel reads no gradient
    # inside it, and blamed the division, the one "risky" node it knew by name
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    with nanwatch.watch(m, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        out = _NanInBackward.apply(m(x))
        (F.mse_loss(out, y) / 2.0).backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is None, a.summary
    assert "whose nodes DivBackward0, _NanInBackwardBackward can each make" in a.summary


# ---------------------------------------- a NaN a forward keeps aside, not in its output


class _MoE(nn.Module):
    """Top-1 routing with a load-balancing term kept on ``self.aux`` (the loop adds it to
    the loss): the mean router probability of the tokens sent to each expert, NaN for an
    expert that got none."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        choice = logits.argmax(-1)
        out = torch.zeros_like(x)
        aux = []
        for e, expert in enumerate(self.experts):
            sel = choice == e
            out[sel] = expert(x[sel])
            aux.append(F.softmax(logits, -1)[sel, e].mean())  # the mean over no token
        self.aux = torch.stack(aux).sum()
        return self.head(out)


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_kept_on_an_attribute_is_named_in_the_forward_that_made_it(mode: str) -> None:
    torch.manual_seed(0)
    model, crit = _MoE(), nn.CrossEntropyLoss()
    with torch.no_grad():
        model.router.bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))  # every token to expert 0
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
        loss = crit(model(x), y) + 0.01 * model.aux
        loss.backward()
        opt.step()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None
    assert a.summary.startswith(
        "NaN born in the forward of _MoE, in a value it did not return that the loss used "
        "[op aten.mean.default at "
    ), a.summary
    assert a.op.code is not None and "the mean over no token" in a.op.code
    d = nw.report.diagnoses[0]
    assert (d.code, d.path) == ("NW113", "_MoE"), d.headline
