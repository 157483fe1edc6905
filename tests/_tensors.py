"""Hypothesis strategies for awkward tensors, and the float64 reference their statistics
must equal, computed the slow way: one Python number at a time.

Tensors: every floating dtype this torch has (float16, bfloat16, float32, float64, the
float8 types) and complex (measured by magnitude); 0 to 4 dims, zero-size and 0-d;
contiguous, transposed, sliced with a step (the skipped elements hold NaN, so reading
them shows) and channels_last. Values mix NaN, +inf, -inf, -0.0, subnormals
(``smallest_normal / 2``), the dtype's max and min and arbitrary finite numbers.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

FLOAT8 = tuple(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
)
REAL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, *FLOAT8)
COMPLEX_DTYPES = (torch.complex32, torch.complex64, torch.complex128)
ALL_DTYPES = REAL_DTYPES + COMPLEX_DTYPES
PART = {torch.complex32: torch.float16, torch.complex64: torch.float32}
PART[torch.complex128] = torch.float64
LAYOUTS = ("contiguous", "transposed", "stepped", "channels_last")

_SPECIAL = ("nan", "+inf", "-inf", "-0.0", "0.0", "subnormal", "-subnormal", "max", "min")
_LIMITS = ("tiny", "half-max", "-half-max")


def part_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype whose limits apply: a complex dtype's parts, else itself."""
    return PART.get(dtype, dtype)


def _value(kind: str, fi: torch.finfo, finite: float) -> float:
    sub = fi.smallest_normal / 2
    return {
        "nan": math.nan,
        "+inf": math.inf,
        "-inf": -math.inf,
        "-0.0": -0.0,
        "0.0": 0.0,
        "subnormal": sub,
        "-subnormal": -sub,
        "max": float(fi.max),
        "min": float(fi.min),
        "tiny": float(fi.smallest_normal),
        "half-max": float(fi.max) / 2,
        "-half-max": -float(fi.max) / 2,
    }.get(kind, finite)


@st.composite
def real_values(draw: Any, dtype: torch.dtype, *, finite_only: bool) -> float:
    fi = torch.finfo(part_dtype(dtype))
    kinds = _SPECIAL + _LIMITS
    if finite_only:
        kinds = tuple(k for k in kinds if k not in ("nan", "+inf", "-inf"))
    # about half the values arbitrary finite numbers across the dtype's whole range
    kind = draw(st.one_of(st.sampled_from(kinds), st.just("finite")))
    finite = draw(st.floats(min_value=float(fi.min), max_value=float(fi.max), width=64))
    return _value(kind, fi, finite)


