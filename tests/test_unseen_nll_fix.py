"""NW113's fix names the loss call that failed: a model that computes its own loss (Hugging
Face, labels all -100) gets a skip in the user's names, not the line's arguments taken for
logits; a line with two criterion calls gets the one whose batch was empty rewritten."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests.zoo import TwoTasks


def _bert() -> Any:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
    )
    return tf.BertForSequenceClassification(cfg)


def _batch(step: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(1, 50, (4, 12)),
        "attention_mask": torch.ones(4, 12, dtype=torch.long),
        "labels": torch.randint(0, 3, (4,)) if step < 1 else torch.full((4,), -100),
    }


def _run_loop(fix: str, model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[Any]:
    """The fix pasted into a loop over ``batches``; the values of ``out`` it left."""
    body = "\n".join("    " + line for line in fix.splitlines())
    src = f"for batch in batches:\n{body}\n    outs.append(out)\n"
    outs: list[Any] = []
    exec(src, {"model": model, "batches": batches, "outs": outs, "F": F, "torch": torch})
    return outs


def test_hf_model_loss_all_labels_ignored_fix_skips_in_users_names(tmp_path: Path) -> None:
    model = model_ = _bert()
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(model, report_dir=tmp_path),
    ):
        for step in range(2):
            batch = _batch(step)
            out = model(**batch)
            out.loss.backward()
    d = info.value.diagnosis
    assert d.code == "NW113"
    fix = d.fix
    assert 'if not (batch["labels"] != -100).any():' in fix
    assert "out = model(**batch)" in fix
    assert "logits, y" not in fix and "F.cross_entropy(x" not in fix
    # pasted into the loop: the batch whose labels all are -100 is skipped, not NaN
    torch.manual_seed(1)
    outs = _run_loop(fix, model_, [_batch(0), _batch(1), _batch(0)])
    assert len(outs) == 2 and all(torch.isfinite(o.loss) for o in outs)
    # the commented alternative runs too: the loss outside the model, 0 when nothing counts
    alt = [line[2:] for line in fix.splitlines() if line.startswith("# ") and "=" in line]
    assert alt and alt[-1].startswith("loss = F.cross_entropy(out.logits")
    g: dict[str, Any] = {"model": model_, "batch": _batch(1), "F": F, "torch": torch}
    exec("\n".join(alt), g)
    assert g["loss"].item() == 0.0 and "labels" in g["batch"]


def test_hf_tuple_loss_fix_does_not_take_inputs_for_logits(tmp_path: Path) -> None:
    model = _bert()
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(model, report_dir=tmp_path),
    ):
        for step in range(2):
            b = _batch(step)
            x, labels = b["input_ids"], b["labels"]
            loss, _ = model(x, labels=labels, return_dict=False)
            loss.backward()
    fix = info.value.diagnosis.fix
    assert "F.cross_entropy(x" not in fix and "logits, y" not in fix
    assert "if not (labels != -100).any():" in fix
    assert "loss, _ = model(x, labels=labels, return_dict=False)" in fix


def _mtl_fix(variant: str, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    torch.manual_seed(0)
    model = TwoTasks()
    ce, bce = nn.CrossEntropyLoss(), nn.BCEWithLogitsLoss()
    names: dict[str, Any] = {}
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(model, ce, bce, report_dir=tmp_path) as nw,
    ):
        for step in range(3):
            x = torch.randn(16, 8)
            ya = torch.randint(0, 4, (16,))
            yb = (torch.rand(16, 1) < 0.5).float()
            m = torch.rand(16) < (0.5 if step != 2 else 0.0)
            la, lb = model(x)
            names.update(la=la, lb=lb, ya=ya, yb=yb, m=m, ce=ce, bce=bce, F=F)
            if variant == "ce":
                loss = bce(lb, yb) + ce(la[m], ya[m])
            else:
                loss = ce(la, ya) + bce(lb[m], yb[m])
            loss.backward()
            nw.step()
    assert info.value.diagnosis.code == "NW113"
    return info.value.diagnosis.fix, names


def _check_runs(fix: str, names: dict[str, Any]) -> None:
    g = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in names.items()}
    exec(fix, g)
    assert torch.isfinite(g["loss"])


def test_two_criteria_on_a_line_fix_rewrites_the_empty_ce(tmp_path: Path) -> None:
    fix, names = _mtl_fix("ce", tmp_path)
    assert fix.startswith("loss = bce(lb, yb) + (ce(la[m], ya[m]) if (ya[m] != -100).any() else 0)")
    assert "logits" not in fix
    _check_runs(fix, names)


def test_two_criteria_on_a_line_fix_rewrites_the_empty_bce(tmp_path: Path) -> None:
    fix, names = _mtl_fix("bce", tmp_path)
    assert fix.startswith("loss = ce(la, ya) + (bce(lb[m], yb[m]) if lb[m].numel() else 0)")
    assert "pred" not in fix
    _check_runs(fix, names)
