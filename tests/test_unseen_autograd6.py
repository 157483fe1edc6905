"""An overflow hidden inside a watched criterion's forward (NW105) is fixed in the loss
code, not as if the criterion were the model's forward."""

from __future__ import annotations

from nanwatch.records import OpEvent, Phase
from nanwatch.rules.testing import TraceBuilder, diagnose, stat


def _criterion_step() -> TraceBuilder:
    """A float16 Net, then a watched criterion module (an nn loss: a root call with
    is_loss) whose own op overflowed to +inf, absorbed by the next op: no record is bad."""
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0, numel=64), shape=(8, 8), dtype="float16")
    o = b.forward(net, stat(-30.0, 30.0, numel=32), dtype="float16", shape=(8, 4))
    crit = b.call("EnergyLoss", root=True, is_loss=True)
    b.input(crit, source=o, dtype="float16", shape=(8, 4))
    b.forward(crit, stat(0.0, 0.0, numel=1), dtype="float16", shape=())
    del x
    b.op(
        OpEvent(
            op="aten.sum.default",
            phase=Phase.FORWARD,
            path="EnergyLoss",
            born="+inf",
            output=stat(0.0, float("inf"), numel=1),
            inputs=[("self", stat(0.0, 900.0, numel=2048, counted=True))],
            source="train.py:42",
            # the user's line calls the criterion; the op is inside its forward
            code="loss = criterion(model(x))",
            dtype="float16",
        )
    )
    return b


def test_hidden_overflow_in_a_watched_loss_module_is_fixed_in_the_loss_code() -> None:
    trace = _criterion_step().build()
    assert trace.anomaly is None
    d = next(d for d in diagnose(trace) if d.code == "NW105")
    assert d.path == "EnergyLoss"
    assert "in the loss code" in d.fix
    assert "model's forward" not in d.fix
    assert "model.float()" not in d.fix  # the model is not where it overflowed
