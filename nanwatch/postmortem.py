"""Crash capture: classify the exception, write the report, survive a dead GPU.

When the code inside ``watch(...)`` raises, the watcher finishes the step from host-side
data and calls :func:`capture`, which writes the report as JSON and HTML into
``config.report_dir`` before the exception leaves the context, and prints the paths and a
short summary to stderr. The exception itself goes on unchanged. :func:`install_signal_handlers`
does the same for SIGTERM (a scheduler ending the job), then lets the process end as it
would have. Nothing here touches a tensor: after a CUDA error the context is dead and any
device access would raise again (or hang).

Example:
    >>> classify(RuntimeError("CUDA error: device-side assert triggered"))["class"]
    'cuda-device-assert'
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import math
import os
import re
import signal
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanwatch.records import StepTrace
    from nanwatch.report import Report
    from nanwatch.watcher import Watcher

__all__ = [
    "atomic_write",
    "capture",
    "classify",
    "classify_signal",
    "install_signal_handlers",
    "interrupt_behind",
    "step_advice",
]

#: (class, how to recognize it in the exception's type name and message); first match wins
_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cuda-device-assert", ("device-side assert",)),
    ("out-of-memory", ("OutOfMemoryError", "out of memory", "CUDA out of memory")),
    (
        "cuda-error",
        (
            "CUDA error",
            "AcceleratorError",
            "cuDNN error",
            "CUBLAS_STATUS",
            "CUDNN_STATUS",
            "illegal memory access",
            "unspecified launch failure",
        ),
    ),
    (
        "peer-failure",  # torch.distributed's backends when another rank went away
        (
            "Connection closed by peer",
            "Connection reset by peer",
            "remote worker crashing",
            "remote process exited",
        ),
    ),
    ("autograd-inplace", ("modified by an inplace operation",)),
    (
        "graph-freed",  # a tensor carried across steps with its graph (an RNN's hidden state)
        (
            "backward through the graph a second time",
            "saved tensors after they have already been freed",
        ),
    ),
    (
        "no-graph",  # backward() on a tensor computed without autograd's graph
        ("does not require grad and does not have a grad_fn",),
    ),
    (
        "non-scalar-backward",  # loss.backward() on a loss of many values, no gradient given
        ("grad can be implicitly created only for scalar outputs",),
    ),
    ("packing-length", ("Length of all samples has to be greater than 0",)),
    ("ctc-input-lengths", ("Expected input_lengths to have value at most",)),
    (
        "shorter-than-window",  # framing a clip shorter than one window (audio, signals)
        (
            "maximum size for tensor at dimension",  # x.unfold(dim, size, step)
            "Padding size should be less than the corresponding input dimension",  # reflect
            "expected 0 < n_fft <",  # torch.stft(center=False)
        ),
    ),
    (
        "norm-one-value",  # a BatchNorm (InstanceNorm) in training given a batch (map) of 1
        (
            "Expected more than 1 value per channel when training",
            "Expected more than 1 spatial element when training",
        ),
    ),
    ("python-overflow", ("math range error", "Numerical result out of range")),
    (
        "empty-reduction",  # min/max (amax, argmax, kthvalue) of a tensor with no element
        (
            "Expected reduction dim to be specified for input.numel() == 0",
            "to have non-zero size",
            "over an empty dimension",
        ),
    ),
    (
        "view-layout",  # .view() of a tensor a transpose or permute left non-contiguous
        ("view size is not compatible with input tensor's size and stride",),
    ),
    # a Python number written into a tensor whose dtype cannot hold it (masked_fill(m, -1e9)
    # on float16 scores): "value cannot be converted to type c10::Half without overflow"
    ("scalar-overflow", ("without overflow",)),
    ("fp16-unscale", ("Attempting to unscale FP16 gradients",)),  # GradScaler on .half()
    # F.gaussian_nll_loss (nn.GaussianNLLLoss) refuses a negative variance: a raw output
    ("negative-variance", ("var has negative entry/entries",)),
    (
        "distribution-constraint",  # torch.distributions' validate_args: before "non-finite"
        ("to satisfy the constraint",),  # and "dtype" (the printed values may say either)
    ),
    (
        "non-finite",  # a check that refuses NaN/inf: clip_grad_norm_(error_if_nonfinite=True)
        (
            "is non-finite",
            "non-finite values",
            "Inf or NaN",
            "NaN or Inf",
            "inf or nan",
            "nan or inf",
            "contains either `inf`, `nan`",
        ),
    ),
    ("anomaly", ("AnomalyError",)),
    ("guard", ("GuardError",)),
    (
        "linalg",  # torch.linalg.LinAlgError, and the same failures raised as RuntimeError
        (
            "LinAlgError",
            "not positive-definite",
            "input matrix is singular",
            "matrix is singular",
            "failed to converge",
            "singular U",
        ),
    ),
    (
        "index-out-of-range",
        ("is out of bounds", "index out of range", "out of bounds for dimension"),
    ),
    (
        "shape-mismatch",
        (
            "size mismatch",
            "shapes cannot be multiplied",
            "must match the size",
            "mat1 and mat2 shapes",
            "Expected input batch_size",
            "doesn't match the broadcast shape",
            "size of tensor a",
            # a convolution's channels, a norm's shape or features, built for another size
            "channels, but got",
            "expected input with shape",
            "running_mean should contain",
            "Expected hidden",  # an RNN's hidden state made for another batch or layout
            "must be equal to input_size",  # an RNN's input with another number of features
        ),
    ),
    (
        "device-mismatch",
        (
            "Expected all tensors to be on the same device",
            "is on a different device",
            "is not on the expected device",
            "device type",
        ),
    ),
    (
        "dtype-error",
        (
            "expected scalar type",
            "Expected object of scalar type",
            "should be the same",
            "dtype",
            "not implemented for",
        ),
    ),
)

#: what to do about each class: plain words, read in the report and on stderr
ADVICE: dict[str, str] = {
    "cuda-device-assert": (
        "A CUDA kernel's assertion failed, most often an index out of range: a class target "
        "outside [0, num_classes) (a 255 'void' label without ignore_index=255, a -1 padding "
        "label) or a token id >= num_embeddings. The CUDA context is now unusable. Kernels run "
        "asynchronously, so the failing one was launched by one of the last modules listed, "
        "not necessarily the line in the traceback. Confirm with CUDA_LAUNCH_BLOCKING=1 "
        "python train.py (the traceback then points at the failing op), or run the batch on "
        "the CPU for a readable error."
    ),
    "cuda-error": (
        "The CUDA runtime reported an error and the context is likely unusable. If a line "
        "above the traceback reads 'Assertion ... failed' (`t >= 0 && t < n_classes`, "
        "'index out of bounds'), an earlier kernel's device-side assert killed the context "
        "and this call only met it: an index out of range, most often a class target outside "
        "[0, num_classes) or a token id >= num_embeddings. Kernels run asynchronously, so "
        "the failing one was launched by one of the last modules listed. Confirm with "
        "CUDA_LAUNCH_BLOCKING=1 python train.py: the traceback then points at the failing op."
    ),
    "out-of-memory": (
        "The device ran out of memory. The largest tensors of the last step are listed. Lower "
        "the batch size, use autocast (bfloat16/float16) or activation checkpointing; "
        "torch.cuda.memory_summary() shows what holds memory, and "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces fragmentation."
    ),
    "peer-failure": (
        "A peer rank failed first and broke its connection to this one, so this error is a "
        "consequence: that rank's own report (one file per rank in the report directory, "
        "-rank<r>- in its name) names the cause."
    ),
    "autograd-inplace": (
        "Autograd saved a tensor for the backward pass and an in-place op changed it before "
        "backward ran. The module output, buffer or parameter that changed is listed when "
        "nanwatch matched it: replace the in-place op (x.mul_(2) -> x = x * 2; "
        "nn.ReLU(inplace=False); out[mask] = 0 -> out = out.masked_fill(mask, 0)), or write "
        "a buffer only after backward."
    ),
    "graph-freed": (
        "A tensor kept from an earlier step still carries that step's autograd graph, which "
        "its backward() freed: detach it where it is carried to the next step (an RNN's "
        "hidden state in truncated BPTT: hidden = hidden.detach(), or (h.detach(), "
        "c.detach()) for an LSTM; a running total of losses: total += loss.item(); an "
        "output cached on a module or in a list). retain_graph=True is not the fix there: "
        "each backward would run back through every earlier batch, slower and larger every "
        "step. If one step's graph is really differentiated twice (two losses, each with its "
        "own backward), add the losses and call backward() once, or pass retain_graph=True "
        "to the first call only."
    ),
    "no-graph": (
        "backward() ran on a tensor with no autograd graph: it was computed with gradients "
        "off (inside torch.no_grad() or torch.inference_mode()), from values cut off the "
        "graph (.detach(), .item(), .numpy(), torch.tensor(...)), or from weights that all "
        "have requires_grad=False. print(loss.grad_fn) on the loss line, and compute the "
        "loss from the model's output with torch ops, outside no_grad."
    ),
    "non-scalar-backward": (
        "backward() ran on a tensor of more than one value with no gradient argument: "
        "autograd starts from a single number. Reduce the loss where it is made "
        "(loss = per_sample.mean(), or .sum(); a loss made with reduction='none' needs it), "
        "or pass backward(gradient=...) of the tensor's shape to weight each value."
    ),
    "packing-length": (
        "pack_padded_sequence got a length of 0: every sequence must have at least one step "
        "(an empty line, a text the tokenizer cut to nothing, a length counted from a mask "
        "that is all padding). Drop empty samples in the Dataset or the collate_fn, or pack "
        "lengths.clamp_min(1) and leave those rows out of the loss with a mask."
    ),
    "ctc-input-lengths": (
        "CTC was given an input_lengths value larger than the log-probabilities' time "
        "dimension T (log_probs is (T, N, C)): input_lengths must count the frames the model "
        "outputs, after its time downsampling (strided convolutions, pooling, frame "
        "stacking), not the frames or samples of its input. Compute them per strided layer, "
        "L = (L + 2 * padding - kernel_size) // stride + 1, and clamp them to T."
    ),
    "shorter-than-window": (
        "The input is shorter than one window of the op that frames it (Tensor.unfold, "
        "torch.stft's n_fft, a reflect padding of half a window): a clip or sequence this "
        "short gives no frame. Drop inputs shorter than a window in the Dataset or the "
        "collate_fn, or zero-pad them to the window's length first."
    ),
    "norm-one-value": (
        "A BatchNorm in training mode got one value per channel, whose variance cannot be "
        "computed: drop the epoch's short last batch (DataLoader(..., drop_last=True)) or "
        "skip batches of 1 (if x.shape[0] > 1). Call model.eval() before predicting one "
        "sample; to train on batches of 1, use GroupNorm or LayerNorm in its place. An "
        "InstanceNorm given a 1x1 map in training is the same error: give it larger inputs "
        "or fewer downsamplings before it."
    ),
    "python-overflow": (
        "A Python math function overflowed a float64 (math.exp(x) for x over 709.78, "
        "x ** y, math.cosh): the number it was given is too large, most often a loss that "
        "has diverged (perplexity = math.exp(loss)). The loss of the last steps is in the "
        "report: if it has been growing, lower the learning rate or clip the gradients "
        "(torch.nn.utils.clip_grad_norm_); to log a perplexity that cannot overflow, use "
        "math.exp(min(loss, 700))."
    ),
    "view-layout": (
        "Tensor.view() was given a tensor that is not contiguous in memory: a transpose, "
        "permute, .T or expand before it reordered its dimensions without moving the data, "
        "and view() can only regroup dimensions that are laid out one after the other. Call "
        ".reshape(...) in its place (it copies only when it must), or .contiguous().view(...)."
    ),
    "empty-reduction": (
        "A min or max (amax, argmax, aminmax) was taken of a tensor with no element, which "
        "has no value: a boolean mask or a filter selected nothing in this batch. Skip the "
        "reduction when the selection is empty (mask.any()), or reduce over the whole tensor "
        "with the rest masked to ±inf."
    ),
    "scalar-overflow": (
        "A Python number was written into a tensor whose dtype cannot hold it (a mask value "
        "of -1e9 into float16 scores, whose finite values end at ±65504): use the dtype's own "
        "limit, torch.finfo(x.dtype).min or .max, not a constant tuned for float32."
    ),
    "fp16-unscale": (
        "A GradScaler refused to unscale float16 gradients: the weights themselves are "
        "float16 (model.half(), .to(torch.float16)), and a GradScaler is for mixed "
        "precision, where the weights stay float32. Keep the model in float32 and run the "
        "forward under torch.autocast(device_type='cuda', dtype=torch.float16) (the device "
        "of your model), with scaler.scale(loss).backward(); scaler.step(optimizer); "
        "scaler.update(). For a model that must stay pure float16, drop the scaler (or "
        "train in bfloat16, which needs none)."
    ),
    "non-finite": (
        "A check refused a NaN or inf value (clip_grad_norm_(error_if_nonfinite=True), "
        "torch.multinomial's probabilities): the steps below show which tensors were not "
        "finite, and Where it went wrong names the first one nanwatch saw."
    ),
    "negative-variance": (
        "GaussianNLLLoss (F.gaussian_nll_loss) got a var with negative entries: a variance "
        "must be >= 0, so make it positive where it is made, var = F.softplus(raw) + 1e-6 "
        "(or var = log_var.exp() of a predicted log). A raw Linear output is negative about "
        "half the time; a clamp or a relu leaves no gradient below 0, and the loss raises "
        "a 0 to its eps (1e-6) but refuses a negative value."
    ),
    "distribution-constraint": (
        "A torch.distributions distribution refused its parameters (validate_args): a "
        "scale or std must be > 0 -- std = F.softplus(raw) + 1e-5, or "
        "log_std.clamp(-20, 2).exp(), never a raw Linear output or a relu (0 is refused); "
        "probs must lie in [0, 1] and sum to 1 -- pass logits= instead (Categorical(logits="
        "out)). When the invalid values are NaN, nanwatch's anomaly (Where it went wrong) "
        "names where the NaN came from."
    ),
    "linalg": (
        "A torch.linalg factorization or solve failed on its matrix. If it is a kernel or "
        "covariance matrix, add a jitter to the diagonal (K = K + 1e-6 * "
        "torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)) or keep a learned noise "
        "away from 0 (noise = F.softplus(raw_noise) + 1e-4), compute it in float64, and "
        "check for duplicate inputs or more features than samples (rank deficiency). If it "
        "holds NaN or inf (torch.isfinite(K).all()), that value is the cause: "
        "mode='forensic' names the op that made it."
    ),
    "anomaly": "nanwatch stopped the run at the first anomaly (on_anomaly='raise').",
    "guard": (
        "A nanwatch guard checked the inputs before the kernel ran and stopped the call; the "
        "message names the values, their positions and the fix."
    ),
    "index-out-of-range": (
        "An index was outside its valid range (on the GPU this is 'device-side assert "
        "triggered'). Check class targets against the number of classes and ignore_index, "
        "and token ids against the embedding size."
    ),
    "shape-mismatch": (
        "Two tensors' shapes do not fit. The last modules and their input shapes are listed; "
        "the one still running raised."
    ),
    "device-mismatch": (
        "An op got tensors on different devices. The devices of the last modules' inputs are "
        "listed: move the model and every batch tensor with .to(device)."
    ),
    "dtype-error": (
        "An op got a dtype it does not take (a float64 batch into float32 weights, integer "
        "targets where floats are expected). The dtypes of the last modules' inputs are "
        "listed: cast the input (x.float()) or use autocast."
    ),
    "keyboard-interrupt": (
        "Interrupted from the keyboard; the report holds the steps recorded so far."
    ),
    "signal": (
        "The process was told to stop (a scheduler or `kill` ending the job); the report holds "
        "the steps recorded so far, the step in progress included."
    ),
    "exit": "sys.exit() was called inside the watched code.",
    "user-raised": (
        "Raised by your own code (an exception class it defines), not by torch or Python: "
        "if it ends the run on purpose (early stopping, a time limit), nothing here needs "
        "fixing. Any NaN or inf nanwatch saw before it is listed in the report."
    ),
    "other": "The last modules that ran before the exception are listed.",
}

#: the IndexError of a Python sequence, not of a tensor: "list index out of range"
_PYTHON_INDEX = re.compile(
    r"(list|tuple|string|str|bytes|bytearray|range object|deque|array)"
    r"( assignment)? index out of range"
)

#: torch's re-raise of a DataLoader worker's exception: "Caught IndexError in DataLoader
#: worker process 0.", then "Original Traceback ...", ending in the original "Type: message"
_WORKER_CAUGHT = re.compile(r"^Caught (?P<type>\w+) in DataLoader worker process (?P<id>\d+)\.")


def _worker_original(message: str) -> tuple[str, str] | None:
    """(the worker number, the original exception's last line) of a DataLoader worker's
    re-raised exception; None for any other message.

    >>> _worker_original("Caught IndexError in DataLoader worker process 1.\\nOriginal "
    ...     "Traceback ...\\n  File ...\\nIndexError: list index out of range\\n")
    ('1', 'IndexError: list index out of range')
    """
    m = _WORKER_CAUGHT.match(message)
    if m is None:
        return None
    kind = m["type"]
    for line in reversed(message.strip().splitlines()):
        name = line.split(":", 1)[0].strip()
        if name.rsplit(".", 1)[-1] == kind:  # (a module-qualified name: its class name)
            return m["id"], line.strip()
    return None


def dataset_advice(exc: BaseException) -> str | None:
    """Advice for an exception raised by a Dataset's ``__getitem__`` while a DataLoader
    fetched a batch, in this process (its frames: the dataset, the index asked for and the
    dataset's length) or in a worker (torch's re-raise: the worker and the line, from the
    original traceback's text); None when no ``__getitem__`` called by torch's data
    utilities raised it. Frames and Python values only: no tensor is read."""
    from nanwatch._frames import _TB_HEADER, _short, is_internal

    data_dir = os.path.join("torch", "utils", "data") + os.sep
    worker = _worker_original(str(exc))
    if worker is not None:
        rows = str(exc).splitlines()
        at, fetched = None, False
        for row in rows:
            m = _TB_HEADER.match(row)
            if m is None:
                continue
            if data_dir in m["file"]:
                fetched = True
            elif fetched and not is_internal(m["file"]) and m["func"] == "__getitem__":
                at = f"{_short(m['file'])}:{m['line']}"
        if at is None:
            return None
        return (
            f"Raised by the dataset, not the model: {worker[1]} in its __getitem__ at {at}, in "
            f"DataLoader worker process {worker[0]}, while it fetched a batch. A worker's "
            "error does not say which sample: DataLoader(..., num_workers=0) raises it in this "
            "process, where the post-mortem names the index and the dataset's length."
        )
    tb = exc.__traceback__
    frame = None
    called_by_torch = False
    while tb is not None:
        f = tb.tb_frame
        name = f.f_code.co_filename
        if data_dir in name:
            called_by_torch = True
        elif called_by_torch and f.f_code.co_name == "__getitem__" and not is_internal(name):
            frame = (f, tb.tb_lineno)
            break
        tb = tb.tb_next
    if frame is None:
        return None
    f, line = frame
    code = f.f_code
    local = f.f_locals
    owner = local.get("self") if code.co_argcount else None
    cls = type(owner).__name__ if owner is not None else "the dataset"
    index = local.get(code.co_varnames[1]) if code.co_argcount >= 2 else None
    call = f"{cls}.__getitem__({index!r})" if isinstance(index, int) else f"{cls}.__getitem__"
    said = (
        f"Raised by the dataset, not the model: {call} at {_short(code.co_filename)}:{line}, "
        "while the DataLoader fetched a batch"
    )
    if owner is not None and isinstance(exc, IndexError):
        try:  # the dataset's own __len__, as the DataLoader's sampler calls it
            n = len(owner)
        except Exception:  # the user's exception matters more than ours
            return said + "."
        at = f"index {index}" if isinstance(index, int) else "the index"
        return (
            f"{said}; len(dataset) is {n} ({cls}.__len__), so its sampler asks for indices "
            f"0 to {n - 1}. Make __len__ count only the samples __getitem__ can read, or fix "
            f"what {at} reads at that line."
        )
    return said + "."


#: the public name of torch's linear-algebra error (its class lives in torch._C)
_LINALG_ERROR = "torch.linalg.LinAlgError"
#: torch.linalg functions that take the matrix first: what the advice calls it
_LINALG_CALLS = (
    "cholesky", "cholesky_ex", "solve", "solve_ex", "inv", "inv_ex", "eigh", "eigvalsh",
    "eig", "svd", "svdvals", "lstsq", "lu_factor", "ldl_factor", "det", "slogdet",
    "logdet", "pinv", "cholesky_inverse", "cholesky_solve", "potrf", "matrix_power",
)  # fmt: skip


def linalg_advice(message: str, code: str | None = None) -> str:
    """ADVICE for a torch.linalg error, by what failed (``not positive-definite``,
    ``singular``, ``failed to converge``), with the matrix under the name the user's
    line ``code`` gives it (``torch.linalg.cholesky(K)`` -> ``K``) where it is a name.

    Example:
        >>> msg = "linalg.solve: ... the input matrix is singular."
        >>> "lstsq(A, b)" in linalg_advice(msg, "x = torch.linalg.solve(A, b)")
        True
    """
    found = _linalg_operands(code)
    m = found[0] if found else ("A" if "singular" in message else "K")
    rhs = found[1] if found and len(found) > 1 else "B"
    eye = f"torch.eye({m}.shape[-1], dtype={m}.dtype, device={m}.device)"
    nan = (
        f"If {m} holds NaN or inf (torch.isfinite({m}).all() is False), that value is the "
        "cause, not the matrix's rank: mode='forensic' names the op that made it."
    )
    if "singular" in message and "positive-definite" not in message:
        return (
            f"{m} is singular (rank-deficient), so solve/inv has no unique answer: use "
            f"torch.linalg.lstsq({m}, {rhs}).solution or torch.linalg.pinv({m}), or add a "
            f"ridge, {m} + 1e-6 * {eye}. Duplicate or collinear rows or columns, a row of "
            "zeros, a regularizer that reached 0 make a matrix singular; for a kernel, Gram "
            "or covariance matrix scale the ridge to 1e-6 to 1e-3 of its diagonal's mean "
            f"and compute in float64 ({m}.double()). {nan}"
        )
    if "converge" in message:
        return (
            f"The decomposition of {m} did not converge: compute it in float64 "
            f"({m}.double()), symmetrize it before eigh (({m} + {m}.mT) / 2), and add a "
            f"small jitter ({m} + 1e-6 * {eye}). It is badly conditioned or has many "
            f"repeated eigen or singular values. {nan}"
        )
    return (
        f"{m} is not positive-definite: add a jitter to its diagonal, {m} = {m} + 1e-6 * "
        f"{eye}, or keep a learned noise away from 0 (F.softplus(raw_noise) + 1e-4, not a "
        "bare softplus that can reach 0). Compute it in float64 "
        f"({m}.double()), and check the inputs for duplicates (identical rows make a kernel "
        f"matrix singular) or more features than samples (rank deficiency). {nan}"
    )


def _linalg_operands(code: str | None) -> list[str]:
    """The arguments of the torch.linalg call on the user's line that are plain names or
    attributes, in order, up to the first that is not: ``x = torch.linalg.solve(A, b)`` ->
    ``["A", "b"]``; ``[]`` when the matrix is an expression or no such call is there."""
    if not code:
        return []
    import ast

    try:
        tree = ast.parse(code.strip())
    except SyntaxError:
        return []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name not in _LINALG_CALLS:
            continue
        out: list[str] = []
        for arg in node.args[:2]:
            if not isinstance(arg, (ast.Name, ast.Attribute)):
                break
            out.append(ast.unparse(arg))
        return out
    return []


#: the C++ names torch's "value cannot be converted to type ... without overflow" gives dtypes
_CPP_DTYPES = {
    "c10::Half": "float16", "at::Half": "float16", "c10::BFloat16": "bfloat16",
    "at::BFloat16": "bfloat16", "float": "float32", "double": "float64",
    "c10::Float8_e4m3fn": "float8_e4m3fn", "c10::Float8_e5m2": "float8_e5m2",
    "int8_t": "int8", "signed char": "int8", "uint8_t": "uint8", "unsigned char": "uint8",
    "int16_t": "int16", "short": "int16", "int": "int32", "int32_t": "int32",
    "int64_t": "int64", "long": "int64",
}  # fmt: skip
_CONVERTED = re.compile(r"converted to type (?P<type>.+?) without overflow")
#: names a call is made on that are modules, not tensors (``torch.full(...)``)
_NOT_TENSORS = frozenset({"torch", "F", "nn", "np", "numpy", "math", "torch.nn.functional"})


def scalar_overflow_advice(message: str, code: str | None = None) -> str:
    """ADVICE for a Python number too large for the dtype of the tensor it was written into
    (``scores.masked_fill(mask, -1e9)`` on float16 scores), from torch's message and the
    user's line ``code``: that line with the number replaced by the dtype's own limit,
    ``torch.finfo(scores.dtype).min``, when the line holds such a number.

    Example:
        >>> msg = "value cannot be converted to type c10::Half without overflow"
        >>> "s = s.masked_fill(m, torch.finfo(s.dtype).min)" in scalar_overflow_advice(
        ...     msg, "s = s.masked_fill(m, -1e9)")
        True
    """
    import torch  # loaded: it raised the error

    m = _CONVERTED.search(message)
    name = _CPP_DTYPES.get(m["type"].strip()) if m is not None else None
    dtype = getattr(torch, name, None) if name is not None else None
    if not isinstance(dtype, torch.dtype):
        return ADVICE["scalar-overflow"]
    floating = dtype.is_floating_point
    info: Any = torch.finfo(dtype) if floating else torch.iinfo(dtype)
    lo, hi = float(info.min), float(info.max)
    found = _out_of_range_number(code, lo, hi)
    limit = f"torch.{'finfo' if floating else 'iinfo'}"
    span = f"its finite values end at ±{hi:g}" if floating else f"it holds {lo:g}..{hi:g}"
    if found is None or code is None:
        return (
            f"A Python number on this line does not fit in {name} ({span}): write the "
            f"dtype's own limit, {limit}(x.dtype).min or .max, not a constant tuned for a "
            "wider dtype."
        )
    (start, end), literal, negative, recv = found
    held = f"{recv}.dtype" if recv is not None else f"torch.{name}"
    bound = f"{limit}({held}).{'min' if negative else 'max'}"
    fixed = code[:start] + bound + code[end:]
    text = f"{literal} does not fit in {name} ({span}): write the dtype's own limit, {fixed}"
    if not floating:
        return text + f" (or keep the tensor in a wider dtype than {name})."
    if info.bits >= 32:
        return text + "."
    wide = torch.finfo(torch.float32)
    return (
        f"{text}. {bound} is {lo if negative else hi:g} in {name} and "
        f"{wide.min if negative else wide.max:g} in float32, so the line works in both "
        f"(autocast or .half() made this tensor {name}); as a mask value it keeps a row "
        "with every position masked finite."
    )


#: reductions that have no value over no element, by the name torch's message gives
_EXTREMA = {"min": "+", "amin": "+", "argmin": "+", "max": "-", "amax": "-", "argmax": "-"}
_REDUCED = re.compile(r"^(?P<fn>\w+)\(\)")


def empty_reduction_advice(message: str, code: str | None = None) -> str:
    """ADVICE for a min or max of a tensor with no element (``D[i][y != y[i]].min()`` in
    a batch with one class), from torch's message and the user's line ``code``: the
    boolean selection that came out empty, the guard that skips it, and the masked form of
    the same reduction.

    Example:
        >>> msg = "min(): Expected reduction dim to be specified for input.numel() == 0."
        >>> empty_reduction_advice(msg, "neg = D[i][y != y[i]].min()")[:70]
        'D[i][y != y[i]] is empty (the mask y != y[i] selects no element in thi'
    """
    import ast

    m = _REDUCED.match(message)
    fn = m["fn"] if m is not None else None
    if fn is None or not code:
        return ADVICE["empty-reduction"]
    try:
        tree = ast.parse(code.strip())
    except SyntaxError:
        return ADVICE["empty-reduction"]
    found: list[tuple[ast.Subscript, ast.Call]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr != fn:
            continue
        recv = node.func.value
        if isinstance(recv, ast.Name) and recv.id == "torch":
            recv = node.args[0] if node.args else recv
        if isinstance(recv, ast.Subscript) and not isinstance(
            recv.slice, (ast.Constant, ast.Slice, ast.Tuple, ast.UnaryOp)
        ):
            found.append((recv, node))
    if len(found) != 1:
        return ADVICE["empty-reduction"]
    sub, call = found[0]
    operand, mask, base = ast.unparse(sub), ast.unparse(sub.slice), ast.unparse(sub.value)
    text = (
        f"{operand} is empty (the mask {mask} selects no element in this batch), and "
        f"{fn}() of no value has none: skip it when nothing is selected, "
        f"if ({mask}).any(): ..."
    )
    sign = _EXTREMA.get(fn)
    if sign is not None and not fn.startswith("arg") and not call.args and not call.keywords:
        if isinstance(sub.slice, ast.Compare) and len(sub.slice.ops) == 1:
            flip = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}.get(type(sub.slice.ops[0]))
            inverse = (
                ast.unparse(ast.Compare(sub.slice.left, [flip()], sub.slice.comparators))
                if flip is not None
                else f"~({mask})"
            )
        else:
            inverse = f"~({mask})"
        inf = "float('inf')" if sign == "+" else "float('-inf')"
        text += (
            f"; or mask instead of selecting: {base}.masked_fill({inverse}, {inf}).{fn}() "
            f"is {sign}inf for an empty selection, which the loss must then leave out"
        )
    return (
        text + ". A mask made from labels is empty in a batch of one class (no negative) "
        "or where a class appears once (no positive)."
    )


def _tracebacks(exc: BaseException) -> list[TracebackType]:
    """The traceback entries of ``exc``, outermost first (at most 512)."""
    out: list[TracebackType] = []
    tb = exc.__traceback__
    while tb is not None and len(out) < 512:
        out.append(tb)
        tb = tb.tb_next
    return out


def _innermost_user(exc: BaseException) -> TracebackType | None:
    """The innermost traceback entry of ``exc`` in the user's code (not torch's, not
    nanwatch's): the line that raised, as the user wrote it. None when there is none."""
    from nanwatch import _frames

    return next(
        (
            t
            for t in reversed(_tracebacks(exc))
            if not _frames.is_internal(t.tb_frame.f_code.co_filename)
        ),
        None,
    )


def _raising_line(exc: BaseException) -> str | None:
    """The code of the innermost user frame of ``exc``'s traceback (the line that raised)."""
    import traceback

    from nanwatch._frames import user_line_from_traceback

    try:
        return user_line_from_traceback("".join(traceback.format_tb(exc.__traceback__)))[1]
    except Exception:  # the user's exception matters more than ours
        return None


def _out_of_range_number(
    code: str | None, lo: float, hi: float
) -> tuple[tuple[int, int], str, bool, str | None] | None:
    """The first number written in ``code`` (one line) as a call's argument that is outside
    ``lo..hi``: its columns, its text, whether it is negative, and the tensor the call is a
    method of (``scores`` of ``scores.masked_fill(m, -1e9)``; None for ``torch.full``)."""
    if not code:
        return None
    import ast

    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            value = _number(arg)
            if value is None or lo <= value <= hi:
                continue
            recv = None
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(
                func.value, (ast.Name, ast.Attribute)
            ):
                recv = ast.unparse(func.value)
                recv = None if recv in _NOT_TENSORS else recv
            end = arg.end_col_offset if arg.end_col_offset is not None else arg.col_offset
            if arg.lineno != 1 or arg.end_lineno != 1:
                return None
            cols = (arg.col_offset, end)
            return cols, code[cols[0] : cols[1]], value < 0, recv
    return None


def _number(node: Any) -> float | None:
    """The value of a number written as a literal (``-1e9``, ``1e5``, ``-(10**9)``: no)."""
    import ast

    sign = 1.0
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        sign = -1.0 if isinstance(node.op, ast.USub) else 1.0
        node = node.operand
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return sign * float(node.value)
    return None


_DEVICE_LOST = ("cuda-device-assert", "cuda-error")


def _users_class(typ: type) -> bool:
    """``typ`` is an exception class the user's own code defines (an ``EarlyStop`` of the
    training script), not one of Python, torch or an installed library."""
    module = sys.modules.get(typ.__module__)
    file = getattr(module, "__file__", None)
    if typ.__module__ == "__main__":
        return True
    if not isinstance(file, str):
        return False
    from nanwatch import _frames

    return not _frames.is_internal(file)


def interrupt_behind(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The Ctrl-C that ``exc``, a ``sys.exit()`` raised while handling it, ends the run for:
    Lightning's Trainer shuts down on a KeyboardInterrupt, then exits with 1. The run was
    interrupted, not ended on purpose: its post-mortem is the interrupt's, and the exit goes
    on as it was raised. None for any other exception (``raise SystemExit(1) from None``
    included: its raiser cut the link).

    Example:
        >>> try:
        ...     try:
        ...         raise KeyboardInterrupt
        ...     except KeyboardInterrupt:
        ...         raise SystemExit(1)
        ... except SystemExit as exc:
        ...     type(interrupt_behind(exc)).__name__
        'KeyboardInterrupt'
    """
    if not isinstance(exc, SystemExit) or exc.__suppress_context__:
        return None
    behind = exc.__context__
    return behind if isinstance(behind, KeyboardInterrupt) else None


def classify(exc: BaseException, names: Mapping[int, str] | None = None) -> dict[str, Any]:
    """What kind of failure ``exc`` is, from its type and message only (no device access):
    ``class``, ``type``, ``message``, ``device_lost`` (the CUDA context is unusable) and
    ``advice``. Raised inside an optimizer's method (its traceback goes through it), it has
    ``optimizer`` too (see :func:`optimizer_error`; ``names``: weights' names by id).

    Example:
        >>> classify(RuntimeError("CUDA error: device-side assert triggered"))["class"]
        'cuda-device-assert'
        >>> classify(IndexError("Target 255 is out of bounds."))["class"]
        'index-out-of-range'
        >>> classify(IndexError("list index out of range"))["class"]
        'other'
    """
    from nanwatch.errors import AnomalyError, GuardError

    name = type(exc).__name__
    message = str(exc)
    # nanwatch's own errors by type: their messages quote the user's line, which may say
    # anything ("cuda", "dtype", ...)
    if isinstance(exc, KeyboardInterrupt):
        cls = "keyboard-interrupt"
    elif isinstance(exc, SystemExit):
        cls = "exit"
    elif isinstance(exc, GuardError):
        cls = "guard"
    elif isinstance(exc, AnomalyError):
        cls = "anomaly"
    else:
        text = f"{name}: {message}"
        worker = _worker_original(message)
        if worker is not None:  # a DataLoader worker's: what the original exception says
            text = worker[1]
            message_of = worker[1].split(":", 1)[-1].strip()
        else:
            message_of = message
        cls = next(
            (c for c, needles in _CLASSES if any(n in text for n in needles)),
            "other",
        )
        if cls == "index-out-of-range" and _PYTHON_INDEX.fullmatch(message_of):
            cls = "other"  # a Python sequence's (sys.argv[1], a list of batches): no tensor's
        if cls == "other" and _users_class(type(exc)):
            cls = "user-raised"
    typename = f"{type(exc).__module__}.{type(exc).__qualname__}"
    if typename == "torch._C._LinAlgError" or _is_linalg_error(exc):
        cls, typename = "linalg", _LINALG_ERROR
    info: dict[str, Any] = {
        "class": cls,
        "type": typename,
        "message": message[:4000],
        "device_lost": cls in _DEVICE_LOST,
        "advice": (
            _constraint_advice(message)
            if cls == "distribution-constraint"
            else linalg_advice(message)
            if cls == "linalg"
            else scalar_overflow_advice(message, _raising_line(exc))
            if cls == "scalar-overflow"
            else empty_reduction_advice(message, _raising_line(exc))
            if cls == "empty-reduction"
            else (cls == "other" and (_function_advice(message) or _group_norm_advice(message)))
            or ADVICE[cls]
        ),
    }
    if cls in {"dtype-error", "other"}:
        try:  # the source and a local's dtype only: no device access
            said = index_dtype_advice(exc) if cls == "dtype-error" else bool_arithmetic_advice(exc)
        except Exception:  # the user's exception matters more than ours
            said = None
        if said is not None:
            info["advice"] = said
    if cls == "view-layout":
        try:  # the source and a tensor's shape and layout only: no device access
            said = view_advice(exc)
        except Exception:  # the user's exception matters more than ours
            said = None
        if said is not None:
            info["advice"] = said
    if cls == "ctc-input-lengths":
        try:  # shapes, and lengths held on the CPU only: no device access
            said = ctc_lengths_advice(exc)
        except Exception:  # the user's exception matters more than ours
            said = None
        if said is not None:
            info["advice"] = said
    if cls == "shorter-than-window":
        try:  # the message and the user's source only
            said = short_window_advice(exc)
        except Exception:  # the user's exception matters more than ours
            said = None
        if said is not None:
            info["advice"] = said
    if cls == "shape-mismatch":
        try:  # shapes and module attributes only: no device access
            said = rnn_hidden_advice(exc) or broadcast_advice(exc)
        except Exception:  # the user's exception matters more than ours
            said = None
        if said is not None:
            info["advice"] = said
    if cls in _POSITION_CLASSES:
        try:  # shapes and module attributes only: no device access
            said = position_advice(exc) or position_ids_advice(exc) or batch_shape_advice(exc)
            if said is None and cls == "index-out-of-range":
                said = token_ids_advice(exc) or index_advice(exc)
            if said is None and cls == "cuda-device-assert":
                said = device_index_advice(exc)
        except Exception:  # the user's exception matters more than ours
            said = None
        if said is not None:
            info["advice"] = said + (
                " The CUDA context is now unusable: restart the process after the fix."
                if cls in _DEVICE_LOST
                else ""
            )
    if cls not in _DEVICE_LOST and cls not in _NOT_RAISED_BY_OP:
        try:  # frames and Python values only: no device access
            said = dataset_advice(exc)
        except Exception:  # the user's exception matters more than ours
            said = None
        if said is not None:
            info["advice"] = said
    if cls not in _NOT_RAISED_BY_OP and _raised_in_backward(exc):
        info["in_backward"] = True  # autograd's engine raised it: a backward did not finish
    if cls not in _DEVICE_LOST and cls not in _NOT_RAISED_BY_OP:  # (async: the step only
        try:  # surfaced a kernel's error) (an interrupt lands anywhere)
            found = optimizer_error(exc, cls, names)
        except Exception:  # the user's exception matters more than ours
            found = None
        if found is not None:
            info["optimizer"] = found
            info["advice"] = _optimizer_advice(cls, found)
    return info


#: classes an input longer than a module's position table raises as: the shape error of a
#: sliced position buffer, the index error of a lookup past its rows, the CUDA assert of one
_POSITION_CLASSES = (
    "other",
    "index-out-of-range",
    "shape-mismatch",
    "cuda-device-assert",
    "cuda-error",
)
#: a table's or buffer's name that says it holds positions (``position_embeddings``,
#: ``embed_positions``, ``pos_emb``, GPT-2's ``wpe``, ``position_ids``)
_POSITION_NAME = re.compile(r"position|(?:^|_)pos(?:_|$)|wpe", re.IGNORECASE)
#: a config setting that fixes the number of positions (``max_position_embeddings``,
#: ``n_positions``, ``n_ctx``, ``max_seq_len``, ``block_size``)
_POSITION_KEY = re.compile(
    r"^(?!.*relative).*position|^n_ctx$|seq_len(?:gth)?$|^block_size$|^max_len$|context_length",
    re.IGNORECASE,
)


def position_advice(exc: BaseException) -> str | None:
    """Advice for an error raised inside a module's forward (any class, any model) whose
    input sequence is longer than the position table that module holds: a child
    ``nn.Embedding`` or an integer buffer sized by a config setting for positions
    (``max_position_embeddings``), or named for positions when it raised the error itself
    or the error's message names its size or the input's length. A table with a
    ``padding_idx`` keeps its rows up to it for padding (RoBERTa's positions start at
    ``padding_idx + 1``), so fewer positions are usable than it has rows. From the
    traceback's frames, shapes and module attributes only: no device access. None when no
    running forward held such a table shorter than its input.

    Example:
        >>> import torch
        >>> class M(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.register_buffer("position_ids", torch.arange(4))
        ...     def forward(self, x):
        ...         return x + self.position_ids[: x.shape[1]]
        >>> try:
        ...     M()(torch.zeros(1, 6, dtype=torch.long))
        ... except RuntimeError as e:
        ...     print(position_advice(e)[:55])
        The input has 6 tokens, but position_ids (buffer) has 4
    """
    import torch
    from torch import nn

    message = str(exc)
    frames = [t.tb_frame for t in _tracebacks(exc)]
    owners = [(f, me) for f in frames if isinstance(me := f.f_locals.get("self"), nn.Module)]
    if not owners:
        return None
    root = owners[0][1]
    configs = [c for _, m in owners if (c := getattr(m, "config", None)) is not None]
    for frame, module in reversed(owners):
        if isinstance(module, nn.Embedding):
            continue  # a table given its ids: the guard's and torch's message say that
        length, arg, what = _sequence_length(frame, torch)
        if length is None:
            continue
        for name, rows, usable, padding in _position_tables(module, configs, torch, nn):
            if length <= usable:
                continue
            key = _config_setting(configs, rows)
            table = getattr(module, name, None)
            if (
                key is None
                and not any(m is table for _, m in owners)
                and not re.search(rf"\b(?:{rows}|{length})\b", message)
            ):
                continue  # named for positions, but neither raised nor named by the error
            path = next((q for q, m in root.named_modules() if m is module), "")
            kind = type(table).__name__ if isinstance(table, nn.Module) else "buffer"
            where = f"{path}.{name}" if path else name
            size = f"{rows} positions"
            if padding is not None:
                size = (
                    f"{rows} rows but {usable} positions (padding_idx={padding}: positions "
                    f"start at {padding + 1})"
                )
            if key:
                size += f" (config.{key}={rows})"
            sliced = f"{arg}[:, :{usable}]" if what == "tokens" else f"{arg}[:, :{usable}, :]"
            grow = (
                f"a model built with {key} >= {length + rows - usable} (a pretrained model's "
                "is fixed)"
                if key
                else f"a table of {length + rows - usable} rows"
            )
            return (
                f"The input has {length} {what}, but {where} ({kind}) has {size}. Truncate "
                f"when tokenizing: tokenizer(..., truncation=True, max_length={usable}), or "
                f"slice the batch: {sliced} (and its attention_mask and labels alike). Longer "
                f"inputs need {grow}."
            )
    return None


def token_ids_advice(exc: BaseException) -> str | None:
    """Advice for an index error raised by a model's input embeddings (the table a Hugging
    Face model's ``get_input_embeddings()`` returns, which ``resize_token_embeddings``
    resizes) given token ids past its last row: tokens added to the tokenizer after the
    model was built. The words of the guard's NW513, for a run without guards; reads the
    ids only on the CPU (after a CUDA error the device is not read). None otherwise."""
    import torch
    from torch import nn

    from nanwatch import _frames, guards

    frames = [t.tb_frame for t in _tracebacks(exc)]
    owners = [
        (i, me) for i, f in enumerate(frames) if isinstance(me := f.f_locals.get("self"), nn.Module)
    ]
    tables = [(i, m) for i, m in owners if isinstance(m, nn.Embedding)]
    if not tables:
        return None
    at, emb = tables[-1]
    ids = frames[at].f_locals.get("input")
    if (
        not isinstance(ids, torch.Tensor)
        or ids.device.type != "cpu"
        or ids.dtype not in (torch.long, torch.int)
        or ids.numel() == 0
    ):
        return None
    rows = emb.num_embeddings
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi < rows:
        return None
    root = None
    for _, m in owners[: owners.index((at, emb))]:
        get = getattr(m, "get_input_embeddings", None)
        if not callable(get) or not callable(getattr(m, "resize_token_embeddings", None)):
            continue
        try:
            table = get()
        except Exception:  # a model that does not implement it
            continue
        if table is emb or getattr(table, "weight", None) is emb.weight:
            root = m
            break
    if root is None:
        return None
    path = next((q for q, m in owners[0][1].named_modules() if m is emb), "") or "the table"
    user = next(
        (f for f in reversed(frames[:at]) if not _frames.is_internal(f.f_code.co_filename)),
        None,
    )
    var = guards._held_as(user, ids)
    past = int((ids >= rows).sum())
    given = f"{var} holds" if var else "the token ids given hold"
    return (
        f"{path} (Embedding, {type(root).__name__}'s input embeddings) has {rows} rows, so "
        f"token ids must be in 0..{rows - 1}, but {given} {lo}..{hi} ({past:,} of "
        f"{ids.numel():,} past the last row): tokens added to the tokenizer after the model "
        "was built (a pad or special token) have no row. Fix: "
        "model.resize_token_embeddings(len(tokenizer)) (a row for every token), after adding "
        "the tokens and before building the optimizer, which holds the old table."
    )


def position_ids_advice(exc: BaseException) -> str | None:
    """Advice for an index error raised by a position table (an ``nn.Embedding`` the
    model's config sized for positions, or named for them) given ids it has no row for,
    on an input short enough for it: negative positions (left padding given positions by
    ``attention_mask.cumsum(-1) - 1``) or positions that carry an offset (counting on
    across packed sequences). The words of the guard's NW513, from the traceback's frames;
    reads the ids only on the CPU (after a CUDA error the device is not read). None
    otherwise.
    """
    import torch
    from torch import nn

    from nanwatch import _frames, guards

    frames = [t.tb_frame for t in _tracebacks(exc)]
    owners = [
        (i, me) for i, f in enumerate(frames) if isinstance(me := f.f_locals.get("self"), nn.Module)
    ]
    if not owners:
        return None
    roots = [owners[0][1]]
    tables = [(i, m) for i, m in owners if isinstance(m, nn.Embedding)]
    ids: Any = None
    table: nn.Module
    pad: int | None = None
    if tables:
        at, emb = tables[-1]
        ids, rows, pad, table = (
            frames[at].f_locals.get("input"),
            emb.num_embeddings,
            emb.padding_idx,
            emb,
        )
        kind = "Embedding"
    else:  # a buffer a config sized for positions, read at the positions (BERT's gather)
        at, table = owners[-1]
        size = re.search(r"with size (\d+)", message := str(exc))
        if size is None or guards._position_key(roots, int(size.group(1))) is None:
            return None
        rows, pad, kind = int(size.group(1)), None, "buffer"
        ids = next(
            (
                v
                for k, v in frames[at].f_locals.items()
                if isinstance(k, str)
                and guards._POSITION_NAME.search(k)
                and isinstance(v, torch.Tensor)
                and str(rows) in message
            ),
            None,
        )
    if (
        not isinstance(ids, torch.Tensor)
        or ids.device.type != "cpu"
        or ids.dtype not in (torch.long, torch.int)
        or ids.dim() < 1
        or ids.numel() == 0
    ):
        return None
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < rows:
        return None
    name = guards.position_table_name(roots, table, rows)
    if name is None:
        return None
    user = next(
        (f for f in reversed(frames[:at]) if not _frames.is_internal(f.f_code.co_filename)),
        None,
    )
    var = guards._held_as(user, ids)
    if lo < 0 and hi < rows:
        hint, fix = guards.negative_position_words(ids, name, var)
    elif lo >= 0 and guards._looks_like_positions(ids):
        start = guards.position_start(roots, rows, lo, pad)
        found = guards.offset_position_words(ids, rows, start, name, var)
        if found is None:
            return None
        hint, fix = found
    else:
        return None
    path = next((q for q, m in roots[0].named_modules() if m is table), "") or "the table"
    words = []
    for line in fix.split("\n"):
        code, _, note = line.partition("   # ")
        words.append(code.removeprefix("# ") + (f" ({note})" if note else ""))
    given = f"{var} holds" if var else "the ids given hold"
    head = (
        f"{path} ({kind}) has {rows} rows"
        if kind == "Embedding"
        else f"{path} reads its buffers at {rows} positions"
    )
    return (
        f"{head}, so ids must be in 0..{rows - 1}, but {given} {lo}..{hi}{hint}. Fix: "
        + "; ".join(words)
        + "."
    )


def batch_shape_advice(exc: BaseException) -> str | None:
    """Advice for an error raised inside a model's forward whose per-token inputs disagree:
    the integer (or bool) tensors of two or more dimensions the outermost running module
    was given (``input_ids``, ``attention_mask``, ``token_type_ids``) that do not share the
    first one's shape, when the error's message names one of the sizes that differ. From the
    traceback's frames and shapes only. None otherwise.

    Example:
        >>> import torch
        >>> class M(torch.nn.Module):
        ...     def forward(self, input_ids, attention_mask):
        ...         return input_ids * attention_mask
        >>> try:
        ...     M()(torch.ones(2, 8, dtype=torch.long), torch.ones(2, 6, dtype=torch.long))
        ... except RuntimeError as e:
        ...     print(batch_shape_advice(e)[:53])
        input_ids is (2, 8) but attention_mask is (2, 6): the
    """
    import torch
    from torch import nn

    tb = exc.__traceback__
    while tb is not None and not (
        tb.tb_frame.f_code.co_name == "forward"
        and isinstance(tb.tb_frame.f_locals.get("self"), nn.Module)
    ):
        tb = tb.tb_next  # the first module's own forward (not torch's call machinery)
    if tb is None:
        return None
    frame = tb.tb_frame
    code = frame.f_code
    given = []
    for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
        t = frame.f_locals.get(name)
        if (
            name != "self"
            and isinstance(t, torch.Tensor)
            and t.dim() >= 2
            and not t.is_floating_point()
            and not t.is_complex()
        ):
            given.append((name, tuple(int(n) for n in t.shape)))
    if len(given) < 2:
        return None
    (first, shape), rest = given[0], given[1:]
    off = [(name, other) for name, other in rest if other != shape]
    if not off:
        return None
    sizes = {n for _, other in off for n in (*other, *shape)} - (
        {n for n in shape} & {n for _, other in off for n in other}
    )
    if not any(re.search(rf"\b{n}\b", str(exc)) for n in sizes):
        return None
    name, other = off[0]
    return (
        f"{first} is {_dims(shape)} but {name} is {_dims(other)}: the tensors of one "
        "batch that go token by token (ids, attention mask, token types) must all have the "
        "same (batch, length). Make them together: tokenizer(texts, padding=True, "
        "truncation=True) returns them aligned; a collate_fn that pads or cuts one must do "
        "the same to the others."
    )


#: tensor methods (and ``torch.`` functions) that take ``(dim, index, ...)``, and write or
#: read along ``dim`` of their receiver at each index: a graph's scatter and gather
_INDEX_CALLS = frozenset(
    f"{base}{tail}"
    for base in ("index_add", "index_copy", "index_fill", "scatter", "scatter_add")
    for tail in ("", "_")
) | {"scatter_reduce", "scatter_reduce_", "index_select", "gather", "take_along_dim"}
#: factories whose first arguments are the sizes of what they make (``torch.zeros(n, d)``)
_SIZED = frozenset({"zeros", "ones", "empty", "full", "rand", "randn"})


def _frame_value(frame: FrameType, node: Any) -> Any:
    """The value of a name, an attribute chain, a constant or a negated int in ``frame``,
    read without running any of the user's code (no property or ``__getattr__``); None for
    any other expression."""
    import ast

    import torch

    if isinstance(node, ast.Name):
        for scope in (frame.f_locals, frame.f_globals):
            if node.id in scope:
                return scope[node.id]
        return None
    if isinstance(node, ast.Attribute):  # no property or __getattr__ of the user's runs
        base = _frame_value(frame, node.value)
        own = getattr(base, "__dict__", None)
        if isinstance(own, dict) and node.attr in own:
            return own[node.attr]
        if isinstance(base, torch.nn.Module):
            for table in (base._buffers, base._parameters, base._modules):
                if node.attr in table:
                    return table[node.attr]
        return None
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _frame_value(frame, node.operand)
        return -v if type(v) is int else None
    return None


def _line_indices(frame: FrameType, line: int) -> list[tuple[str, str, int, str, Any, int | None]]:
    """The integer tensors line ``line`` of ``frame``'s code passes as an index, the
    innermost first (it ran first): each as (its source, what it indexes, the dim, the op
    or ``"[]"``, the tensor, the size of that dim when the line names it). Names, shapes
    and dtypes only: no value of a tensor is read, so it is safe after a CUDA error."""
    import ast
    import linecache

    import torch

    text = linecache.getline(frame.f_code.co_filename, line).strip()
    try:  # a block's header (``for ...:``, ``if ...:``) parses with a body
        tree = ast.parse(text + " pass" if text.endswith(":") else text)
    except SyntaxError:
        return []

    def value(node: ast.expr) -> Any:
        return _frame_value(frame, node)

    def size(node: ast.expr, dim: int) -> int | None:
        t = value(node)
        if isinstance(t, torch.Tensor):
            return int(t.shape[dim]) if -t.dim() <= dim < t.dim() else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name.endswith("_like") and node.args:
                return size(node.args[0], dim)
            if name in _SIZED and node.args:
                dims = node.args[0] if isinstance(node.args[0], (ast.Tuple, ast.List)) else None
                sizes = [value(a) for a in (dims.elts if dims is not None else node.args)]
                got = sizes[dim] if -len(sizes) <= dim < len(sizes) else None
                return got if type(got) is int else None
        return None

    found: list[tuple[ast.expr, ast.expr | None, int, str]] = []  # index, indexed, dim, op
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, args = node.func.attr, list(node.args)
            if name not in _INDEX_CALLS:
                continue
            target: ast.expr | None = node.func.value
            if isinstance(target, ast.Name) and target.id == "torch" and args:
                target = args.pop(0)
            dim = value(args[0]) if len(args) >= 2 else None
            if type(dim) is int:
                found.append((args[1], target, dim, name))
        elif isinstance(node, ast.Subscript):
            first = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
            if isinstance(first, (ast.Name, ast.Attribute)):
                found.append((first, node.value, 0, "[]"))
    out: list[tuple[str, str, int, str, Any, int | None]] = []
    for index, target, dim, op in reversed(found):
        t = value(index)
        if (
            not isinstance(t, torch.Tensor)
            or t.is_floating_point()
            or t.is_complex()
            or t.dtype is torch.bool
            or t.numel() == 0
        ):
            continue
        n = size(target, dim) if target is not None else None
        into = ast.unparse(target) if target is not None else "a tensor"
        out.append((ast.unparse(index), into, dim, op, t, n))
    return out


def index_advice(exc: BaseException) -> str | None:
    """Advice for an index out of range raised on the user's line (an ``edge_index`` whose
    node ids start at 1, or that names nodes of a larger graph than the batch holds): the
    integer tensor that line passes as an index (``x.index_add_(0, dst, ...)``,
    ``h.index_select(0, src)``, ``x.scatter_add_(0, idx, ...)``, ``h[src]``), its smallest
    and largest value, and the size of the dimension it indexes when the line names it.
    Only names the line reads (no call of the user's is run again), and only CPU tensors
    (after a CUDA error the device is not read). None when no such index is out of range.

    For ``deg = torch.zeros(n).index_add_(0, dst, w)`` in a file of the user's, with ``n``
    6 and ``dst`` holding 1 to 6, it begins: "dst, the index of index_add_ along dim 0,
    holds 1 to 6, but that dimension has 6 entries (0 to 5): 1 of 6 out of range. Ids that
    start at 1 (numbered from 1 in a file) need dst - 1."
    """
    user = _innermost_user(exc)
    if user is None:
        return None
    for where, into, dim, op, t, n in _line_indices(user.tb_frame, user.tb_lineno):
        if t.device.type != "cpu":
            continue
        lo, hi = int(t.min()), int(t.max())
        low = -n if op == "[]" and n is not None else 0
        if n is not None and low <= lo and hi < n:
            continue  # this one is in range: another index on the line raised
        if n is None and (lo >= 0 or op == "[]"):
            continue  # nothing to tell it by (a subscript takes negative indices)
        what = f"the index of {op}" if op != "[]" else f"the index into {into}"
        head = f"{where}, {what} along dim {dim}, holds {lo} to {hi}"
        if n is None:
            return f"{head}: a negative index is out of range there."
        past = int((t >= n).sum()) + (int((t < low).sum()))
        drawn = _randint_past(user.tb_frame, user.tb_lineno, where, n)
        starts = (
            drawn
            if drawn is not None
            else f" Ids that start at 1 (numbered from 1 in a file) need {where} - 1."
            if lo == 1 and hi == n
            else ""
        )
        larger = (
            ""
            if drawn is not None
            else " An id of a larger set than this tensor was built for (the nodes of the "
            "whole graph in a sampled subgraph, classes or tokens past the table) must be "
            "renumbered into it, or the tensor built with its full size."
        )
        return (
            f"{head}, but that dimension has {n} entries (0 to {n - 1}): {past} of "
            f"{t.numel()} out of range.{starts}{larger} On the GPU the same index is "
            "'device-side assert triggered'."
        )
    return None


def _randint_past(frame: FrameType, line: int, index: str, n: int) -> str | None:
    """What says the index ``index`` (a name) was drawn by ``torch.randint`` with a high
    bound past the ``n`` entries it indexes, in a statement of the same function above
    ``line``: the high bound is exclusive, so ``randint(0, T + 1)`` draws T, one past a
    table of T entries. None when it was not so drawn."""
    import ast
    import linecache

    if not index.isidentifier():
        return None
    path, first = frame.f_code.co_filename, frame.f_code.co_firstlineno
    assign = re.compile(rf"^\s*{re.escape(index)}\s*(?::[^=]+)?=(?!=)")
    stmt = None
    for num in range(line - 1, max(first, line - 60) - 1, -1):
        text = linecache.getline(path, num).strip()
        if assign.match(text):
            stmt = text
            break
    if stmt is None:
        return None
    try:
        tree = ast.parse(stmt)
    except SyntaxError:
        return None
    for call in ast.walk(tree):
        if not (
            isinstance(call, ast.Call)
            and (call.func.attr if isinstance(call.func, ast.Attribute) else "") == "randint"
            and isinstance(call.func, ast.Attribute)
            and ast.unparse(call.func.value) == "torch"
        ):
            continue
        given = {k.arg: k.value for k in call.keywords if k.arg}
        args = list(call.args)
        if "high" in given:
            high = given["high"]
        elif len(args) >= 2 and not isinstance(args[1], (ast.Tuple, ast.List)):
            high = args[1]  # randint(low, high, size)
        elif args:
            high = args[0]  # randint(high, size)
        else:
            return None
        bound = _frame_value(frame, high)
        left = (  # high written as ``X + 1``: X
            high.left
            if isinstance(high, ast.BinOp)
            and isinstance(high.op, ast.Add)
            and isinstance(high.right, ast.Constant)
            and high.right.value == 1
            else None
        )
        if type(bound) is not int and left is not None:
            bound = _frame_value(frame, left)
            bound = bound + 1 if type(bound) is int else None
        if type(bound) is not int or bound <= n:
            return None
        text = ast.unparse(high)
        fixed = ast.unparse(left) if left is not None and bound == n + 1 else str(n)
        return (
            f" {index} was drawn by `{stmt}`: torch.randint's high is exclusive, so "
            f"randint(..., {text}, ...) draws up to {bound - 1}, past the last entry {n - 1}:"
            f" the high for {n} entries is {fixed} (torch.randint(..., {fixed}, ...) draws 0 "
            f"to {n - 1})."
        )
    return None


def _script_name() -> str:
    """The script this process runs (``train.py``), as the user would rerun it."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.endswith(".py") and name != "__main__.py" else "your_script.py"


def device_index_advice(exc: BaseException) -> str | None:
    """Advice for a CUDA device-side assert raised in a function of the user's that
    passes integer tensors as indices on the line that raised or on a line before it
    (``out.index_add_(0, dst, h[src])`` in a graph layer; kernels run asynchronously, so
    the error surfaces at a later op): those indices by name, the op, the dim and its size
    when the line names it. After the assert no GPU value can be read, so it names the
    check to add instead. The innermost user frame with such a line is read. From the
    source, names, shapes and dtypes only: no device access. None when no index is found.

    For a layer whose ``torch.zeros_like(h).index_add_(0, dst, h[src])`` ran before the
    error surfaced, with ``h`` of 6 rows, it begins: "The assert most likely came from an
    index this code passed: src, the index into h along dim 0 (6 entries) and dst, the
    index of index_add_ along dim 0 (6 entries), at ..."
    """
    import linecache

    from nanwatch import _frames

    for tb in reversed(_tracebacks(exc)):
        frame = tb.tb_frame
        code = frame.f_code
        if _frames.is_internal(code.co_filename):
            continue
        sites: dict[tuple[str, str], tuple[str, int, int | None, int]] = {}
        for line in range(tb.tb_lineno, code.co_firstlineno - 1, -1):
            for where, into, dim, op, _t, n in _line_indices(frame, line):
                what = f"the index of {op}" if op != "[]" else f"the index into {into}"
                sites.setdefault((where, what), (where, dim, n, line))
            if len(sites) >= 3:
                break
        if not sites:
            continue
        named = [
            f"{where}, {what} along dim {dim}" + (f" ({n} entries)" if n is not None else "")
            for (where, what), (_, dim, n, _line) in list(sites.items())[:3]
        ]
        lines = sorted({line for *_, line in sites.values()})
        file = os.path.basename(code.co_filename)
        at = f"{file}:{lines[0]}" + (f"-{lines[-1]}" if len(lines) > 1 else "")
        checks = "; ".join(
            f"assert 0 <= int({where}.min()) and int({where}.max()) < {n}"
            if n is not None
            else f"assert int({where}.min()) >= 0"
            for where, _dim, n, _line in list(sites.values())[:2]
        )
        first = linecache.getline(code.co_filename, lines[0]).strip()
        listed = ", ".join(named[:-1]) + " and " + named[-1] if len(named) > 1 else named[0]
        return (
            f"The assert most likely came from an index this code passed: {listed}, at "
            f"{at} ({first}). One of them holds an id outside its range: node ids numbered "
            "from 1, the whole graph's node ids in a sampled subgraph, a class or token past "
            "its table. No GPU value can be read after the assert: add before that line, "
            f"and rerun: {checks}; or run this batch on the CPU, where nanwatch names the "
            "value and its position. Kernels run asynchronously, so an earlier kernel may "
            f"have failed instead: CUDA_LAUNCH_BLOCKING=1 python {_script_name()} makes the "
            "traceback point at it."
        )
    return None


def _sequence_length(frame: FrameType, torch: Any) -> tuple[int | None, str, str]:
    """The longest sequence among the tensors ``frame``'s function was given, the argument
    that holds it and what it counts: an integer tensor's last dimension (token ids, an
    attention mask: ``(batch, length)``, ``"tokens"``), a 3-d floating tensor's middle one
    (``inputs_embeds``: ``(batch, length, dim)``, ``"positions"``)."""
    code = frame.f_code
    nargs = code.co_argcount + code.co_kwonlyargcount
    best: tuple[int | None, str, str] = (None, "", "")
    for name in code.co_varnames[:nargs]:
        t = frame.f_locals.get(name)
        if name == "self" or not isinstance(t, torch.Tensor) or t.dim() < 1:
            continue
        if t.is_floating_point():
            if t.dim() != 3:
                continue
            n, what = int(t.shape[-2]), "positions"
        elif t.dtype is torch.bool or t.is_complex():
            continue
        else:
            n, what = int(t.shape[-1]), "tokens"
        if best[0] is None or n > best[0]:
            best = (n, name, what)
    return best


def _position_tables(
    module: Any, configs: list[Any], torch: Any, nn: Any
) -> list[tuple[str, int, int, int | None]]:
    """The position tables ``module`` holds itself: ``(name, rows, usable, padding_idx)``
    for each child ``nn.Embedding`` and integer buffer (its last dimension) named for
    positions or sized by a config setting for positions, the smallest usable first."""
    found: list[tuple[str, int, int, int | None]] = []
    for name, child in module.named_children():
        if not isinstance(child, nn.Embedding) or child.num_embeddings < 1:
            continue
        rows = int(child.num_embeddings)
        if not (_POSITION_NAME.search(name) or _config_setting(configs, rows)):
            continue
        pad = child.padding_idx
        usable = rows - (pad + 1) if isinstance(pad, int) and 0 <= pad < rows - 1 else rows
        found.append((name, rows, usable, pad if usable < rows else None))
    for name, buf in module.named_buffers(recurse=False):
        if not isinstance(buf, torch.Tensor) or buf.dim() < 1 or buf.is_floating_point():
            continue
        if buf.dtype is torch.bool or buf.is_complex():
            continue
        rows = int(buf.shape[-1])
        if rows > 0 and _POSITION_NAME.search(name) and not any(r == rows for _, r, _, _ in found):
            found.append((name.rpartition(".")[2], rows, rows, None))
    return sorted(found, key=lambda t: t[2])


def _config_setting(configs: list[Any], rows: int) -> str | None:
    """The one setting for positions, among the configs of the running modules, whose value
    is ``rows`` (``max_position_embeddings``, GPT-2's ``n_positions``); None for none or
    several."""
    keys = {
        key
        for config in configs
        for key, value in getattr(config, "__dict__", {}).items()
        if type(value) is int and value == rows and _POSITION_KEY.search(key)
    }
    return keys.pop() if len(keys) == 1 else None


def _is_linalg_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``torch.linalg.LinAlgError`` (torch only when already loaded)."""
    torch = sys.modules.get("torch")
    linalg = getattr(torch, "linalg", None)
    kind = getattr(linalg, "LinAlgError", None)
    return isinstance(kind, type) and isinstance(exc, kind)


_BAD_GRADIENT = re.compile(
    r"Function (?P<fn>\w+?)Backward\d* returned an invalid gradient at index (?P<i>\d+) - "
    r"got \[(?P<got>[^\]]*)\] but expected shape compatible with \[(?P<want>[^\]]*)\]"
)
_GRADIENT_COUNT = re.compile(
    r"function (?P<fn>\w+?)Backward\d* returned an incorrect number of gradients "
    r"\(expected (?P<want>\d+), got (?P<got>\d+)\)",
    re.IGNORECASE,
)


#: nn.RNN/LSTM/GRU's check of a given hidden state: "Expected hidden[0] size (1, 10, 16),
#: got [1, 4, 16]"
_HIDDEN_SIZE = re.compile(
    r"Expected hidden(?:\[\d\])? size \((?P<want>\d+(?:, \d+)*)\), got \[(?P<got>\d+(?:, \d+)*)\]"
)


_CTC_AT_MOST = re.compile(r"input_lengths to have value at most (\d+), but got value (\d+)")


def ctc_lengths_advice(exc: BaseException) -> str | None:
    """Advice for CTC's refusal of an ``input_lengths`` value past the log-probabilities' T,
    in the names of the user's call: lengths counted before the model's time downsampling
    (40 frames -> 20: a factor of 2, so ``((lengths + 1) // 2).clamp(max=T)``). The lengths
    are read only when they are a list or a CPU tensor (no device access); None when the
    message is another. (Batch-first log-probs are the guard's NW520, before the kernel.)"""
    import ast

    from torch import Tensor

    from nanwatch import _frames

    m = _CTC_AT_MOST.search(str(exc))
    if m is None:
        return None
    frames, got = int(m[1]), int(m[2])
    tbs = _tracebacks(exc)
    ctc = next(
        (t.tb_frame.f_locals for t in reversed(tbs) if t.tb_frame.f_code.co_name == "ctc_loss"),
        {},
    )
    il = ctc.get("input_lengths")
    lens: list[int] = []
    if isinstance(il, Tensor) and il.device.type == "cpu" and not il.is_floating_point():
        lens = [int(n) for n in il.reshape(-1).tolist()]
    elif isinstance(il, (list, tuple)) and all(isinstance(n, int) for n in il):
        lens = list(il)
    most = max([got, *lens])
    # the user's call: its log_probs and input_lengths arguments, by position or keyword
    user = next(
        (t for t in reversed(tbs) if not _frames.is_internal(t.tb_frame.f_code.co_filename)),
        None,
    )
    span = _span_text(user.tb_frame.f_code, user.tb_lasti, user.tb_lineno) if user else None
    lp_text = lens_text = None
    lens_at: tuple[int, int] | None = None
    call: Any = None
    if span:
        try:
            call = ast.parse(span, mode="eval").body
        except SyntaxError:
            call = None
    starred = isinstance(call, ast.Call) and any(isinstance(a, ast.Starred) for a in call.args)
    if span and isinstance(call, ast.Call) and not starred:
        given = dict(enumerate(call.args))
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        lp_node = kw.get("log_probs", given.get(0))
        lens_node = kw.get("input_lengths", given.get(2))
        if lp_node is not None and lens_node is not None:
            lp_text = ast.get_source_segment(span, lp_node)
            lens_text = ast.get_source_segment(span, lens_node)
            lens_at = (lens_node.col_offset, lens_node.end_col_offset or 0)
    lens_name = f" ({lens_text})" if lens_text else ""
    lp_name = lp_text or "log_probs"
    said = (
        f"CTC's input_lengths{lens_name} go up to {most} frames, but {lp_name} has T = "
        f"{frames} (its first dim, (T, N, C))"
    )
    after = (
        "input_lengths must count the frames the model outputs, after its time downsampling "
        "(strided convolutions, pooling, frame stacking), not the frames or samples of its "
        "input"
    )
    per_layer = "L = (L + 2 * padding - kernel_size) // stride + 1 per strided layer"
    factor = round(most / frames) if frames > 0 and most >= 1.5 * frames else 0
    t_of = f"{_paren_text(lp_name)}.shape[0]"
    if factor < 2:
        return f"{said}: {after}. Compute them with {per_layer}, and clamp them to T."
    if not isinstance(il, Tensor) or lens_text is None:
        return (
            f"{said}: {after} ({most} -> {frames}: about x{factor}). Compute them with "
            f"{per_layer}, and clamp them to T."
        )
    new = f"(({lens_text} + {factor - 1}) // {factor}).clamp(max={t_of})"
    said += (
        f": they count the model's input, before its time downsampling ({most} -> {frames}, "
        f"about x{factor}); pass the lengths after it, {new}. "
    )
    tail = f"Exact for strided layers padded by kernel_size // 2; for others, {per_layer}."
    line = _line_text(user.tb_frame.f_code.co_filename, user.tb_lineno) if user else None
    if span is None or lens_at is None or not line or line.count(span) != 1:
        return f"{said}{tail}\nout_lengths = {new}"
    fixed = span[: lens_at[0]] + "out_lengths" + span[lens_at[1] :]
    return f"{said}{tail}\nout_lengths = {new}\n{line.replace(span, fixed)}"


_UNFOLD_SIZE = re.compile(r"maximum size for tensor at dimension (\d+) is (\d+) but size is (\d+)")
_REFLECT_SIZE = re.compile(
    r"but got: padding \((\d+), (\d+)\) at dimension (\d+) of input \[([\d, ]+)\]"
)
_NFFT_SIZE = re.compile(r"expected 0 < n_fft < (\d+), but got n_fft=(\d+)")


def short_window_advice(exc: BaseException) -> str | None:
    """Advice for framing an input shorter than one window, from the message's numbers and
    the user's call (the tensor it frames): ``wav.unfold(-1, 400, 160)`` of 320 samples,
    ``torch.stft(x, 400, ...)`` of 100 (center=True pads n_fft // 2 by reflection, which
    needs more samples than that; center=False needs n_fft). None for another message."""
    import ast

    from nanwatch import _frames

    message = str(exc)
    tbs = _tracebacks(exc)
    user = next(
        (t for t in reversed(tbs) if not _frames.is_internal(t.tb_frame.f_code.co_filename)),
        None,
    )
    span = _span_text(user.tb_frame.f_code, user.tb_lasti, user.tb_lineno) if user else None
    call: Any = None
    if span:
        try:
            call = ast.parse(span, mode="eval").body
        except SyntaxError:
            call = None
    what: ast.expr | None = None
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
        if call.func.attr == "unfold" and ast.unparse(call.func.value) not in ("torch", "F"):
            what = call.func.value
        elif call.args:
            what = call.args[0]
    name = ast.get_source_segment(span, what) if span and what is not None else None
    x = name or "the input"
    end = (
        "drop inputs shorter than that in the Dataset or the collate_fn, or zero-pad them "
        "to it first"
    )
    if m := _UNFOLD_SIZE.search(message):
        dim, have, size = int(m[1]), int(m[2]), int(m[3])
        pad = ""
        if name and isinstance(call, ast.Call) and call.args and ast.unparse(call.args[0]) == "-1":
            pad = (
                f"\n{name} = torch.nn.functional.pad({name}, (0, max(0, {size} - "
                f"{name}.shape[-1])))   # before the unfold: one frame at least"
            )
        return (
            f"{x} has {have} values along dimension {dim}, fewer than one window of the "
            f"unfold ({size}): no frame fits. {end[0].upper()}{end[1:]}.{pad}"
        )
    if m := _REFLECT_SIZE.search(message):
        left, dim = int(m[1]), int(m[3])
        shape = [int(n) for n in m[4].split(",") if n.strip()]
        held = str(shape[dim]) if 0 <= dim < len(shape) else "fewer"
        if "stft" not in (span or "") and not any(t.tb_frame.f_code.co_name == "stft" for t in tbs):
            return (
                f"A reflect padding of {left} needs more than {left} values along dimension "
                f"{dim}, and {x} has {held}: pad less, use mode='replicate' or 'constant', or "
                "give it a larger input."
            )
        return (
            f"{x} has {held} samples, but torch.stft(center=True) pads n_fft // 2 = {left} "
            "on each side by reflection, which needs more samples than that: the clip is "
            f"shorter than half a window. {end[0].upper()}{end[1:]} (more than {left} "
            "samples)."
        )
    if m := _NFFT_SIZE.search(message):
        have, n_fft = int(m[1]), int(m[2])
        return (
            f"{x} has {have} samples, fewer than n_fft = {n_fft}: torch.stft(center=False) "
            f"needs one whole window. {end[0].upper()}{end[1:]} ({n_fft} samples)."
        )
    return None


def _paren_text(expr: str) -> str:
    from nanwatch.rules._evidence import paren

    return paren(expr)


def _line_text(filename: str, lineno: int) -> str | None:
    import linecache

    text = linecache.getline(filename, lineno).strip()
    return text if text.isascii() else None


def rnn_hidden_advice(exc: BaseException) -> str | None:
    """Advice for an ``nn.RNN``/``LSTM``/``GRU`` that refused the hidden state it was given,
    led by the module and what its input's shape means to it: with ``batch_first=False``
    an input of shape (batch, steps, features) is read as (steps, batch, features), so a
    hidden state made for the real batch is refused; a hidden state given as (batch,
    layers, hidden) is refused whatever ``batch_first`` says; else the batch it was made
    for is not this input's (a last batch of another size). From the traceback's frames,
    the message and shapes only. None when no recurrent module's forward raised it."""
    from torch import Tensor, nn

    m = _HIDDEN_SIZE.search(str(exc))
    if m is None:
        return None
    want = tuple(int(n) for n in m["want"].split(", "))
    got = tuple(int(n) for n in m["got"].split(", "))
    if len(want) != 3 or len(got) != 3:
        return None
    tbs = _tracebacks(exc)
    frames = [t.tb_frame for t in tbs]
    owners = [(f, me) for f in frames if isinstance(me := f.f_locals.get("self"), nn.Module)]
    rnn = next(
        (
            (f, me, x)
            for f, me in reversed(owners)
            if isinstance(me, nn.RNNBase) and isinstance(x := f.f_locals.get("input"), Tensor)
        ),
        None,
    )
    if rnn is None:
        return None
    frame, module, x = rnn
    arg = _first_argument(tbs[: frames.index(frame)]) or "x"
    shape = tuple(int(n) for n in x.shape)
    path = next((q for q, me in owners[0][1].named_modules() if me is module), "")
    kind = type(module).__name__
    name = f"{path} ({kind})" if path else kind
    layers, batch, hidden = want
    if x.is_nested or x.dim() not in (2, 3):
        return None
    if got == (batch, layers, hidden) and batch != layers:
        return (
            f"{name} was given a hidden state of shape {list(got)}, but it takes (num_layers * "
            f"num_directions, batch, hidden_size) = {list(want)}, also with batch_first=True "
            f"(which is for the input and output only): make it torch.zeros({layers}, "
            f"{batch}, {hidden}), or pass none (zeros are the default)."
        )
    if (
        not module.batch_first
        and len(shape) == 3
        and shape[1] == batch
        and shape[0] == got[1]
        and shape[0] != shape[1]
    ):
        return rnn_batch_first_advice(
            name,
            module,
            shape,
            f", while the hidden state given with it is for a batch of {got[1]}",
        )
    return (
        f"{name} was given a hidden state for a batch of {got[1]}, but its input has a batch "
        f"of {batch} (shape {list(shape)}): make the hidden state from each batch's size, "
        f"torch.zeros({layers}, {arg}.size({0 if module.batch_first else 1}), {hidden}), "
        "or pass none (zeros are the default); a hidden state carried from the last batch "
        "does not fit a shorter one (DataLoader(..., drop_last=True))."
    )


#: the two batch sizes an error contrasts: broadcasting's, the class losses', nanwatch's
#: NW503 guard's, the binary losses'
_BATCH_PAIRS = (
    re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)"),
    re.compile(r"input batch_size \((\d+)\) to match target batch_size \((\d+)\)"),
    re.compile(r"the batch sizes differ \((\d+) vs (\d+)\)"),
    re.compile(r"Target size \(torch\.Size\(\[(\d+).*?input size \(torch\.Size\(\[(\d+)"),
)


def batch_sizes_named(message: str) -> set[int]:
    """The two different batch sizes ``message`` says disagree; empty when it says none.

    >>> sorted(batch_sizes_named("Expected input batch_size (10) to match target batch_size (4)."))
    [4, 10]
    """
    for pattern in _BATCH_PAIRS:
        m = pattern.search(message)
        if m is not None and m[1] != m[2]:
            return {int(m[1]), int(m[2])}
    return set()


def rnn_batch_first_advice(name: str, module: Any, shape: tuple[int, ...], then: str) -> str:
    """What an ``nn.RNN``/``LSTM``/``GRU`` built with ``batch_first=False`` (``name``:
    its path and class) made of an input of ``shape`` (batch, steps, features), and the
    constructor that reads it so; ``then``: what followed from it."""
    built = f"nn.{type(module).__name__}({module.input_size}, {module.hidden_size}"
    if module.num_layers != 1:
        built += f", num_layers={module.num_layers}"
    if module.bidirectional:
        built += ", bidirectional=True"
    return (
        f"{name} has batch_first=False, so it reads its input of shape {list(shape)} as "
        f"(steps, batch, features): {shape[1]} sequences of {shape[0]} steps{then}. If the "
        f"input is (batch, steps, features), build it with {built}, batch_first=True) (its "
        "output is then batch-first too; the hidden state stays (layers, batch, hidden))."
    )


def _first_argument(tbs: list[TracebackType]) -> str | None:
    """The source of the first argument of the call the innermost user frame of ``tbs``
    was making when it raised (``x`` of ``self.lstm(x, (h0, c0))``), when it is a name or
    an attribute."""
    import ast

    from nanwatch import _frames

    user = next(
        (t for t in reversed(tbs) if not _frames.is_internal(t.tb_frame.f_code.co_filename)),
        None,
    )
    text = _span_text(user.tb_frame.f_code, user.tb_lasti, user.tb_lineno) if user else None
    if not text:
        return None
    try:
        call = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(call, ast.Call) or not call.args:
        return None
    first = call.args[0]
    if not isinstance(first, ast.Name | ast.Attribute):
        return None
    return ast.get_source_segment(text, first)


#: ops that return a view of the same data with its dimensions reordered, repeated or cut
#: (new strides, no copy): a .view() of what they return can fail
_RESTRIDES = frozenset(
    {"transpose", "permute", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "expand",
     "expand_as", "narrow", "unfold", "as_strided", "diagonal", "T", "mT", "H", "mH"}
)  # fmt: skip


_BROADCAST = re.compile(
    r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at "
    r"non-singleton dimension (\d+)"
)


def broadcast_advice(exc: BaseException) -> str | None:
    """Advice for an elementwise op on the user's line whose two tensors do not broadcast
    ("The size of tensor a (32) must match the size of tensor b (30) at non-singleton
    dimension 3"): the tensors that line names, with their shapes, and when they differ only
    in their trailing (spatial) sizes, a prediction resized to the target's size (a
    segmentation output upsampled by a fixed factor from an input whose size is not a
    multiple of the stride). From the innermost user frame's source and the shapes of its
    local tensors only: no device access. None when the line names no such pair. Of
    ``(p * t).sum((2, 3))`` with p (2, 4, 32, 32) and t (2, 4, 30, 30): "p * t at
    train.py:35 raised: p is (2, 4, 32, 32) and t is (2, 4, 30, 30), and dimension 3
    differs (32 vs 30); ... p = F.interpolate(p, size=t.shape[-2:], ...)".
    """
    import ast

    import torch

    from nanwatch import _frames

    m = _BROADCAST.search(str(exc))
    if m is None:
        return None
    size_a, size_b, dim = int(m[1]), int(m[2]), int(m[3])
    user = _innermost_user(exc)
    if user is None:
        return None
    frame, lineno = user.tb_frame, user.tb_lineno
    where, line = _frames.describe_line(frame.f_code.co_filename, lineno)
    span = _span_text(frame.f_code, user.tb_lasti, lineno)
    text = span or line
    if not text:
        return None
    try:
        tree = ast.parse(text.strip())
    except SyntaxError:
        return None
    named: dict[str, tuple[int, ...]] = {}
    grad: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id not in named:
            t = frame.f_locals.get(n.id)
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                named[n.id] = tuple(int(d) for d in t.shape)
                if t.requires_grad:
                    grad.add(n.id)
    if len(named) < 2:
        return None
    rank = max(len(s) for s in named.values())

    def size_at(shape: tuple[int, ...]) -> int | None:
        k = dim - (rank - len(shape))
        return shape[k] if 0 <= k < len(shape) else None

    first = next((k for k, s in named.items() if size_at(s) == size_a), None)
    second = next((k for k, s in named.items() if k != first and size_at(s) == size_b), None)
    if first is None or second is None:
        return None
    sa, sb = named[first], named[second]
    said = (
        f"{span.strip() if span else line} at {where} raised: {first} is {sa} and "
        f"{second} is {sb}, and dimension {dim} differs ({size_a} vs {size_b}); "
        "broadcasting stretches a size of 1, not another size."
    )
    trailing = [
        i for i in range(min(len(sa), len(sb))) if sa[len(sa) - 1 - i] != sb[len(sb) - 1 - i]
    ]
    if len(sa) == len(sb) >= 3 and trailing and max(trailing) < min(2, len(sa) - 2):
        pred, target = (first, second) if first in grad or second not in grad else (second, first)
        want = named[target]
        said += (
            f" Only the spatial sizes differ ({'x'.join(map(str, named[pred][-2:]))} vs "
            f"{'x'.join(map(str, want[-2:]))}): an output upsampled by a fixed scale_factor "
            "(or strided down and up) does not come back to an input size that is not a "
            "multiple of the stride. Resize the prediction to the target's size where it is "
            f"made: {pred} = F.interpolate({pred}, size={target}.shape[-2:], "
            "mode='bilinear', align_corners=False) (resize a mask with mode='nearest'), or "
            "pad the input to a multiple of the stride."
        )
    return said


def view_advice(exc: BaseException) -> str | None:
    """Advice for a ``.view()`` of a non-contiguous tensor, led by the user's call that
    raised (``f.view(-1, 8)`` at ``train.py:73``), the tensor's shape when it is a local
    variable, the op that reordered it (``.permute(0, 2, 3, 1)`` on the line that assigned
    it in the same function, or in the call itself) and the call rewritten with
    ``.reshape``. From the traceback's innermost user frame, its source and a tensor's
    shape only: no device access. None when the call is not found on that line. Of
    ``h = x.transpose(0, 1)`` then ``h.view(-1)``: "h.view(-1) at train.py:5 raised: h
    (shape [3, 2]) is not contiguous in memory, made by .transpose(0, 1) on line 4, ...
    Write h.reshape(-1) (it copies only when it must), or h.contiguous().view(-1)."
    """
    import ast

    import torch

    from nanwatch import _frames

    user = _innermost_user(exc)
    if user is None:
        return None
    frame, lineno = user.tb_frame, user.tb_lineno
    where, line = _frames.describe_line(frame.f_code.co_filename, lineno)
    if line is None:
        return None
    found = _view_call(line, _span_text(frame.f_code, user.tb_lasti, lineno))
    if found is None:
        return None
    text, call = found
    recv = call.func.value
    recv_text = ast.get_source_segment(text, recv) or ""
    args = ", ".join(
        ast.get_source_segment(text, a) or ast.unparse(a) for a in (*call.args, *call.keywords)
    )
    fixed = recv_text
    if not isinstance(recv, ast.Name | ast.Attribute | ast.Call | ast.Subscript):
        fixed = f"({recv_text})"
    what, made = fixed, ""
    op = _restride(recv, text)
    if op is not None:
        made = f": {op} reordered its dimensions without moving the data"
    else:  # a variable, or an elementwise op of one (it keeps that variable's layout)
        name = next(
            (
                n.id
                for n in ast.walk(recv)
                if isinstance(n, ast.Name)
                and isinstance(t := frame.f_locals.get(n.id), torch.Tensor)
                and not t.is_contiguous()
            ),
            None,
        )
        t = frame.f_locals.get(name) if name is not None else None
        if name == recv_text and isinstance(t, torch.Tensor):
            what = f"{recv_text} (shape {_shape(t.shape)})"
        origin = _assigned_by(frame, name, lineno) if name is not None else None
        if origin is not None:
            op, at = origin
            made = (
                f", made by {op} on line {at}, which reordered its dimensions without "
                "moving the data"
            )
            if name != recv_text:
                made = f" (it keeps the layout of {name}{made})"
    return (
        f"{ast.get_source_segment(text, call)} at {where} raised: {what} is not contiguous "
        f"in memory{made}, and view() can only regroup dimensions that are laid out one "
        f"after the other. Write {fixed}.reshape({args}) (it copies only when it must), or "
        f"{fixed}.contiguous().view({args})."
    )


#: torch's error for an index tensor of a floating dtype, by the op: ``gather(): Expected
#: dtype int32/int64 for index``, ``torch.take_along_dim(): dtype of indices should be Long``
_INDEX_DTYPE = re.compile(
    r"(?P<op>\w+)\(\): (?:Expected dtype int32(?:/| or )int64 for index"
    r"|dtype of indices should be Long)"
)
#: ops that take an index tensor, and its place among a method call's positional arguments
#: (one more in the torch.op(input, ...) form) and its keyword
_INDEX_ARG = {
    "gather": (1, "index"),
    "scatter": (1, "index"),
    "scatter_add": (1, "index"),
    "scatter_reduce": (1, "index"),
    "index_select": (1, "index"),
    "index_add": (1, "index"),
    "index_copy": (1, "index"),
    "index_fill": (1, "index"),
    "take_along_dim": (0, "indices"),
}


def index_dtype_advice(exc: BaseException) -> str | None:
    """Advice for an index tensor of a floating dtype given to an op that takes integer
    indices (``q.gather(1, a)`` with actions or labels kept in a float buffer): the user's
    line with the index cast, ``a.long()``, from the traceback's innermost user frame and
    its source. None for another error, or when the call is not found on that line.
    """
    import ast

    from nanwatch import _frames

    m = _INDEX_DTYPE.search(str(exc))
    if m is None:
        return None
    op = m["op"].rstrip("_")
    user = _innermost_user(exc)
    if user is None:
        return None
    frame, lineno = user.tb_frame, user.tb_lineno
    where, line = _frames.describe_line(frame.f_code.co_filename, lineno)
    if line is None or op not in _INDEX_ARG:
        return None
    text = line.strip()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    place, key = _INDEX_ARG[op]
    found: list[tuple[ast.Call, ast.expr]] = []
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            continue
        if call.func.attr.rstrip("_") != op:
            continue
        module = ast.unparse(call.func.value) == "torch"
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        at = place + 1 if module else place
        index = kw.get(key, call.args[at] if len(call.args) > at else None)
        if index is not None:
            found.append((call, index))
    if len(found) != 1:
        return None
    call, index = found[0]
    seg = ast.get_source_segment(text, index) or ast.unparse(index)
    cast = (
        seg
        if isinstance(index, ast.Name | ast.Attribute | ast.Call | ast.Subscript)
        else (f"({seg})")
    )
    fixed = (
        text[: index.col_offset] + f"{cast}.long()" + text[index.end_col_offset :]
        if index.end_col_offset is not None
        else None
    )
    if fixed is None:
        return None
    return (
        f"{ast.get_source_segment(text, call)} at {where} raised: its index {seg} is a "
        "floating-point tensor, and an index must be an integer (int64) tensor. Indices "
        "kept in a float buffer (actions or labels stored in a torch.zeros(...) replay "
        "buffer or a numpy float array) come back as floats. Cast where it indexes: "
        f"{fixed}, or store them as integers (torch.zeros(n, dtype=torch.long))."
    )


def bool_arithmetic_advice(exc: BaseException) -> str | None:
    """Advice for a subtraction with a bool tensor (``1 - done`` on a bool done flag): the
    user's line with that operand cast to the other operand's kind, ``done.float()``, and
    ``~done`` for a mask. The operand is found on the raising line as a local variable (or
    an index of one) whose dtype is bool: a dtype, no device access. None otherwise."""
    import ast

    import torch

    from nanwatch import _frames

    if "Subtraction, the `-` operator, with a bool tensor" not in str(exc):
        return None
    user = _innermost_user(exc)
    if user is None:
        return None
    frame, lineno = user.tb_frame, user.tb_lineno
    where, line = _frames.describe_line(frame.f_code.co_filename, lineno)
    if line is None:
        return None
    text = line.strip()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None

    def is_bool(node: ast.expr) -> bool:
        base = node.value if isinstance(node, ast.Subscript) else node
        t = frame.f_locals.get(base.id) if isinstance(base, ast.Name) else None
        return isinstance(t, torch.Tensor) and t.dtype is torch.bool

    hits = [
        (n, side)
        for n in ast.walk(tree)
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub)
        for side in (n.left, n.right)
        if isinstance(side, ast.Name | ast.Subscript) and is_bool(side)
    ]
    if len(hits) != 1 or hits[0][1].end_col_offset is None:
        return None
    sub, side = hits[0]
    seg = ast.get_source_segment(text, side) or ast.unparse(side)
    fixed = text[: side.col_offset] + f"{seg}.float()" + text[side.end_col_offset :]
    return (
        f"{ast.get_source_segment(text, sub)} at {where} raised: {seg} is a bool tensor, "
        "and torch does not subtract bools (a done or mask flag stored as bool). For a "
        f"number (a not-done factor of 0 or 1): {fixed}; for a mask, ~{seg}."
    )


def _span_text(code: Any, lasti: int, lineno: int) -> str | None:
    """The source of the expression ``code`` was running at instruction ``lasti``, when it
    lies on line ``lineno`` alone (Python 3.11's instruction positions)."""
    import itertools
    import linecache

    positions = getattr(code, "co_positions", None)
    if positions is None or lasti < 0:
        return None
    pos = next(itertools.islice(positions(), lasti // 2, None), None)
    if pos is None or pos[0] != lineno or pos[1] != lineno or None in (pos[2], pos[3]):
        return None
    raw = linecache.getline(code.co_filename, lineno)
    return raw[pos[2] : pos[3]] if raw.isascii() else None


def _view_call(line: str, span: str | None) -> tuple[str, Any] | None:
    """(source, its ``x.view(...)`` call node): the expression that raised when its span is
    known and is one, else the only ``.view(...)`` call on the line."""
    import ast

    for text in (span, line):
        if not text:
            continue
        try:
            tree = ast.parse(text.strip())
        except SyntaxError:
            continue
        calls = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "view"
            and (n.args or n.keywords)
        ]
        if len(calls) == 1:
            return text.strip(), calls[0]
    return None


def _restride(node: Any, text: str) -> str | None:
    """The op in expression ``node`` (parsed from ``text``) that reorders a tensor's
    dimensions without copying (``.transpose(1, 2)``, ``.permute(0, 2, 1)``, ``.T``), the
    outermost one, as written."""
    import ast

    rows = text.splitlines(keepends=True)

    def offset(line: int | None, col: int | None) -> int:
        return sum(len(r) for r in rows[: (line or 1) - 1]) + (col or 0)

    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            attr, inner = n.func.attr, n.func.value
        elif isinstance(n, ast.Attribute):
            attr, inner = n.attr, n.value
        else:
            continue
        if attr in _RESTRIDES and text.isascii():
            start = offset(inner.end_lineno, inner.end_col_offset)
            op = text[start : offset(n.end_lineno, n.end_col_offset)].lstrip(") \t\n")
            if op.startswith("."):
                return op
    return None


def _assigned_by(frame: FrameType, name: str, lineno: int) -> tuple[str, int] | None:
    """The op that reordered ``name`` (see :func:`_restride`) in the last assignment to it
    above line ``lineno`` in ``frame``'s function, and that assignment's line."""
    import ast
    import inspect
    import textwrap

    try:
        lines, start = inspect.getsourcelines(frame.f_code)
        text = textwrap.dedent("".join(lines))
        tree = ast.parse(text)
    except (OSError, TypeError, SyntaxError, ValueError):  # no source, or not one block
        return None
    offset = max(start - 1, 0)
    last: tuple[int, Any] | None = None
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign | ast.AnnAssign):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                at = n.lineno + offset
                if at < lineno and (last is None or at > last[0]):
                    last = (at, n.value)
    if last is None or last[1] is None:
        return None
    op = _restride(last[1], text)
    return (op, last[0]) if op is not None else None


def _function_advice(message: str) -> str | None:
    """Advice for autograd's check of a custom Function's backward (an exception of no
    class of its own), led by what it names: the Function, the input, and the shape or the
    count it got and expected; None for another message.

    >>> _function_advice("Function ClipBackward returned an invalid gradient at index 0 - "
    ...     "got [1] but expected shape compatible with [6, 1]")[:66]
    'Clip.backward returned a gradient of shape [1] for forward input 0'
    """
    m = _BAD_GRADIENT.search(message)
    if m is not None:
        fn, i, got, want = m["fn"], m["i"], m["got"], m["want"]
        return (
            f"{fn}.backward returned a gradient of shape [{got}] for forward input {i} "
            f"(counted from 0, ctx not counted), whose shape is [{want}]: each gradient has "
            "its input's shape. A backward that reduces (.sum(), .mean()) must do so only over "
            "the dimensions its forward broadcast that input along, with keepdim=True, as "
            f"grad.sum(dim, keepdim=True). torch.autograd.gradcheck({fn}.apply, inputs) on "
            "small float64 inputs checks the backward against the forward."
        )
    m = _GRADIENT_COUNT.search(message)
    if m is not None:
        fn, got, want = m["fn"], m["got"], m["want"]
        return (
            f"{fn}.backward returned {got} gradient{'s' if got != '1' else ''} for a forward "
            f"that takes {want} argument{'s' if want != '1' else ''} (ctx not counted): "
            "return one per forward argument, in order, None for each one that needs no "
            "gradient (a flag, an int, a tensor that does not require grad)."
        )
    return None


#: group norm's checks: the layer's constructor, the functional, and a weight built for
#: another channel count than its input has
_GROUPS_CTOR = re.compile(
    r"num_channels \((?P<c>\d+)\) must be divisible by num_groups \((?P<g>\d+)\)"
)
_GROUPS_CALL = re.compile(
    r"channels in input to be divisible by num_groups, but got input of shape "
    r"\[\d+, (?P<c>\d+)[^\]]*\] and num_groups=(?P<g>\d+)"
)
_GROUPS_WEIGHT = re.compile(
    r"Expected weight to be a vector of size equal to the number of channels in input, "
    r"but got weight of shape \[(?P<w>\d+)\] and input of shape \[\d+, (?P<c>\d+)"
)


def _group_norm_advice(message: str) -> str | None:
    """Advice for GroupNorm's channel checks, with the numbers of the message: the groups
    that divide the channels, and ``math.gcd(G, C)``, the largest count of groups that
    divides both (what a UNet whose widths change per level needs at each width); None for
    another message.

    >>> _group_norm_advice("num_channels (48) must be divisible by num_groups (32)")[:60]
    'GroupNorm splits the channels into num_groups equal groups: '
    """
    import math

    m = _GROUPS_CTOR.search(message) or _GROUPS_CALL.search(message)
    if m is not None:
        c, g = int(m["c"]), int(m["g"])
        if c <= 0 or g <= 0:
            return None
        gcd = math.gcd(g, c)
        divisors = [d for d in range(1, c + 1) if c % d == 0]
        listed = (
            f" Counts of groups that divide {c}: {', '.join(map(str, divisors))}."
            if len(divisors) <= 12
            else ""
        )
        return (
            f"GroupNorm splits the channels into num_groups equal groups: {c} channels do not "
            f"split into {g} ({c} / {g} = {c / g:g}).{listed} Where the width changes from "
            "layer to layer (a UNet's levels), compute the groups from the width: "
            f"num_groups = math.gcd({g}, channels) ({gcd} for {c} channels, {c // gcd} "
            f"per group), or make every width a multiple of {g}."
        )
    m = _GROUPS_WEIGHT.search(message)
    if m is not None:
        w, c = int(m["w"]), int(m["c"])
        return (
            f"This GroupNorm was built for {w} channels (its weight has {w} entries) and its "
            f"input has {c} (dim 1): build it with num_channels={c}, the width of the layer "
            f"before it, as nn.GroupNorm(num_groups, {c}) with num_groups dividing {c}."
        )
    return None


_CONSTRAINT = re.compile(
    r"Expected parameter (?P<param>\w+) .*?of distribution (?P<dist>\w+)"
    # the constraint's repr nests one level: IndependentConstraint(Real(), 1)
    r".*?to satisfy the constraint (?P<constraint>\w+(?:\((?:[^()]|\([^()]*\))*\))?), "
    r"but found invalid values",
    re.DOTALL,
)
#: a distribution parameter that is a scale: positive by construction
_SCALES = ("scale", "scale_tril", "covariance_matrix", "precision_matrix", "concentration",
           "rate", "df", "concentration0", "concentration1", "alpha", "temperature")  # fmt: skip


#: what a positive map that made a scale of exactly 0 did, by the autograd node torch's
#: message prints with the invalid values (``grad_fn=<SoftplusBackward0>``); ``{low}``: the
#: input below which the map rounds to 0 in the values' dtype
_SCALE_MAKERS = {
    "Softplus": (
        "{param} must be > 0, and it was made by a softplus, which is positive in exact "
        "arithmetic but rounds to exactly 0 once its input is below about {low}: a floor "
        "keeps it positive, {param} = F.softplus(raw) + 1e-5; and look at why raw went that "
        "low (a learning rate too high, an unnormalized input)."
    ),
    "Exp": (
        "{param} must be > 0, and it was made by an exp, which underflows to exactly 0 once "
        "its input is below about {low}: clamp the log first, {param} = "
        "{log}, or add a floor, raw.exp() + 1e-5."
    ),
    "Sigmoid": (
        "{param} must be > 0, and it was made by a sigmoid, which rounds to exactly 0 once "
        "its input is below about {low_normal}: add a floor, torch.sigmoid(raw) + 1e-5, or use "
        "F.softplus(raw) + 1e-5."
    ),
    "Relu": (
        "{param} must be > 0, and it was made by a relu, which is exactly 0 for every "
        "negative input (and passes no gradient there): {param} = F.softplus(raw) + 1e-5 "
        "in place of the relu, or predict its log: {log}."
    ),
}


def _log_form(param: str) -> str:
    """A positive distribution parameter predicted as its log, in its own name: a Normal's
    scale is a std (``log_std.clamp(-20, 2).exp()``, at most e^2); a rate, a concentration
    or a df is not bounded by 2 (a Dirichlet's concentrations of 10, a count's rate of 100):
    only the exp's range is kept, ``log_rate.clamp(-20, 20).exp()``.

    >>> _log_form("scale"), _log_form("concentration")
    ('log_std.clamp(-20, 2).exp()', 'log_concentration.clamp(-20, 20).exp()')
    """
    if param == "scale":
        return "log_std.clamp(-20, 2).exp()"
    return f"log_{param}.clamp(-20, 20).exp()"


def _underflow_edge(values: str, *, normal: bool = False) -> str:
    """Where exp (and softplus) of a number rounds to 0 in the dtype of the values torch
    printed (``dtype=torch.float16`` in the tensor's repr; float32 when it names none): the
    log of that dtype's smallest positive value, ``-103.3 in float32``; with ``normal``, of
    its smallest normal value (a sigmoid flushes below it: ``-87.3 in float32``)."""
    m = re.search(r"dtype=torch\.(\w+)", values)
    name = m[1] if m else "float32"
    from nanwatch.stats import dtype_limits  # torch is loaded: it raised the error

    lim = dtype_limits(name)
    if lim is None:
        return "the log of the dtype's smallest positive value"
    return f"{math.log(lim.tiny if normal else lim.subnormal):.1f} in {name}"


def _made_by_node(values: str) -> str:
    """The autograd node that made the invalid values, as torch prints the tensor in its
    message (``tensor([0., 0.], grad_fn=<SoftplusBackward0>)``): ``Softplus``; "" when
    the values have no history.

    >>> _made_by_node("tensor([0., 0.], grad_fn=<SoftplusBackward0>)")
    'Softplus'
    """
    m = re.search(r"grad_fn=<(\w+?)Backward\d*>", values)
    return m[1] if m else ""


def _nan_rows(values: str) -> list[int]:
    """The rows of a 2-d tensor as torch printed it that hold NaN in every entry
    (``[nan, nan, nan]``); [] when it printed no such row, or summarized the rows
    (``...``), whose printed place is then not their index.

    >>> _nan_rows("tensor([[-0.5, -1.0],\\n        [nan, nan]])")
    [1]
    """
    text = values.lstrip(": \n")  # what follows torch's "found invalid values:"
    if not text.startswith("tensor([[") or text.startswith("tensor([[[") or "..." in text:
        return []
    rows = re.findall(r"\[([^\[\]]*)\]", text)
    return [
        i
        for i, row in enumerate(rows)
        if (cells := [c.strip() for c in row.split(",") if c.strip()])
        and all(c == "nan" for c in cells)
    ]


def _normalized_logits_advice(values: str) -> str:
    """Why the normalized logits of a Categorical (OneHotCategorical, Multinomial) are NaN:
    torch normalizes them along the last dimension, ``logits - logits.logsumexp(-1)``,
    which is NaN for a row that is -inf in every entry (every action masked), and for a
    row holding +inf or NaN. ``values``: the tensor as torch printed it."""
    rows = _nan_rows(values)
    said = (
        f" (row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:8]))}"
        f"{' ...' if len(rows) > 8 else ''} of the printed values)"
        if rows
        else ""
    )
    return (
        f"the logits it keeps are normalized, logits - logits.logsumexp(-1, keepdim=True), "
        f"and they hold NaN{said}. A row whose every entry is -inf -- a state whose every "
        "action is masked, or a mask combined with another that leaves nothing -- gives "
        "-inf - (-inf) = NaN there; so do a +inf logit and a NaN already in the logits. "
        "Mask with the dtype's most negative finite value instead of -inf, "
        "logits.masked_fill(~legal, torch.finfo(logits.dtype).min) (a row with every "
        "action masked becomes uniform, not NaN), and keep states with no legal action out "
        "of the loss (legal.any(-1)); a NaN or +inf the model made is named where it went "
        "wrong."
    )


def _constraint_advice(message: str) -> str:
    """ADVICE for a torch.distributions constraint error, led by the parameter it names
    (``Expected parameter scale (...) of distribution Normal(...) to satisfy the constraint
    GreaterThan(lower_bound=0.0), but found invalid values: tensor(...)``)."""
    m = _CONSTRAINT.search(message)
    if m is None:
        return ADVICE["distribution-constraint"]
    param, dist, constraint = m["param"], m["dist"], m["constraint"]
    values = message[m.end() :]
    nan = re.search(r"\bnan\b", values) is not None
    head = f"{dist}'s parameter {param} does not satisfy {constraint}"
    if param == "logits" and constraint.startswith("IndependentConstraint(Real()"):
        return f"{head}: {_normalized_logits_advice(values)}"
    if nan:
        return (
            f"{head}: it holds NaN, which no constraint accepts. The NaN was made before the "
            "distribution: where nanwatch saw it first (Where it went wrong, the anomaly) "
            "names the module or op that made it; fix that, not the distribution."
        )
    made = _SCALE_MAKERS.get(_made_by_node(values)) if param in _SCALES else None
    if made is not None:
        fix = made.format(
            param=param,
            log=_log_form(param),
            low=_underflow_edge(values),
            low_normal=_underflow_edge(values, normal=True),
        )
    elif param in _SCALES:
        fix = (
            f"{param} must be > 0, and a raw Linear output is negative about half the time, a "
            f"relu exactly 0: make it positive by construction, {param} = F.softplus(raw) + "
            f"1e-5, or predict its log: {_log_form(param)}."
        )
    elif param == "probs":
        fix = (
            "probs must lie in [0, 1] and sum to 1 along the last dimension (a relu(x) / "
            "sum is 0/0 for a row of zeros): pass the unnormalized scores as logits= "
            f"instead ({dist}(logits=out)), which normalizes them safely."
        )
    else:
        fix = (
            "map the network's output into the constraint's set by construction (softplus "
            "for > 0, sigmoid for (0, 1), logits= for probabilities) rather than passing it "
            "raw."
        )
    return f"{head}: {fix}"


def step_advice(info: dict[str, Any], trace: StepTrace | None, *, scaler: bool = False) -> None:
    """Sharpen ``info``'s advice (from :func:`classify`) with what the watcher recorded in the
    step that raised (``trace``): for an exception about non-finite values, which parameter
    gradients were not finite, and, when a GradScaler scaled them (``scaler``), that such
    steps are expected and skipped by ``scaler.step``. Host-side data only.

    Example:
        >>> from nanwatch.records import StepTrace
        >>> info = classify(RuntimeError("The total norm of order 2.0 ... is non-finite"))
        >>> step_advice(info, StepTrace(step=3, scale=65536.0), scaler=True)
        >>> "error_if_nonfinite=False" in info["advice"]
        True
    """
    if trace is not None and info.get("class") in (*_DEVICE_LOST, "index-out-of-range"):
        _compiled_call_advice(info, trace)
    if info.get("class") != "non-finite" or trace is None:
        return
    from nanwatch.records import Phase

    bad = [
        r.role
        for r in trace.records
        if r.phase is Phase.GRADIENT and r.stat is not None and not r.stat.finite
    ]
    norm = trace.grad_norm
    grads_bad = bool(bad) or (norm is not None and not math.isfinite(norm))
    clip = "total norm" in str(info.get("message", ""))
    which = ""
    if bad:
        names = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        which = f" ({names})"
    if scaler and trace.scale is not None and (grads_bad or clip):
        fix = (
            "call clip_grad_norm_ with error_if_nonfinite=False, after scaler.unscale_(optimizer)"
            if clip
            else "let scaler.step(optimizer) skip the step instead of raising on it"
        )
        info["advice"] = (
            "Under a GradScaler, inf and NaN gradients are expected on some steps (scaler.step "
            f"skips them): {fix}. Step {trace.step}'s gradients were scaled by "
            f"{trace.scale:.4g} and overflowed{which}; scaler.update() lowers the scale after "
            "such a step."
        )
    elif grads_bad:
        info["advice"] = (
            f"Step {trace.step}'s parameter gradients were not finite{which}"
            + (" when clip_grad_norm_ summed them" if clip else "")
            + ": the check only reports them. Where it went wrong names the op that made the "
            "first NaN or inf; fix that, not the check."
        )
    elif (
        trace.anomaly is None
        and not trace.ops
        and trace.records
        and all(r.stat is None or r.stat.finite for r in trace.records)
    ):
        # nothing nanwatch watched held it: the value was made by code it does not watch,
        # between the model's output and the check (sampling code after the model)
        info["advice"] = (
            f"Every value nanwatch watched in step {trace.step} was finite (the modules' "
            "inputs and outputs, the loss, the gradients): the NaN or inf was made by your "
            "code between the model's output and this check, on a line of the traceback "
            "above it. Sampling code is the usual place: logits / temperature with a "
            "temperature of 0 (take the argmax instead when it is 0), a top-k/top-p mask "
            "that removes every token (always keep the most likely one), a log of a "
            "probability of 0."
        )


def _compiled_call_advice(info: dict[str, Any], trace: StepTrace) -> None:
    """The error came out of a ``torch.compile``'d child holding guarded modules that could
    not be checked (a ``"compiled_call"`` note, see ``guards._explain_compiled``): the
    advice leads with that child, its tables' sizes and its integer inputs, and how to have
    the guard name the values. Host-side data only."""
    note = next((n for n in reversed(trace.notes) if n.kind == "compiled_call"), None)
    if note is None or not note.data.get("guarded"):
        return
    data = note.data
    known = "; ".join([*data.get("sizes", ()), *(f"input {i}" for i in data.get("ids", ()))])
    info["advice"] = (
        f"The error came out of the torch.compile'd call of {note.path}, which holds "
        f"{', '.join(data['guarded'])}: a guard cannot check inputs inside a compiled graph"
        + (f" ({known})" if known else "")
        + f". Run this batch through {note.path} uncompiled (its ._orig_mod), or on the CPU, "
        "and the guard names the values and their positions. " + str(info.get("advice", ""))
    )


def _raised_in_backward(exc: BaseException) -> bool:
    """Whether ``exc`` came out of autograd's engine (its traceback goes through
    ``torch.autograd.backward`` or ``torch.autograd.grad``): a custom Function's backward
    that raised, a gradient of the wrong shape."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "_engine_run_backward" or (
            code.co_name in ("backward", "grad")
            and os.path.normcase(code.co_filename).endswith(
                os.path.normcase(os.path.join("torch", "autograd", "__init__.py"))
            )
        ):
            return True
        tb = tb.tb_next
    return False


#: classes not raised by the op that ran: where they landed says nothing of the cause
_NOT_RAISED_BY_OP = ("keyboard-interrupt", "signal", "exit", "anomaly", "guard", "peer-failure")

#: frames of an optimizer's machinery that are not its method (hooks' wrapper, decorators)
_OPT_WRAPPERS = ("wrapper", "_use_grad", "maybe_fallback", "_fn", "decorate_context")


def optimizer_error(
    exc: BaseException, cls: str = "other", names: Mapping[int, str] | None = None
) -> dict[str, Any] | None:
    """Where ``exc`` was raised, when inside a ``torch.optim.Optimizer``'s method (its
    ``step()``, called or wrapped by the hooks' machinery): ``class`` (the optimizer's),
    ``method``, ``in_closure`` (the closure it was given raised: its forward or backward),
    ``variable`` (the user's name for the optimizer, when the calling frame holds it) and,
    for a shape mismatch, ``mismatch``: the weights whose state tensors (``exp_avg``, ...)
    have another shape than the weight, at most 8, and ``mismatched``/``params`` counts.
    From the traceback's frames and tensors' metadata only: no device access.

    Example:
        >>> optimizer_error(RuntimeError("boom")) is None
        True
    """
    import torch

    frames = [t.tb_frame for t in _tracebacks(exc)]
    optimizer: Any = None
    first = -1
    for i, f in enumerate(frames):
        me = f.f_locals.get("self")
        if isinstance(me, torch.optim.Optimizer):
            optimizer, first = me, i
            break
    if optimizer is None:
        return None
    inner = frames[first:]
    methods = [
        f.f_code.co_name
        for f in inner
        if f.f_locals.get("self") is optimizer and f.f_code.co_name not in _OPT_WRAPPERS
    ]
    method = "step" if "step" in methods or not methods else methods[-1]
    # the closure it was given (LBFGS, Lightning) runs the forward and backward inside it
    codes: set[Any] = set()
    for f in inner:
        closure = f.f_locals.get("closure") if f.f_locals.get("self") is optimizer else None
        while isinstance(closure, functools.partial):
            closure = closure.func
        if callable(closure):  # a function, or an object's __call__ (Lightning's Closure)
            codes.add(getattr(closure, "__code__", None))
            codes.add(getattr(closure.__call__, "__code__", None))
    codes.discard(None)
    module_file = os.path.normcase(os.path.abspath(torch.nn.modules.module.__file__))
    in_closure = any(
        f.f_code in codes
        or (
            f.f_code.co_name in ("_call_impl", "_wrapped_call_impl")
            and os.path.normcase(os.path.abspath(f.f_code.co_filename)) == module_file
        )
        for f in inner
    )
    out: dict[str, Any] = {
        "class": type(optimizer).__name__,
        "method": method,
        "in_closure": in_closure,
    }
    variable = _name_in_caller(frames[first - 1], optimizer) if first > 0 else None
    if variable:
        out["variable"] = variable
    if cls == "shape-mismatch" and not in_closure:
        out.update(_state_mismatches(optimizer, names or {}))
    return out


def _name_in_caller(frame: FrameType, obj: Any) -> str | None:
    """The name ``frame`` holds ``obj`` under: a local, or an attribute of its ``self``."""
    local = frame.f_locals
    for key, value in local.items():
        if value is obj and key.isidentifier() and key != "self":
            return key
    owner = local.get("self")
    attrs = getattr(owner, "__dict__", None)
    if isinstance(attrs, dict):
        for key, value in attrs.items():
            if value is obj and isinstance(key, str) and key.isidentifier():
                return f"self.{key}"
    return None


def _state_mismatches(optimizer: Any, names: Mapping[int, str]) -> dict[str, Any]:
    """The weights of ``optimizer`` whose state tensors do not have the weight's shape.
    A state tensor with a size 1 where the weight has another is a reduced factor
    (Adafactor's ``row_var``), not a mismatch. Shapes only: nothing is read."""
    import torch

    state = getattr(optimizer, "state", None)
    if state is None or not hasattr(state, "get"):
        return {}
    found: list[dict[str, Any]] = []
    total = mismatched = 0
    for gi, group in enumerate(getattr(optimizer, "param_groups", ())):
        for pi, p in enumerate(group.get("params", ())):
            if not isinstance(p, torch.Tensor):
                continue
            total += 1
            entry = state.get(p)
            if not isinstance(entry, dict):
                continue
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue
                shape, want = tuple(value.shape), tuple(p.shape)
                if shape == want or (
                    len(shape) == len(want)
                    and all(a in (b, 1) for a, b in zip(shape, want, strict=True))
                ):
                    continue
                mismatched += 1
                if len(found) < 8:
                    found.append(
                        {
                            "param": names.get(id(p)) or f"param_groups[{gi}]['params'][{pi}]",
                            "key": str(key),
                            "shape": list(want),
                            "state_shape": list(shape),
                        }
                    )
                break
    return {"mismatch": found, "mismatched": mismatched, "params": total} if found else {}


def _optimizer_advice(cls: str, found: dict[str, Any]) -> str:
    """What to do about an exception raised inside an optimizer's method."""
    call = f"{found['class']}.{found['method']}()"
    if found.get("in_closure"):  # its forward or backward raised: the modules are the lead
        return ADVICE[cls]
    if cls != "shape-mismatch":
        return (
            f"Raised inside {call}, not by a module: the modules listed had all finished. "
            + (ADVICE[cls])
        )
    var = found.get("variable")
    clear = f"{var}.state.clear()" if var else "clear its .state after loading"
    rows = found.get("mismatch") or []
    if rows:
        m = rows[0]
        what = (
            f"{call} raised, not a module: the optimizer's state has another model's shapes "
            f"({m['param']} is {_shape(m['shape'])}, its {m['key']} is "
            f"{_shape(m['state_shape'])}; {found.get('mismatched', 1)} of "
            f"{found.get('params', '?')} parameters differ). "
        )
    else:
        what = (
            f"{call} raised, not a module: a tensor of the optimizer's state (exp_avg, "
            "momentum_buffer, ...) does not have its parameter's shape. "
        )
    return what + (
        "The state was loaded (load_state_dict) from a checkpoint saved for a different "
        "architecture. Do not load the optimizer state when the model changed (rebuild the "
        f"optimizer instead), or start it afresh after loading: {clear}"
    )


def _shape(dims: Any) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _dims(dims: Any) -> str:
    """``(2, 8)``: a shape as torch prints a tensor's size."""
    return "(" + ", ".join(str(d) for d in dims) + ")"


def classify_signal(name: str) -> dict[str, Any]:
    """The error entry of a report written because the process received signal ``name``.

    Example:
        >>> classify_signal("SIGTERM")["message"]
        'the process received SIGTERM'
    """
    return {
        "class": "signal",
        "type": name,
        "message": f"the process received {name}",
        "device_lost": False,
        "advice": ADVICE["signal"],
    }


# ---------------------------------------------------------------------- files
def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never
    half of one: a temporary file in the same directory, flushed to disk, then renamed over
    ``path``. A process killed mid-write leaves at most a hidden ``.<name>.*.tmp`` file.

    Example:
        >>> p = atomic_write(Path(tempfile.mkdtemp()) / "r.json", "{}")
        >>> p.read_text()
        '{}'
    """
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(errno.EISDIR, "a directory; give a file name", str(p))
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as err:  # name the user's path, not a temporary file's
        raise type(err)(err.errno, err.strerror, str(p)) from None
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        with contextlib.suppress(OSError):
            dfd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    return p


def report_stem(report: Report, when: datetime.datetime | None = None) -> str:
    """``nanwatch-<YYYYmmdd-HHMMSS>-rank<r>-step<n>``: sortable by time, one per rank."""
    when = when or datetime.datetime.now()
    rank = report.rank if report.rank is not None else 0
    step: Any = None
    if report.error is not None:
        step = report.error.get("step")
    if step is None:
        step = report.steps[-1].step if report.steps else 0
    return f"nanwatch-{when:%Y%m%d-%H%M%S}-rank{rank}-step{step}"


def _save_new(report: Report, directory: Path, stem: str) -> tuple[Path, str]:
    """Save ``report`` as ``<stem>.json`` under a name no other process holds: the name is
    claimed by creating the file exclusively (``O_EXCL``), the next suffix (``-2``, ``-3``,
    ...) when taken, so two ranks or jobs writing at the same second never overwrite each
    other. Returns the JSON path and the stem (the HTML page takes the same)."""
    directory.mkdir(parents=True, exist_ok=True)
    candidate, n = stem, 1
    while True:
        json_path = directory / f"{candidate}.json"
        if not (directory / f"{candidate}.html").exists():
            try:
                os.close(os.open(json_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                pass
            else:
                try:
                    return report.save(json_path), candidate
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(json_path)
                    raise
        n += 1
        candidate = f"{stem}-{n}"


# ---------------------------------------------------------------------- where
def unwritable(directory: str | os.PathLike[str]) -> str | None:
    """Why no report can be written in ``directory`` (``"PermissionError: ..."``), or None
    when it can: the directory is made if missing, and a temporary file is created in it
    and removed. Asked before a report is due, so that a message never points at a
    directory the report will not be in.

    Example:
        >>> unwritable("/proc/nanwatch-reports")           # doctest: +SKIP
        "FileNotFoundError: [Errno 2] No such file or directory: '/proc/nanwatch-reports'"
    """
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def full_report_line(directory: str | os.PathLike[str]) -> str:
    """The last line of ``nanwatch run``'s :class:`~nanwatch.AnomalyError`: where its report
    is, or, when ``directory`` cannot take it, that it will not be written and what to do.

    Example:
        >>> full_report_line("/tmp/reports")               # doctest: +SKIP
        '  full report: in /tmp/reports (nanwatch report <file>.json)'
    """
    problem = unwritable(directory)
    if problem is None:
        return f"  full report: in {os.fspath(directory)} (nanwatch report <file>.json)"
    return (
        f"  full report: not written, {os.fspath(directory)!r} is not writable ({problem}); "
        "give --report-dir a writable directory"
    )


# ---------------------------------------------------------------------- capture
def capture(watcher: Watcher, exc: BaseException) -> Path | None:
    """Write the post-mortem report for ``exc`` (JSON, then HTML) into the watcher's
    ``config.report_dir``, print the paths and a short summary to stderr, and return the
    JSON path. Never raises: a failure to write is a warning, so the user's exception stays
    the one that propagates. Host-side data only; no tensor is touched.

    Example:
        >>> with nanwatch.watch(model) as nw:          # doctest: +SKIP
        ...     raise RuntimeError("boom")   # -> nanwatch-reports/nanwatch-...-step0.json
    """
    return write_report(watcher, exc=exc)


def write_report(
    watcher: Watcher,
    *,
    exc: BaseException | None = None,
    reason: str | None = None,
    announce: bool = True,
) -> Path | None:
    """Write the watcher's report (JSON, then HTML) under a fresh name in
    ``config.report_dir`` and return the JSON path; ``announce`` prints the paths and a short
    summary to stderr. Never raises: a failure is a warning and None.

    Example:
        >>> write_report(nw, announce=False)          # doctest: +SKIP
        PosixPath('nanwatch-reports/nanwatch-20261122-101500-rank0-step41.json')
    """
    # a SIGTERM now waits until the report is written and announced; after a post-mortem
    # (the run is over) it ends the process with no second report
    with _DeferSignal(final=exc is not None or reason is not None):
        return _write_report(watcher, exc=exc, reason=reason, announce=announce)


def _write_report(
    watcher: Watcher, *, exc: BaseException | None, reason: str | None, announce: bool
) -> Path | None:
    directory = Path(watcher.config.report_dir)
    try:
        from nanwatch.report import Report

        report = Report.from_watcher(watcher, exc, reason=reason)
        json_path, stem = _save_new(report, directory, report_stem(report))
    except Exception as err:
        what = "the post-mortem report" if exc is not None or reason else "the report"
        _warn(
            f"nanwatch: could not write {what} to {str(directory)!r} "
            f"({type(err).__name__}: {err}); "
            + ("the original error follows unchanged. " if exc is not None else "")
            + "Give report_dir= (nanwatch.watch, NanWatchCallback, nanwatch run --report-dir) a "
            "writable directory."
        )
        return None
    paths = [json_path]
    html_error: str | None = None
    try:
        paths.append(report.save(directory / f"{stem}.html"))
    except Exception as err:
        html_error = f"{type(err).__name__}: {err}"
        _warn(
            f"nanwatch: the JSON report is at {json_path}, but its HTML page could "
            f"not be written ({html_error}); render it later with: nanwatch report {json_path} "
            "--html report.html"
        )
    if not announce:
        return json_path
    try:
        from nanwatch.render import print_summary

        print_summary(report, paths)
    except Exception:
        with contextlib.suppress(Exception):
            sys.stderr.write(f"nanwatch: post-mortem report written to {json_path}\n")
    return json_path


def _warn(message: str) -> None:
    """A warning pointing at the user's line; if warnings are errors (-W error), stderr."""
    try:
        from nanwatch import _frames

        _frames.warn_at_user(message, safe=True)
    except Exception:
        with contextlib.suppress(Exception):
            sys.stderr.write(message + "\n")


# ---------------------------------------------------------------------- signals
_Handler = Callable[[int, FrameType | None], Any] | int | None


class _DeferSignal:
    """While a report is being written in the main thread, a SIGTERM is held back: the report
    is completed and announced, then the signal goes to the handler that was installed or,
    with none, ends the process as the default does. After a post-mortem (``final``: that
    report was the last), a watcher's handler passes it straight on, with no second report.
    Without this, the signal would cut the post-mortem short, or start a second report in
    the middle of the first."""

    _writing = False  #: a report is being written in the main thread (no nesting)

    def __init__(self, *, final: bool) -> None:
        self.final = final
        self.previous: _Handler = None
        self.received: list[int] = []

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def __enter__(self) -> _DeferSignal:
        if (
            _DeferSignal._writing
            or not hasattr(signal, "SIGTERM")
            or threading.current_thread() is not threading.main_thread()
        ):
            return self
        try:
            current = signal.getsignal(signal.SIGTERM)
            if current is None or current == signal.SIG_IGN:
                return self  # set from C, or ignored: left alone
            signal.signal(signal.SIGTERM, self._hold)
        except (ValueError, OSError, TypeError):
            return self
        self.previous = current
        _DeferSignal._writing = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        previous = self.previous
        if previous is None:
            return
        _DeferSignal._writing = False
        with contextlib.suppress(ValueError, OSError, TypeError):
            signal.signal(signal.SIGTERM, previous)
        for signum in self.received[:1]:  # one delivery: the default ends the process
            if isinstance(previous, _SigtermHandler) and self.final:
                previous.pass_on(signum, None)
            elif callable(previous):
                previous(signum, None)
            else:
                _default_action(signum)


def _default_action(signum: int) -> None:
    """End the process as the default action of ``signum`` does."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


class _SigtermHandler:
    """Writes the watcher's report on SIGTERM, then hands the signal to the handler that
    was installed before (another watcher's, the framework's, or the default: terminate).

    Nested watchers chain: each handler calls the one it replaced. A handler whose watcher
    detached while another handler sat on top of it stays in the chain as a pass-through.
    """

    def __init__(self, watcher: Watcher, previous: _Handler) -> None:
        self.watcher: weakref.ReferenceType[Watcher] = weakref.ref(watcher)
        self.previous = previous
        self.active = True

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        w = self.watcher()
        if self.active and w is not None and w.attached:
            with contextlib.suppress(Exception):
                write_report(w, reason=signal.Signals(signum).name)
        self.pass_on(signum, frame)

    def pass_on(self, signum: int, frame: FrameType | None) -> None:
        """Hand the signal to the handler this one replaced, without writing a report."""
        prev = self.previous
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:  # SIG_DFL (or a handler not installed from Python): end as the default does
            _default_action(signum)

    def undo(self) -> None:
        self.active = False
        try:
            current = signal.getsignal(signal.SIGTERM)
        except (ValueError, OSError):
            return
        if id(current) != id(self):  # (not `is`: mypy would narrow `self` to the union)
            return  # another handler sits on top; it keeps calling us, a pass-through now
        target = self.previous
        while isinstance(target, _SigtermHandler) and not target.active:
            target = target.previous
        with contextlib.suppress(ValueError, OSError, TypeError):
            signal.signal(signal.SIGTERM, target if target is not None else signal.SIG_DFL)


def install_signal_handlers(watcher: Watcher) -> Callable[[], None]:
    """Write the watcher's report on SIGTERM for as long as it is attached, then let the
    process end as it would have (the previous handler runs; the default one terminates).
    Returns the undo function. Only the main thread can install signal handlers; elsewhere,
    and when SIGTERM is ignored or was set from C, nothing is installed.

    Nor in a distributed run (world size > 1): a Python handler only runs once the main
    thread is back in the interpreter, so a rank blocked in a collective would outlive the
    launcher's SIGTERM until the process group's timeout. There the signal ends the process
    at once, as it would without nanwatch; the rank seen now is kept for the reports.

    Example:
        >>> undo = install_signal_handlers(nw)          # doctest: +SKIP
        >>> undo()                                      # doctest: +SKIP
    """
    from nanwatch.report import rank_of

    _, world = rank_of(watcher)
    if (world or 0) > 1 or _launcher_world_size() > 1:
        return _nothing
    if not hasattr(signal, "SIGTERM") or threading.current_thread() is not threading.main_thread():
        return _nothing
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        return _nothing
    if previous is None or previous == signal.SIG_IGN:
        return _nothing
    handler = _SigtermHandler(watcher, previous)
    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        return _nothing
    return handler.undo


def _launcher_world_size() -> int:
    """$WORLD_SIZE as a launcher (torchrun, Lightning, SLURM scripts) sets it; 0 when unset."""
    world = os.environ.get("WORLD_SIZE", "")
    return int(world) if world.isdigit() else 0


def _nothing() -> None:
    return None
