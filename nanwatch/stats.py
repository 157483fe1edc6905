"""Per-tensor statistics, computed on the tensor's own device, and dtype limits.

This module knows tensors, not modules. The hot path is :func:`minmax`: one fused
``torch.aminmax`` pass whose result stays on the device (NaN propagates through it, so
non-finite values are visible without a second read). :func:`describe` does the counting
(NaN, +inf, -inf, zeros, near the limit) and is meant for tensors already known bad.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanwatch._compat import aminmax
from nanwatch.records import TensorStat

_FLOAT8 = frozenset(
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
#: floating dtypes that pack several values into one element (float4_e2m1fn_x2: two 4-bit
#: floats a byte). torch has no arithmetic on them (no finfo, no aminmax), so they get
#: metadata only, like integers.
_PACKED = frozenset(getattr(torch, name) for name in ("float4_e2m1fn_x2",) if hasattr(torch, name))
_COMPLEX_PART = {
    torch.complex32: torch.float16,
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}
_STATS_LAYOUTS = (
    torch.strided,
    torch.sparse_coo,
    torch.sparse_csr,
    torch.sparse_csc,
    torch.sparse_bsr,
    torch.sparse_bsc,
)


@dataclass(frozen=True)
class DtypeLimits:
    """What a floating dtype can hold, from ``torch.finfo``.

    Example:
        >>> lim = dtype_limits(torch.float16)
        >>> round(lim.exp_bound, 2)
        11.09
    """

    name: str
    bits: int
    max: float  #: largest finite value
    tiny: float  #: smallest positive normal
    eps: float
    #: the largest x with exp(x) finite: log(finfo.max) (11.09 for float16, 88.72 for float32)
    exp_bound: float

    @property
    def low_precision(self) -> bool:
        return self.bits <= 16

    @property
    def subnormal(self) -> float:
        """The smallest positive value (a subnormal: ``tiny * eps``)."""
        return self.tiny * self.eps

    @property
    def short_range(self) -> bool:
        """Its largest value is far below float32's (float16, float8): computing in float32
        gives room. bfloat16 has float32's exponent, so there it gives none."""
        return self.max < _F32_MAX / 2


_F32_MAX = float(torch.finfo(torch.float32).max)


@functools.cache
def _limits_of(dtype: torch.dtype) -> DtypeLimits | None:
    if dtype in _COMPLEX_PART:
        dtype = _COMPLEX_PART[dtype]
    if not dtype.is_floating_point or dtype in _PACKED:
        return None
    fi = torch.finfo(dtype)
    return DtypeLimits(
        name=dtype_name(dtype),
        bits=fi.bits,
        max=float(fi.max),
        tiny=float(fi.tiny),
        eps=float(fi.eps),
        exp_bound=math.log(float(fi.max)),
    )


def dtype_limits(dtype: torch.dtype | str) -> DtypeLimits | None:
    """Limits of a floating (or complex: of its parts) dtype; None for integers and bool.

    Accepts the dtype or its name as records store it (``"float16"``).
    """
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            return None
        dtype = resolved
    return _limits_of(dtype)


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=64)
def device_name(device: torch.device) -> str:
    """``torch.device("cuda", 0)`` -> ``"cuda:0"`` (cached: every record asks it)."""
    return str(device)


def has_values(t: torch.Tensor) -> bool:
    """Whether statistics can be computed: a floating or complex tensor with data."""
    if not (t.is_floating_point() or t.is_complex()) or t.dtype in _PACKED:
        return False
    if t.is_meta or t.layout not in _STATS_LAYOUTS:
        return False
    if t.is_nested:
        return True
    return t.numel() > 0


def _values(t: torch.Tensor) -> torch.Tensor:
    """A dense, real view of the values of ``t`` suitable for reductions."""
    if t.is_nested:
        t = torch.cat([c.reshape(-1) for c in t.unbind()]) if t.size(0) else t.values()
    elif t.layout is torch.sparse_coo:
        t = t.coalesce().values()
    elif t.layout is not torch.strided:
        t = t.values()
    if t.is_complex():
        t = _magnitude(t)
    if t.dtype in _FLOAT8:
        t = t.float()
    return t


