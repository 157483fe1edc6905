"""Domain fixes found by user testing: x / x.norm() of a zero vector is a normalization, not
a distance of 0 (every such line of the function gets F.normalize); a mean along an empty
tail slice names the dim; a temperature of 0 in a statement on several lines is floored on
the user's own statement; a log of a softmax gets the log_softmax rewrite alone."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from nanwatch.rules.domain import _is_distance
from tests._diagnoses import code_lines, text
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: x / x.norm() at a zero vector: a normalization


class _CosineAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(4, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        q = q / q.norm(dim=-1, keepdim=True)
        k = k / k.norm(dim=-1, keepdim=True)
        return (q @ k.transpose(-2, -1)).softmax(dim=-1)


class _Hyperplane(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.normal = nn.Embedding(3, 4, padding_idx=0)

    def forward(self, r: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        w = self.normal(r)
        w = w / w.norm(p=2, dim=-1, keepdim=True)
        return e - (e * w).sum(-1, keepdim=True) * w


def _zero_token() -> torch.Tensor:
    x = torch.randn(2, 3, 4)
    x[:, 0] = 0.0  # a cls token of zeros
    return x


def test_a_normalized_zero_vector_is_not_a_distance_and_every_normalization_is_fixed() -> None:
    torch.manual_seed(0)
    m = _CosineAttention()
    x = _zero_token()
    d = _first(_raises(m, lambda: m(x), "forensic"), "NW111")
    assert d.title.endswith("normalizing a zero vector")
    assert "distance" not in d.title
    said = text(d)
    assert "the divisor q.norm(dim=-1, keepdim=True) is the norm of the numerator q" in said
    assert "2 of 6 norms are 0" in said
    assert "keep = i != j" not in d.fix and "same place" not in said
    lines = code_lines(d.fix).splitlines()
    assert [ln.split("   #")[0] for ln in lines] == [
        "q = F.normalize(q, dim=-1)",
        "k = F.normalize(k, dim=-1)",
    ]
    src, start = inspect.getsourcelines(_CosineAttention.forward)
    k_line = start + next(i for i, ln in enumerate(src) if ln.strip().startswith("k = k /"))
    assert f"line {k_line}: the same normalization of k" in d.fix
    q, k = m.qk(x).chunk(2, dim=-1)
    ns = {"F": F, "q": q, "k": k}
    exec(compile("\n".join(lines), "<fix>", "exec"), ns)
    assert torch.isfinite(ns["q"]).all() and torch.isfinite(ns["k"]).all()


def test_a_padding_row_normalized_by_hand_gets_normalize_and_no_pair_advice() -> None:
    torch.manual_seed(0)
    m = _Hyperplane()
    r, e = torch.tensor([0, 1, 2]), torch.randn(3, 4)
    d = _first(_raises(m, lambda: m(r, e), "forensic"), "NW111")
    assert d.title.endswith("normalizing a zero vector")
    assert "zero" in d.explanation and "padding" in d.explanation
    assert "i == j" not in d.explanation
    fixed = code_lines(d.fix).split("   #")[0]
    assert fixed == "w = F.normalize(w, dim=-1)"
    ns = {"F": F, "w": m.normal(r)}
    exec(compile(fixed, "<fix>", "exec"), ns)
    assert torch.isfinite(ns["w"]).all()


def test_a_norm_is_a_distance_only_of_a_difference() -> None:
    assert _is_distance("d = (p[i] - p[j]).norm(dim=-1)")
    assert _is_distance("torch.linalg.vector_norm(x[:, None] - x[None], dim=-1)")
    assert not _is_distance("n = q.norm(dim=-1, keepdim=True)")
    assert not _is_distance("torch.linalg.norm(w, dim=-1)")


class _Inverse(nn.Module):
    def forward(self, p: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        d = (p[i] - p[j]).norm(dim=-1)
        return 1.0 / d


def test_a_distance_of_0_does_not_say_the_norms_gradient_is_nan() -> None:
    a = torch.zeros(3, requires_grad=True)
    a.norm().backward()
    assert torch.equal(a.grad, torch.zeros(3))  # what the text must not contradict
    m = _Inverse()
    p = torch.tensor([[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]])
    d = _first(
        _raises(m, lambda: m(p, torch.tensor([0, 1]), torch.tensor([2, 0])), "forensic"),
        "NW111",
    )
    assert d.title.endswith("at a distance of 0")
    assert "norm's own gradient at 0 is NaN" not in d.explanation
    assert "torch's norm and cdist give 0 there" in d.explanation


# ------------------------------ 2: a mean along a tail slice that is empty


class _AvgPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_prefix = 1
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x[:, self.num_prefix:].mean(dim=1))  # fmt: skip


def test_a_mean_over_an_empty_tail_slice_names_the_dim_and_keeps_the_users_names() -> None:
    m = _AvgPool()
    x = torch.randn(2, 1, 4)  # the prefix token only: every patch was dropped
    for mode in ("watch", "forensic"):
        d = _first(_raises(m, lambda: m(x), mode), "NW113")
        said = "\n".join(d.evidence)
        assert "mean along dim 1 of x[:, self.num_prefix:], and that dim has size 0" in said
        assert "mask" not in d.fix
        fixed = code_lines(d.fix).split("   #")[0]
        assert fixed == (
            "return self.head(x[:, self.num_prefix:].sum(dim=1) / "
            "max(x.shape[1] - self.num_prefix, 1))"
        )
        body = fixed.removeprefix("return ")
        assert torch.isfinite(eval(body, {"self": m, "x": x})).all()
        full = torch.randn(2, 5, 4)
        assert torch.allclose(eval(body, {"self": m, "x": full}), m(full))


# ------------------------------ 3: a temperature of 0 in a statement on several lines


class _Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_zero_temperature_is_floored_on_the_users_statement_on_several_lines() -> None:
    torch.manual_seed(0)
    m = _Student()
    x, t = torch.randn(2, 4), torch.randn(2, 3)

    def run() -> None:
        out = m(x)
        T = 0.0
        kd = F.kl_div(F.log_softmax(out / T, dim=1), F.log_softmax(t / T, dim=1),
                      reduction="sum", log_target=True) * (T * T) / out.numel()  # fmt: skip
        kd.backward()

    d = _first(_raises(m, run, "forensic"), "NW111")
    fixed = code_lines(d.fix).split("   #")[0]
    assert "d = max(d, 1e-3)" not in d.fix
    # T also scales the loss (* (T * T)): a floor in the divisions alone would leave the
    # distillation term 0; a temperature of 0 is a config error, fixed where T is set
    assert "max(T, 1e-3)" not in code_lines(d.fix)
    assert fixed.startswith("assert T > 0")
    exec(compile(fixed, "<fix>", "exec"), {"T": 2.0})


# ------------------------------ 4: log(softmax(z)): the log_softmax rewrite, no templates


def _soft_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -(target * torch.log(F.softmax(logits, dim=-1))).sum(-1).mean()


def test_a_log_of_a_softmax_gets_log_softmax_and_only_a_floor_beside_it() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    with torch.no_grad():
        m.weight.mul_(400.0)  # logit gaps far past exp's range: softmax is exactly 0
    x = torch.randn(4, 4)
    target = torch.full((4, 3), 1 / 3)
    for mode in ("watch", "forensic"):
        d = _first(_raises(m, lambda: _soft_ce(m(x), target).backward(), mode), "NW110")
        for unrelated in ("binary_cross_entropy_with_logits", "softplus", "pixels", "sigmoid"):
            assert unrelated not in d.fix, (mode, unrelated)
        lines = code_lines(d.fix).splitlines()
        assert len(lines) == 1 and "log_softmax(logits, dim=-1)" in lines[0]
        assert "clamp_min(torch.finfo(" in d.fix
    fixed = lines[0].split("   #")[0]
    assert fixed == "return -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()"
    out = eval(fixed.removeprefix("return "), {"F": F, "target": target, "logits": m(x)})
    assert torch.isfinite(out)
