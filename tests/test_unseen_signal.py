"""Unseen signal-processing models: complex exp and log (the statistics of a complex tensor
are of |z|; exp overflows by its real part, and a complex tensor has no clamp), log(0) of a
target made on a functional loss's own line, an eps that is 0 in float16, and a buffer
that was NaN from the module's __init__."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


def _diag(run) -> nanwatch.Diagnosis:
    with pytest.raises(nanwatch.AnomalyError) as info:
        run()
    return info.value.diagnoses[0]


def _first_line(fix: str) -> str:
    """The fix's first line as a statement (``return e`` -> ``out = e``), comment dropped."""
    line = fix.splitlines()[0].split("   #")[0].strip()
    return "out = " + line.removeprefix("return ") if line.startswith("return ") else line


def _train(model: nn.Module, make, steps: int = 2, *, mode: str = "watch") -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanwatch.watch(model, postmortem=False, mode=mode) as nw:
        for step in range(steps):
            loss = make(step)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()


# ---------------------------------------------------------------- complex exp (NW101)


class _Modes(nn.Module):
    def __init__(self, positive: bool) -> None:
        super().__init__()
        self.positive = positive
        self.decay = nn.Parameter(torch.tensor([1.0, -5.0]))
        self.omega = nn.Parameter(torch.tensor([0.5, 1.0]))

    def forward(self, amps: torch.Tensor) -> torch.Tensor:
        t = torch.arange(256, dtype=torch.float32)
        d = F.softplus(self.decay) if self.positive else self.decay
        s = torch.complex(-d[:, None] * t / 2, self.omega[:, None] * t)
        modes = torch.exp(s)
        return (amps[:, :, None] * modes).sum(1).real


def _modes(positive: bool) -> None:
    torch.manual_seed(0)
    m = _Modes(positive)
    amps = torch.complex(torch.randn(2, 2), torch.randn(2, 2))
    _train(m, lambda step: m(amps).square().mean())


def test_complex_exp_overflow_is_read_by_its_real_part_and_fixed_without_clamp() -> None:
    d = _diag(lambda: _modes(False))
    assert d.code == "NW101" and d.op == "aten.exp"
    text = "\n".join(d.evidence)
    assert "e^Re(z)" in text and "real part" in text
    assert "only |z|" in text  # what is known of a complex tensor, said so
    assert "largest value is" not in text and "argument reached" not in text
    line = _first_line(d.fix)
    assert line == "modes = torch.exp(torch.complex(s.real.clamp(max=44.3), s.imag))"
    s = torch.complex(torch.tensor([640.0, -3.0]), torch.tensor([256.0, 1.0]))
    scope: dict[str, object] = {"torch": torch, "s": s}
    exec(line, scope)  # the old fix, s.clamp(max=44.3), raised NotImplementedError
    assert torch.isfinite(scope["modes"]).all()  # type: ignore[call-overload]


def test_complex_exp_with_a_softplus_decay_stays_silent() -> None:
    _modes(True)


# ---------------------------------------------------------------- complex log (NW110)


