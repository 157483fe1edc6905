"""Half-precision training told on the user's own lines: a model cast to float16 and
trained with AdamW (no autocast, no float32 master weights), whose eps=1e-8 is 0 in
float16. NW301's fix (and NW107's) rewrites the user's cast, forward, backward, step and
optimizer lines, with names of the user's own, whatever the mode. An lr is written one way
in every message (NW306 as NW101). NW108: a float16 LayerNorm whose eps is so small that
the 1 / sqrt(var + eps) it saves for backward is inf."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.rules.gradients import hyper

MODES = ("watch", "sentinel")


def _nw301(nw: nanwatch.Watcher) -> nanwatch.Diagnosis:
    return next(d for t in nw.history for d in t.diagnoses if d.code == "NW301")


@pytest.mark.parametrize("mode", MODES)
def test_float16_adamw_eps_fix_rewrites_the_users_own_lines(mode: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    net.half()
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.01)
    loss_fn = nn.MSELoss()
    inputs, targets = torch.randn(32, 8).half(), torch.randn(32, 1).half()
    with nanwatch.watch(net, loss_fn, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            out = net(inputs)
            err = loss_fn(out, targets)
            err.backward()
            optimizer.step()
            optimizer.zero_grad()
            nw.step()
    d = _nw301(nw)
    assert d.title == "Optimizer eps is 0 in the weights' dtype"
    assert "AdamW's eps=1e-8 is 0 in float16, whose smallest positive value is 5.96e-08" in (
        " ".join(d.evidence)
    )
    assert "at least 6.1e-05 (torch.finfo(torch.float16).tiny), 1e-4 as a power of 10" in (
        d.explanation
    )
    assert d.fix.splitlines() == [
        "# delete net.half(): float32 weights, float16 in the forward only",
        "scaler = torch.amp.GradScaler('cpu')   # once, before the loop",
        "with torch.autocast(device_type='cpu', dtype=torch.float16):",
        "    out = net(inputs)",
        "    err = loss_fn(out, targets)",
        "scaler.scale(err).backward()   # was: err.backward()",
        "scaler.step(optimizer)   # was: optimizer.step()",
        "scaler.update()",
        "# or, keeping float16 weights: optimizer = torch.optim.AdamW(net.parameters(), "
        "lr=3e-4, weight_decay=0.01, eps=1e-4)",
    ]
    # the eps written is one float16 holds as a normal number, from torch.finfo
    assert torch.finfo(torch.float16).tiny <= 1e-4 < 10 * torch.finfo(torch.float16).tiny


def test_a_cast_inside_the_models_construction_is_undone_on_its_line() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(torch.float16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 8).half(), torch.randn(32, 1).half()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    fix = _nw301(nw).fix.splitlines()
    assert fix[0] == (
        "model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))   "
        "# float32 weights, float16 in the forward only"
    )
    assert "    loss = nn.functional.mse_loss(model(x), y)" in fix
    assert fix[-1] == (
        "# or, keeping float16 weights: opt = torch.optim.Adam(model.parameters(), lr=1e-3, "
        "eps=1e-4)"
    )


def test_the_fix_written_on_the_users_lines_trains_without_nan() -> None:
    """The fix, pasted: float32 weights, the forward under autocast, a GradScaler."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.01)
    loss_fn = nn.MSELoss()
    inputs, targets = torch.randn(32, 8).half(), torch.randn(32, 1).half()
    scaler = torch.amp.GradScaler("cpu")
    with nanwatch.watch(net, loss_fn, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            with torch.autocast(device_type="cpu", dtype=torch.float16):
                out = net(inputs)
                err = loss_fn(out, targets)
            scaler.scale(err).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            nw.step()
    assert nw.anomalies == []
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_bfloat16_weights_whose_updates_round_away_get_the_users_lines_back() -> None:
    """NW107 (pure bfloat16 weights, updates lost to rounding): the model's construction
    without its ``.to(dtype)`` (a dtype held in a variable), the forward under autocast."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-5)
    x, y = torch.randn(16, 32, dtype=dtype), torch.randint(0, 4, (16,))
    with nanwatch.watch(net, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            logits = net(x)
            loss = nn.functional.cross_entropy(logits.float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = next(d for t in nw.history for d in t.diagnoses if d.code == "NW107")
    assert "about lr = 1e-5 per value" in " | ".join(d.evidence)
    assert d.fix.splitlines()[:4] == [
        "net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))   "
        "# float32 weights, bfloat16 in the forward only",
        "with torch.autocast(device_type='cpu', dtype=torch.bfloat16):",
        "    logits = net(x)",
        "    loss = nn.functional.cross_entropy(logits.float(), y)",
    ]
    assert "GradScaler" not in d.fix  # bfloat16 has float32's range: nothing to scale


def test_nw306_writes_its_learning_rate_as_nw101_does() -> None:
    """One style for an lr in every message (``5e-3``, not ``0.005``): NW306's evidence and
    fix, and NW101's growth note, all written by one helper."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=5e-3, weight_decay=1000)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = next(d for t in nw.history for d in t.diagnoses if d.code == "NW306")
    assert "lr 5e-3 × weight_decay 1000 = 5, past 2" in d.evidence[0], d.evidence
    assert "(SGD, lr 5e-3)" in d.fix and "0.005" not in " ".join(d.evidence)
    assert [hyper(x) for x in (5e-3, 1e-3, 3e-4, 0.05, 30000.0)] == [
        "5e-3",
        "1e-3",
        "3e-4",
        "0.05",
        "30000",
    ]


class _Tagger(nn.Module):
    """Token ids -> tags: an embedding whose padding row is 0, a LayerNorm, a head."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16, padding_idx=0)
        self.norm = nn.LayerNorm(16, eps=eps)
        self.head = nn.Linear(16, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(ids)))


def _tag(eps: float, mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = _Tagger(eps).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.tensor([[3, 4, 0, 0]])  # two padded tokens: rows of equal values (zeros)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            out = model(ids).float()
            nn.functional.cross_entropy(out.flatten(0, 1), ids.flatten()).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.gpu_bound_weaker(
    reason=(
        "nothing has landed when backward begins: the LayerNorm's backward op is not traced, "
        "and the rstd its forward saved is what NW108 reads"
    )
)
@pytest.mark.parametrize("mode", MODES)
def test_a_float16_layernorm_eps_whose_inverse_root_overflows_is_named(mode: str) -> None:
    """LayerNorm(eps=1e-12) in float16: the forward is finite (0 for a padded row), the
    saved 1 / sqrt(0 + eps) = 1e6 is inf in float16, and the backward makes NaN."""
    nw = _tag(1e-12, mode)
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW108", [x.headline for x in nw.history[0].diagnoses]
    floor = 1 / torch.finfo(torch.float16).max ** 2
    assert f"{floor:.3g}" == "2.33e-10"
    assert d.evidence[0] == (
        "aten.native_layer_norm's backward made NaN in float16: the 1 / sqrt(var + eps) its "
        "forward saved (rstd) is +inf for 2 of 4 rows"
    )
    assert (
        "those rows have variance 0 (equal values) and the LayerNorm's eps is below "
        in (d.evidence[1])
    )
    assert d.fix.splitlines()[1:3] == [
        "    if isinstance(m, nn.LayerNorm) and m.eps < 2.33e-10:",
        "        m.eps = 1e-5",
    ]


def test_a_float16_layernorm_with_an_eps_it_holds_trains_silently() -> None:
    nw = _tag(1e-5, "watch")
    assert nw.anomalies == [] and not [d for t in nw.history for d in t.diagnoses]