def _magnitude(z: torch.Tensor) -> torch.Tensor:
    """|z| in the dtype of z's parts. A finite z whose magnitude lies past that dtype's
    range (both parts near its max: complex64(3e38, 3e38)) reads as the largest finite
    value, not inf: the tensor holds no inf (``torch.isfinite`` agrees), and its headroom
    is gone, which ``near_max`` counts."""
    m = z.abs()
    return m.masked_fill(torch.isinf(m) & torch.isfinite(z), torch.finfo(m.dtype).max)


def minmax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """min and max of ``t`` as 0-d tensors on ``t``'s device, in one pass; no sync.

    NaN anywhere makes both NaN; an inf shows in min or max. For complex tensors the
    magnitudes are measured. Returns None when ``t`` has no values to measure.
    """
    if not has_values(t):
        return None
    v = _values(t.detach())  # detach, not a no_grad block: this runs for every record
    if v.numel() == 0:
        return None
    mn, mx = aminmax(v)
    return mn, mx


def _nonfinite_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``~isfinite(t)`` with one row per index along dim 0, on ``t``'s device; None when
    ``t`` has no rows to tell apart."""
    if not has_values(t) or t.dim() < 1 or t.is_nested or t.layout is not torch.strided:
        return None
    dense = t.detach()  # complex: a part that is not finite (|z| may overflow alone)
    if dense.dtype in _FLOAT8:
        dense = dense.float()
    if dense.numel() == 0:
        return None
    return (~torch.isfinite(dense)).reshape(dense.shape[0], -1)


def bad_row_flags(t: torch.Tensor) -> torch.Tensor | None:
    """Whether each index along dim 0 (each sample of a batch) holds a NaN or an inf, as a
    bool tensor on ``t``'s device; no sync. None when ``t`` has no rows to tell apart.

    >>> bad_row_flags(torch.tensor([[1.0, 2.0], [float("nan"), 0.0]])).tolist()
    [False, True]
    """
    with torch.no_grad():
        rows = _nonfinite_rows(t)
        return None if rows is None else rows.any(dim=1)


def bad_row_counts(t: torch.Tensor) -> torch.Tensor | None:
    """How many values of each index along dim 0 (each sample of a batch) are NaN or inf,
    as an int64 tensor on ``t``'s device; no sync, the same one pass as
    :func:`bad_row_flags`. Read late (the accelerator path), after the batch may be freed,
    the counts still tell a whole sample gone bad (divided by a zero norm) from a bad
    pixel of a loaded one. None when ``t`` has no rows to tell apart.

    >>> bad_row_counts(torch.tensor([[1.0, 2.0], [float("nan"), float("inf")]])).tolist()
    [0, 2]
    """
    with torch.no_grad():
        rows = _nonfinite_rows(t)
        return None if rows is None else rows.sum(dim=1)


def whole_bad_rows(t: torch.Tensor, *, max_rows: int = 8) -> tuple[tuple[int, ...], int] | None:
    """When the NaN/inf of ``t`` (2 or more dims) fill whole rows (indices along dim 0: a
    weight's output units, an embedding's tokens) and at least one row is finite throughout:
    the first ``max_rows`` of those rows and how many there are (a host read: anomaly-time
    work). None otherwise: a bad value beside finite ones in its row, no bad row, or none
    finite.

    >>> nan = float("nan")
    >>> whole_bad_rows(torch.tensor([[1.0, 2.0], [nan, nan], [3.0, 4.0]]))
    ((1,), 1)
    >>> whole_bad_rows(torch.tensor([[1.0, nan], [nan, nan]])) is None
    True
    """
    if t.dim() < 2:
        return None
    with torch.no_grad():
        rows = _nonfinite_rows(t)
        if rows is None or rows.shape[1] < 2:
            return None
        bad = rows.sum(dim=1)
        whole = bad == rows.shape[1]
        if bool(((bad > 0) & ~whole).any()) or bool(whole.all()):
            return None
        found, count = rows_from_flags(whole, max_rows=max_rows)
        return (found, count) if count else None


def rows_from_flags(flags: torch.Tensor, *, max_rows: int = 8) -> tuple[tuple[int, ...], int]:
    """The first ``max_rows`` indices set (non-zero) in ``flags`` and how many are set (a
    host read)."""
    idx = flags.nonzero().flatten()
    return tuple(int(i) for i in idx[:max_rows].tolist()), int(idx.numel())


def read_minmax(t: torch.Tensor) -> tuple[float, float] | None:
    """:func:`minmax`, read to the host now (a sync on accelerators; free on CPU)."""
    if not has_values(t):
        return None
    with torch.no_grad():
        v = _values(t)
        if v.numel() == 0:
            return None
        mn, mx = aminmax(v)
        return float(mn), float(mx)


def numel(t: torch.Tensor) -> int:
    if t.is_nested:
        return int(sum(c.numel() for c in t.unbind()))
    if t.layout is torch.sparse_coo:
        return int(t._nnz())
    if t.layout is not torch.strided:
        return int(t.values().numel())
    return t.numel()


def describe(t: torch.Tensor, *, rows: bool = False, max_rows: int = 8) -> TensorStat | None:
    """Full statistics of ``t``: min/max, counts of NaN, +inf, -inf, exact zeros, values
    within a factor of 2 of the dtype's largest finite value, and max |x| over finite
    values. With ``rows=True``, also the indices along dim 0 holding a non-finite value
    (the samples of a batch). One host transfer."""
    if not has_values(t):
        return None
    lim = dtype_limits(t.dtype)
    with torch.no_grad():
        v = _values(t)
        n = v.numel()
        if n == 0:
            return None
        if v.dtype not in (torch.float32, torch.float64):
            v = v.float()
        finite = torch.isfinite(v)
        absv = v.abs()
        half = (lim.max / 2) if lim is not None else math.inf
        parts = [
            torch.isnan(v).sum(),
            (v == math.inf).sum(),
            (v == -math.inf).sum(),
            (v == 0).sum(),
            ((absv >= half) & finite).sum(),
        ]
        fa = torch.where(finite, absv, torch.zeros((), dtype=v.dtype, device=v.device))
        head = torch.stack([p.to(v.dtype) for p in parts] + [fa.max()])
        flags = bad_row_flags(t) if rows else None
        nan_c, pinf_c, ninf_c, zero_c, near_c, famax = head.tolist()
        has_finite = bool(finite.any()) if nan_c or pinf_c or ninf_c else True
        if nan_c:
            mn = mx = math.nan  # NaN propagates, as in the fused pass
        else:
            mn, mx = (float(x) for x in aminmax(v))
        bad_rows: tuple[int, ...] | None = None
        bad_count: int | None = None
        bad_cols: tuple[int, ...] | None = None
        col_count: int | None = None
        if flags is not None:
            bad_rows, bad_count = rows_from_flags(flags, max_rows=max_rows)
            if bad_count and v.dim() == 2 and not v.is_complex():  # rows of features
                cols = ~torch.isfinite(v).all(dim=0)
                bad_cols, col_count = rows_from_flags(cols, max_rows=max_rows)
    return TensorStat(
        min=mn,
        max=mx,
        numel=n,
        nan=int(nan_c),
        posinf=int(pinf_c),
        neginf=int(ninf_c),
        zeros=int(zero_c),
        near_max=int(near_c),
        finite_amax=float(famax) if has_finite else None,
        bad_rows=bad_rows,
        bad_row_count=bad_count,
        bad_cols=bad_cols,
        bad_col_count=col_count,
    )


def brief(t: torch.Tensor) -> TensorStat | None:
    """Statistics of a tensor :func:`describe` leaves out: an integer or bool tensor (a
    target, an index: min, max and numel) or an empty one (numel 0; min and max read 0, no
    value counted). Floating tensors with values get :func:`describe`; None for layouts
    without plain values (meta, sparse, nested, packed float4).

    >>> brief(torch.tensor([-100, 3])).max, brief(torch.zeros(0, 4)).numel
    (3.0, 0)
    """
    if t.is_meta or t.is_nested or t.layout is not torch.strided or t.dtype in _PACKED:
        return None
    n = t.numel()
    if n == 0:
        return TensorStat(0.0, 0.0, 0, nan=0, posinf=0, neginf=0, zeros=0)
    if has_values(t):
        return describe(t)
    with torch.no_grad():
        v = t.to(torch.uint8) if t.dtype is torch.bool else t
        mn, mx = aminmax(v)
        return TensorStat(float(mn), float(mx), n)


def stat_from_minmax(mn: float, mx: float, n: int) -> TensorStat:
    return TensorStat(min=mn, max=mx, numel=n)


def foreach_absmax(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """max |x| of each tensor, results on the device; NaN propagates. On accelerators with
    multi-tensor kernels (one launch per dtype/device group). On CPU, where the infinity
    norm reads a tensor about 7x slower than a fused min/max pass, tensors of more than
    ``_SMALL_INF`` values get an ``aminmax`` each and the many small ones (biases, norms'
    weights) share one multi-tensor call: 400 tensors of 8 to 64 values take 1.3 ms so,
    against 4.7 ms with an ``aminmax`` each."""
    if not tensors:
        return []
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    with torch.no_grad():
        for (dtype, device), idx in groups.items():
            ts = [tensors[i] for i in idx]
            if dtype in _FLOAT8 or dtype.is_complex:
                norms = [_absmax(t) for t in ts]
            elif device.type == "cpu":
                # the infinity norm has no identity: an empty tensor is 0 by _absmax
                small = [
                    j
                    for j, t in enumerate(ts)
                    if 0 < t.numel() <= _SMALL_INF and t.layout is torch.strided
                ]
                shared: dict[int, torch.Tensor] = {}
                if small:
                    norms_small = torch._foreach_norm([ts[j] for j in small], math.inf)
                    shared = dict(zip(small, norms_small, strict=True))
                norms = [shared[j] if j in shared else _absmax(t) for j, t in enumerate(ts)]
            else:
                norms = list(torch._foreach_norm(ts, math.inf))
            for i, nrm in zip(idx, norms, strict=True):
                out[i] = nrm
    return [o for o in out if o is not None]


def foreach_finite_probe(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One value per tensor, on its device, that is finite when every value of the tensor
    is: for the weights' check after an update, where only finiteness is asked. A large
    float32/float64 tensor on the CPU (see :func:`hot_l2_pays`) gets its L2 norm, one dot
    product (:func:`l2`): one pass over memory where ``max |x|`` takes two there (``amin``
    and ``amax``: 1.3 ms against 2.3 ms for eight 4 MiB weights read cold). Its squares
    also overflow for finite values past the square root of the dtype's max: a non-finite
    probe says "look closer" (:func:`foreach_absmax` of that tensor), never "bad". Every
    other tensor gets its max |x| (:func:`foreach_absmax`).

    >>> [float(v) for v in foreach_finite_probe([torch.ones(1 << 16), torch.tensor([-2.0])])]
    [256.0, 2.0]
    """
    probed = [hot_l2_pays(t) for t in tensors]
    if not any(probed):
        return foreach_absmax(tensors)
    rest = iter(foreach_absmax([t for t, p in zip(tensors, probed, strict=True) if not p]))
    with torch.no_grad():
        return [l2(t) if p else next(rest) for t, p in zip(tensors, probed, strict=True)]


