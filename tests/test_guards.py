"""Loss guards: bad loss inputs raise GuardError before the kernel runs, for the module and
the functional form; valid inputs of every torch loss pass untouched."""

from __future__ import annotations

import copy
import math
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import nanwatch
from nanwatch import guards, ops, scenarios
from nanwatch.errors import GuardError, NanwatchError
from nanwatch.rules.base import Diagnosis, catalog
from tests._guard_reads import count_reads_and_syncs


@pytest.fixture(autouse=True)
def no_function_mode_left() -> Iterator[None]:
    yield
    assert torch._C._len_torch_function_stack() == 0, "a TorchFunctionMode was left active"


def watch(*modules: nn.Module, **kw: Any) -> nanwatch.Watcher:
    kw.setdefault("postmortem", False)
    kw.setdefault("on_anomaly", "record")
    return nanwatch.watch(*modules, **kw)


def guarded(criterion: nn.Module, *args: Any, functional_guards: bool = True) -> GuardError:
    """Call ``criterion(*args)`` under nanwatch and return the GuardError it raises."""
    with pytest.raises(GuardError) as info, watch(criterion, functional_guards=functional_guards):
        criterion(*args)
    return info.value


def guarded_f(fn: Callable[[], Any]) -> GuardError:
    """Call ``fn`` (a functional loss) under nanwatch's functional guards."""
    with pytest.raises(GuardError) as info, watch(nn.Identity(), functional_guards=True):
        fn()
    return info.value


# ------------------------------------------------------------------ every torch loss
def _signs(n: int) -> torch.Tensor:
    return torch.tensor([1.0, -1.0] * (n // 2))


#: class name -> (constructor, inputs). Valid inputs for every loss torch.nn defines.
VALID: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]] = {
    "BCELoss": (nn.BCELoss, lambda: (torch.rand(6, 3).clamp(0.05, 0.95), torch.rand(6, 3))),
    "BCEWithLogitsLoss": (
        lambda: nn.BCEWithLogitsLoss(pos_weight=torch.full((3,), 2.0)),
        lambda: (torch.randn(6, 3), torch.rand(6, 3).round()),
    ),
    "CTCLoss": (
        nn.CTCLoss,
        lambda: (
            torch.randn(12, 2, 6).log_softmax(2),
            torch.randint(1, 6, (2, 4)),
            torch.tensor([12, 12]),
            torch.tensor([4, 3]),
        ),
    ),
    "CosineEmbeddingLoss": (
        lambda: nn.CosineEmbeddingLoss(margin=0.2),
        lambda: (torch.randn(6, 4), torch.randn(6, 4), _signs(6)),
    ),
    "CrossEntropyLoss": (
        lambda: nn.CrossEntropyLoss(weight=torch.rand(5) + 0.5, label_smoothing=0.1),
        lambda: (torch.randn(6, 5), torch.tensor([0, 4, -100, 2, 1, 3])),
    ),
    "GaussianNLLLoss": (
        nn.GaussianNLLLoss,
        lambda: (torch.randn(6, 2), torch.randn(6, 2), torch.rand(6, 2) + 0.1),
    ),
    "HingeEmbeddingLoss": (nn.HingeEmbeddingLoss, lambda: (torch.randn(6), _signs(6))),
    "HuberLoss": (lambda: nn.HuberLoss(delta=0.5), lambda: (torch.randn(6, 3), torch.randn(6, 3))),
    "KLDivLoss": (
        lambda: nn.KLDivLoss(reduction="batchmean"),
        lambda: (torch.randn(6, 5).log_softmax(1), torch.randn(6, 5).softmax(1)),
    ),
    "L1Loss": (nn.L1Loss, lambda: (torch.randn(6, 3), torch.randn(6, 3))),
    "LinearCrossEntropyLoss": (
        lambda: nn.LinearCrossEntropyLoss(4, 5, ignore_index=255),
        lambda: (torch.randn(6, 4), torch.tensor([0, 4, 255, 2, 1, 3])),
    ),
    "MSELoss": (nn.MSELoss, lambda: (torch.randn(6, 3), torch.randn(6, 3))),
    "MarginRankingLoss": (
        lambda: nn.MarginRankingLoss(margin=0.1),
        lambda: (torch.randn(6), torch.randn(6), _signs(6)),
    ),
    "MultiLabelMarginLoss": (
        nn.MultiLabelMarginLoss,
        lambda: (torch.randn(3, 4), torch.tensor([[3, 0, -1, 1], [1, 2, 3, -1], [0, -1, 0, 0]])),
    ),
    "MultiLabelSoftMarginLoss": (
        nn.MultiLabelSoftMarginLoss,
        lambda: (torch.randn(6, 4), torch.randint(0, 2, (6, 4)).float()),
    ),
    "MultiMarginLoss": (
        lambda: nn.MultiMarginLoss(p=2, margin=0.5),
        lambda: (torch.randn(6, 4), torch.randint(0, 4, (6,))),
    ),
    "NLLLoss": (
        lambda: nn.NLLLoss(ignore_index=1),
        lambda: (torch.randn(2, 5, 3, 3).log_softmax(1), torch.randint(0, 5, (2, 3, 3))),
    ),
    "NLLLoss2d": (
        nn.NLLLoss2d,
        lambda: (torch.randn(2, 5, 3, 3).log_softmax(1), torch.randint(0, 5, (2, 3, 3))),
    ),
    "PoissonNLLLoss": (
        lambda: nn.PoissonNLLLoss(log_input=False),
        lambda: (torch.rand(6) + 0.1, torch.randint(0, 4, (6,)).float()),
    ),
    "SmoothL1Loss": (
        lambda: nn.SmoothL1Loss(beta=0.5),
        lambda: (torch.randn(6, 3), torch.randn(6, 3)),
    ),
    "SoftMarginLoss": (nn.SoftMarginLoss, lambda: (torch.randn(6), _signs(6))),
    "TripletMarginLoss": (
        lambda: nn.TripletMarginLoss(margin=0.5, swap=True),
        lambda: (torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4)),
    ),
    "TripletMarginWithDistanceLoss": (
        lambda: nn.TripletMarginWithDistanceLoss(distance_function=nn.PairwiseDistance()),
        lambda: (torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4)),
    ),
}

#: every loss this torch defines, enumerated (VALID may name losses of newer versions)
LOSSES = [c.__name__ for c in guards.loss_classes()]


