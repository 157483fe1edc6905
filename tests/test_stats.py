"""Statistics equal a float64 reference computed the slow way; limits come from finfo."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanwatch import stats
from nanwatch.records import TensorStat
from tests import _tensors as _t

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
        *(  # two 4-bit floats a byte: torch 2.8 and later
            [torch.full((2, 3), 0x35, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)]
            if hasattr(torch, "float4_e2m1fn_x2")
            else []
        ),
    ],
    ids=["empty", "int", "bool", "meta", "float4-packed"][: 4 + hasattr(torch, "float4_e2m1fn_x2")],
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


def test_complex_magnitudes_past_the_parts_range_are_not_infinite() -> None:
    """complex64(3e38, 3e38) is finite (torch.isfinite agrees) though |z| is past float32's
    largest value: it reads as that value, with no headroom left, not as an inf; and the
    norm of complex128 values is taken in float64."""
    fmax = float(torch.finfo(torch.float32).max)
    z = torch.tensor([[complex(3e38, 3e38)], [complex(1.0, 0.0)]], dtype=torch.complex64)
    s = stats.describe(z, rows=True)
    assert s is not None and s.finite and s.posinf == 0
    assert (s.max, s.near_max, s.bad_row_count) == (fmax, 1, 0)
    assert stats.read_minmax(z) == (1.0, fmax)
    wide = torch.tensor([1e100j, 1e100], dtype=torch.complex128)
    assert float(stats.foreach_l2([wide])[0]) == pytest.approx(math.sqrt(2) * 1e100)


def _check_stat(case: _t.Case, ref: _t.Ref, s: TensorStat | None, *, rows: bool) -> None:
    """``s`` says what the float64 reference says: min/max (NaN wherever a NaN is), the
    counts, the finite max |x| and, with ``rows``, the bad samples."""
    assert s is not None and s.numel == ref.numel
    assert _t.close(case, s.min, ref.min) and _t.close(case, s.max, ref.max), (s, ref)
    assert (s.nan, s.posinf, s.neginf, s.zeros) == (ref.nan, ref.posinf, ref.neginf, ref.zeros)
    assert abs(s.near_max - ref.near_max) <= ref.near_max_slack, (s.near_max, ref.near_max)  # type: ignore[operator]
    assert _t.close(case, s.finite_amax, ref.finite_amax), (s.finite_amax, ref.finite_amax)
    assert s.finite is ref.finite
    if rows and ref.bad_rows is not None:
        assert s.bad_row_count == len(ref.bad_rows)
        assert list(s.bad_rows or ()) == ref.bad_rows[:8]
    else:
        assert s.bad_rows is None and s.bad_row_count is None


@pytest.mark.parametrize("dtype", _t.ALL_DTYPES, ids=_t.dtype_id)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_statistics_equal_a_float64_reference(dtype: torch.dtype, data: st.DataObject) -> None:
    """describe, minmax, read_minmax and bad_row_flags on every floating and complex dtype,
    0 to 4 dims, zero-size, non-contiguous and channels_last, values mixing NaN, +-inf,
    -0.0, subnormals and the dtype's limits."""
    case = data.draw(_t.cases((dtype,)), label="case")
    t = case.make()
    ref = _t.reference(case)
    if ref.numel == 0:  # zero-size: nothing to measure, and no error
        assert stats.describe(t, rows=True) is None
        assert stats.minmax(t) is None and stats.read_minmax(t) is None
        assert stats.bad_row_flags(t) is None
        return
    _check_stat(case, ref, stats.describe(t, rows=True), rows=True)
    mm = stats.minmax(t)  # the hot path: one fused pass, NaN propagating
    assert mm is not None
    assert _t.close(case, float(mm[0]), ref.min) and _t.close(case, float(mm[1]), ref.max)
    read = stats.read_minmax(t)
    assert read is not None and _t.close(case, read[0], ref.min)
    assert _t.close(case, read[1], ref.max)
    flags = stats.bad_row_flags(t)
    if ref.bad_rows is None:  # 0-d: no samples to tell apart
        assert flags is None
    else:
        assert flags is not None
        assert flags.nonzero().flatten().tolist() == ref.bad_rows


def _l2_expected(case: _t.Case, ref: _t.Ref) -> tuple[float, str]:
    """The L2 norm foreach_l2 must give, and how close. It sums squares in float32 (float64
    for 64-bit parts), unscaled, as torch does: a sum past that range may read inf ("over"),
    one below its normal range may lose its tiny terms ("under": only bounded above)."""
    if ref.nan:
        return math.nan, "exact"
    if ref.posinf or ref.neginf:
        return math.inf, "exact"
    wide = _t.part_dtype(case.dtype) is torch.float64
    acc = torch.finfo(torch.float64 if wide else torch.float32)
    ss = math.fsum(m * m for m in ref.magnitudes)  # inf when even float64 overflows
    scale = max((abs(m) for m in ref.magnitudes), default=0.0) or 1.0
    norm = scale * math.sqrt(math.fsum((m / scale) ** 2 for m in ref.magnitudes))
    if ss > float(acc.max):
        return norm, "over"
    if ss < float(acc.smallest_normal) * 2.0**30:
        return norm, "under"
    return norm, "close"


