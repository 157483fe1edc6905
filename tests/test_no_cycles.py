"""A watched step leaves no reference cycles behind (issue 8). Garbage in a cycle is freed
only by Python's cyclic collector, and each object of it counts toward the next
collection: a recursive nested function (``iter_tensors``' walk, torch's ``tree_flatten``
helper) left a cycle per module call or per op, and the collector then ran several times
a training step, a full pass over the process's objects every few dozen steps."""

from __future__ import annotations

import gc
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

import nanwatch
from nanwatch._structure import iter_tensors, leaves

Pair = namedtuple("Pair", "a b")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.norm(self.lin(x))
        return {"out": h, "aux": Pair(h.mean(), [x, (h,)])}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)["out"]
        return self.head(x)


def _cyclic_garbage(mode: str | None) -> int:
    torch.manual_seed(0)
    m = _Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    nw = nanwatch.watch(m, mode=mode, postmortem=False) if mode else None

    def step() -> None:
        F.cross_entropy(m(x), y).backward()  # a functional loss: the functional guards
        opt.step()
        opt.zero_grad()
        if nw is not None:
            nw.step()

    try:
        if nw is not None:
            nw.attach()
        for _ in range(3):  # warm-up: lazily built state is not garbage
            step()
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(4):
                step()
            return gc.collect()
        finally:
            if enabled:
                gc.enable()
    finally:
        if nw is not None:
            nw.detach()


def test_the_unwatched_step_makes_no_cycles() -> None:
    assert _cyclic_garbage(None) == 0  # the baseline the watched steps are held to


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_a_watched_step_makes_no_cycles(mode: str) -> None:
    assert _cyclic_garbage(mode) == 0


def test_iter_tensors_leaves_no_cycle() -> None:
    t = torch.zeros(2)
    gc.collect()
    gc.disable()
    try:
        for _ in range(50):
            roles = [r for r, _ in iter_tensors({"a": [t, (t,)], "b": Pair(t, None)}, "out")]
        assert gc.collect() == 0
    finally:
        gc.enable()
    assert roles == ["out['a'][0]", "out['a'][1][0]", "out['b'].a"]


@pytest.mark.parametrize(
    "obj",
    [
        ([1, (2, 3)], {"a": 4, "b": [5]}),
        (torch.Size([2, 3]), [torch.zeros(1)], None),
        Pair(1, [2, Pair(3, 4)]),
        torch.zeros(3, 2).max(dim=0),  # a torch.return_types structseq
        [],
    ],
)
def test_leaves_give_the_tensors_tree_flatten_gives(obj: object) -> None:
    # the op checker reads only the tensors among the leaves (a torch.Size, which
    # tree_flatten splits into ints, stays one leaf)
    got = [x for x in leaves(obj) if isinstance(x, torch.Tensor)]
    want = [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]
    assert len(got) == len(want)
    assert all(a is b for a, b in zip(got, want, strict=True))
    if not any(isinstance(x, torch.Size) for x in leaves(obj)):
        assert leaves(obj) == tree_flatten(obj)[0]
