"""What older torch releases in the declared range (``torch>=2.1``) lack, simulated on the
one this suite runs on: the fallbacks must give the same answers.

Seen on torch 2.4 (CPU): an autograd node carries no ``_input_metadata`` before 2.5, so a
loss on ``model(x).float()`` (a float32 copy of a float16 output that is already gone)
could not be linked to the model's record, and NW103 warned about an exp the loss computes
in float32."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import guards


def _without_metadata(node: Any) -> Any:
    """A stand-in for ``node`` as torch < 2.5 has it: the same class name and metadata
    dict, no ``_input_metadata``."""
    cls = type(type(node).__name__, (), {"metadata": property(lambda self: node.metadata)})
    return cls()


def test_a_float32_copy_of_a_gone_float16_output_is_linked_without_node_metadata() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4).half()
    found: list[Any] = []
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        x = model(torch.randn(3, 8).half()).float()  # the float16 output is a temporary
        node, nr = x.grad_fn.next_functions[0]
        found.append(guards._dead_upcast_source(nw, x, _without_metadata(node), nr))
        found.append(guards._dead_upcast_source(nw, x, node, nr))  # torch >= 2.5
        F.mse_loss(x, torch.zeros_like(x)).backward()
    recs = nw.history[0].records
    out = next(r.index for r in recs if r.phase.value == "forward" and r.path == "Linear")
    assert found == [(out, "float16"), (out, "float16")]


def test_an_unrecorded_node_without_metadata_links_nothing() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4).half()
    with nanwatch.watch(nn.Identity(), on_anomaly="record", postmortem=False) as nw:
        x = model(torch.randn(3, 8).half()).float()  # made by an unwatched model
        node, nr = x.grad_fn.next_functions[0]
        assert guards._dead_upcast_source(nw, x, _without_metadata(node), nr) is None
