"""Statistics equal a float64 reference computed the slow way; limits come from finfo."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanwatch import stats

SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0]


@pytest.mark.parametrize(
    ("dtype", "bound"),
    [
        (torch.float16, 11.0898),
        (torch.bfloat16, 88.7189),
        (torch.float32, 88.7228),
        (torch.float64, 709.7827),
    ],
)
def test_exp_bound_is_log_of_finfo_max(dtype: torch.dtype, bound: float) -> None:
    lim = stats.dtype_limits(dtype)
    assert lim is not None
    assert lim.exp_bound == pytest.approx(bound, abs=1e-3)
    assert lim.max == float(torch.finfo(dtype).max)
    assert lim.low_precision is (lim.bits <= 16)
    assert torch.isinf(
        torch.exp(torch.tensor(lim.exp_bound * 1.001, dtype=torch.float64)).to(dtype)
    )


def test_limits_by_name_and_for_non_floats() -> None:
    assert stats.dtype_limits("float16") == stats.dtype_limits(torch.float16)
    assert stats.dtype_limits(torch.int64) is None
    assert stats.dtype_limits("not_a_dtype") is None
    assert stats.dtype_limits(torch.complex64) == stats.dtype_limits(torch.float32)
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            lim = stats.dtype_limits(getattr(torch, name))
            assert lim is not None and lim.bits == 8


def test_describe_counts_every_kind_in_one_tensor() -> None:
    lim = torch.finfo(torch.float32)
    t = torch.tensor(
        [1.0, math.nan, math.inf, -math.inf, 0.0, -0.0, lim.max, -lim.max, 1e-45, lim.tiny]
    )
    s = stats.describe(t)
    assert s is not None
    assert (s.nan, s.posinf, s.neginf, s.zeros, s.near_max) == (1, 1, 1, 2, 2)
    assert s.finite_amax == pytest.approx(lim.max)
    assert s.has_nan and not s.finite and math.isnan(s.amax)
    assert s.kinds() == "NaN, +inf, -inf"


def test_describe_names_the_bad_samples() -> None:
    t = torch.randn(10, 3, 2)
    t[2, 1, 0] = math.nan
    t[7, 0, 1] = math.inf
    s = stats.describe(t, rows=True, max_rows=1)
    assert s is not None and s.bad_rows == (2,) and s.bad_row_count == 2


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 5).to(torch.float8_e4m3fn),
        lambda: torch.randn(4, 5, dtype=torch.complex64),
        lambda: torch.randn(6, 4).t(),  # non-contiguous
        lambda: torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last),
        lambda: torch.randn(4, 4).to_sparse(),
        lambda: torch.randn(4, 4).to_sparse_csr(),
        lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
        lambda: torch.tensor(3.5),
    ],
    ids=["float8", "complex", "non-contiguous", "channels_last", "coo", "csr", "nested", "0-d"],
)
def test_awkward_tensors_get_statistics(make) -> None:  # type: ignore[no-untyped-def]
    t = make()
    mm = stats.read_minmax(t)
    assert mm is not None and all(math.isfinite(v) for v in mm)
    s = stats.describe(t)
    assert s is not None and s.finite


@pytest.mark.parametrize(
    "t",
    [
        torch.empty(0, 3),
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(2, dtype=torch.bool),
        torch.empty(3, device="meta"),
        torch.full((2, 3), 0x35, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
    ],
    ids=["empty", "int", "bool", "meta", "float4-packed"],
)
def test_tensors_without_values_have_no_statistics(t: torch.Tensor) -> None:
    assert stats.minmax(t) is None
    assert stats.describe(t) is None
    assert stats.bad_row_flags(t) is None
    if not (t.is_floating_point() or t.is_complex()) or t.is_meta:
        return
    assert stats.dtype_limits(t.dtype) is None or t.numel() == 0
    assert stats.brief(t) is None or t.numel() == 0


def test_foreach_norms_propagate_nan_and_keep_float16_from_overflowing() -> None:
    ts = [
        torch.tensor([3.0, -4.0]),
        torch.tensor([1.0, math.nan]),
        torch.tensor([60000.0, 60000.0], dtype=torch.float16),
    ]
    absmax = [float(x) for x in stats.foreach_absmax(ts)]
    assert absmax[0] == 4.0 and math.isnan(absmax[1]) and absmax[2] == 60000.0
    l2 = [float(x) for x in stats.foreach_l2(ts)]
    assert l2[0] == 5.0 and math.isnan(l2[1])
    assert l2[2] == pytest.approx(60000.0 * math.sqrt(2), rel=1e-3)  # not inf


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(_DTYPES),
    values=st.lists(
        st.one_of(
            st.floats(allow_nan=False, allow_infinity=False, width=64), st.sampled_from(SPECIAL)
        ),
        min_size=1,
        max_size=40,
    ),
    rows=st.integers(min_value=1, max_value=4),
)
def test_statistics_equal_a_float64_reference(
    dtype: torch.dtype, values: list[float], rows: int
) -> None:
    n = len(values) - len(values) % rows or rows
    vals = (values * rows)[:n]
    t = torch.tensor(vals, dtype=torch.float64).to(dtype).reshape(rows, -1)
    ref = t.to(torch.float64).numpy()  # the values as the dtype holds them
    fmax = float(torch.finfo(dtype).max)
    s = stats.describe(t, rows=True)
    assert s is not None
    assert s.nan == int(np.isnan(ref).sum())
    assert s.posinf == int(np.isposinf(ref).sum())
    assert s.neginf == int(np.isneginf(ref).sum())
    assert s.zeros == int((ref == 0).sum())
    finite = ref[np.isfinite(ref)]
    assert s.near_max == int((np.abs(finite) >= fmax / 2).sum())
    if finite.size:
        assert s.finite_amax == np.abs(finite).max()
    if not np.isnan(ref).any():
        assert s.min == ref.min() and s.max == ref.max()
        mm = stats.read_minmax(t)
        assert mm == (ref.min(), ref.max())
    bad = np.where(~np.isfinite(ref).all(axis=1))[0]
    assert s.bad_row_count == len(bad)
    assert list(s.bad_rows or ()) == list(bad[:8])
