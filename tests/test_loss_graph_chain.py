"""A log in loss code whose line is not known (watch and sentinel mode: the loss is a
function of the model's output, outside every module) is read from the loss's autograd
graph: what made the log's own input. ``log(1 - p)`` with ``p`` an nn.Sigmoid's output is
the complement of a saturated sigmoid, not "a ratio, a probability or an entropy": the fix
computes the loss from the logits (the failure of ``examples/train_nan.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.ops import made_from
from nanwatch.rules.domain import _chain_producer
from tests._diagnoses import text, top

torch.set_num_threads(1)


def _bce(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def _complement_only(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -((1 - y) * torch.log(1 - p)).mean()


def _saturated(loss_fn, mode: str, *, defer: bool = False):  # type: ignore[no-untyped-def]
    """A classifier ending in nn.Sigmoid whose logit for sample 0 is 40 (sigmoid rounds to
    exactly 1.0 in float32) with label 0: log(1 - p) is -inf there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1), nn.Sigmoid())
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[10.0, 0.0, 0.0]]))
        model[0].bias.zero_()
    x = torch.zeros(4, 3)
    x[0, 0] = 4.0
    y = torch.tensor([[0.0], [1.0], [0.0], [1.0]])
    nw = nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False)
    if defer:
        nw._defer_cpu = True
    with nw:
        loss = loss_fn(model(x), y)
        loss.backward()
        nw.step()
    return nw


@pytest.mark.parametrize("defer", [False, True])
def test_a_hand_written_bce_on_a_sigmoid_module_is_fixed_from_the_logits(defer: bool) -> None:
    d = top(_saturated(_bce, "watch", defer=defer))
    assert d.code == "NW110"
    assert (
        d.title == "Log of zero in a hand-written binary cross-entropy: the sigmoid saturated at 1"
    )
    assert "log <- rsub <- sigmoid" in text(d)
    assert "a hand-written binary cross-entropy" in text(d)
    lines = d.fix.splitlines()
    assert lines[0].startswith("model[1] = nn.Identity()")  # the Sigmoid module, by its path
    assert "binary_cross_entropy_with_logits(logits, y)" in lines[1]
    assert "logsigmoid(-logits)" in lines[2]
    assert "a ratio" not in d.fix  # not the recipe for a log of unknown origin


def test_sentinel_mode_says_the_same_without_the_module() -> None:
    # sentinel records the model's output only: the sigmoid is known from the graph, the
    # module that applied it is not
    d = top(_saturated(_bce, "sentinel"))
    assert d.code == "NW110"
    assert "p the output of a sigmoid" in text(d)
    assert d.fix.splitlines()[0].startswith("loss = ")
    assert "binary_cross_entropy_with_logits" in d.fix and "nn.Identity" not in d.fix


def test_a_log_of_the_complement_alone_leads_with_logsigmoid() -> None:
    d = top(_saturated(_complement_only, "watch"))
    assert d.code == "NW110"
    assert d.title == "Log of zero: 1 - sigmoid, with the sigmoid saturated at 1"
    assert "hand-written binary cross-entropy" not in text(d)
    lines = d.fix.splitlines()
    assert lines[0].startswith("model[1] = nn.Identity()")
    assert "logsigmoid(-logits)" in lines[1]


def test_made_from_follows_first_inputs_and_stops_at_watched_outputs() -> None:
    z = torch.zeros(2, requires_grad=True)
    p = torch.sigmoid(z * 2)
    q = torch.log(1 - p)
    assert made_from(q.grad_fn) == ["rsub", "sigmoid", "mul", "leaf"]
    assert made_from(q.grad_fn, depth=2) == ["rsub", "sigmoid"]
    stop = p.grad_fn
    assert made_from(q.grad_fn, lambda n: n is stop) == ["rsub", "watched:sigmoid"]
    assert made_from(torch.log(z.exp()).grad_fn) == ["exp", "leaf"]


def test_the_chain_says_what_made_a_logs_input() -> None:
    assert _chain_producer(["rsub", "watched:sigmoid"]) == "one-minus-sigmoid"
    assert _chain_producer(["rsub", "sigmoid", "mul"]) == "one-minus-sigmoid"
    assert _chain_producer(["rsub", "mul", "erf"]) == "cdf"
    assert _chain_producer(["rsub", "mul"]) == "one-minus"
    assert _chain_producer(["watched:softmax"]) == "softmax"
    assert _chain_producer(["relu", "addmm"]) == "relu"
    assert _chain_producer(["exp", "leaf"]) is None
    assert _chain_producer([]) is None


def test_the_chain_travels_with_the_op_event_in_a_saved_report() -> None:
    nw = _saturated(_bce, "watch")
    ev = next(e for t in nw.history for e in t.ops if e.made_from)
    from nanwatch.records import OpEvent

    again = OpEvent.from_dict(ev.to_dict())
    assert again.made_from == ev.made_from == ["rsub", "watched:sigmoid"]


def _xent(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(z, dim=-1)
    return -(torch.log(p) * torch.nn.functional.one_hot(y, z.shape[-1])).sum(-1).mean()


def _spread(mode: str, *, defer: bool = False):  # type: ignore[no-untyped-def]
    """Logits 100 apart: the softmax of the low ones is subnormal (not 0), its log finite,
    and the log's gradient 1/p overflows in backward."""
    model = nn.Linear(2, 3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[50.0, 0.0], [-50.0, 0.0], [0.0, 0.0]]))
        model.bias.zero_()
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    y = torch.tensor([1, 2])
    nw = nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False)
    if defer:
        nw._defer_cpu = True
    with nw:
        _xent(model(x), y).backward()
        nw.step()
    return nw