def _make(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    ctor, inputs = VALID[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NLLLoss2d is deprecated
        module = ctor()
    args = inputs()
    first = args[0].clone().requires_grad_(True)
    return module, (first, *args[1:])


class _Capture(TorchFunctionMode):
    """Records the functional loss calls made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in guards.functional_specs():
            self.calls.append((func, tuple(args), dict(kwargs)))
        return func(*args, **kwargs)


def test_every_loss_in_torch_nn_is_enumerated_and_known() -> None:
    # enumerated from torch, so a new torch loss shows up here: give it inputs in VALID and
    # its meaning in guards._SEMANTICS
    assert set(LOSSES) <= set(VALID), set(LOSSES) - set(VALID)
    assert len(LOSSES) >= 20
    for cls in guards.loss_classes():
        spec = guards.spec_for(cls)
        assert spec is not None, cls
        assert spec.kind != "generic", f"{cls.__name__} ({spec.call}) has no semantics"
        assert getattr(F, spec.name) is spec.func
    assert guards.spec_for(nn.CrossEntropyLoss).call == "F.cross_entropy"
    assert guards.spec_for(nn.NLLLoss2d) is guards.spec_for(nn.NLLLoss)


@pytest.mark.parametrize("name", LOSSES)
def test_module_binding_matches_what_the_functional_receives(name: str) -> None:
    module, args = _make(name)
    spec = guards.spec_for(type(module))
    assert spec is not None
    binding = guards._ModuleBinding(module, spec)
    bound = binding.bind(module, args, {})
    with _Capture() as cap:
        module(*args)
    func, fargs, fkwargs = cap.calls[0]
    assert func is spec.func
    truth = guards._bind_functional(spec, fargs, fkwargs)
    for key, value in truth.items():
        if key not in bound:
            assert name == "LinearCrossEntropyLoss" and key in ("linear_weight", "linear_bias")
            continue
        if isinstance(value, torch.Tensor):
            assert bound[key] is value, key
        elif key not in ("size_average", "reduce"):
            assert bound[key] == value, key


def _grads(loss: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss.sum(), first)
    return g


@pytest.mark.parametrize("name", LOSSES)
def test_valid_inputs_pass_untouched(name: str) -> None:
    module, args = _make(name)
    reference = module(*args)
    ref_grad = _grads(reference, args[0])
    with watch(module, functional_guards=True) as nw:
        out = module(*args)
        notes = [n for n in nw.trace.notes if n.kind == "loss_input"]
    assert torch.equal(out, reference)
    assert torch.equal(_grads(out, args[0]), ref_grad)
    # one note per call: the functional inside the module is not checked twice
    assert [n.data["loss"] for n in notes] == [type(module).__name__]
    assert notes[0].data["input_dtype"] == "float32"
    assert math.isfinite(notes[0].data["input_min"])


@pytest.mark.parametrize("name", LOSSES)
def test_valid_inputs_pass_untouched_functional(name: str) -> None:
    module, args = _make(name)
    spec = guards.spec_for(type(module))
    assert spec is not None
    with _Capture() as cap:
        module(*args)
    func, fargs, fkwargs = cap.calls[0]
    reference = func(*fargs, **fkwargs)
    with watch(nn.Identity()) as nw:  # functional guards are on by default
        out = getattr(F, spec.name)(*fargs, **fkwargs)  # as the user calls it: F.<name>
        notes = [n for n in nw.trace.notes if n.kind == "loss_input"]
    assert torch.equal(out, reference)
    assert [n.path for n in notes] == [spec.call]


def test_uint8_targets_pass_where_pytorch_takes_them() -> None:
    criterion = nn.CrossEntropyLoss(ignore_index=255)
    logits = torch.randn(6, 4).half().float()
    labels = torch.tensor([0, 3, 255, 1, 2, 255], dtype=torch.uint8)
    reference = criterion(logits, labels)
    with watch(criterion) as nw:
        out = criterion(logits, labels)
    assert torch.equal(out, reference)
    note = nw.history[-1].notes[0]
    assert note.data["ignored"] == 2 and note.data["target_dtype"] == "uint8"
    # a uint8 mask (a PNG loaded as is) is rejected by the spatial kernel: named first
    mask = torch.randint(0, 4, (2, 3, 3), dtype=torch.uint8)
    err = guarded(criterion, torch.randn(2, 4, 3, 3), mask)
    assert err.code == "NW502" and "needs int64 class indices" in str(err)
    assert "uint8" in str(err) and "(or uint8)" not in str(err)


# ------------------------------------------------------------------ the error itself
def _voc_masks() -> torch.Tensor:
    mask = torch.randint(0, 21, (4, 128, 128))
    flat = mask.view(-1)
    flat[:3912] = 255
    return mask


def test_target_255_names_count_classes_and_the_ignore_index() -> None:
    criterion = nn.CrossEntropyLoss()
    logits, mask = torch.randn(4, 21, 128, 128), _voc_masks()
    line = sys._getframe().f_lineno + 2
    with pytest.raises(GuardError) as info, watch(criterion) as nw:
        loss = criterion(logits, mask)  # noqa: F841  (the user's line)
    err = info.value
    assert err.source is not None and err.source.endswith(f"test_guards.py:{line}")
    assert str(err).startswith(f"CrossEntropyLoss at {err.source}: ")
    assert (
        "target contains 255 at 3,912 positions (of 65,536); CrossEntropyLoss(ignore_index=-100) "
        "with 21 classes accepts 0..20 — did you mean ignore_index=255?"
    ) in str(err)
    assert err.loss == "CrossEntropyLoss" and err.path == "CrossEntropyLoss"
    assert err.module == "CrossEntropyLoss"
    assert err.check == "target-range" and err.code == "NW501"
    assert err.values == (255,) and err.counts == (3912,)
    assert err.count == 3912 and err.total == 65536
    assert err.positions == ((0, 0, 0), (0, 0, 1), (0, 0, 2))
    assert err.expected == "0..20, or ignore_index=-100"
    assert err.fix == "criterion = nn.CrossEntropyLoss(ignore_index=255)"
    assert err.source_line is not None
    assert err.source_line.startswith("loss = criterion(logits, mask)")
    assert err.where == f"CrossEntropyLoss at {err.source}"
    assert isinstance(err, NanwatchError) and isinstance(err, ValueError)
    assert type(err).__module__ == "nanwatch"
    d = err.diagnosis
    assert isinstance(d, Diagnosis)
    assert (d.code, d.severity, d.path, d.source) == ("NW501", "error", err.path, err.source)
    assert d.fix == err.fix
    # the post-mortem of the step says the same
    trace = nw.history[-1]
    assert (trace.diagnoses[0].code, trace.diagnoses[0].severity) == ("NW501", "error")
    assert trace.error is not None and trace.error["class"] == "guard"
    (guard,) = [n for n in trace.notes if n.kind == "guard"]
    assert guard.data["values"] == [255] and guard.data["count"] == 3912


def test_target_255_functional_form() -> None:
    logits, mask = torch.randn(2, 21, 8, 8), torch.randint(0, 21, (2, 8, 8))
    mask[1, 2, 3] = 255
    err = guarded_f(lambda: F.cross_entropy(logits, mask, reduction="sum"))
    assert err.loss == "F.cross_entropy" and err.module is None
    assert "F.cross_entropy(..., ignore_index=-100) with 21 classes" in str(err)
    assert err.positions == ((1, 2, 3),)
    assert err.fix == (
        'err = guarded_f(lambda: F.cross_entropy(logits, mask, reduction="sum", ignore_index=255))'
    )


def test_a_caught_guard_error_is_a_warning_not_a_second_error() -> None:
    criterion = nn.CrossEntropyLoss()
    with nanwatch.watch(criterion, postmortem=False) as nw:  # on_anomaly="raise"
        for _ in range(2):
            try:
                criterion(torch.randn(4, 3), torch.tensor([0, 1, 255, 2]))
            except GuardError:
                continue  # skip the bad batch
            nw.step()
    (d,) = {d.code: d for t in nw.history for d in t.diagnoses}.values()
    assert (d.code, d.severity) == ("NW501", "warning")
    assert "the GuardError was caught and the step went on" in d.evidence


def test_functional_guards_off_leaves_functional_losses_to_torch() -> None:
    with pytest.raises(IndexError), watch(nn.Identity(), functional_guards=False):
        F.nll_loss(torch.randn(3, 4), torch.tensor([0, 1, 255]))


def test_class_index_equal_to_c_suggests_zero_based_labels() -> None:
    err = guarded(nn.CrossEntropyLoss(), torch.randn(5, 3), torch.tensor([1, 2, 3, 3, 1]))
    assert err.values == (3,) and err.counts == (2,)
    assert "labels 1..3 need `target - 1`, or the model needs 4 outputs" in str(err)


def test_minus_one_with_other_ignore_index_suggests_it() -> None:
    criterion = nn.NLLLoss(ignore_index=255, reduction="sum")
    err = guarded(criterion, torch.randn(4, 3).log_softmax(1), torch.tensor([0, -1, 2, 255]))
    assert err.values == (-1,)
    assert "did you mean ignore_index=-1?" in str(err)
    assert err.fix.endswith("nn.NLLLoss(reduction='sum', ignore_index=-1)")


def test_class_target_dtype() -> None:
    err = guarded(nn.CrossEntropyLoss(), torch.randn(4, 3), torch.tensor([0.0, 1.0, 2.0, 1.0]))
    assert (err.code, err.check, err.values) == ("NW502", "target-dtype", ("float32",))
    assert "needs int64 class indices" in str(err) and err.fix.endswith(".long())")
    err = guarded_f(lambda: F.nll_loss(torch.randn(4, 3), torch.tensor([0, 1, 2, 1]).int()))
    assert err.code == "NW502" and err.loss == "F.nll_loss"


def test_class_target_shapes() -> None:
    ce = nn.CrossEntropyLoss()
    logits, tokens = torch.randn(2, 7, 50), torch.randint(0, 50, (2, 7))
    with pytest.raises(GuardError) as info, watch(ce):
        ce(logits, tokens)
    err = info.value
    assert err.code == "NW503" and err.check == "target-shape"
    assert "the 50 classes look like the last dimension" in str(err)
    assert err.fix == (
        "ce(logits.movedim(-1, 1), tokens)  # or ce(logits.flatten(0, 1), tokens.flatten())"
    )
    err = guarded(ce, torch.randn(2, 5, 4, 4), torch.randint(0, 5, (2, 1, 4, 4)))
    assert "channel dimension of size 1" in str(err) and ".squeeze(1)" in err.fix
    err = guarded(ce, torch.randn(2, 5, 4, 4), torch.randint(0, 5, (2, 8, 8)))
    assert "spatial sizes differ ((4, 4) vs (8, 8))" in str(err)
    assert "F.interpolate(" in err.fix
    err = guarded_f(lambda: F.cross_entropy(torch.randn(2, 5), torch.randint(0, 5, (3,))))
    assert "batch sizes differ (2 vs 3)" in str(err)


def test_probability_targets() -> None:
    ce = nn.CrossEntropyLoss()
    logits = torch.randn(4, 3)
    out = guarded(ce, logits, torch.tensor([[0.5, 0.5, 0.0]] * 3 + [[3.0, -1.0, 0.0]]))
    assert out.code == "NW511" and out.count == 2 and out.positions == ((3, 0), (3, 1))
    with watch(ce):  # soft targets in range pass
        ce(logits, torch.rand(4, 3).softmax(1))


def test_multilabel_margin_and_multi_margin_ranges() -> None:
    err = guarded(
        nn.MultiLabelMarginLoss(), torch.randn(2, 3), torch.tensor([[0, 3, -1], [1, -1, 0]])
    )
    assert err.values == (3,) and "accepts -1..2" in str(err)
    err = guarded(nn.MultiMarginLoss(), torch.randn(3, 3), torch.tensor([0, 5, 2]))
    assert err.values == (5,) and err.positions == ((1,),)


@pytest.mark.skipif(not hasattr(nn, "LinearCrossEntropyLoss"), reason="torch < 2.13")
def test_linear_cross_entropy_reads_classes_from_its_weight() -> None:
    criterion = nn.LinearCrossEntropyLoss(4, 5)
    err = guarded(criterion, torch.randn(3, 4), torch.tensor([0, 5, 1]))
    assert "with 5 classes accepts 0..4" in str(err)


def test_ctc_targets() -> None:
    ctc = nn.CTCLoss()
    lp = torch.randn(10, 2, 5).log_softmax(2)
    lens = torch.tensor([10, 10])
    err = guarded(ctc, lp, torch.tensor([[1, 0, 2], [1, 2, 3]]), lens, torch.tensor([3, 3]))
    assert (err.code, err.positions) == ("NW512", ((0, 1),))
    err = guarded(ctc, lp, torch.tensor([[1, 7, 2], [1, 2, 3]]), lens, torch.tensor([3, 3]))
    assert (err.code, err.values) == ("NW501", (7,))
    with watch(ctc):  # padding beyond target_lengths is not a label
        ctc(lp, torch.tensor([[1, 2, 9], [1, 2, 3]]), lens, torch.tensor([2, 3]))


def test_bce_input_outside_zero_one() -> None:
    bce = nn.BCELoss()
    logits = torch.tensor([-2.0, 0.3, 1.5, 0.9])
    err = guarded(bce, logits, torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert (err.code, err.check, err.count, err.total) == ("NW504", "input-range", 2, 4)
    assert err.positions == ((0,), (2,))
    assert "these look like logits" in str(err) and "BCEWithLogitsLoss" in err.fix
    err = guarded_f(
        lambda: F.binary_cross_entropy(torch.tensor([0.5, math.nan]), torch.tensor([1.0, 0.0]))
    )
    assert "input contains NaN at 1 position (of 2)" in str(err) and err.positions == ((1,),)


def test_binary_targets_outside_zero_one() -> None:
    err = guarded(nn.BCEWithLogitsLoss(), torch.randn(4), torch.tensor([0.0, 255.0, 255.0, 0.0]))
    assert (err.code, err.values, err.counts) == ("NW505", (255.0,), (2,))
    assert "a 0/255 mask" in str(err) and err.fix.endswith("/ 255)")
    err = guarded(nn.BCELoss(), torch.rand(3), torch.tensor([-1.0, 1.0, -1.0]))
    assert "labels of -1 and 1" in str(err)


def test_binary_shape_and_dtype() -> None:
    err = guarded(nn.BCEWithLogitsLoss(), torch.randn(8, 1), torch.rand(8).round())
    assert err.code == "NW507" and ".squeeze(-1)" in err.fix
    err = guarded(nn.BCEWithLogitsLoss(), torch.randn(8), torch.ones(8, dtype=torch.long))
    assert err.code == "NW509" and err.fix.endswith(".float())")
    err = guarded(nn.BCELoss(), torch.rand(8), torch.rand(8).half())
    assert err.code == "NW509" and "needs the input's dtype (float32)" in str(err)


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_broadcast_module_and_functional() -> None:
    mse = nn.MSELoss()
    pred, y = torch.randn(16, 1), torch.randn(16)
    with pytest.raises(GuardError) as info, watch(mse):
        loss = mse(pred, y)  # noqa: F841
    err = info.value
    assert (err.code, err.check) == ("NW506", "broadcast")
    assert "broadcast to (16, 16)" in str(err) and "256 terms instead of 16" in str(err)
    assert err.fix == "loss = mse(pred.squeeze(-1), y)  # noqa: F841"  # the user's own line
    err = guarded_f(lambda: F.l1_loss(pred, y))
    assert err.fix == "err = guarded_f(lambda: F.l1_loss(pred.squeeze(-1), y))"
    err = guarded(nn.MarginRankingLoss(), torch.randn(4), torch.randn(4), torch.ones(4, 1))
    assert err.code == "NW506"
    with watch(mse):  # a scalar target expands without growing: PyTorch's warning is enough
        mse(pred, torch.tensor(0.5))


def test_ignore_silences_a_check() -> None:
    mse = nn.MSELoss()
    with pytest.warns(UserWarning, match="target size"), watch(mse, ignore=["NW506"]):
        out = mse(torch.randn(4, 1), torch.randn(4))
    assert out.shape == ()


def test_device_mismatch() -> None:
    # the meta device stands in for an accelerator: PyTorch rejects the mix the same way
    mse = nn.MSELoss()
    err = guarded(mse, torch.randn(4, device="meta"), torch.randn(4))
    assert (err.code, err.check, err.values) == ("NW508", "device", ("cpu",))
    assert "target is on cpu but input is on meta" in str(err)
    ce = nn.CrossEntropyLoss(weight=torch.ones(3, device="meta"))
    err = guarded(ce, torch.randn(2, 3), torch.tensor([0, 1]))
    assert "CrossEntropyLoss.weight is on meta" in str(err) and ".to(" in err.fix


def test_sign_targets() -> None:
    err = guarded(nn.SoftMarginLoss(), torch.randn(6), torch.tensor([0.0, 1.0] * 3))
    assert (err.code, err.values, err.counts) == ("NW510", (0.0,), (3,))
    assert "0/1 labels" in str(err) and err.fix.endswith("* 2 - 1)")
    err = guarded_f(
        lambda: F.cosine_embedding_loss(torch.randn(2, 3), torch.randn(2, 3), torch.tensor([1, 2]))
    )
    assert err.code == "NW510" and err.values == (2,)


def test_kl_negative_target() -> None:
    err = guarded(nn.KLDivLoss(reduction="batchmean"), torch.randn(2, 3), -torch.rand(2, 3))
    assert err.code == "NW511" and err.count == 6
    with watch(
        kl := nn.KLDivLoss(reduction="batchmean", log_target=True)
    ):  # log-targets may be negative
        kl(torch.randn(2, 3), -torch.rand(2, 3))


def test_kl_log_target_of_log_zero() -> None:
    """log_target=True with the log of a one-hot target: exp(-inf) * (-inf - x) is NaN in
    every zero slot. It was a NaN loss diagnosed as 'NaN or inf in the loss targets', with
    a fix that standardizes the targets."""
    logp = torch.randn(2, 3).log_softmax(-1)
    target = F.one_hot(torch.tensor([0, 2]), 3).float()
    assert torch.isnan(F.kl_div(logp, target.log(), log_target=True)).item()  # torch's NaN
    kl = nn.KLDivLoss(reduction="batchmean", log_target=True)
    err = guarded(kl, logp, target.log())
    assert (err.code, err.check, err.count) == ("NW511", "log-target-neginf", 4)
    assert err.positions == ((0, 1), (0, 2), (1, 0))
    assert "0 * -inf = NaN" in str(err) and "KLDivLoss(log_target=False)" in err.fix
    err = guarded_f(lambda: F.kl_div(logp, target.log(), log_target=True))
    assert err.code == "NW511" and "log_target=False" in err.fix
    with watch(kl):  # finite log-probabilities pass
        kl(logp, target.clamp_min(1e-6).log())


# ------------------------------------------------------------------ evidence for the rules
def test_loss_input_note_has_the_documented_keys() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1))
    criterion = nn.CrossEntropyLoss(ignore_index=2)
    with watch(model, criterion) as nw:
        probs = model(torch.randn(5, 4))
        criterion(probs, torch.tensor([0, 2, 1, 2, 0]))
        (note,) = [n for n in nw.trace.notes if n.kind == "loss_input"]
        rec = nw.record_of(probs)
    d = note.data
    assert note.path == "CrossEntropyLoss" and note.source is not None
    assert d["loss"] == "CrossEntropyLoss" and d["input_dtype"] == "float32"
    assert d["input_grad_fn"] == "SoftmaxBackward0"
    assert rec is not None and d["input_source"] == rec.index
    assert 0 <= d["input_min"] <= d["input_max"] <= 1
    assert d["probability_rows"] is True  # softmax before CrossEntropyLoss: a rule's evidence
    assert (d["ignore_index"], d["ignored"]) == (2, 2)
    expected = probs.detach().abs().amax(dim=1)
    assert d["ignored_amax"] == pytest.approx(float(expected[[1, 3]].max()))
    assert d["valid_amax"] == pytest.approx(float(expected[[0, 2, 4]].max()))
    assert d["reduction"] == "mean"


def test_bce_note_counts_saturation() -> None:
    bce = nn.BCELoss()
    x = torch.tensor([0.0, 1.0, 1.0, 0.5, 1e-45])
    y = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    with watch(bce) as nw:
        bce(x, y)
    d = nw.history[-1].notes[0].data
    assert (d["exact_zeros"], d["exact_ones"]) == (1, 2)
    assert d["value_clamped"] == 3  # log(0) and log(1 - 1) hit the -100 clamp; 1e-45 too


def test_one_host_sync_per_guarded_call(monkeypatch: pytest.MonkeyPatch) -> None:
    reads, syncs = count_reads_and_syncs(monkeypatch)
    criterion = nn.CrossEntropyLoss(ignore_index=255)
    target = torch.randint(0, 5, (2, 6, 6))
    target[0, 0, 0] = 255
    with watch(criterion, functional_guards=True):
        criterion(torch.randn(2, 5, 6, 6), target)
        F.binary_cross_entropy(torch.rand(8), torch.rand(8))
    assert len(reads) == 2  # every reduction of a call in one read
    # the module loss's input is the watched criterion's input, measured at its record
    assert {"ignored", "target_min", "target_max"} <= set(reads[0])
    assert {"input_min", "input_max", "input_outside", "exact_zeros"} <= set(reads[1])
    assert syncs == []


def test_on_the_cpu_ranges_read_at_once_spare_the_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU a read is no sync: the target's range read first says no ignore_index is
    in it (no mask), the input's min says no -inf is (no gather at the target classes).
    The evidence is the same as from the one read an accelerator makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func.overloadpacket is not torch.ops.aten._local_scalar_dense:
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    real_guard = guards._guard
    counted: list[list[str]] = []

    def counted_guard(*args: Any, **kwargs: Any) -> None:
        with CountOps() as c:
            real_guard(*args, **kwargs)
        counted.append(c.ops)

    monkeypatch.setattr(guards, "_guard", counted_guard)
    torch.manual_seed(0)
    logits, y = torch.randn(8, 5), torch.randint(0, 5, (8,))
    masked = logits.clone()
    masked[0, y[0]] = -math.inf  # a -inf at a target: the gather must still run
    notes = []
    for now in (True, False):
        monkeypatch.setattr(guards, "_CPU_READS_NOW", now)
        criterion = nn.CrossEntropyLoss()  # watched; the functional calls are guarded
        with watch(criterion, postmortem=False, on_anomaly="warn", functional_guards=True) as nw:
            F.cross_entropy(logits, y)
            with pytest.warns(nanwatch.NanwatchWarning):
                F.cross_entropy(masked, y)
                nw.step()
        notes.append([n.data for n in nw.history[-1].notes if n.kind == "loss_input"])
    fast, slow = counted[0], counted[2]
    assert "eq" in slow and "where" in slow and "gather" in slow
    assert "eq" not in fast and "where" not in fast and "gather" not in fast
    assert "gather" in counted[1]  # the input holds -inf: looked at
    assert notes[0] == notes[1]


@pytest.mark.parametrize("deferred", [False, True], ids=["cpu", "accelerator-path"])
def test_a_loss_input_the_watcher_measured_is_not_read_again(
    monkeypatch: pytest.MonkeyPatch, deferred: bool
) -> None:
    """The logits were measured at the model's output: the loss guard takes that min and
    max (on a GPT-2-sized vocabulary a second pass over them is 0.7% of the step) unless
    they changed in place since."""
    from torch.utils._python_dispatch import TorchDispatchMode

    passes: list[tuple[int, ...]] = []

    class CountPasses(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func.overloadpacket is torch.ops.aten.aminmax:
                passes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    real_guard = guards._guard

    def counted_guard(*args: Any, **kwargs: Any) -> None:
        with CountPasses():
            real_guard(*args, **kwargs)

    monkeypatch.setattr(guards, "_guard", counted_guard)
    torch.manual_seed(0)
    model, criterion = nn.Linear(4, 3), nn.CrossEntropyLoss()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    nw = watch(model, criterion, functional_guards=True)
    nw._defer_cpu = deferred
    with nw:
        logits = model(x)
        criterion(logits, y)
        F.cross_entropy(logits, y)  # a functional loss on a watched output: the same
        reused = len(passes)
        changed = model(x)
        changed.mul_(100)  # changed in place after it was measured: read again
        F.cross_entropy(changed, y)
        nw.step()
    assert (8, 3) not in passes[:reused]
    assert passes[reused:].count((8, 3)) == 1
    first, functional, second = (n.data for n in nw.history[-1].notes if n.kind == "loss_input")
    lo, hi = torch.aminmax(logits.detach())
    assert (first["input_min"], first["input_max"]) == (lo.item(), hi.item())
    assert (functional["input_min"], functional["input_max"]) == (lo.item(), hi.item())
    assert second["input_max"] == pytest.approx(100 * hi.item(), rel=1e-6)


# ------------------------------------------------------------------ when guards stay quiet
def test_quiet_during_replays_and_after_detach() -> None:
    criterion = nn.CrossEntropyLoss()
    bad = (torch.randn(2, 3), torch.tensor([0, 255]))
    with watch(criterion, functional_guards=True):
        with ops._replay_scope(), pytest.raises(IndexError):
            criterion(*bad)
        with ops._replay_scope(), pytest.raises(IndexError):
            F.cross_entropy(*bad)
    with pytest.raises(IndexError):
        criterion(*bad)
    with pytest.raises(IndexError):
        F.cross_entropy(*bad)


def test_guards_false_registers_nothing() -> None:
    criterion = nn.CrossEntropyLoss()
    with watch(criterion, guards=False, functional_guards=True), pytest.raises(IndexError):
        criterion(torch.randn(2, 3), torch.tensor([0, 255]))


def test_user_loss_subclass_is_guarded_through_its_functional() -> None:
    class FocalLoss(nn.modules.loss._Loss):
        def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            ce = F.cross_entropy(logits, target, reduction="none")
            return ((1 - torch.exp(-ce)) ** 2 * ce).mean()

    focal = FocalLoss()
    assert guards.spec_for(FocalLoss) is None
    with pytest.raises(IndexError), watch(focal, functional_guards=False):
        focal(torch.randn(2, 3), torch.tensor([0, 255]))
    err = guarded(focal, torch.randn(2, 3), torch.tensor([0, 255]))  # on by default
    assert err.loss == "F.cross_entropy"


def test_an_internal_error_disables_the_guard_not_the_training(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(p: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setitem(guards._CHECKS, "class", broken)
    criterion = nn.CrossEntropyLoss()
    warned = pytest.warns(RuntimeWarning, match="loss guard .*; guards are off")
    with warned, watch(criterion) as nw:
        out = criterion(torch.randn(2, 3), torch.tensor([0, 1]))
        criterion(torch.randn(2, 3), torch.tensor([0, 1]))
    assert out.shape == () and nw.faults == [("loss guard", "RuntimeError: boom")]


def test_functional_mode_comes_off_the_stack_under_another_mode() -> None:
    nw = watch(nn.Identity(), functional_guards=True).attach()
    other = _Capture()
    other.__enter__()
    try:
        nw.detach()
        assert torch._C._len_torch_function_stack() == 1
        assert torch._C._get_function_stack_at(0) is other
        F.mse_loss(torch.zeros(2), torch.zeros(2))
        assert len(other.calls) == 1
    finally:
        other.__exit__(None, None, None)


def test_guard_error_pickles_with_its_attributes() -> None:
    err = guarded(nn.MultiMarginLoss(), torch.randn(2, 3), torch.tensor([0, 9]))
    copy_ = pickle.loads(pickle.dumps(err))
    assert str(copy_) == str(err)
    assert (copy_.values, copy_.positions, copy_.fix) == (err.values, err.positions, err.fix)
    assert copy.copy(err).code == err.code


def test_guard_rules_are_in_the_catalog() -> None:
    import nanwatch.rules.guards as family

    codes = {r.code: r for r in catalog()}
    for code, (title, _) in family.CHECKS.items():
        assert codes[code].title == title and codes[code].family == "guards"
    assert set(family.CHECKS) == {f"NW5{i:02d}" for i in range(1, 21)}


# ------------------------------------------------------------------ scenarios and CUDA
@pytest.mark.parametrize("name", ["target-255", "broadcast-mse", "added-token"])
@pytest.mark.filterwarnings("ignore:Using a target size")
def test_scenarios(name: str) -> None:
    outcome = scenarios.run(scenarios.get(name))
    assert outcome.mismatches(with_diagnosis=False) == []
    assert outcome.mismatches() == []
    assert isinstance(outcome.error, GuardError)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_error_is_raised_and_the_context_survives() -> None:
    criterion = nn.CrossEntropyLoss().cuda()
    logits = torch.randn(4, 21, 32, 32, device="cuda")
    mask = torch.randint(0, 21, (4, 32, 32), device="cuda")
    mask[:, 0, :] = 255
    with pytest.raises(GuardError, match="did you mean ignore_index=255"), watch(criterion):
        criterion(logits, mask)
    with pytest.raises(GuardError, match="input contains NaN"), watch(bce := nn.BCELoss()):
        bce(torch.full((8,), math.nan, device="cuda"), torch.ones(8, device="cuda"))
    # the context is alive: kernels run and results come back
    assert torch.ones(3, device="cuda").sum().item() == 3.0
    mask[mask == 255] = 0
    with watch(criterion, functional_guards=True):
        loss = criterion(logits, mask)
        F.cross_entropy(logits, mask)
    assert math.isfinite(loss.item())
    torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_embedding_ids_are_checked_and_the_context_survives() -> None:
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100)).cuda()
    ids = torch.randint(0, 100, (4, 32), device="cuda")
    ids[2, 7] = 100  # on CUDA, unguarded: "device-side assert triggered"
    with pytest.raises(GuardError, match="one past the last row") as info, watch(model):
        model(ids)
    assert info.value.positions == ((2, 7),)
    bag = nn.EmbeddingBag(10, 4).cuda()
    flat = torch.tensor([1, 2, 3, 10], device="cuda")
    offsets = torch.tensor([0, 2], device="cuda")
    with pytest.raises(GuardError, match="EmbeddingBag has 10 rows"), watch(bag):
        bag(flat, offsets)
    with (
        pytest.raises(GuardError, match=r"accepts 0\.\.2"),
        watch(nn.Identity(), functional_guards=True),
    ):
        F.one_hot(torch.tensor([0, 3], device="cuda"), 3)  # CUDA's one_hot does not check
    # the context is alive: kernels run and results come back
    assert torch.ones(3, device="cuda").sum().item() == 3.0
    ids[2, 7] = 5
    reference = model(ids)
    with watch(model, functional_guards=True):
        out = model(ids)
        F.one_hot(ids, 100)
    assert torch.equal(out, reference)
    torch.cuda.synchronize()


def test_tensor_subclass_targets_are_read() -> None:
    class Mask(torch.Tensor):  # like torchvision's tv_tensors.Mask
        pass

    mask = torch.randint(0, 3, (2, 4, 4)).as_subclass(Mask)
    mask[0, 1, 1] = 255
    err = guarded(nn.CrossEntropyLoss(), torch.randn(2, 3, 4, 4), mask)
    assert err.values == (255,) and err.positions == ((0, 1, 1),)


def test_fake_tensors_are_not_read() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with watch(nn.Identity(), functional_guards=True) as nw, FakeTensorMode() as mode:
        logits = mode.from_tensor(torch.randn(2, 3))
        target = mode.from_tensor(torch.tensor([0, 255]))
        F.cross_entropy(logits, target)  # nothing to read: shapes only, no error
        (note,) = nw.trace.notes
    assert note.kind == "loss_input" and "target_max" not in note.data


def test_the_activation_behind_views_is_named_in_the_evidence() -> None:
    import nanwatch

    model = torch.nn.Linear(4, 1)
    criterion = torch.nn.BCELoss()
    with nanwatch.watch(model, criterion, postmortem=False) as nw:
        p = torch.sigmoid(model(torch.randn(6, 4))).squeeze(1)  # a view over the sigmoid
        criterion(p, torch.ones(6))
        notes = [n for n in nw.trace.notes if n.kind == "loss_input"]
    assert notes[0].data["input_grad_fn"] == "SqueezeBackward1"
    assert notes[0].data["input_activation"] == "SigmoidBackward0"


# ------------------------------------------------------------------ the functional tap
def test_functional_guards_wrap_only_the_guarded_functionals_while_attached() -> None:
    originals = {name: getattr(F, name) for name in ("cross_entropy", "embedding", "one_hot")}
    relu = F.relu
    a = watch(nn.Identity()).attach()
    b = watch(nn.Identity()).attach()
    try:
        assert all(getattr(F, n) is not f for n, f in originals.items())
        assert all(getattr(F, n).__wrapped__ is f for n, f in originals.items())
        assert F.relu is relu  # nothing else is touched
        # what is guarded is still read from the originals while they are wrapped
        assert guards.spec_for(nn.CrossEntropyLoss).func is originals["cross_entropy"]
        # no TorchFunctionMode: calls of other functions do not go through Python
        assert not torch.overrides._get_current_function_mode_stack()
        a.detach()
        assert F.cross_entropy is not originals["cross_entropy"]  # b still guards
    finally:
        a.detach()
        b.detach()
    assert all(getattr(F, n) is f for n, f in originals.items())


def test_a_functional_called_in_another_thread_is_that_threads_business() -> None:
    import threading

    errors: list[BaseException] = []

    def other() -> None:
        try:  # not watched in this thread: PyTorch's own error
            F.cross_entropy(torch.randn(2, 3), torch.tensor([0, 255]))
        except BaseException as exc:
            errors.append(exc)

    with watch(nn.Identity()):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        with pytest.raises(GuardError):
            F.cross_entropy(torch.randn(2, 3), torch.tensor([0, 255]))
    assert len(errors) == 1 and type(errors[0]) is IndexError


def test_a_watched_functional_loss_compiles_without_graph_breaks() -> None:
    def step(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y)

    logits, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    with watch(nn.Identity()):
        explained = torch._dynamo.explain(step)(logits, y)
        out = torch.compile(step, backend="eager")(logits, y)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert torch.allclose(out, F.cross_entropy(logits, y))


# ------------------------------------------------------------------ CTC: target too long
def _labels(*rows: list[int]) -> torch.Tensor:
    """Padded (N, S) CTC targets: each row padded with 1s (beyond its length: not labels)."""
    s = max(len(r) for r in rows)
    return torch.tensor([r + [1] * (s - len(r)) for r in rows])


def _no_repeats(n: int) -> list[int]:
    return [1 + i % 5 for i in range(n)]  # 1, 2, 3, 4, 5, 1, ...: no label twice in a row


def test_ctc_target_longer_than_its_input_names_the_sample_and_the_fix() -> None:
    ctc = nn.CTCLoss()
    lp = torch.randn(15, 2, 6).log_softmax(2)
    targets = _labels(_no_repeats(5), _no_repeats(20))
    in_len, tgt_len = torch.tensor([15, 15]), torch.tensor([5, 20])
    assert ctc(lp, targets, in_len, tgt_len).item() == math.inf  # what it would compute
    with pytest.raises(GuardError) as info, watch(ctc):
        ctc(lp, targets, in_len, tgt_len)
    err = info.value
    assert (err.code, err.check) == ("NW516", "ctc-length")
    assert (
        "1 target of 2 is longer than its input can align (sample 1: 20 labels need at least "
        "20 frames, input_lengths[1] = 15); CTCLoss(zero_infinity=False) gives it a loss of "
        "+inf, so the mean over the batch is +inf too"
    ) in str(err)
    assert (err.positions, err.count, err.total, err.values) == (((1,),), 1, 2, (20,))
    assert err.fix.startswith("ctc = nn.CTCLoss(zero_infinity=True)  # drops them")
    assert "filter out utterances whose labels are too long for their audio" in err.fix
    assert "lower the time downsampling" in err.fix
    assert err.diagnosis.code == "NW516" and err.diagnosis.severity == "error"
    # the module's other settings are kept in the fix
    lp7 = torch.randn(15, 2, 7).log_softmax(2)
    err = guarded(nn.CTCLoss(blank=6, reduction="sum"), lp7, targets, in_len, tgt_len)
    assert "so the sum over the batch is +inf too" in str(err)
    assert err.fix.startswith("nn.CTCLoss(blank=6, reduction='sum', zero_infinity=True)")


def test_ctc_repeated_labels_need_a_blank_between() -> None:
    ctc = nn.CTCLoss(reduction="none")
    lp = torch.randn(12, 3, 6).log_softmax(2)
    # 3 3 3 3 3 3 3 3: 7 repeats, 15 frames; 2 2 4 4 4 1: 3 repeats, 9 frames
    targets = _labels([3] * 8, [1, 2, 3, 4, 5, 1, 2, 3], [2, 2, 4, 4, 4, 1])
    tgt_len = torch.tensor([8, 8, 6])
    in_len = torch.tensor([12, 12, 8])
    assert ctc(lp, targets, in_len, tgt_len).isinf().tolist() == [True, False, True]
    err = guarded(ctc, lp, targets, in_len, tgt_len)
    assert err.code == "NW516" and err.positions == ((0,), (2,)) and err.values == (15, 9)
    assert (
        "2 targets of 3 are longer than their input can align (sample 0: 8 labels with 7 "
        "repeats need at least 15 frames, input_lengths[0] = 12; sample 2: 6 labels with 3 "
        "repeats need at least 9 frames, input_lengths[2] = 8); CTCLoss(zero_infinity=False) "
        "gives them a loss of +inf\n"
    ) in str(err)  # reduction="none": no word about the batch


def test_ctc_concatenated_targets_and_lengths_as_tuples() -> None:
    lp = torch.randn(12, 3, 6).log_softmax(2)
    # 1 2 3 | 3 3 1 1 2 | 4 4: sample 0 ends with 3 and sample 1 starts with 3, a pair
    # across two samples is no repeat
    flat = torch.tensor([1, 2, 3, 3, 3, 1, 1, 2, 4, 4])
    tgt_len = (3, 5, 2)
    assert F.ctc_loss(lp, flat, (12, 7, 2), tgt_len, reduction="none").isinf().tolist() == [
        False,
        False,
        True,
    ]
    err = guarded_f(lambda: F.ctc_loss(lp, flat, [12, 6, 3], tgt_len, reduction="sum"))
    assert (err.code, err.loss, err.positions) == ("NW516", "F.ctc_loss", ((1,),))
    assert (
        "1 target of 3 is longer than its input can align (sample 1: 5 labels with 2 repeats "
        "need at least 7 frames, input_lengths[1] = 6); F.ctc_loss(..., zero_infinity=False) "
        "gives it a loss of +inf, so the sum over the batch is +inf too"
    ) in str(err)  # sample 2 (4 4 in 3 frames) fits exactly
    assert err.fix.endswith(
        'F.ctc_loss(lp, flat, [12, 6, 3], tgt_len, reduction="sum", zero_infinity=True))'
        "  # drops them; or filter out utterances whose labels are too long for their audio "
        "(or lower the time downsampling)"
    )


def test_ctc_unbatched_target_too_long() -> None:
    lp = torch.randn(4, 6).log_softmax(1)  # (T, C): one sample
    target = torch.tensor([2, 2, 3, 1])  # one repeat: 5 frames needed
    assert F.ctc_loss(lp, target, torch.tensor(4), torch.tensor(4)).item() == math.inf
    err = guarded(nn.CTCLoss(), lp, target, torch.tensor(4), torch.tensor(4))
    assert err.code == "NW516" and err.positions == ((0,),)
    assert (
        "1 target of 1 is longer than its input can align (the target: 4 labels with 1 repeat "
        "need at least 5 frames, input_lengths = 4); CTCLoss(zero_infinity=False) gives it a "
        "loss of +inf\n"
    ) in str(err)
    with watch(nn.Identity()):  # 5 frames are enough; lengths as tuples
        assert math.isfinite(F.ctc_loss(torch.randn(5, 6).log_softmax(1), target, (5,), (4,)))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_ctc_lengths_that_fit_exactly_pass_untouched(reduction: str) -> None:
    """target_length + repeats == input_length is the shortest alignment: finite, no error,
    for padded, concatenated and unbatched targets, lengths as tensors, tuples or lists."""
    ctc = nn.CTCLoss(reduction=reduction)
    lp = torch.randn(9, 3, 6).log_softmax(2).requires_grad_()
    rows = [[2, 2, 4, 4, 4, 1], [1, 2, 3, 4, 5, 1, 2, 3, 4], [5, 5, 5, 5, 5]]  # 9 frames each
    padded, tgt_len = _labels(*rows), torch.tensor([6, 9, 5])
    flat = torch.tensor([v for r in rows for v in r])
    in_len = torch.tensor([9, 9, 9])
    calls: list[tuple[Any, ...]] = [
        (lp, padded, in_len, tgt_len),
        (lp, padded, (9, 9, 9), [6, 9, 5]),
        (lp, flat, in_len, tgt_len),
        (lp, flat, [9, 9, 9], (6, 9, 5)),
        (lp[:, 0], flat[:6], torch.tensor(9), torch.tensor(6)),  # unbatched
        (lp[:, 0], flat[:6], (9,), (6,)),
    ]
    for args in calls:
        reference = ctc(*args)
        with watch(ctc) as nw:
            out = ctc(*args)
            kinds = [n.kind for n in nw.trace.notes]
        assert torch.equal(out, reference) and out.isfinite().all()
        assert kinds == ["loss_input"]


def test_ctc_zero_infinity_drops_the_sample_so_nothing_is_raised() -> None:
    lp = torch.randn(12, 2, 6).log_softmax(2)
    targets = _labels([3] * 8, _no_repeats(20))
    in_len, tgt_len = torch.tensor([12, 12]), torch.tensor([8, 20])
    ctc = nn.CTCLoss(zero_infinity=True)
    reference = ctc(lp, targets, in_len, tgt_len)
    with watch(ctc) as nw:
        assert torch.equal(ctc(lp, targets, in_len, tgt_len), reference)
        out = F.ctc_loss(lp, targets, in_len, tgt_len, zero_infinity=True)
        assert torch.equal(out, reference) and reference.item() == 0.0
        assert [n.kind for n in nw.trace.notes] == ["loss_input", "loss_input"]


def test_ctc_length_check_is_in_the_one_read(monkeypatch: pytest.MonkeyPatch) -> None:
    reads, syncs = count_reads_and_syncs(monkeypatch)
    ctc = nn.CTCLoss()
    lp = torch.randn(12, 2, 6).log_softmax(2)
    with watch(ctc, functional_guards=True):
        ctc(lp, _labels([1, 2, 3], [4, 4]), torch.tensor([12, 3]), torch.tensor([3, 2]))
        F.ctc_loss(lp, torch.tensor([1, 2, 3, 4, 4]), (12, 3), (3, 2))
    assert len(reads) == 2 and all("ctc_short" in keys for keys in reads)
    assert syncs == []


def test_labels_zero_to_c_are_not_told_to_subtract_one() -> None:
    # 0 is a label too: `target - 1` would make it -1, another target out of range
    err = guarded(nn.CrossEntropyLoss(), torch.randn(5, 3), torch.tensor([0, 2, 3, 1, 0]))
    assert "target - 1" not in str(err) and "- 1" not in err.fix
    assert "the labels run 0..3, so they need 4 classes" in str(err)
    assert err.fix == "give the model 4 outputs, or remap the labels to 0..2"
    # ignored entries do not count as labels: 1..3 with -100 padding still means 1-based
    err = guarded(nn.CrossEntropyLoss(), torch.randn(4, 3), torch.tensor([1, -100, 3, 2]))
    # ... and the shift leaves them ignored (-100 - 1 would be a label out of range)
    assert err.fix.endswith("torch.where(target == -100, target, target - 1))")


def test_guard_error_is_also_the_error_torch_raises_on_the_cpu() -> None:
    # a loop that skips bad batches with `except IndexError` behaves as without nanwatch
    crit, emb = nn.CrossEntropyLoss(), nn.Embedding(10, 4)
    cases: list[Callable[[], Any]] = [
        lambda: crit(torch.randn(4, 3), torch.tensor([0, 1, 3, 2])),
        lambda: F.cross_entropy(torch.randn(4, 3), torch.tensor([0, 1, 7, 2])),
        lambda: emb(torch.tensor([[1, 12]])),
    ]
    for call in cases:
        with pytest.raises(IndexError) as info, watch(crit, emb, postmortem=False):
            call()
        err = info.value
        assert isinstance(err, GuardError) and err.torch_error_type is IndexError
        assert "raised as an IndexError too: torch's own error for this call" in str(err)
        copy_ = pickle.loads(pickle.dumps(err))  # the type survives a pickle
        assert isinstance(copy_, IndexError) and isinstance(copy_, GuardError)
        assert copy_.code == err.code
    # torch computes a silently wrong loss here: a plain GuardError (ValueError)
    err = guarded(nn.BCEWithLogitsLoss(), torch.randn(4), torch.tensor([0.0, 255.0, 1.0, 0.0]))
    assert err.torch_error_type is None and not isinstance(err, IndexError)
    assert "raised as" not in str(err)


def test_guard_does_not_run_an_embedding_that_renormalizes_its_weight() -> None:
    emb = nn.Embedding(10, 4, max_norm=0.5)
    before = emb.weight.detach().clone()
    with pytest.raises(GuardError) as info, watch(emb, postmortem=False):
        emb(torch.tensor([[1, 12]]))
    assert info.value.torch_error_type is None
    assert torch.equal(emb.weight.detach(), before)


def test_multilabel_soft_margin_targets_are_binary() -> None:
    # its targets are 0/1 per class, like BCE's: -1/1 labels train a wrong loss silently
    targets = torch.tensor([[1.0, -1.0, -1.0], [-1.0, 1.0, 1.0]])
    err = guarded(nn.MultiLabelSoftMarginLoss(), torch.randn(2, 3), targets)
    assert err.code == "NW505" and "labels of -1 and 1" in str(err)
    assert err.fix.endswith("(target + 1) / 2)")  # the guarded() helper calls it so


def test_255_among_0_1_labels_is_a_missing_marker_not_a_0_255_mask() -> None:
    # `target / 255` would turn every positive label into 0.0039: mask the 255s instead
    target = torch.tensor([[0.0, 1.0, 255.0], [1.0, 0.0, 1.0]])
    err = guarded(nn.BCEWithLogitsLoss(), torch.randn(2, 3), target)
    assert "/ 255" not in err.fix and "0/255 mask" not in str(err)
    assert "255 among 0/1 labels" in str(err)
    assert "target.clamp(0, 1), reduction='none'" in err.fix and "(target != 255)" in err.fix
    err = guarded(nn.BCEWithLogitsLoss(), torch.randn(3), torch.tensor([0.0, 255.0, 255.0]))
    assert err.fix.endswith("target / 255)")


def test_first_positions_say_how_many_there_are_in_all() -> None:
    """'first positions: 8, 9, 10 (of 8)' read as positions out of a range of 8."""
    crit = nn.MarginRankingLoss()
    y = torch.tensor([1.0] * 8 + [0.0] * 8)  # 0/1 labels; the loss takes 1 and -1
    with watch(crit, postmortem=False), pytest.raises(GuardError) as info:
        crit(torch.randn(16), torch.randn(16), y)
    assert "first positions: 8, 9, 10 … (8 in all)" in str(info.value)
