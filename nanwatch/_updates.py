"""Which of torch's optimizers can write a NaN into a weight from finite numbers: read by
the weight check's note (is the update a possible writer of a NaN at all?) and by NW301.

>>> nan_free_update("Adam", {"lr": 1e-3, "eps": 1e-8, "betas": [0.9, 0.999]}, True) is not None
True
>>> nan_free_update("Adam", {"lr": 1e-3, "eps": 0.0, "betas": [0.9, 0.999]}, True) is None
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: torch's own optimizers whose update makes no NaN from finite numbers: the update, and
#: what it divides by. SGD divides by nothing; the adaptive ones divide by a root of a
#: running mean of squares plus eps (Adamax: by max(β₂ u, |g| + eps)), at least eps when
#: eps > 0, and by bias corrections 1 - β^t, not 0 when β < 1. RMSprop(centered=True)
#: takes the root of a difference, which rounding can make negative: not listed.
NAN_FREE_UPDATES = {
    "SGD": "w - lr × (g + weight_decay × w + momentum × buf), has no division and no square root",
    "Adam": "w - lr × m̂ / (√v̂ + eps), divides by at least eps",
    "AdamW": "w - lr × m̂ / (√v̂ + eps), divides by at least eps",
    "NAdam": "w - lr × m̂ / (√v̂ + eps), divides by at least eps",
    "RAdam": "w - lr × m̂ / (√v̂ + eps) (or w - lr × m̂ early on), divides by at least eps",
    "Adamax": "w - lr × m̂ / max(β₂ u, |g| + eps), divides by at least eps",
    "Adagrad": "w - lr × g / (√(Σ g²) + eps), divides by at least eps",
    "RMSprop": "w - lr × g / (√(mean of g²) + eps), divides by at least eps",
}
#: the numeric settings of a param group an update reads (each must be finite)
UPDATE_SETTINGS = (
    "lr",
    "eps",
    "betas",
    "weight_decay",
    "momentum",
    "dampening",
    "alpha",
    "lr_decay",
    "initial_accumulator_value",
    "momentum_decay",
)


def numbers(v: object) -> list[float]:
    """The numbers of a setting: ``lr`` 1e-3 -> [0.001], ``betas`` (0.9, 0.999) -> both."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return [float(v)]
    if isinstance(v, (list, tuple)):
        return [float(x) for x in v if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return []


def nan_free_update(
    optimizer: str, group: Mapping[str, object], state_finite: bool | None, *, own: bool = True
) -> str | None:
    """What the update of torch's optimizer ``optimizer`` (class name; ``own``: torch's own
    class, not one of the same name defined elsewhere) is, when it cannot make a NaN from a
    finite gradient and a finite weight: one of :data:`NAN_FREE_UPDATES`, every setting of
    its param ``group`` finite, and for those that divide eps > 0, betas below 1, not
    centered and its state read finite (``state_finite``). None otherwise."""
    form = NAN_FREE_UPDATES.get(optimizer)
    if form is None or not own:
        return None
    values = [x for k in UPDATE_SETTINGS for x in numbers(group.get(k))]
    if not all(math.isfinite(x) for x in values):
        return None
    if optimizer == "SGD":
        return form
    eps = numbers(group.get("eps"))
    betas = numbers(group.get("betas"))
    if not eps or min(eps) <= 0 or any(not 0.0 <= b < 1.0 for b in betas):
        return None
    if group.get("centered") is True or state_finite is not True:
        return None
    return form