@settings(max_examples=100, deadline=None)
@given(batch=st.lists(_t.cases(), min_size=1, max_size=5))
def test_foreach_norms_equal_a_float64_reference(batch: list[_t.Case]) -> None:
    """The weight and gradient checks: max |x| and the L2 norm of many tensors of mixed
    dtypes at once; NaN propagates, inf shows, an empty tensor is 0."""
    tensors = [c.make() for c in batch]
    refs = [_t.reference(c) for c in batch]
    absmax = [float(x) for x in stats.foreach_absmax(tensors)]
    l2 = [float(x) for x in stats.foreach_l2(tensors)]
    assert len(absmax) == len(l2) == len(batch)
    for case, ref, a, n in zip(batch, refs, absmax, l2, strict=True):
        want = math.nan if ref.nan else max((abs(m) for m in ref.magnitudes), default=0.0)
        assert _t.close(case, a, want), (case, a, want)
        expected, how = _l2_expected(case, ref)
        # a complex tensor's magnitudes are rounded in its parts' dtype before the norm
        rel = (
            max(1e-4, 2 * float(torch.finfo(_t.part_dtype(case.dtype)).eps))
            if case.is_complex
            else 1e-4
        )
        if math.isnan(expected):
            assert math.isnan(n)
        elif how == "exact":
            assert n == expected
        elif how == "over":
            assert n == math.inf or n == pytest.approx(expected, rel=rel), (case, n, expected)
        elif how == "under":
            assert 0.0 <= n <= expected * (1 + rel) + 1e-300, (case, n, expected)
        else:
            assert n == pytest.approx(expected, rel=rel), (case, n, expected)


@pytest.mark.parametrize(
    "layout",
    ["channels_last", "transposed", "sliced", "expanded", "size_one_dims"],
)
@pytest.mark.parametrize("planted", [None, math.nan, math.inf, -math.inf])
def test_aminmax_reads_every_layout_like_torch(layout: str, planted: float | None) -> None:
    """Tensors stored in another order than their shape's are reduced as a flat view of
    memory (channels_last: about 5x faster on the CPU); the answer is torch's, NaN and inf
    included, and tensors that are not dense keep torch's own path."""
    from nanwatch._compat import aminmax, storage_order

    torch.manual_seed(0)
    base = torch.randn(4, 6, 5, 3)
    if planted is not None:
        base[2, 3, 1, 0] = planted
    t = {
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "transposed": base.transpose(1, 3),
        "sliced": base[:, ::2],
        "expanded": base[:, :1].expand(4, 6, 5, 3),
        "size_one_dims": base[:1, :, :1].permute(3, 2, 1, 0),
    }[layout]
    got = [x.item() for x in aminmax(t)]
    want = [x.item() for x in torch.aminmax(t)]
    assert got == pytest.approx(want, nan_ok=True)
    flat = storage_order(t)
    assert flat.data_ptr() == t.data_ptr()  # a view: nothing copied
    if layout in ("channels_last", "transposed"):
        assert flat.dim() == 1 and flat.numel() == t.numel()
    if layout in ("sliced", "expanded"):
        assert flat is t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("planted", [None, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, "middle", -1])
def test_large_tensors_read_with_amin_amax_agree_with_aminmax(
    dtype: torch.dtype, planted: float | None, where: int | str
) -> None:
    """Past SPLIT_MINMAX_NUMEL values a float32/float64 CPU tensor is read with amin and
    amax, not aminmax (faster there): min stays min, max stays max, a NaN anywhere (the
    first or last value, the tail past the last vector) makes both NaN, an inf shows."""
    from nanwatch._compat import SPLIT_MINMAX_NUMEL, aminmax

    torch.manual_seed(1)
    t = torch.randn(SPLIT_MINMAX_NUMEL + 3, dtype=torch.float32).to(dtype)
    if planted is not None:
        t[t.numel() // 2 if where == "middle" else int(where)] = planted
    got = [x.item() for x in aminmax(t)]
    want = [x.item() for x in torch.aminmax(t)]
    assert got == pytest.approx(want, nan_ok=True)
    if planted is not None and math.isnan(planted):
        assert math.isnan(got[0]) and math.isnan(got[1])
    cl = t[: 16 * 8 * 32 * 64].view(16, 8, 32, 64).contiguous(memory_format=torch.channels_last)
    assert [x.item() for x in aminmax(cl)] == pytest.approx(
        [x.item() for x in torch.aminmax(cl)], nan_ok=True
    )