class _Cepstrum(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.proj = nn.Linear(16, 16)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        X = torch.fft.fft(self.proj(frames) * (frames.abs().sum(-1, keepdim=True) > 0))
        return torch.fft.ifft(torch.log(X + self.eps)).real


class _LogSpectrum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        X = torch.fft.fft(self.proj(frames) * (frames.abs().sum(-1, keepdim=True) > 0))
        return torch.fft.ifft(torch.log(X)).real


def _silent_frame(m: nn.Module) -> None:
    torch.manual_seed(0)

    def make(step: int) -> torch.Tensor:
        frames = torch.randn(4, 16)
        if step == 1:
            frames[2] = 0.0
        return m(frames).square().mean()

    _train(m, make)


@pytest.mark.parametrize("eps", [0.0, 1e-7])
def test_complex_log_of_zero_is_minus_inf_and_its_fix_needs_no_clamp(eps: float) -> None:
    torch.manual_seed(0)
    m = _Cepstrum(eps)
    if eps:
        _silent_frame(m)  # healthy twin
        return
    d = _diag(lambda: _silent_frame(m))
    assert d.code == "NW110"
    text = "\n".join(d.evidence)
    assert "-inf+0j" in text and "exact zeros" in text
    assert "self.eps added nothing" in text  # eps = 0.0 on the line
    assert "softmax" not in d.explanation and "complex" in d.explanation
    line = _first_line(d.fix)
    assert line == "out = torch.fft.ifft(torch.log(X + max(self.eps, 1e-8))).real"
    scope: dict[str, object] = {"torch": torch, "X": torch.fft.fft(torch.zeros(16)), "self": m}
    exec(line, scope)
    assert torch.isfinite(scope["out"]).all()  # type: ignore[call-overload]


def test_complex_log_with_no_eps_gets_its_zeros_replaced() -> None:
    torch.manual_seed(0)
    m = _LogSpectrum()
    d = _diag(lambda: _silent_frame(m))
    assert d.code == "NW110" and "-inf+0j" in d.evidence[0]
    line = _first_line(d.fix)
    assert "torch.where(X == 0" in line and ".clamp" not in line
    scope: dict[str, object] = {"torch": torch, "X": torch.fft.fft(torch.zeros(16))}
    exec(line, scope)
    assert torch.isfinite(scope["out"]).all()  # type: ignore[call-overload]


# ---------------------------------------------------- log of a functional loss's target


class _Gen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 1, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(z)).squeeze(1)


def _mag(x: torch.Tensor) -> torch.Tensor:
    return torch.stft(x, 32, 8, window=torch.hann_window(32), return_complex=True).abs()


def _log_mag_loss(silent_target: bool) -> None:
    torch.manual_seed(0)
    g = _Gen()

    def make(step: int) -> torch.Tensor:
        z, y = torch.randn(2, 2, 128), 0.3 * torch.randn(2, 128)
        if step == 1 and silent_target:
            y[0, :96] = 0.0
        S, T = _mag(g(z)), _mag(y)
        return F.l1_loss(S.log(), T.log())

    _train(g, make)


def test_log_of_a_silent_target_on_the_loss_line_is_a_log_of_zero_not_bad_data() -> None:
    d = _diag(lambda: _log_mag_loss(True))
    assert d.code == "NW110", d  # was NW401 "NaN or inf in the loss targets"
    text = "\n".join(d.evidence)
    assert "T.log() is -inf wherever T is exactly 0" in text
    assert "assert torch.isfinite" not in d.fix
    line = _first_line(d.fix)
    assert line == "out = F.l1_loss(S.clamp_min(1e-5).log(), T.clamp_min(1e-5).log())"
    T = _mag(torch.zeros(1, 128))
    scope: dict[str, object] = {"F": F, "S": T + 1.0, "T": T}
    exec(line, scope)
    assert torch.isfinite(scope["out"])  # type: ignore[arg-type]


def test_log_magnitude_loss_of_a_sounding_target_stays_silent() -> None:
    _log_mag_loss(False)


# ------------------------------------------------------------ an eps that is 0 in float16


