"""The rules' per-step caches give what a full pass over the history gives: NW303 carries
each key's minimum over the history from one step to the next (issue 8: the rules run on
every step, and this pass was most of their time)."""

from __future__ import annotations

import math
import random
import warnings
from collections import deque

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.config import Thresholds
from nanwatch.records import StepTrace
from nanwatch.rules import base, gradients
from nanwatch.rules.gradients import _window_mins


def _walk(ring: int, steps: int, keys: int, seed: int) -> None:
    rng = random.Random(seed)
    values: dict[int, dict[str, float]] = {}
    history: deque[StepTrace] = deque(maxlen=ring)
    calls = {"rows": 0}

    def row(t: StepTrace) -> dict[str, float]:
        calls["rows"] += 1
        return values[t.step]

    names = [f"k{i}" for i in range(keys)]
    for step in range(steps):
        trace = StepTrace(step=step)
        # few distinct values, some absent: the minimum is often tied, and often held by
        # the step about to be dropped
        values[step] = {k: float(rng.randint(1, 4)) for k in names if rng.random() >= 0.2}
        if history:
            ctx = base.RuleContext(trace=trace, history=list(history), thresholds=Thresholds())
            base._prune_memo(trace, list(history))
            window = _window_mins(ctx, "tag", row)
            got = [window.get(k) for k in [*names, "never"]]
            want = [
                min((values[t.step].get(k, math.inf) for t in history), default=math.inf)
                for k in [*names, "never"]
            ]
            assert got == want, (step, got, want)
        history.append(trace)
    base._prune_memo(StepTrace(step=-1), [])
    # carried, not recomputed: about one new row a step, not the whole history
    assert calls["rows"] <= 3 * steps


@pytest.mark.parametrize("seed", range(6))
def test_window_minimum_matches_a_full_pass_as_the_history_grows_and_slides(seed: int) -> None:
    _walk(ring=5, steps=40, keys=7, seed=seed)


def test_window_minimum_with_a_history_of_one_step() -> None:
    _walk(ring=1, steps=10, keys=3, seed=0)


def _traces_in(value: object) -> list[StepTrace]:
    if isinstance(value, StepTrace):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _traces_in(v)]
    return []


def test_a_dropped_step_is_not_kept_alive() -> None:
    history: deque[StepTrace] = deque(maxlen=2)
    for step in range(6):
        trace = StepTrace(step=step)
        if history:
            ctx = base.RuleContext(trace=trace, history=list(history), thresholds=Thresholds())
            base._prune_memo(trace, list(history))
            _window_mins(ctx, "tag", lambda t: {"k": float(t.step)})
        history.append(trace)
    try:
        held = [t for _, kept in base._MEMO.values() for v in kept.values() for t in _traces_in(v)]
        assert held == []  # steps are named by id and number in the carried value
    finally:
        base._prune_memo(StepTrace(step=-1), [])


class _HalfDead(nn.Module):
    """A head whose first layer is multiplied by 0: its gradients are exactly 0 every step
    (NW304, a dead layer), while the rest trains."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = nn.Linear(4, 4)
        self.live = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dead(x) * 0.0 + self.live(x)


def test_a_layer_dead_for_the_whole_history_is_not_looked_up_in_every_step_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NW304 asks, every step, for the last step the dead layer moved: that scan walked every
    # record of every step of the history each time (a step's cost grew with the history)
    computed: dict[int, int] = {}
    inner = gradients._moving_paths

    def counted(trace: StepTrace) -> frozenset[str]:
        computed[trace.step] = computed.get(trace.step, 0) + 1
        return inner(trace)

    monkeypatch.setattr(gradients, "_moving_paths", counted)
    torch.manual_seed(0)
    model = _HalfDead()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    steps = 24
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, mode="watch") as nw:
            for _ in range(steps):
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    assert any(d.code == "NW304" for d in nw.report.diagnoses)  # the scan ran
    assert len(computed) >= steps // 2
    assert max(computed.values()) <= 2  # once as the current step, at most once as history


def test_a_run_whose_weights_stay_nan_reads_each_steps_bad_weights_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # every step of a run whose weights went NaN asks, of every weight, since when it has
    # been so: each step of the history is read once, not once per weight and step
    from nanwatch import watcher

    computed: dict[int, int] = {}
    inner = watcher.Watcher._bad_weights_of

    def counted(self: watcher.Watcher, trace: StepTrace) -> frozenset[str]:
        if self._bad_weights_cache.get(id(trace), (None,))[0] is not trace:
            computed[trace.step] = computed.get(trace.step, 0) + 1
        return inner(self, trace)

    monkeypatch.setattr(watcher.Watcher, "_bad_weights_of", counted)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    bad = x.clone()
    bad[0, 0] = float("nan")
    steps = 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, mode="watch", on_anomaly="warn") as nw:
            for i in range(steps):
                F.mse_loss(model(bad if i == 2 else x), y).backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    assert all(not torch.isfinite(p).all() for p in model.parameters())  # broken for good
    assert len(computed) >= steps // 2  # the history was asked about
    assert max(computed.values()) == 1
