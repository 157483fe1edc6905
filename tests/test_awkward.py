"""Inputs and models nanwatch must survive (issue 9): every tensor kind a module can return,
every output structure, and models with their own hooks. Each records what it can and warns
at most once about the rest."""

from __future__ import annotations

import collections
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import Phase


class Emit(nn.Module):
    """Returns whatever ``make(x)`` builds from its input."""

    def __init__(self, make: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.make = make

    def forward(self, x: torch.Tensor) -> Any:
        return self.make(self.fc(x))


def _float8(h: torch.Tensor) -> torch.Tensor:
    return h.detach().to(torch.float8_e4m3fn)


def _float4(h: torch.Tensor) -> torch.Tensor:
    """Two 4-bit floats a byte (MX-style quantized weights): no arithmetic exists on it."""
    return (h.detach() * 16).to(torch.uint8).view(torch.float4_e2m1fn_x2)


TENSOR_KINDS: dict[str, Callable[[torch.Tensor], Any]] = {
    "float16": lambda h: h.half(),
    "bfloat16": lambda h: h.bfloat16(),
    "float64": lambda h: h.double(),
    "float8_e4m3fn": _float8,
    "float4_e2m1fn_x2": _float4,
    "complex64": lambda h: torch.complex(h, h * 2),
    "int64": lambda h: (h > 0).long(),
    "bool": lambda h: h > 0,
    "zero-size": lambda h: h[:0],
    "0-d": lambda h: h.sum(),
    "non-contiguous": lambda h: h.t(),
    "channels_last": lambda h: h.reshape(2, 2, 2, 2).contiguous(memory_format=torch.channels_last),
    "sparse_coo": lambda h: h.detach().to_sparse(),
    "sparse_csr": lambda h: h.detach().to_sparse_csr(),
    "nested": lambda h: torch.nested.nested_tensor([h[0].detach(), h[1, :2].detach()]),
    "meta": lambda h: torch.empty(3, 3, device="meta"),
    "no-grad": lambda h: h.detach(),
    "view-of-view": lambda h: h.view(-1)[1:].view(1, -1)[:, ::2],
}


@pytest.mark.parametrize("kind", list(TENSOR_KINDS))
def test_every_tensor_kind_is_recorded_without_noise(kind: str) -> None:
    if kind.startswith("float") and not hasattr(torch, kind):
        pytest.skip(f"this torch has no {kind}")
    model = Emit(TENSOR_KINDS[kind])
    x = torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, on_anomaly="record") as nw:
            out = model(x)
            loss = model.fc(x).sum()
            loss.backward()
            nw.step()
    ours = [w for w in caught if "nanwatch" in str(w.message)]
    assert not ours, [str(w.message) for w in ours]
    assert nw.first_anomaly is None and not nw.faults
    rec = next(r for r in nw.history[-1].records if r.path == "Emit" and r.phase is Phase.FORWARD)
    assert rec.dtype == str(out.dtype).removeprefix("torch.")
    floating = out.is_floating_point() or out.is_complex()
    packed = str(out.dtype).startswith("torch.float4")  # no values torch can compute on
    has_data = floating and not packed and not out.is_meta and (out.is_nested or out.numel() > 0)
    assert (rec.stat is not None) == has_data
    if rec.stat is not None and not out.is_nested and out.layout is torch.strided:
        ref = out.abs() if out.is_complex() else out.float()
        assert rec.stat.max == pytest.approx(float(ref.max()), rel=1e-3)


def test_all_special_values_in_one_output_are_counted() -> None:
    fi = torch.finfo(torch.float32)
    special = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-45, fi.max, fi.min, 1.0])
    model = Emit(lambda h: torch.cat([h.reshape(-1)[:2], special]))
    with nanwatch.watch(model, on_anomaly="record") as nw:
        model(torch.randn(4, 4))
    a = nw.first_anomaly
    assert a is not None and a.path == "Emit"
    s = a.record.stat
    assert s is not None
    assert (s.nan, s.posinf, s.neginf, s.near_max) == (1, 1, 1, 2)
    assert s.zeros is not None and s.zeros >= 1


