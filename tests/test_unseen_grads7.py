"""Fine-tuning found by user testing: a low-rank adapter whose two factors are both
initialized to zeros (each one's gradient is the other: exactly 0 forever; no dead ReLU,
no BCE), and a backbone unfrozen with ``opt.add_param_group`` whose exploding gradient the
NW303 clip fix must cover (not only the parameters the optimizer was built on).

Each runs a tiny real model under ``nanwatch.watch`` on CPU."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)


class _LoRA(nn.Module):
    def __init__(self, base: nn.Linear, *, random_a: bool, r: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.zeros(r, base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, r))
        if random_a:
            nn.init.normal_(self.A, std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.t() @ self.B.t()) * 2.0


def _lora(*, random_a: bool):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = _LoRA(nn.Linear(8, 3), random_a=random_a)
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.AdamW([model.A, model.B], 1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            for _ in range(8):
                loss = crit(model(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    return nw


def test_lora_with_both_factors_zero_says_zero_factors_not_dead_units() -> None:
    nw = _lora(random_a=False)
    ds = [d for d in nw.report.diagnoses if d.code == "NW304"]
    assert ds
    d = ds[0]
    assert d.path == "_LoRA"
    txt = "\n".join([*d.evidence, d.explanation, d.fix or ""])
    assert "A, B" in txt and "submodule base" in txt
    assert "initialized to zeros" in d.explanation
    assert "torch.nn.init.kaiming_uniform_(model.A, a=math.sqrt(5))" in (d.fix or "")
    assert "LeakyReLU" not in txt and "BCEWithLogitsLoss" not in txt and "dead" not in txt


def test_lora_with_one_random_factor_stays_silent() -> None:
    nw = _lora(random_a=True)
    assert not [d for d in nw.report.diagnoses if d.code == "NW304"]


def test_generic_vanishing_fix_leaves_out_relu_and_bce_lines_they_do_not_apply_to() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    with torch.no_grad():
        model[0].weight.mul_(1e4)  # the tanh saturates: its gradient is exactly 0
    crit = nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            for _ in range(8):
                loss = crit(model(torch.randn(8, 6)), torch.randn(8, 2))
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    ds = [d for d in nw.report.diagnoses if d.code == "NW304"]
    assert ds
    fix = ds[0].fix or ""
    assert "find what stops the gradient" in fix
    assert "BCEWithLogitsLoss" not in fix and "LeakyReLU" not in fix


def _unfreeze(*, late_group: bool):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    backbone = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    head = nn.Linear(16, 5)
    model = nn.Sequential(backbone, head)
    crit = nn.CrossEntropyLoss()
    for p in backbone.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(head.parameters(), lr=2.0, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            for step in range(12):
                if step == 5 and late_group:
                    for p in backbone.parameters():
                        p.requires_grad_(True)
                    opt.add_param_group({"params": backbone.parameters()})
                x = torch.randn(8, 3, 8, 8) * 3
                loss = crit(model(x), torch.randint(0, 5, (8,)))
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    return nw


def test_nw303_after_add_param_group_clips_every_group_not_only_the_head() -> None:
    nw = _unfreeze(late_group=True)
    ds = [d for d in nw.report.diagnoses if d.code == "NW303"]
    assert ds
    fix = ds[0].fix or ""
    assert 'clip_grad_norm_([p for g in opt.param_groups for p in g["params"]]' in fix
    assert "head.parameters()" not in fix
    assert "# before opt.step()" in fix