@dataclass
class Case:
    """A tensor to build any number of times, and the values it holds."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: str
    values: list[Any]  # float64 (or complex) numbers, row-major, before rounding to dtype

    @property
    def is_complex(self) -> bool:
        return self.dtype.is_complex

    @property
    def wide(self) -> torch.dtype:
        return torch.complex128 if self.is_complex else torch.float64

    def _contiguous(self) -> torch.Tensor:
        with warnings.catch_warnings():  # complex32: "ComplexHalf support is experimental"
            warnings.simplefilter("ignore", UserWarning)
            return torch.tensor(self.values, dtype=self.wide).reshape(self.shape).to(self.dtype)

    def make(self) -> torch.Tensor:
        """A fresh tensor of ``shape`` holding ``values`` rounded to ``dtype``, laid out as
        ``layout`` says."""
        c = self._contiguous()
        if self.layout == "transposed":
            rev = tuple(reversed(range(c.dim())))
            return c.permute(rev).contiguous().permute(rev)
        if self.layout == "stepped":
            big = torch.full(
                (2 * self.shape[0], *self.shape[1:]),
                complex(math.nan, math.nan) if self.is_complex else math.nan,
                dtype=self.wide,
            )
            big[::2] = torch.tensor(self.values, dtype=self.wide).reshape(self.shape)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return big.to(self.dtype)[::2]
        if self.layout == "channels_last":
            return c.contiguous(memory_format=torch.channels_last)
        return c

    def held(self) -> list[Any]:
        """The values as the dtype holds them, as Python numbers, row-major."""
        return self._contiguous().reshape(-1).to(self.wide).tolist()  # type: ignore[no-any-return]


@st.composite
def cases(draw: Any, dtypes: tuple[torch.dtype, ...] = ALL_DTYPES) -> Case:
    dtype = draw(st.sampled_from(dtypes))
    ndim = draw(st.integers(min_value=0, max_value=4))
    shape = [draw(st.integers(min_value=1, max_value=4)) for _ in range(ndim)]
    if ndim and draw(st.integers(min_value=0, max_value=7)) == 0:  # zero-size, now and then
        shape[draw(st.integers(min_value=0, max_value=ndim - 1))] = 0
    layout = draw(st.sampled_from(LAYOUTS))
    if (
        (layout == "transposed" and ndim < 2)
        or (layout == "stepped" and ndim < 1)
        or (layout == "channels_last" and ndim != 4)
    ):
        layout = "contiguous"
    n = math.prod(shape)
    finite_only = draw(st.integers(min_value=0, max_value=2)) == 0  # the finite fast path
    part = real_values(dtype, finite_only=finite_only)
    if dtype.is_complex:
        element: st.SearchStrategy[Any] = st.builds(complex, part, part)
    else:
        element = part
    values = draw(st.lists(element, min_size=n, max_size=n))
    return Case(dtype, tuple(shape), layout, values)


@dataclass
class Ref:
    """Statistics computed one Python number at a time, in float64."""

    numel: int
    magnitudes: list[float]  # the values themselves, or |z| for complex
    nan: int
    posinf: int
    neginf: int
    zeros: int
    near_max: int
    #: complex magnitudes are computed by torch in the parts' dtype and rounded there: the
    #: number of them on the ``near_max`` boundary, within that rounding, either way
    near_max_slack: int
    finite_amax: float | None
    min: float
    max: float
    bad_rows: list[int] | None
    fmax: float

    @property
    def finite(self) -> bool:
        return not (self.nan or self.posinf or self.neginf)


def magnitude(z: complex, fmax: float) -> float:
    """|z| by C99 ``hypot`` (an inf part gives inf even beside a NaN); a finite z whose
    magnitude is past the parts' range reads as its largest finite value."""
    m = math.hypot(z.real, z.imag)
    if math.isfinite(z.real) and math.isfinite(z.imag):
        return min(m, fmax)
    return m


def reference(case: Case) -> Ref:
    held = case.held()
    fi = torch.finfo(part_dtype(case.dtype))
    fmax = float(fi.max)
    if case.is_complex:
        mags = [magnitude(z, fmax) for z in held]
        bad = [not (math.isfinite(z.real) and math.isfinite(z.imag)) for z in held]
        tol = 2 * float(fi.eps)
    else:
        mags = [float(x) for x in held]
        bad = [not math.isfinite(x) for x in held]
        tol = 0.0
    finite = [m for m in mags if math.isfinite(m)]
    half = fmax / 2
    near = sum(1 for m in finite if abs(m) >= half)
    near_slack = sum(1 for m in finite if abs(abs(m) - half) <= half * tol) if tol else 0
    has_nan = any(math.isnan(m) for m in mags)
    bad_rows: list[int] | None = None
    if case.shape and case.shape[0] and len(held):
        per_row = len(held) // case.shape[0]
        bad_rows = [r for r in range(case.shape[0]) if any(bad[r * per_row : (r + 1) * per_row])]
    return Ref(
        numel=len(held),
        magnitudes=mags,
        nan=sum(1 for m in mags if math.isnan(m)),
        posinf=sum(1 for m in mags if m == math.inf),
        neginf=sum(1 for m in mags if m == -math.inf),
        zeros=sum(1 for m in mags if m == 0),
        near_max=near,
        near_max_slack=near_slack,
        finite_amax=max((abs(m) for m in finite), default=None),
        min=math.nan if has_nan or not mags else min(mags),
        max=math.nan if has_nan or not mags else max(mags),
        bad_rows=bad_rows,
        fmax=fmax,
    )


def close(case: Case, got: float | None, want: float | None) -> bool:
    """Equal, NaN equal to NaN; for complex within the rounding of |z| in the parts' dtype."""
    if got is None or want is None:
        return got is want
    if math.isnan(want):
        return math.isnan(got)
    if not case.is_complex or math.isinf(want):
        return got == want
    fi = torch.finfo(part_dtype(case.dtype))
    smallest = float(fi.smallest_normal) * float(fi.eps)  # the smallest subnormal
    return math.isclose(got, want, rel_tol=2 * float(fi.eps), abs_tol=smallest)


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