def test_a_subnormal_softmax_under_a_log_gets_log_softmax() -> None:
    d = top(_spread("watch"))
    assert d.code == "NW110"
    assert "the log's input is subnormal" in text(d)
    assert "a softmax output (log <- softmax): a probability that underflowed\n" in text(d) + "\n"
    assert d.fix.startswith("logp = F.log_softmax(logits, dim=-1)")


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_log_node_named_without_its_input_claims_no_value(mode: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # read late (the accelerator path) with nothing of what the node saved kept (over the
    # byte budget), or in sentinel, the log's node is known by its name: what it was given
    # is not said, only what its gradient makes where
    import nanwatch.watcher as w

    monkeypatch.setattr(w, "_KEEP_SAVED", 0)
    d = top(_spread(mode, defer=True))
    assert d.code == "NW110"
    words = text(d)
    assert "its input x was freed before it could be read" in words
    assert "below 0 is NaN" not in words and "minimum is ?" not in words
    assert "log_softmax" in d.fix


def test_read_late_with_what_it_saved_the_log_node_is_told_as_on_the_cpu() -> None:
    d = top(_spread("watch", defer=True))
    assert d.code == "NW110"
    assert "the log's input is subnormal" in text(d)
    assert d.fix.startswith("logp = F.log_softmax(logits, dim=-1)")


class _Het(nn.Module):
    """A mean and a variance head; the variance is a Linear's raw output."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(2, 1)
        self.var = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mu(x), self.var(x)


def _gaussian_nll(mu: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (0.5 * torch.log(var) + (y - mu) ** 2 / (2 * var)).mean()


def _shifted_nll(mu: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (0.5 * torch.log(var - 3) + (y - mu) ** 2).mean()


def _het(loss_fn, *, defer: bool = False):  # type: ignore[no-untyped-def]
    model = _Het()
    with torch.no_grad():
        model.var.weight.fill_(1.0)
        model.var.bias.fill_(-1.0)
    x = torch.tensor([[0.1, 0.2], [2.0, 1.0]])
    nw = nanwatch.watch(model, on_anomaly="record", postmortem=False)
    if defer:
        nw._defer_cpu = True
    with nw:
        mu, var = model(x)
        loss_fn(mu, var, torch.zeros(2, 1)).backward()
        nw.step()
    return nw


@pytest.mark.parametrize("defer", [False, True])
def test_a_log_of_a_linears_raw_output_names_the_layer(defer: bool) -> None:
    d = top(_het(_gaussian_nll, defer=defer))
    assert d.code == "NW110"
    assert "is the output of var (Linear) itself (the same 2 values" in text(d)
    assert "softplus(model.var(h)) + 1e-6" in d.fix


def test_a_log_of_a_value_computed_from_the_layer_is_not_called_its_output() -> None:
    d = top(_het(_shifted_nll))
    assert d.code == "NW110"
    assert "var (Linear)" not in text(d)
    assert "find what makes it negative" in d.fix


def test_a_std_over_the_last_dim_of_one_element_in_loss_code_is_named() -> None:
    # std(-1): autograd saves dim -1 as 2**64 - 1; read modulo the rank it was dim 0 of a
    # 3-d tensor (two elements), and the std over one element went unnamed (NW100)
    model = nn.Linear(4, 1)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        h = model(torch.randn(2, 3, 4))
        with pytest.warns(UserWarning, match="degrees of freedom"):
            loss = h.std(-1).sum()
        loss.backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW113"
    assert "reduced 1 element into each output (6 values into 6 outputs)" in text(d)


def _masked_pooling(partial: bool):  # type: ignore[no-untyped-def]
    """Attention pooling in loss code: softmax over scores a padding mask filled with -inf;
    row (0, 1) is padding everywhere. ``partial``: batch 1 is padded at its end too."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    mask = torch.zeros(2, 3, 6, dtype=torch.bool)
    mask[0, 1, :] = True
    if partial:
        mask[1, :, 4:] = True
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        h = model(torch.randn(2, 3, 4))
        w = torch.softmax(h.masked_fill(mask, float("-inf")), -1)
        (w * h).sum().backward()
        nw.step()
    return nw


def test_a_fully_masked_row_of_a_softmax_in_loss_code_is_nw402() -> None:
    # the fill value is not saved; the rows made NaN are exactly those the mask covers
    # whole, and partly covered rows stayed finite: the fill was -inf
    nw = _masked_pooling(partial=True)
    d = top(nw)
    assert d.code == "NW402"
    assert "12 of 36 values are -inf and none is NaN or +inf: at least one row" in text(d)
    assert nw.first_anomaly is not None and nw.first_anomaly.op is not None
    assert nw.first_anomaly.op.scalars["nan_rows"] == 1


def test_without_a_partly_masked_row_the_fill_is_not_guessed() -> None:
    # a NaN or +inf fill would make the same rows NaN: the op and its rows are named, the
    # fill is not claimed
    nw = _masked_pooling(partial=False)
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.op == "aten._softmax"
    assert a.op.inputs == [] and a.op.scalars["nan_rows"] == 1
    assert top(nw).code != "NW402"
