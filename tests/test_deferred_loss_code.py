"""The accelerator path (driven on the CPU with ``_defer_cpu``) gives the loss code's
diagnoses that the CPU path gives, although its values are read late, when the loss and
the temporaries the user's code made may be gone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import LOSS_PATH, AnomalyKind
from nanwatch.stats import HostRead
from tests.test_backward_lines import _zero_linear
from tests.test_unseen_mtl import TwoHeads


def _deferred(*modules: nn.Module, **kw: object) -> nanwatch.Watcher:
    nw = nanwatch.watch(*modules, on_anomaly="record", postmortem=False, **kw)  # type: ignore[arg-type]
    nw._defer_cpu = True  # the accelerator path, driven on CPU
    return nw


def _sqrt_step(model: nn.Module) -> None:
    out = model(torch.randn(2, 4))
    torch.sqrt(out).mean().backward()  # the loss is gone once this returns


def test_sentinel_names_the_loss_codes_risky_node_after_the_loss_is_gone() -> None:
    model = _zero_linear()
    nw = _deferred(model, mode="sentinel")
    with nw:
        _sqrt_step(model)
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.origin == "after-output"
    assert a.op is not None and a.op.node == "SqrtBackward0"  # named at backward()
    assert nw.history[-1].diagnoses[0].code != "NW100"


def test_watch_mode_names_the_single_loss_node_next_to_the_output() -> None:
    model = _zero_linear()
    nw = _deferred(model)
    with nw:
        out = model(torch.randn(2, 4))
        (out.abs() + 1).log().mean().backward()  # finite: nothing to name
        nw.step()
    assert nw.first_anomaly is None


class _Half(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g / torch.zeros_like(g)  # the user's own backward makes inf / NaN


def test_a_custom_functions_backward_in_the_loss_code_is_named_not_its_neighbour() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    nw = _deferred(model)
    with nw:
        e = model(torch.randn(5, 4))
        _Half.apply(e[:, None] - e[None]).pow(2).mean().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD and a.path == LOSS_PATH
    assert "custom autograd.Function _Half" in a.summary
    assert a.op is None or a.op.node != "SubBackward0"  # not blamed on the node beside it


def test_a_loss_module_given_a_selection_of_the_output_is_replayed_on_that_selection() -> None:
    torch.manual_seed(0)
    model, crit = nn.Linear(6, 2), nn.SmoothL1Loss()
    nw = _deferred(model, crit)
    with nw:
        p = model(torch.randn(4, 6))
        keep = torch.zeros(4, dtype=torch.bool)  # nothing selected: the mean of nothing
        crit(p[keep], torch.zeros_like(p[keep])).backward()
        nw.step()
    d = nw.history[-1].diagnoses[0]
    assert d.code == "NW113" and d.op is not None and d.op.startswith("aten.smooth_l1_loss")


def test_a_full_backward_hook_on_a_head_is_named_when_read_late() -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    handle = model.head2.register_full_backward_hook(
        lambda m, gi, go: (gi[0] / gi[0].norm(),)  # type: ignore[index]  # 0/0
    )
    try:
        nw = _deferred(model)
        with nw:
            p1, p2 = model(torch.randn(16, 8))
            (p1.pow(2).mean() + 0.0 * p2.sum()).backward()
            nw.step()
    finally:
        handle.remove()
    a = nw.first_anomaly
    assert a is not None and a.path == "head2"
    assert "backward hook of head2 (register_full_backward_hook)" in a.summary


def _focal_like(model: nn.Module, w: torch.Tensor | None = None) -> None:
    """(1 - p) ** 0.5 at p == 1: PowBackward0 makes NaN from a finite gradient; what it
    saved (1 - p, with exact zeros) is the evidence, freed once the node has run."""
    p = torch.sigmoid(model(torch.full((2, 4), 1.0)) * 100.0)
    loss = (1 - p) ** 0.5
    if w is not None:
        loss = loss * w
    loss.mean().backward()


def _saturating() -> nn.Linear:
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()
    return model


def _focal_run() -> nanwatch.Watcher:
    model = _saturating()
    nw = _deferred(model)
    with nw:
        _focal_like(model)
        nw.step()
    return nw


def test_a_flagged_loss_node_is_read_with_what_it_saved_kept_from_its_hook() -> None:
    nw = _focal_run()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.node == "PowBackward0"
    base = dict(a.op.inputs)["self"]
    assert base is not None and base.min == 0 and base.zeros == 6  # 1 - p, all at 0
    assert a.op.scalars["exponent"] == 0.5
    assert nw._pending_nodes == []  # nothing kept once the flags were read


def test_over_the_byte_budget_a_flagged_node_is_named_by_its_name(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import nanwatch.watcher as w

    monkeypatch.setattr(w, "_KEEP_SAVED", 0)
    a = _focal_run().first_anomaly
    assert a is not None and a.op is not None and a.op.node == "PowBackward0"
    assert a.op.inputs == []  # not kept: its name and its line are the evidence


def test_a_saved_value_written_in_place_after_the_hook_is_not_told_as_seen() -> None:
    # the flag is read at the step's end: a weight the flagged node saved (bias ** 0.5
    # saves the bias itself) was written in place before that, so its values are no
    # longer those the node saw, and the node is named by its name alone
    model = _zero_linear()
    nw = _deferred(model)
    with nw:
        out = model(torch.randn(2, 4))
        (out.sum() + (model.bias**0.5).sum()).backward()  # d/db sqrt(b) at 0: inf
        with torch.no_grad():
            model.bias.add_(1.0)
        nw.step()
    ev = next(e for t in nw.history for e in t.ops if e.node == "PowBackward0")
    assert ev.inputs == [] and ev.scalars["exponent"] == 0.5


def test_a_nan_target_hidden_by_where_is_found_in_what_the_loss_code_saved() -> None:
    # (p - y) ** 2 of a NaN target, hidden by torch.where: no flag checks a whole power,
    # and its saved operand (p - y), kept when backward began, holds the NaN that backward
    # multiplies a 0 by, as the CPU path reads it in the node's hook
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    nw = _deferred(model)
    with nw:
        p = model(torch.randn(8, 4))
        y = torch.randn(8, 6)
        y[:, 4:] = float("nan")
        torch.where(~torch.isnan(y), (p - y) ** 2, 0.0).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.node == "PowBackward0"
    assert dict(a.op.inputs)["self"].nan == 16  # read from the operand kept
    assert nw.history[0].diagnoses[0].code == "NW407"
    assert nw._loss_snaps == []  # released at the step's end


def test_a_gathers_saved_input_is_no_factor_of_its_gradient() -> None:
    # alpha * logp with alpha = 1 / count, a count of 0: the Mul that saved alpha (+inf) is
    # where 0 x inf is NaN; the gather nearer the loss saved the product only for its shape
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    counts = torch.tensor([500.0, 30.0, 0.0])
    alpha = counts.sum() / (len(counts) * counts)
    nw = _deferred(m)
    with nw:
        logp = torch.nn.functional.log_softmax(m(torch.randn(8, 4)), 1)
        y = torch.randint(0, 2, (8,))
        (-(alpha * logp).gather(1, y[:, None]).mean()).backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.node == "MulBackward0"


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.act = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_loss_codes_graph_is_read_after_backward_when_the_forward_had_not_landed(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a GPU-bound step: the forward's statistics have not landed when backward() begins,
    # so the +inf loss is found before the update, after backward freed what the loss
    # code saved and the user dropped the loss. It was NW100, "not traced in this mode";
    # the graph is read as backward() found it, from the saved values kept then
    monkeypatch.setattr(HostRead, "ready", lambda self: False)
    torch.manual_seed(0)
    model = _Classifier()
    with torch.no_grad():
        model.fc.weight.copy_(torch.tensor([[10.0, 0.0, 0.0]]))
        model.fc.bias.zero_()
    x = torch.zeros(4, 3)
    x[0, 0] = 4.0  # a logit of 40: the sigmoid rounds to exactly 1.0 in float32
    y = torch.tensor([[0.0], [1.0], [0.0], [1.0]])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nw = _deferred(model, mode=mode)
    with nw:
        p = model(x)
        (-(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()).backward()
        opt.step()  # the forward is read here, before the update
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW110", d.title
    assert "hand-written binary cross-entropy" in d.title
    assert nw._late_loss is None  # not held past the step


def test_a_loss_graph_read_late_stops_at_a_watched_output_the_user_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the loss code's graph read after backward, once the function that made the watched
    # output returned: the walk ends at that output's node, as it did while the output was
    # alive, not inside the module that made it (its "add" is the module's own op)
    from tests.test_unseen_domain10 import _CRF

    monkeypatch.setattr(HostRead, "ready", lambda self: False)
    m = _CRF()

    def run() -> None:
        t = m.trans()  # -inf at a forbidden transition
        mask = torch.tensor([1.0, 1.0, 0.0])
        (t[torch.tensor([1, 0, 0]), torch.tensor([0, 2, 2])] * mask).sum().backward()

    nw = _deferred(m)
    with nw:
        run()
        nw.step()
    notes = [n for n in nw.history[0].notes if n.kind == "loss_graph"]
    assert notes and notes[0].data["ops"] == ["sum", "mul", "index"]