Point = collections.namedtuple("Point", ["x", "y"])


class Opaque:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _gen(h: torch.Tensor) -> Iterator[torch.Tensor]:
    yield h


@pytest.mark.parametrize(
    ("make", "roles"),
    [
        (lambda h: None, []),
        (lambda h: ((h, [h * 2, {"deep": (h * 3,)}]), None), ["output[0][1][1]['deep'][0]"]),
        (lambda h: Point(h, None), ["output.x"]),
        (lambda h: {"a": h, "n": 3, "s": "text"}, ["output['a']"]),
    ],
    ids=["none", "nested", "namedtuple", "dict-with-scalars"],
)
def test_output_structures(make: Callable[[torch.Tensor], Any], roles: list[str]) -> None:
    model = Emit(make)
    with nanwatch.watch(model) as nw:
        model(torch.randn(4, 4))
        nw.step()
    got = {r.role for r in nw.history[-1].records if r.path == "Emit" and r.phase is Phase.FORWARD}
    assert set(roles) <= got


def test_generators_are_not_consumed_and_opaque_objects_warn_once() -> None:
    consumed: list[bool] = []

    def gen(h: torch.Tensor) -> Iterator[torch.Tensor]:
        consumed.append(True)
        yield h

    model = Emit(gen)
    other = Emit(Opaque)
    with (
        pytest.warns(nanwatch.NanwatchWarning, match="Opaque holds no tensor") as record,
        nanwatch.watch(model, other) as nw,
    ):
        for _ in range(3):
            g = model(torch.randn(4, 4))
            other(torch.randn(4, 4))
            nw.step()
    assert consumed == []  # nanwatch never iterated the generator
    assert len(list(g)) == 1 and consumed == [True]
    assert len([w for w in record if "Opaque" in str(w.message)]) == 1


class _Cache:
    """Stands for transformers' ``cache_utils.Cache`` (no transformers needed)."""

    def __init__(self, h: torch.Tensor) -> None:
        self.keys = [h]


_Cache.__module__ = "transformers.cache_utils"
_Cache.__name__ = _Cache.__qualname__ = "Cache"
DynamicCache = type("DynamicCache", (_Cache,), {"__module__": "transformers.cache_utils"})


