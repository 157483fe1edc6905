"""Guards on calls a library makes inside the user's ``model(...)``: a label one past an LM's
vocabulary (NW501) is not taken for 1-based labels and the positions are said to index the
library's own flattened target; a CTC target too long for its input (NW516) gets a fix that
keeps every argument of the call, or the setting the library reads zero_infinity from; CTC
fed softmax probabilities is noted as such for the rules."""

from __future__ import annotations

import importlib
import sys
import textwrap
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.errors import GuardError

_LIB = """
import types
import torch
import torch.nn.functional as F
from torch import nn


def lm_loss(logits, labels, ignore_index=-100):
    logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(logits, labels, ignore_index=ignore_index)


class TinyLM(nn.Module):
    def __init__(self, vocab=50, dim=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def get_output_embeddings(self):
        return self.head

    def resize_token_embeddings(self, n):
        raise NotImplementedError

    def forward(self, ids, labels):
        return lm_loss(self.head(self.emb(ids)), labels)


def ctc_loss_fn(logits, labels, lengths, zero_infinity=False):
    mask = labels > 0
    flat = labels.masked_select(mask)
    lp = F.log_softmax(logits, dim=-1).transpose(0, 1)
    return F.ctc_loss(
        lp,
        flat,
        lengths,
        mask.sum(-1),
        blank=0,
        reduction="sum",
        zero_infinity=zero_infinity,
    )


class TinyCTC(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(ctc_zero_infinity=False)
        self.lin = nn.Linear(4, 6)

    def forward(self, x, labels, lengths):
        return ctc_loss_fn(
            self.lin(x), labels, lengths, zero_infinity=self.config.ctc_zero_infinity
        )


def fixed_ctc(lp, flat, il, tl):
    return F.ctc_loss(lp, flat, il, tl, blank=0, zero_infinity=False)
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[types.ModuleType]:
    """A tiny "installed library" (its file lives under site-packages/)."""
    root = tmp_path_factory.mktemp("nw7") / "site-packages"
    root.mkdir()
    (root / "nw7_fakelib.py").write_text(textwrap.dedent(_LIB))
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("nw7_fakelib")
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("nw7_fakelib", None)


def watch(*modules: nn.Module, **kw: Any) -> nanwatch.Watcher:
    kw.setdefault("postmortem", False)
    kw.setdefault("on_anomaly", "raise")
    return nanwatch.watch(*modules, **kw)


# ---------------------------------------------------------------- NW501: past the vocabulary
def test_label_equal_to_vocab_size_in_library_lm_is_not_called_one_based(
    lib: types.ModuleType,
) -> None:
    torch.manual_seed(0)
    model = lib.TinyLM()
    ids = torch.randint(1, 50, (2, 10))
    labels = ids.clone()
    labels[:, :4] = -100  # the prompt
    labels[:, -1] = 50  # an EOS id from a tokenizer the model was not resized for
    with pytest.raises(GuardError) as info, watch(model):
        model(ids, labels)
    err = info.value
    text = str(err)
    assert err.code == "NW501" and err.values == (50,)
    assert "target - 1" not in text and "- 1" not in err.fix
    assert "50 is one past the last class (49)" in text and "needs 51 outputs" in text
    assert err.fix.startswith("model.resize_token_embeddings(len(tokenizer))")
    # the positions index the library's flattened, shifted copy, not `labels`
    assert "first positions: 8, 17 (in the (18,) target that F.cross_entropy got in " in text
    assert "nw7_fakelib.py:" in text and "not in your tensor" in text


def test_few_labels_of_many_classes_without_zero_need_more_outputs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    target = torch.tensor([5, 17, 100, 42, 88, 100])  # 0 absent: normal for 6 of 100 ids
    with pytest.raises(GuardError) as info, watch(nn.Identity(), functional_guards=True):
        F.cross_entropy(logits, target)
    err = info.value
    assert "- 1" not in err.fix and "class indices start at 0" not in str(err)
    assert err.fix == "give the model 101 outputs, or remap the labels to 0..99"
    assert "not in your tensor" not in str(err)  # the user's own call: their positions


def test_one_based_labels_with_ignored_positions_keep_the_ignore_index() -> None:
    logits = torch.randn(8, 4)
    target = torch.tensor([1, 2, -100, 3, 4, 4, -100, 1])
    with pytest.raises(GuardError) as info, watch(nn.Identity(), functional_guards=True):
        F.cross_entropy(logits, target)
    err = info.value
    assert "labels 1..4 need `target - 1`" in str(err)
    assert err.fix == "F.cross_entropy(logits, torch.where(target == -100, target, target - 1))"
    fixed = torch.where(target == -100, target, target - 1)
    assert torch.isfinite(F.cross_entropy(logits, fixed))


# ---------------------------------------------------------------- NW516: in a library
def _short_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(2, 12, 4)
    labels = torch.randint(1, 6, (2, 10))
    labels[0, 5:] = 0  # padding
    return x, labels, torch.tensor([12, 6])  # sample 1: 10 labels, 6 frames


def test_ctc_too_short_in_library_names_the_setting_it_reads_zero_infinity_from(
    lib: types.ModuleType,
) -> None:
    model = lib.TinyCTC()
    x, labels, lengths = _short_batch()
    with pytest.raises(GuardError) as info, watch(model):
        model(x, labels, lengths)
    err = info.value
    assert err.code == "NW516"
    assert err.fix.startswith("model.config.ctc_zero_infinity = True  # F.ctc_loss in ")
    assert "nw7_fakelib.py:" in err.fix and "F.ctc_loss(log_probs, targets" not in err.fix
    model.config.ctc_zero_infinity = True  # the fix, applied: the call goes through
    with watch(model):
        assert torch.isfinite(model(x, labels, lengths))


def test_ctc_fix_for_a_library_call_keeps_every_argument(lib: types.ModuleType) -> None:
    x, labels, lengths = _short_batch()
    lp = x.matmul(torch.randn(4, 6)).log_softmax(-1).transpose(0, 1)
    mask = labels > 0
    with pytest.raises(GuardError) as info, watch(nn.Identity(), functional_guards=True):
        lib.fixed_ctc(lp, labels[mask], lengths, mask.sum(-1))
    fix = info.value.fix
    assert fix.startswith(
        "F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=blank, "
        "zero_infinity=True)"
    ), fix
    assert fix.count("zero_infinity") == 1


# ---------------------------------------------------------------- CTC on probabilities
@pytest.mark.parametrize("softmax", [True, False])
def test_ctc_on_softmax_probabilities_is_noted_with_a_log_softmax_fix(softmax: bool) -> None:
    torch.manual_seed(0)
    enc, ctc = nn.Linear(20, 12), nn.CTCLoss()
    with watch(enc, ctc, on_anomaly="record") as nw:
        out = enc(torch.randn(30, 3, 20))
        lp = out.softmax(-1) if softmax else out.log_softmax(-1)
        ctc(lp, torch.randint(1, 12, (3, 8)), torch.full((3,), 30), torch.full((3,), 8))
    (note,) = [n for t in (nw.trace, *nw.history) for n in t.notes if n.kind == "loss_input"]
    if softmax:
        assert note.data["probability_rows"] is True
        assert "log_softmax(logits, dim=-1)" in note.data["probabilities_fix"]
    else:
        assert not note.data.get("probability_rows")
        assert "probabilities_fix" not in note.data


def test_ctc_on_softmax_probabilities_warns_nw205_with_the_fix() -> None:
    """The guard's note reaches NW205: CTC fed probabilities is a warning on a finite step
    (the loss is finite, often negative), with the log_softmax fix; log-probabilities are
    quiet."""
    torch.manual_seed(0)
    enc, ctc = nn.Linear(20, 12), nn.CTCLoss()
    for softmax in (True, False):
        with watch(enc, ctc, on_anomaly="record") as nw:
            out = enc(torch.randn(30, 3, 20))
            lp = out.softmax(-1) if softmax else out.log_softmax(-1)
            loss = ctc(lp, torch.randint(1, 12, (3, 8)), torch.full((3,), 30), torch.full((3,), 8))
            loss.backward()
            nw.step()
        found = [d for t in (nw.trace, *nw.history) for d in t.diagnoses if d.code == "NW205"]
        if softmax:
            (d,) = found
            assert "CTCLoss" in d.explanation and "log_softmax" in d.fix
            assert any("sums to 1" in e for e in d.evidence)
        else:
            assert not found


def test_ctc_too_short_with_reduction_none_says_dropping_the_inf_does_not_help() -> None:
    """An ESPnet-style loop drops the +inf per-utterance losses after a CTCLoss with
    reduction='none'; CTC's backward still makes NaN gradients for them (checked here), so
    the guard stops it and says so."""
    torch.manual_seed(0)
    lp = torch.randn(5, 2, 6).log_softmax(-1).requires_grad_()
    t = torch.randint(1, 6, (2, 8))
    lens, tl = torch.tensor([5, 5]), torch.tensor([8, 2])
    loss = F.ctc_loss(lp, t, lens, tl, reduction="none")
    loss[torch.isfinite(loss)].mean().backward()
    assert lp.grad is not None and bool(lp.grad.isnan().any())  # what the guard prevents
    ctc = nn.CTCLoss(reduction="none")
    with pytest.raises(GuardError) as info, watch(ctc):
        ctc(lp.detach(), t, lens, tl)
    assert info.value.code == "NW516"
    assert "does not help" in info.value.diagnosis.explanation
    mean = nn.CTCLoss()
    with pytest.raises(GuardError) as info, watch(mean):
        mean(lp.detach(), t, lens, tl)
    assert "does not help" not in info.value.diagnosis.explanation
