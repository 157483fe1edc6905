"""Index guards: ids out of range for an nn.Embedding / nn.EmbeddingBag (and F.one_hot's
values) raise GuardError before the kernel runs, for the module and the functional form;
valid ids pass with results identical to an unwatched call."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import guards, scenarios
from nanwatch.errors import GuardError
from tests._guard_reads import count_reads_and_syncs


@pytest.fixture(autouse=True)
def no_function_mode_left() -> Iterator[None]:
    yield
    assert torch._C._len_torch_function_stack() == 0, "a TorchFunctionMode was left active"


def watch(*modules: nn.Module, **kw: Any) -> nanwatch.Watcher:
    kw.setdefault("postmortem", False)
    kw.setdefault("on_anomaly", "record")
    return nanwatch.watch(*modules, **kw)


def stopped(model: nn.Module, call: Callable[[], Any], **kw: Any) -> GuardError:
    """Run ``call`` under ``watch(model)`` and return the GuardError it raises."""
    with pytest.raises(GuardError) as info, watch(model, **kw):
        call()
    return info.value


def stopped_f(call: Callable[[], Any]) -> GuardError:
    """Run ``call`` (functional code) under the functional guards."""
    return stopped(nn.Identity(), call, functional_guards=True)


def line_of(text: str) -> int:
    """The line of this file that holds ``text`` (never hard-coded)."""
    source = inspect.getsource(inspect.getmodule(line_of))  # type: ignore[arg-type]
    return next(i for i, ln in enumerate(source.splitlines(), 1) if text in ln)


class LM(nn.Module):
    """Token embedding -> head, like the probe that opened this (a vocabulary of 100)."""

    def __init__(self, vocab: int = 100, dim: int = 16, padding_idx: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))  # the embedding's call is nested in another


# ------------------------------------------------------------------ what is guarded
def test_embeddings_and_one_hot_are_enumerated_from_torch() -> None:
    assert [c.__name__ for c in guards.index_classes()] == ["Embedding", "EmbeddingBag"]
    emb, bag = guards.spec_for(nn.Embedding), guards.spec_for(nn.EmbeddingBag)
    assert emb is not None and bag is not None
    assert (emb.call, emb.kind, emb.classes) == ("F.embedding", "index", ("Embedding",))
    assert (bag.call, bag.kind) == ("F.embedding_bag", "index")
    specs = guards.functional_specs()
    assert specs[F.embedding] is emb and specs[F.embedding_bag] is bag
    # a builtin without an inspectable signature: read from torch's docstring
    one_hot = specs[F.one_hot]
    assert one_hot.params == ("tensor", "num_classes")
    assert dict(one_hot.defaults) == {"num_classes": -1}

    class Scaled(nn.Embedding):  # keeps torch's forward: guarded like an Embedding
        pass

    class Shifted(nn.Embedding):  # its own forward: guarded through F.embedding only
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids + 2)

    assert guards.spec_for(Scaled) is emb and guards.spec_for(Shifted) is None
    assert guards.spec_for(nn.Linear) is None


# ------------------------------------------------------------------ ids out of range
def test_token_id_equal_to_the_vocabulary_size() -> None:
    model = LM()
    ids = torch.randint(0, 100, (2, 12))
    ids[1, 5] = 100
    err = stopped(model, lambda: model(ids))
    assert (err.code, err.check, err.loss, err.module, err.path) == (
        "NW513",
        "index-range",
        "Embedding",
        "emb",
        "emb",
    )
    assert (err.values, err.counts, err.count, err.total) == ((100,), (1,), 1, 24)
    assert err.positions == ((1, 5),) and err.expected == "0..99"
    assert err.source is not None
    assert err.source.endswith(f"test_guards_embedding.py:{line_of('return self.out(self.emb')}")
    # the nested call on the line is told apart: the fix is for self.emb, not self.out
    assert err.fix == "self.emb = nn.Embedding(101, 16)  # or len(tokenizer) rows"
    msg = str(err)
    assert msg.startswith("emb (Embedding) at ")
    assert "input contains 100 at 1 position (of 24); Embedding has 100 rows" in msg
    assert "so ids must be in 0..99 — 100 is one past the last row" in msg
    assert "100 is one past the last row: was a token added to the tokenizer" in msg
    assert "first positions: (1, 5)" in msg
    assert "NW513: checked before the kernel ran" in msg
    assert err.diagnosis.code == "NW513" and err.diagnosis.path == "emb"


def test_the_guard_error_becomes_the_steps_diagnosis() -> None:
    model = LM()
    with pytest.raises(GuardError), watch(model) as nw:
        model(torch.tensor([[3, 100]]))
    (d,) = nw.history[-1].diagnoses
    assert (d.code, d.title, d.severity, d.path) == ("NW513", "Index out of range", "error", "emb")
    assert d.fix == "self.emb = nn.Embedding(101, 16)  # or len(tokenizer) rows"


def test_ids_from_a_larger_vocabulary_name_the_largest() -> None:
    model = LM(padding_idx=0)
    ids = torch.tensor([[5, 50256, 7], [30522, 1, 50256]])
    err = stopped(model, lambda: model(ids))
    assert err.values == (50256, 30522) and err.counts == (2, 1)
    assert "the largest id is 50256, so the ids need 50257 rows" in str(err)
    # the rebuilt table keeps the module's other settings
    assert err.fix.startswith("self.emb = nn.Embedding(50257, 16, padding_idx=0)")


def test_rows_are_read_from_the_weight_not_from_num_embeddings() -> None:
    model = LM()
    model.emb.weight = nn.Parameter(torch.randn(120, 16))  # resized by hand; attribute stale
    assert model.emb.num_embeddings == 100
    with watch(model):
        model(torch.tensor([[110, 119]]))  # rows 110 and 119 exist: torch computes this
    err = stopped(model, lambda: model(torch.tensor([[110, 120]])))
    assert err.values == (120,) and err.expected == "0..119"


def test_tied_weights_and_a_subclass_are_read_as_they_are() -> None:
    class ScaledEmbedding(nn.Embedding):
        pass

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = ScaledEmbedding(50, 8)
            self.lm_head = nn.Linear(8, 50, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.wte(ids))

    model = Tied()
    err = stopped(model, lambda: model(torch.tensor([[1, 50]])))
    assert (err.loss, err.module, err.values) == ("ScaledEmbedding", "wte", (50,))
    assert err.fix.startswith("self.wte = nn.Embedding(51, 8)")


def test_a_hugging_face_model_is_told_to_resize_its_token_embeddings() -> None:
    class FakePreTrained(nn.Module):  # the two methods transformers' PreTrainedModel has
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 8)
            self.embed_positions = nn.Embedding(16, 8)

        def get_input_embeddings(self) -> nn.Module:
            return self.embed_tokens

        def resize_token_embeddings(self, n: int) -> None:
            raise AssertionError("never called by nanwatch")

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(input_ids.shape[1])
            return self.embed_tokens(input_ids) + self.embed_positions(pos)

    model = FakePreTrained()
    err = stopped(model, lambda: model(torch.tensor([[1, 50, 2]])))
    assert err.fix == "model.resize_token_embeddings(len(tokenizer))  # a row for every token"
    # the position embedding is not the input embedding: a longer sequence is truncated
    err = stopped(model, lambda: model(torch.randint(0, 50, (2, 20))))
    assert err.module == "embed_positions" and err.values == (16, 17, 18, 19)
    assert "these are positions: the sequence (20 tokens) is longer than the 16 positions" in str(
        err
    )
    assert "truncation=True, max_length=16" in err.fix


def test_negative_ids_are_padding_to_map_to_the_padding_row() -> None:
    model = LM(padding_idx=0)
    ids = torch.randint(1, 100, (2, 6))
    ids[:, 4:] = -100  # labels' ignore_index used as input padding
    err = stopped(model, lambda: model(ids))
    assert err.values == (-100,) and err.count == 4 and err.positions[:2] == ((0, 4), (0, 5))
    assert "-100 is the loss's ignore_index: were the labels passed as ids?" in str(err)
    assert err.fix == (
        "return self.out(self.emb(ids.masked_fill(ids < 0, 0)))  # 0 is the padding_idx"
    )
    model = LM()  # no padding_idx
    ids[:, 4:] = -1
    err = stopped(model, lambda: model(ids))
    assert "padding written as a negative id?" in str(err)
    # a padding row of its own, in the model's numbers (no invented pad_id)
    assert err.fix == (
        "self.emb = nn.Embedding(101, 16, padding_idx=100)  # row 100 for padding alone\n"
        "return self.out(self.emb(ids.masked_fill(ids < 0, 100)))"
    )


def test_ids_out_of_range_at_both_ends() -> None:
    model = LM()
    err = stopped(model, lambda: model(torch.tensor([[-1, 5, 120]])))
    assert err.values == (-1, 120) and err.positions == ((0, 0), (0, 2))
    assert "map the ids into 0..99" in err.fix


def test_functional_embedding() -> None:
    weight = torch.randn(10, 4)
    ids = torch.tensor([[1, 2, 10]])
    err = stopped_f(lambda: F.embedding(ids, weight))
    assert (err.loss, err.path, err.module) == ("F.embedding", "F.embedding", None)
    assert err.values == (10,) and err.positions == ((0, 2),)
    assert str(err).startswith("F.embedding at ")
    assert "weight has 10 rows, so ids must be in 0..9" in str(err)
    assert err.fix == "give weight at least 11 rows (it has 10), or remap the ids"
    # a negative padding_idx counts from the end, as F.embedding reads it: row 9, which is
    # also the id of a real item, so padding gets a row of its own
    ids = torch.tensor([1, -1])
    err = stopped_f(lambda: F.embedding(ids, weight, padding_idx=-1))
    expected = "F.embedding(ids.masked_fill(ids < 0, 10), weight, padding_idx=10))"
    assert err.fix.endswith(f"{expected}  # once weight has 11 rows: 10 for padding")


def test_ids_must_be_integers() -> None:
    model = LM()
    err = stopped(model, lambda: model(torch.tensor([[1.0, 2.0]])))
    assert (err.code, err.check, err.values) == ("NW514", "index-dtype", ("float32",))
    assert "input is float32; Embedding needs int64 or int32 indices" in str(err)
    # the user's line, comment included (as the loss guards keep it)
    assert err.fix.startswith("return self.out(self.emb(ids.long()))  # the embedding's call")
    reference = model(torch.tensor([[1, 2]]))
    with watch(model):  # int32 ids are what torch also takes
        out = model(torch.tensor([[1, 2]], dtype=torch.int32))
    assert torch.equal(out, reference)


# ------------------------------------------------------------------ EmbeddingBag
def test_embedding_bag_ids_with_offsets_and_in_2d() -> None:
    bag = nn.EmbeddingBag(10, 4, mode="sum")
    ids, offsets = torch.tensor([1, 2, 4, 5, 12, 3]), torch.tensor([0, 2, 4])
    err = stopped(bag, lambda: bag(ids, offsets))
    assert (err.code, err.loss, err.values) == ("NW513", "EmbeddingBag", (12,))
    assert err.positions == ((4,),)
    # an 'unknown' row first (ids unseen when the table was sized); growing it, after
    assert err.fix.startswith("bag = nn.EmbeddingBag(11, 4, mode='sum')  # row 10: 'unknown'")
    assert "(the vocabulary grew): bag = nn.EmbeddingBag(13, 4, mode='sum')" in err.fix
    err = stopped(bag, lambda: bag(torch.tensor([[1, 2], [3, 10]])))
    assert err.values == (10,) and err.positions == ((1, 1),)
    err = stopped_f(lambda: F.embedding_bag(torch.tensor([[1, -1]]), torch.randn(10, 4)))
    assert (err.loss, err.values) == ("F.embedding_bag", (-1,))


def test_embedding_bag_ids_past_the_last_offset_are_not_read() -> None:
    bag = nn.EmbeddingBag(10, 4, mode="sum", include_last_offset=True)
    ids, offsets = torch.tensor([1, 2, 3, 50]), torch.tensor([0, 2, 3])  # 50: after the end
    reference = bag(ids, offsets)  # torch computes it
    with watch(bag):
        out = bag(ids, offsets)
    assert torch.equal(out, reference)
    err = stopped(bag, lambda: bag(torch.tensor([1, 2, 50, 3]), offsets))
    assert err.values == (50,) and err.total == 3


@pytest.mark.parametrize(
    ("offsets", "problem", "fix"),
    [
        (
            [2, 4, 6],  # lengths.cumsum(0): the bags' ends
            "offsets[0] is 2; EmbeddingBag needs offsets that start at 0",
            "bag(ids, torch.cat([off.new_zeros(1), off[:-1]]))",
        ),
        ([0, 4, 2], "offsets decrease at 1 position (of 3)", "lengths.cumsum(0)[:-1]"),
        ([0, 2, 7], "offsets[-1] is 7 but input has 6 ids", "lengths.cumsum(0)[:-1]"),
    ],
)
def test_embedding_bag_offsets(offsets: list[int], problem: str, fix: str) -> None:
    bag = nn.EmbeddingBag(10, 4, mode="sum")
    ids, off = torch.tensor([1, 2, 4, 5, 8, 3]), torch.tensor(offsets)
    with pytest.raises(GuardError) as info, watch(bag):
        bag(ids, off)
    err = info.value
    assert (err.code, err.check) == ("NW515", "offsets")
    assert problem in str(err) and fix in err.fix


def test_embedding_bag_offsets_must_be_integers() -> None:
    bag = nn.EmbeddingBag(10, 4)
    err = stopped(bag, lambda: bag(torch.tensor([1, 2, 3]), torch.tensor([0.0, 2.0])))
    assert (err.code, err.values) == ("NW514", ("float32",))
    assert "offsets is float32" in str(err)


# ------------------------------------------------------------------ F.one_hot
def test_one_hot_values() -> None:
    mask = torch.tensor([[0, 1], [255, 2]])
    err = stopped_f(lambda: F.one_hot(mask, num_classes=3))
    assert (err.code, err.loss, err.values) == ("NW513", "F.one_hot", (255,))
    assert err.positions == ((1, 0),)
    assert "F.one_hot(..., num_classes=3) accepts 0..2 — 255 looks like an ignore label" in str(err)
    assert err.fix.startswith("err = stopped_f(lambda: F.one_hot(mask.masked_fill(mask == 255, 0)")
    labels = torch.tensor([1, 2, 3])
    err = stopped_f(lambda: F.one_hot(labels, 3))
    assert "labels 1..3 need `labels - 1`, or num_classes=4" in str(err)
    err = stopped_f(lambda: F.one_hot(torch.tensor([1, -1])))
    assert err.expected == ">= 0" and err.values == (-1,)
    err = stopped_f(lambda: F.one_hot(labels.int(), 4))
    assert (err.code, err.values) == ("NW514", ("int32",))


# ------------------------------------------------------------------ what passes
def _valid_calls() -> dict[str, tuple[nn.Module | None, Callable[[nn.Module | None], Any]]]:
    emb = nn.Embedding(20, 4, padding_idx=0)
    bag = nn.EmbeddingBag(20, 4, mode="max")
    bag_w = nn.EmbeddingBag(20, 4, mode="sum", include_last_offset=True, padding_idx=3)
    ids = torch.randint(0, 20, (3, 5))
    flat, off = torch.randint(0, 20, (7,)), torch.tensor([0, 3, 3, 7])
    w = torch.randn(7)
    weight = torch.randn(20, 4, requires_grad=True)
    return {
        "Embedding": (emb, lambda m: m(ids)),
        "EmbeddingBag 2-d": (bag, lambda m: m(ids)),
        "EmbeddingBag offsets": (bag_w, lambda m: m(flat, off, per_sample_weights=w)),
        "F.embedding": (None, lambda m: F.embedding(ids, weight, padding_idx=-1)),
        "F.embedding_bag": (None, lambda m: F.embedding_bag(flat, weight, off[:-1], mode="mean")),
        "F.one_hot": (None, lambda m: F.one_hot(ids, 20)),
    }


@pytest.mark.parametrize("name", list(_valid_calls()))
def test_valid_ids_pass_with_identical_results(name: str) -> None:
    module, call = _valid_calls()[name]
    reference = call(module)
    grads = None
    if reference.requires_grad:
        params = list(module.parameters()) if module is not None else []
        grads = torch.autograd.grad(reference.sum(), params) if params else None
    with watch(module or nn.Identity(), functional_guards=True) as nw:
        out = call(module)
        notes = list(nw.trace.notes)
    assert torch.equal(out, reference)
    if grads is not None:
        assert module is not None
        again = torch.autograd.grad(out.sum(), list(module.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(again, grads, strict=True))
    assert notes == []  # a passing index call writes nothing (no "loss_input" note)


def test_one_read_per_embedding_call_and_none_inside_the_guarded_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads, syncs = count_reads_and_syncs(monkeypatch)
    model, bag = LM(), nn.EmbeddingBag(10, 4, include_last_offset=True)
    with watch(model, bag, functional_guards=True):
        model(torch.randint(0, 100, (4, 16)))
        bag(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 4]))
    # one read each (F.embedding inside the guarded module is not checked again)
    assert reads == [
        ["index_min", "index_max"],
        ["offsets_first", "offsets_last", "offsets_decreasing", "index_min", "index_max"],
    ]
    assert syncs == []


# ------------------------------------------------------------------ switches
def test_guards_false_and_functional_guards_off_leave_it_to_torch() -> None:
    model = LM()
    bad = torch.tensor([[1, 100]])
    with watch(model, guards=False, functional_guards=True), pytest.raises(IndexError):
        model(bad)
    with watch(nn.Identity(), functional_guards=False), pytest.raises(IndexError):
        F.embedding(bad, torch.randn(100, 4))


def test_ignore_lets_the_call_through() -> None:
    model = LM()
    with watch(model, ignore=["NW513"]), pytest.raises(IndexError, match="index out of range"):
        model(torch.tensor([[1, 100]]))


def test_an_internal_error_disables_the_embedding_guard_not_the_training(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(p: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setitem(guards._CHECKS, "index", broken)
    model = LM()
    with pytest.warns(RuntimeWarning, match="embedding guard .*guards are off"), watch(model) as nw:
        out = model(torch.tensor([[1, 2]]))
        model(torch.tensor([[1, 2]]))
    assert out.shape == (1, 2, 100) and nw.faults == [("embedding guard", "RuntimeError: boom")]


def test_watch_all_guards_an_embedding_found_in_a_new_root() -> None:
    """``nanwatch run``: the model is discovered at its first call, its embedding with it."""
    model = LM()
    with pytest.raises(GuardError) as info, nanwatch.watch_all(postmortem=False):
        model(torch.tensor([[1, 100]]))
    assert (info.value.module, info.value.values) == ("emb", (100,))


def test_guard_rules_for_indices_are_in_the_catalog() -> None:
    from nanwatch.rules.base import catalog

    codes = {r.code: r for r in catalog()}
    assert codes["NW513"].title == "Index out of range" and codes["NW513"].family == "guards"
    assert codes["NW514"].title == "Index has the wrong dtype"
    assert codes["NW515"].title == "EmbeddingBag offsets invalid"


# ------------------------------------------------------------------ scenario
def test_the_added_token_scenario() -> None:
    from nanwatch.scenarios import added_token

    outcome = scenarios.run(scenarios.get("added-token"))
    assert outcome.mismatches() == []
    err = outcome.error
    assert isinstance(err, GuardError)
    rows = len(added_token.WordTokenizer(list(added_token.WORDS)))  # before the EOS was added
    assert err.values == (rows,) and err.module == "embed"
    assert err.count == added_token.BATCH  # one end-of-text token per row
    assert err.fix == f"self.embed = nn.Embedding({rows + 1}, 32)  # or len(tokenizer) rows"


def test_a_decoder_table_tied_to_the_input_embeddings_is_resized_with_them() -> None:
    # T5-style: the decoder's embed_tokens is its own module sharing the input table's
    # weight; rewriting its construction would be an edit of the library's source
    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Embedding(50, 8)
            self.decoder_embed = nn.Embedding(50, 8)
            self.decoder_embed.weight = self.shared.weight

        def get_input_embeddings(self) -> nn.Module:
            return self.shared

        def resize_token_embeddings(self, n: int) -> None:
            raise AssertionError("never called by nanwatch")

        def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            return self.shared(src).mean(1) + self.decoder_embed(tgt).mean(1)

    model = Seq2Seq()
    err = stopped(model, lambda: model(torch.tensor([[1, 2]]), torch.tensor([[3, 50]])))
    assert err.module == "decoder_embed"
    assert err.fix == "model.resize_token_embeddings(len(tokenizer))  # a row for every token"