class _LogMel(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mel = self.lin(x).square() * (x.abs().sum(-1, keepdim=True) > 0)
        return torch.log(mel + self.eps)


class _Literal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.lin(x).square() * (x.abs().sum(-1, keepdim=True) > 0)
        return torch.log(p + 1e-8)


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * (x.abs().sum(-1, keepdim=True) > 0)
        return (h - h.mean(-1, keepdim=True)) / (h.std(-1, keepdim=True) + 1e-8)


def _half(front: nn.Module, mode: str = "watch") -> None:
    torch.manual_seed(0)
    m = nn.Sequential(front, nn.Linear(8, 2)).half()

    def make(step: int) -> torch.Tensor:
        x = torch.randn(4, 8)
        if step == 1:
            x[1] = 0.0
        return m(x.half()).float().square().mean()

    _train(m, make, mode=mode)


def test_an_eps_attribute_that_is_0_in_float16_is_pointed_out() -> None:
    d = _diag(lambda: _half(_LogMel(1e-8)))
    assert d.code == "NW110"
    text = "\n".join(d.evidence)
    assert "self.eps added nothing" in text and "float16" in text and "5.96e-08" in text
    assert "softmax" not in d.explanation and not d.fix.startswith("logp = F.log_softmax")
    line = _first_line(d.fix)
    assert line == "out = torch.log(mel + max(self.eps, 1e-4))"
    scope = {"torch": torch, "mel": torch.zeros(3, dtype=torch.float16), "self": _LogMel(1e-8)}
    exec(line, scope)
    assert torch.isfinite(scope["out"]).all()  # type: ignore[attr-defined]


def test_an_eps_attribute_that_float16_holds_stays_silent() -> None:
    _half(_LogMel(1e-4))


def test_a_literal_eps_below_float16s_subnormal_in_a_log() -> None:
    d = _diag(lambda: _half(_Literal()))
    assert d.code == "NW110"
    assert any("the 1e-8 on this line is 0 in float16" in e for e in d.evidence)
    assert "6.1e-05" in d.fix and "float32" in d.fix
    line = _first_line(d.fix)
    assert line == "out = torch.log(p + 1e-4)"


def test_a_literal_eps_below_float16s_subnormal_in_a_division() -> None:
    d = _diag(lambda: _half(_Norm()))
    assert d.code == "NW111"
    assert any("the 1e-8 on this line is 0 in float16" in e for e in d.evidence)
    assert "float16 cannot hold it" in d.explanation
    line = _first_line(d.fix)
    assert line == "out = (h - h.mean(-1, keepdim=True)) / (h.std(-1, keepdim=True) + 1e-4)"
    scope = {"h": torch.zeros(2, 8, dtype=torch.float16)}
    exec(line, scope)
    assert torch.isfinite(scope["out"]).all()  # type: ignore[attr-defined]


# --------------------------------------------------- a buffer NaN from __init__ (NW405)


class _Frontend(nn.Module):
    def __init__(self, empty_row: bool) -> None:
        super().__init__()
        fb = torch.rand(4, 8)
        if empty_row:
            fb[1] = 0.0  # a filter that falls between the bins
        self.register_buffer("fb", fb / fb.sum(dim=1, keepdim=True))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.matmul(x, self.fb.t()))


def _frontend(empty_row: bool) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), _Frontend(empty_row))
    x = torch.randn(3, 8)
    _train(m, lambda step: m(x).square().mean())


def test_a_buffer_nan_from_init_points_at_init_not_at_an_update() -> None:
    d = _diag(lambda: _frontend(True))
    assert d.code == "NW405"
    assert "1.fb (buffer) already held NaN" in d.explanation
    assert "_Frontend.__init__" in d.explanation and "checkpoint" in d.explanation
    assert "set or updated outside the forward" not in d.explanation
    assert "_Frontend.__init__" in d.fix and "'fb'" in d.fix


def test_a_finite_buffer_stays_silent() -> None:
    _frontend(False)


class _Magnitude(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.lin(x).square() * (x.abs().sum(-1, keepdim=True) > 0)
        return torch.sqrt(v + 1e-8)


def test_a_literal_eps_below_float16s_subnormal_under_a_sqrt() -> None:
    d = _diag(lambda: _half(_Magnitude(), "forensic"))  # names the backward's line
    assert d.code == "NW112"
    assert any("the 1e-8 on this line is 0 in float16" in e for e in d.evidence)
    assert _first_line(d.fix) == "out = torch.sqrt(v + 1e-4)"
