"""A float16 overflow that zeroes only some rows: a hand-written LayerNorm whose
(x - mean) ** 2 passes finfo(float16).max in the rows with large inputs outputs exact 0s
there and right values elsewhere, so its min and max look normal and no NaN appears. Watch
mode says so from its records (NW115): a normalized output made by a float16 division from
an input too wide to square. Sentinel, where an overflow zeroes a whole output, names the
overflow, not float16 underflow (NW304). Healthy float16 models stay silent."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch


class HandLayerNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return self.g * (x - mu) / torch.sqrt(var + self.eps)


class Float32LayerNorm(HandLayerNorm):
    """The fix: the statistic in float32, the result cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        mu = x32.mean(-1, keepdim=True)
        var = ((x32 - mu) ** 2).mean(-1, keepdim=True)
        return (self.g.float() * (x32 - mu) / torch.sqrt(var + self.eps)).to(x.dtype)


class Scale(nn.Module):
    """A constant scale: its output is its input divided by one number."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / 1000.0


class L2Normalize(nn.Module):
    """x / ||x||: torch's norm accumulates in float32, and |y| <= 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class HandSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x - x.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)


class Net(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.norm = norm
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


#: the diagnoses of a silent float16 overflow (a healthy model gets none of them)
_OVERFLOW = {"NW105", "NW109", "NW304", "NW115"}


def _half_wide_batch() -> torch.Tensor:
    """Four rows of ordinary size, four a thousand times larger."""
    scale = torch.tensor([1.0] * 4 + [1000.0] * 4)[:, None]
    return (torch.randn(8, 16) * scale).half()


def _run(
    model: nn.Module, x: torch.Tensor, mode: str = "watch", steps: int = 2
) -> list[nanwatch.Diagnosis]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return [d for t in nw.history for d in t.diagnoses]


def test_the_large_rows_are_zeroed_and_the_others_are_not() -> None:
    # the failure itself, without nanwatch: what the rule must find
    torch.manual_seed(0)
    model = Net(HandLayerNorm(64)).half()
    x = _half_wide_batch()
    with torch.no_grad():
        y = model.norm(model.fc(x))
    assert bool((y[4:] == 0).all()) and bool((y[:4] != 0).any())
    assert bool(torch.isfinite(y).all())


def test_watch_mode_says_a_float16_norm_of_values_too_wide_to_square() -> None:
    torch.manual_seed(0)
    ds = _run(Net(HandLayerNorm(64)).half(), _half_wide_batch())
    found = [d for d in ds if d.code == "NW115"]
    assert found, [d.headline for d in ds]
    assert "NW109" not in [d.code for d in ds]  # the output is not all 0
    d = found[0]
    assert d.path == "norm" and d.severity == "warning"
    text = "\n".join(d.evidence)
    assert d.evidence[0] in (
        # where the watcher read the output's autograd graph ("graph" notes)
        "norm (forward, output) was divided in float16 by a statistic of its input taken in "
        "float16: a variance, ((x - mean) ** 2).mean() (autograd graph: DivBackward0 <- "
        "SqrtBackward0 <- AddBackward0 <- MeanBackward1 <- PowBackward0; the squares "
        "(PowBackward0) are float16)",
        # from the records alone
        "norm (forward, output) was made by a float16 division (DivBackward0: not a cast "
        "from float32, not a fused norm) and is normalized: -2.766 to 2.639, max |y| between "
        "1 and sqrt(64) = 8, as a division by a standard deviation or root mean square over "
        "its last dim (64) gives",
    )
    assert (
        "its input (fc (forward, output)) spans -2204 to 2012: values 4216 apart; a deviation "
        "past 255.9 squares past 65504 (torch.finfo(torch.float16).max)"
    ) in text
    assert "a row zeroed this way (variance inf, x / inf = 0) does not change them" in text
    assert "x32 = x.float()   # in the forward of model.norm" in d.fix
    assert "nn.LayerNorm" in d.fix
    assert "(NW105)" in d.explanation


def test_forensic_mode_names_the_op_instead() -> None:
    torch.manual_seed(0)
    codes = [d.code for d in _run(Net(HandLayerNorm(64)).half(), _half_wide_batch(), "forensic")]
    assert "NW105" in codes and "NW115" not in codes


def test_a_wholly_zeroed_output_stays_nw109() -> None:
    torch.manual_seed(0)
    codes = [
        d.code for d in _run(Net(HandLayerNorm(64)).half(), (torch.randn(8, 16) * 1000).half())
    ]
    assert "NW109" in codes and "NW115" not in codes


@pytest.mark.parametrize(
    "norm",
    [Float32LayerNorm(64), nn.LayerNorm(64), Scale(), L2Normalize(), HandSoftmax()],
    ids=["float32-statistic", "nn.LayerNorm", "constant-scale", "l2-normalize", "hand-softmax"],
)
def test_healthy_float16_modules_on_the_same_wide_inputs_stay_silent(norm: nn.Module) -> None:
    torch.manual_seed(0)
    assert not _OVERFLOW & {d.code for d in _run(Net(norm).half(), _half_wide_batch(), steps=6)}


def test_a_hand_written_norm_on_ordinary_inputs_stays_silent() -> None:
    torch.manual_seed(0)
    codes = {d.code for d in _run(Net(HandLayerNorm(64)).half(), torch.randn(8, 16).half())}
    assert not _OVERFLOW & codes


def test_a_float16_relu_net_full_of_zeros_stays_silent() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    with torch.no_grad():
        model[0].bias.fill_(-1.0)  # most units off: outputs mostly exact 0
    codes = {d.code for d in _run(model.half(), torch.randn(32, 16).half(), steps=6)}
    assert not _OVERFLOW & codes


def test_sentinel_names_the_overflow_not_float16_underflow() -> None:
    # a whole output zeroed by the overflow: sentinel sees the layers before it get exactly
    # 0 step after step; the batch's float16 values square past 65504, and the layer after
    # the zero has a live bias gradient: an overflow (x / inf = 0), not underflow
    torch.manual_seed(0)
    model = Net(HandLayerNorm(64)).half()
    ds = _run(model, (torch.randn(8, 16) * 1000).half(), mode="sentinel", steps=6)
    found = [d for d in ds if d.code == "NW304"]
    assert found, [d.headline for d in ds]
    d = found[0]
    text = "\n".join(d.evidence)
    assert "head's weight gradient (head.weight) is exactly 0 while head.bias's gradient" in text
    assert (
        "Net (input, input[0]) reaches |x| = 2790 in float16: a square passes 65504 "
        "(torch.finfo(torch.float16).max) once |x| > 255.9, so a variance or norm of such "
        "values computed in float16 is inf, and x / inf = 0"
    ) in text
    assert "underflow" not in text
    assert "GradScaler" not in d.fix
    assert "x32 = x.float()" in d.fix
    assert "an overflow, not underflow" in d.explanation