def test_a_key_value_cache_is_skipped_without_a_warning() -> None:
    # every decoder layer of a transformers model returns its Cache: its tensors are the
    # key/value projections' outputs, recorded there; a warning on every model is noise
    model = Emit(lambda h: (h, DynamicCache(h)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model) as nw:
            model(torch.randn(4, 4))
            nw.step()
    assert [str(w.message) for w in caught] == []
    got = {r.role for r in nw.history[-1].records if r.path == "Emit" and r.phase is Phase.FORWARD}
    assert got == {"output[0]"}


def test_user_hooks_still_run_in_their_order() -> None:
    order: list[str] = []
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    model[0].register_forward_pre_hook(lambda m, a: order.append("user-pre"))
    model[0].register_forward_hook(lambda m, a, o: order.append("user-post"))
    model[0].register_full_backward_hook(lambda m, gi, go: order.append("user-backward"))
    with nanwatch.watch(model) as nw:
        model(torch.randn(2, 3)).sum().backward()
        nw.step()
    assert order == ["user-pre", "user-post", "user-backward"]
    assert any(r.path == "0" for r in nw.history[-1].records)


def test_a_user_hook_that_replaces_the_output_is_respected() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    model[0].register_forward_hook(lambda m, a, o: o * 0 + 7.0)
    with nanwatch.watch(model) as nw:
        out = model(torch.randn(2, 3))
        nw.step()
    assert torch.all(out == 7.0)
    rec = next(r for r in nw.history[-1].records if r.path == "0" and r.phase is Phase.FORWARD)
    assert rec.stat is not None and rec.stat.min == rec.stat.max == 7.0


def test_a_data_parallel_style_wrapper() -> None:
    class Wrapper(nn.Module):  # what DataParallel / DDP look like from outside
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.module(*args, **kwargs)

    inner = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    wrapped = nn.DataParallel(inner) if not torch.cuda.is_available() else Wrapper(inner)
    with nanwatch.watch(wrapped) as nw:
        wrapped(torch.randn(4, 3)).sum().backward()
        nw.step()
    assert "module.1" in nw.module_paths
    grads = {r.role for r in nw.history[-1].records if r.phase is Phase.GRADIENT}
    assert "module.0.weight" in grads


def test_keyword_inputs_are_linked_and_measured() -> None:
    class Attn(nn.Module):
        def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
            return x if mask is None else x.masked_fill(mask, 0.0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.attn = Attn()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return self.attn(h, mask=h > 0)

    model = Net()
    with nanwatch.watch(model) as nw:
        model(torch.randn(2, 3))
        nw.step()
    inputs = {
        r.role: r for r in nw.history[-1].records if r.path == "attn" and r.phase is Phase.INPUT
    }
    assert inputs["input[0]"].source is not None  # linked to fc's output
    assert "input.mask" not in inputs  # a bool tensor of an inner module: not recorded


class _MinMaxNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        return (x - lo) / (hi - lo)  # 0/0 on a constant row


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_torch_func_transforms_are_stepped_over_and_the_hooks_keep_working(mode: str) -> None:
    # per-sample gradients (vmap over grad over functional_call) run the watched modules on
    # wrapper tensors that refuse .item(): the hooks stay out of them, silently, and still
    # watch the training step after
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(_MinMaxNorm(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    crit = nn.CrossEntropyLoss()
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))

    def loss_fn(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> Any:
        return crit(functional_call(model, p, (xi[None],)), yi[None])

    params = {k: v.detach() for k, v in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nanwatch.watch(model, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
            per_sample = vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, x, y)
            assert per_sample["1.weight"].shape == (16, 8, 4)
            for step in range(2):
                xb = x.clone()
                if step == 1:
                    xb[3] = 1.0  # hi - lo = 0
                crit(model(xb), y).backward()
                model.zero_grad()
                nw.step()
    assert nw.faults == []
    a = nw.first_anomaly
    assert a is not None and a.step == 1 and a.record.phase is Phase.FORWARD
    assert a.op is not None and a.op.op == "aten.div.Tensor"


@pytest.mark.parametrize("sparse", [False, True])
def test_a_nan_sent_back_into_an_embedding_is_born_in_the_code_that_used_it(sparse: bool) -> None:
    # an embedding's output is bounded by its table and not measured, but its gradient
    # goes straight into the weight: without a hook there, a NaN made by the code using
    # the lookup (sqrt of a zero distance) was first seen as a NaN weight gradient (NW302)
    class Towers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tower = nn.Embedding(30, 8, sparse=sparse)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return (self.tower(a) - self.tower(b)).pow(2).sum(-1).sqrt()

    torch.manual_seed(0)
    model = Towers()
    a, b = torch.randint(0, 30, (16,)), torch.randint(0, 30, (16,))
    b[3] = a[3]  # distance 0: sqrt's gradient is inf there, times 0 is NaN
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        torch.relu(1 - model(a, b)).pow(2).mean().backward()
        nw.step()
    a_ = nw.first_anomaly
    assert a_ is not None and a_.record.phase is Phase.BACKWARD
    assert a_.record.path == "tower"
    assert nw.history[-1].diagnoses[0].code == "NW112"


def test_a_model_on_the_meta_device_is_attached_without_a_fault() -> None:
    # deferred initialization (FSDP, a big model built on 'meta' first): no values to check
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nw = nanwatch.watch(model, postmortem=False).attach()
        nw.detach()
    assert nw.faults == []