def _wide(v: torch.Tensor) -> torch.Tensor:
    """``v`` in at least float32 (float64 stays float64: a complex128's magnitudes)."""
    return v if v.dtype in (torch.float32, torch.float64) else v.float()


def _absmax(t: torch.Tensor) -> torch.Tensor:
    v = _values(t) if (t.is_complex() or t.dtype in _FLOAT8 or t.layout is not torch.strided) else t
    if v.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    mn, mx = aminmax(v)
    return torch.maximum(-mn, mx)


#: on CPU, the multi-tensor infinity norm reads a tensor about 7x slower per value than
#: ``aminmax`` but saves its ~15 µs of dispatch: it wins up to about 2,500 values
_SMALL_INF = 1 << 11

#: on CPU, tensors at least this large get their own reduction (bandwidth-bound); smaller
#: ones share a multi-tensor call (dispatch-bound)
_BIG = 1 << 16


def hot_l2_pays(t: torch.Tensor) -> bool:
    """Whether the L2 norm of ``t`` is cheaper read the moment ``t`` is written (a
    parameter's gradient, in a post-accumulate-grad hook) than at the end of backward: a
    large float32/float64 tensor on the CPU, still in the cache then (on W1, eight 4 MiB
    gradients: 0.3 ms a step in the hooks against 1.1 to 1.7 ms read cold after backward).
    Plain dense tensors only: a subclass (a FakeTensor being traced, a DTensor) is not
    read behind its back."""
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.dtype in (torch.float32, torch.float64)
        and t.layout is torch.strided
        and t.numel() >= _BIG
    )


