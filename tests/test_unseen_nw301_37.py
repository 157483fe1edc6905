"""NW301 names the update that broke the weights: the learning rate that update used (a
scheduler has stepped since), and a weight already non-finite before an update is not
blamed on that update."""

from __future__ import annotations

import torch
from torch import nn

import nanwatch


def _noam(step: int) -> float:
    """A Noam schedule without its min(): step ** -0.5 is inf at step 0."""
    return 16**-0.5 * torch.tensor(float(step)).pow(-0.5).item()


def test_an_inf_learning_rate_is_the_one_the_update_used_not_the_schedulers_next() -> None:
    """Sentinel reads the weights AdamW's step-0 update broke before step 1's forward; the
    scheduler has stepped since, and the group's lr is finite again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _noam)
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()  # the lr is finite (2.5e-4) from step 1 on
            nw.step()
    d = next(d for t in nw.history for d in t.diagnoses if d.code == "NW301")
    assert d.title == "Non-finite learning rate", (d.title, d.evidence, d.explanation)
    assert "AdamW's learning rate was inf at the update of step 0" in d.evidence, d.evidence
    assert "not the cause" not in d.explanation, d.explanation


def _bag() -> nn.Module:
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            with torch.no_grad():
                self.emb.weight[3] = 0.0  # its norm below has a NaN gradient at 0

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return (self.emb(idx) ** 2).sum(-1).sqrt()

    return Bag()


def test_a_weight_nan_since_an_earlier_update_is_not_blamed_on_a_later_one() -> None:
    """Step 0's update writes a NaN row into the embedding; steps 1 and 2 use other rows,
    whose finite gradients leave that row NaN: their updates did not break it."""
    torch.manual_seed(0)
    model = _bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.tensor([0, 3, 1]), torch.tensor([0, 1, 2]), torch.tensor([4, 5, 2])]
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for idx in batches:
            model(idx).sum().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    first = nw.history[0].diagnoses[0]
    later = [d for t in list(nw.history)[1:] for d in t.diagnoses if d.code == "NW301"]
    assert [d.step for d in later] == [1, 2], [(d.step, d.title) for d in later]
    for d in later:
        assert d.title == "Non-finite weights since an earlier step", (d.title, d.evidence)
        assert (
            "emb.weight was already NaN at the end of step 0 (read after that step's update), "
            "and at every read of it since"
        ) in d.evidence, d.evidence
        assert f"step 0 diagnosed: {first.code} {first.title}" in d.evidence, d.evidence
        assert not any("the update that broke it" in e for e in d.evidence), d.evidence
        assert "before the update of step" in d.explanation and "step 0" in d.explanation
    # the anomaly's own summary says so too, not "made non-finite by the last update"
    for t in list(nw.history)[1:]:
        assert t.anomaly is not None
        assert t.anomaly.summary.startswith(
            "NaN in the weights of emb.weight: non-finite since step 0 (read so at that step "
            "and at every step since), not made by this step"
        ), t.anomaly.summary
