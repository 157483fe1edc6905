"""NW503 when the input's rows and the target's samples differ in number: a view in the
model that spread each sample over rows (``x.view(-1, 128)`` of a (8, 16, 4, 4) feature
map: the classic CNN flatten) is named with its shapes and the per-sample flatten; targets
(B, T) beside logits flattened to (B*T, C) are flattened the same way. Either was "check
that model(x) and y come from the same batch" before; that stays for two real batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanwatch import GuardError, watch

torch.set_num_threads(1)


class _Net(nn.Module):
    def __init__(self, per_row: int) -> None:
        super().__init__()
        self.per_row = per_row
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(per_row, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv(x)))
        x = x.view(-1, self.per_row)
        return self.fc(x)  # type: ignore[no-any-return]


def _raised(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str) -> GuardError:
    crit = nn.CrossEntropyLoss()
    with pytest.raises(GuardError) as info, watch(model, crit, mode=mode):
        crit(model(x), y)
    return info.value


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
@pytest.mark.parametrize(("per_row", "rows"), [(128, 16), (512, 4)])
def test_a_view_that_spreads_samples_over_rows_is_named(mode: str, per_row: int, rows: int) -> None:
    torch.manual_seed(0)
    err = _raised(_Net(per_row), torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)), mode)
    assert err.code == "NW503"
    assert f"batch sizes differ ({rows} vs 8): a view/reshape in the model made (8, 16, 4, 4) " \
        f"into ({rows}, {per_row}), so its rows are no longer samples (a sample has 256 " \
        f"values, a row {per_row})" in str(err)  # fmt: skip
    assert err.fix == (
        "flatten each sample on its own where the model reshapes (8, 16, 4, 4): x.flatten(1) "
        "(or x.view(x.size(0), -1)), 256 values a sample; the layer after it then takes "
        f"in_features=256, not {per_row}"
    )
    # before: "check that model(x) and y come from the same batch"
    assert "same batch" not in err.fix


def test_the_per_sample_flatten_it_asks_for_trains() -> None:
    torch.manual_seed(0)
    model = _Net(256)
    crit = nn.CrossEntropyLoss()
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    with watch(model, crit, mode="watch") as nw:
        loss = crit(model(x), y)
        loss.backward()
        nw.step()
    assert torch.isfinite(loss)


def test_targets_beside_flattened_logits_are_flattened_like_them() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))
    ids, tgt = torch.randint(0, 50, (4, 6)), torch.randint(0, 50, (4, 6))
    with pytest.raises(GuardError) as info, watch(model, mode="watch"):
        logits = model(ids)
        F.cross_entropy(logits.view(-1, 50), tgt)
    err = info.value
    assert err.code == "NW503"
    assert "the target holds one class for each of the input's 24 rows, shaped (4, 6)" in str(err)
    assert err.fix == (
        "F.cross_entropy(logits.view(-1, 50), tgt.reshape(-1))  # flattened like "
        "logits.view(-1, 50)"
    )


def test_two_real_batches_keep_the_same_batch_advice() -> None:
    model = nn.Linear(4, 3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(GuardError) as info, watch(model, crit, mode="watch"):
        crit(model(torch.randn(6, 4)), torch.randint(0, 3, (5,)))
    err = info.value
    assert "batch sizes differ (6 vs 5)" in str(err)
    assert err.fix == "check that model(torch.randn(6, 4)) and torch.randint(0, 3, (5,)) come " \
        "from the same batch"  # fmt: skip