def l2(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of a float32/float64 tensor on the CPU (a dot product: the fastest read
    there), left as a 0-d tensor.

    >>> float(l2(torch.tensor([3.0, 4.0])))
    5.0
    """
    v = t.reshape(-1)
    return torch.dot(v, v).sqrt()


def foreach_l2(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """L2 norm of each tensor, accumulated and returned in at least float32 so float16
    gradients do not overflow the norm; results stay on the device. Multi-tensor kernels on
    accelerators; on CPU a dot product per float32/float64 tensor, which is about twice as
    fast there as the multi-tensor norm."""
    if not tensors:
        return []
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    with torch.no_grad():
        for (dtype, device), idx in groups.items():
            ts = [tensors[i] for i in idx]
            if dtype in _FLOAT8 or dtype.is_complex:
                norms = [_wide(_values(t)).norm() for t in ts]
            elif device.type == "cpu" and dtype in (torch.float32, torch.float64):
                # large tensors: a dot product reads them fastest; the many small ones: one
                # multi-tensor call, not a dispatch each
                big = [j for j, t in enumerate(ts) if t.numel() >= _BIG]
                small = [j for j, t in enumerate(ts) if t.numel() < _BIG]
                norms = [ts[0]] * len(ts)
                for j in big:
                    norms[j] = l2(ts[j])
                if small:
                    for j, nrm in zip(
                        small, torch._foreach_norm([ts[j] for j in small], 2.0), strict=True
                    ):
                        norms[j] = nrm
            elif dtype in (torch.float16, torch.bfloat16):
                try:
                    norms = list(torch._foreach_norm(ts, 2.0, dtype=torch.float32))
                except TypeError:  # torch < 2.4: no dtype argument
                    norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in ts]
            else:
                norms = list(torch._foreach_norm(ts, 2.0))
            for i, nrm in zip(idx, norms, strict=True):
                out[i] = nrm
    return [o for o in out if o is not None]


_STACKABLE = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def read_scalars(values: Sequence[torch.Tensor]) -> list[float]:
    """0-d tensors (statistics left on their devices) read to the host as floats: one
    stack per device and dtype, one conversion per group, one transfer per device --
    not a kernel per value. Accelerator values come through pinned memory. float64 values
    stay float64 (a float32 read would turn 1e300 into inf); the rest read as float32,
    which holds every narrower float exactly."""
    if all(v.device.type == "cpu" for v in values):
        # a read each: no stack, no conversion (2-4x cheaper for the few values of a step,
        # and exact: a Python float holds every float32, float16 and bfloat16 value)
        return [float(v.item()) for v in values]
    return HostRead(values).wait()


class HostRead:
    """0-d tensors on their way to the host (see :func:`read_scalars`). On CUDA they are
    stacked on the device with an event recorded after them, and nothing waits until
    :meth:`wait`, which waits for that event -- for the work that made the values, not for
    what was enqueued since (a backward keeps the GPU busy meanwhile) -- and copies them on
    a side stream. No pinned memory: a page-locked buffer still held when a device-side
    assert kills the context makes its free throw inside a destructor, which aborts the
    process before the user's error is printed. Other devices are read when waited for;
    CPU values at once.

    Example:
        >>> r = HostRead([torch.tensor(1.5), torch.tensor(2.0)])
        >>> r.ready(), r.wait()
        (True, [1.5, 2.0])
    """

    def __init__(self, values: Sequence[torch.Tensor]) -> None:
        self._n = len(values)
        #: per device: (the value indices in order, the flat tensor, the event after it)
        self._parts: list[tuple[list[int], torch.Tensor, Any]] = []
        #: values made on another stream (see note_stream), alive until they are read: the
        #: allocator may hand their memory to that stream's next tensor once they are freed
        self._keep: Sequence[torch.Tensor] | None = None
        by_device: dict[torch.device, dict[torch.dtype, list[int]]] = {}
        for i, v in enumerate(values):
            by_device.setdefault(v.device, {}).setdefault(v.dtype, []).append(i)
        with torch.no_grad():
            for dev, groups in by_device.items():
                if join_streams(dev):
                    self._keep = values
                wide = dev.type == "cpu" or torch.float64 in groups
                acc = torch.float64 if wide else torch.float32
                order = [i for idx in groups.values() for i in idx]
                parts = [
                    torch.stack([values[i] for i in idx]).to(acc)
                    if dtype in _STACKABLE
                    else torch.stack([values[i].to(acc) for i in idx])  # float8 has no stack
                    for dtype, idx in groups.items()
                ]
                flat = parts[0] if len(parts) == 1 else torch.cat(parts)
                event = None
                if dev.type == "cuda":
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(torch.cuda.current_stream(dev))
                self._parts.append((order, flat, event))

    def ready(self) -> bool:
        """Whether :meth:`wait` would return without waiting for a device."""
        return all(
            flat.device.type == "cpu" or (event is not None and event.query())
            for _, flat, event in self._parts
        )

    def wait(self) -> list[float]:
        out: list[float] = [math.nan] * self._n
        for order, flat, event in self._parts:
            if event is not None:
                event.synchronize()  # the values are made
                # copied on a stream of its own: the current one may hold a whole backward
                # enqueued behind them, which this copy must not wait for
                with torch.cuda.stream(_side_stream(flat.device)):
                    host = flat.to("cpu")
            else:
                host = flat if flat.device.type == "cpu" else flat.cpu()
            for i, v in zip(order, host.tolist(), strict=True):
                out[i] = v
        self._keep = None
        return out


#: per CUDA device, the streams other than its default one that watched calls ran on
_PRODUCERS: dict[torch.device, list[Any]] = {}
#: at most this many streams a device (torch's pool has 32 of each priority)
_MAX_PRODUCERS = 64


def note_stream(device: torch.device) -> None:
    """Remember ``device``'s current stream when it is not the default one: statistics
    measured in a ``with torch.cuda.stream(s)`` block are made on ``s``, and a read made
    after the block (``nw.step()`` on the default stream) must wait for ``s`` before it
    stacks them, or it copies values not yet computed. Host-side, once per root call."""
    if device.type != "cuda":
        return
    stream = torch.cuda.current_stream(device)
    if stream == torch.cuda.default_stream(device):
        return
    seen = _PRODUCERS.setdefault(device, [])
    if stream not in seen and len(seen) < _MAX_PRODUCERS:
        seen.append(stream)


def join_streams(device: torch.device) -> bool:
    """Make ``device``'s current stream wait for the streams :func:`note_stream`
    remembered, so what nanwatch enqueues next (a stack of statistics, the norms of the
    gradients a backward on them wrote) runs after their work; whether it waited for one.
    A dict lookup where no step ran on a stream of the user's own."""
    others = _PRODUCERS.get(device)
    if not others:
        return False
    current = torch.cuda.current_stream(device)
    waited = False
    for stream in others:
        if stream != current:
            current.wait_stream(stream)
            waited = True
    return waited


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """One stream per CUDA device for nanwatch's reads (made on first use)."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    return stream
