"""The replay runs a module's forward once more with gradients on only when gradients off
can be why it raised (a forward that differentiates itself: a PINN's
``torch.autograd.grad``); any other error is the code's own, said as it was, the forward run
once. Both runs start from the module's state as the replay found it (buffers, tensors and
numbers held as attributes, caches), and it is all put back afterwards. The watcher's own
runs of a root (sentinel mode making a child's inputs again) retry the same way: a PINN
called twice a step, interior and boundary points, has the sqrt of its child named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import ops

torch.set_num_threads(1)


# ------------------------------------------------------------ a: which errors are retried
class _Raises(nn.Module):
    """Raises its own error under no_grad, after counting the call."""

    def __init__(self, message: str, runs: list[bool]) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.message = message
        self.ran = runs.append  # (a list attribute is the module's state: put back)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ran(torch.is_grad_enabled())
        y = torch.log(self.lin(x) - 10.0)  # NaN: every value is below 10
        if not torch.is_grad_enabled():
            raise ValueError(self.message)
        return y


def test_an_error_of_the_code_itself_is_said_as_it_was_and_not_run_again() -> None:
    """Before, any error made the replay run the forward once more with gradients on, and
    the second run's NaN took the place of the error the code raised. An error that says
    a tensor has no graph is what gradients off make: that one is retried."""
    runs: list[bool] = []
    m = _Raises("batch of 3 rows, the model wants 4", runs)
    result = ops.replay(m, (torch.zeros(3, 2),), {}, path="m")
    assert runs == [False]
    assert result.error == "ValueError: batch of 3 rows, the model wants 4"

    runs.clear()
    m = _Raises("element 0 of tensors does not require grad and does not have a grad_fn", runs)
    result = ops.replay(m, (torch.zeros(3, 2),), {}, path="m")
    assert runs == [False, True]
    assert result.error is None
    assert [ev.op for ev in result.events][:1] == ["aten.log.default"]


def test_forward_again_raises_the_codes_own_error_unchanged_and_runs_once() -> None:
    runs: list[bool] = []
    m = _Raises("bad config: depth must be positive", runs)
    x = torch.zeros(3, 2)
    with ops.preserved_state(m, set()) as state, pytest.raises(ValueError) as info:
        ops.forward_again(m, (x,), {}, grad=False, state=state, devices=set())
    assert str(info.value) == "bad config: depth must be positive"
    assert runs == [False]


def test_an_error_raised_inside_autograd_grad_is_one_that_gradients_may_cause() -> None:
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        torch.autograd.grad(x * 2.0, x, grad_outputs=torch.ones(3))  # says nothing of graphs
    assert ops.grad_caused(info.value)
    assert not ops.grad_caused(ValueError("batch of 3 rows, the model wants 4"))


class _PINN(nn.Module):
    """u(x) and its derivative du/dx, made by the forward itself."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        u = self.net(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return du


def test_forward_again_runs_a_forward_that_differentiates_itself_with_gradients_on() -> None:
    torch.manual_seed(0)
    m = _PINN()
    x = torch.rand(4, 1)
    with ops.preserved_state(m, set()) as state:
        out = ops.forward_again(m, (x,), {}, grad=False, state=state, devices=set())
    assert out.shape == (4, 1)
    assert all(p.grad is None for p in m.parameters())


# --------------------------------------------------- b: state between the runs and after
class _Stateful(nn.Module):
    """Counts its calls in a buffer, a tensor attribute and a number, keeps a cache, and
    differentiates itself; its output is finite on its first call alone."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self.register_buffer("calls", torch.zeros(()))
        self.seen = torch.zeros(())  # not registered: a plain attribute
        self.count = 0
        self.cache: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.add_(1)
        self.count += 1
        self.cache.append(x)
        x = x.requires_grad_(True)
        (du,) = torch.autograd.grad(self.lin(x).sum(), x, create_graph=True)
        # finite while the buffer holds 1: log(0) = -inf on a second call
        return du * torch.log(2.0 - self.calls)


def test_the_second_run_starts_from_the_buffers_the_first_one_found() -> None:
    """Before, the retry saw the buffer the failed no-grad run had already counted up,
    and reported a -inf the user's forward never made."""
    m = _Stateful()
    result = ops.replay(m, (torch.ones(3, 1),), {}, path="m")
    assert result.error is None
    assert result.clean, [ev.op for ev in result.events]


def test_the_replay_puts_back_buffers_tensor_attributes_numbers_and_caches() -> None:
    m = _Stateful()
    seen, cache = m.seen, m.cache
    ops.replay(m, (torch.ones(3, 1),), {}, path="m")
    assert float(m.calls) == 0.0
    assert m.seen is seen and float(m.seen) == 0.0
    assert m.count == 0
    assert m.cache is cache and cache == []


class _Lazy(nn.Module):
    """Binds names as it runs: a cache and a hidden state set the first time, a tuple and
    a submodule it rebinds, a buffer registered the first time, a name it deletes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.shape = (0, 0)  # a tuple: neither a tensor nor a number
        self.head = nn.Identity()
        self.old = torch.ones(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.cache = y.detach()
        self._h = [y]
        self.shape = tuple(y.shape)
        self.head = nn.Tanh()
        self.register_buffer("seen", torch.ones(()), persistent=False)
        del self.old
        return self.head(y)


def test_the_replay_deletes_the_names_its_forward_bound_and_puts_back_those_it_rebound() -> None:
    """Before, a name the replayed forward bound for the first time stayed on the module
    (a cache holding the replay's values, a buffer in its state_dict), and a tuple, a
    submodule or a deleted name kept what the replay left."""
    m = _Lazy()
    head, old, names = m.head, m.old, set(vars(m))
    result = ops.replay(m, (torch.ones(3, 2),), {}, path="m")
    assert result.error is None
    assert set(vars(m)) == names
    assert not hasattr(m, "cache") and not hasattr(m, "_h")
    assert m.shape == (0, 0)
    assert m.head is head and dict(m.named_children()) == {"lin": m.lin, "head": head}
    assert "seen" not in dict(m.named_buffers()) and not m._non_persistent_buffers_set
    assert m.old is old


# ------------------------------------------- c: the watcher's own runs of a root retry too
class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.sqrt(self.w)  # a learned scale at 0: d sqrt(w)/dw is infinite


class _ScaledPINN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
        self.scale = _Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        u = self.scale(self.net(x))
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return (du**2).mean() + u.pow(2).mean() + 1.0


def test_sentinel_names_the_sqrt_of_a_pinn_called_twice_a_step() -> None:
    """Sentinel hooks the root alone: the child's inputs are made again by running the
    root, which raised under no_grad and gave up (NW302, no op named)."""
    torch.manual_seed(0)
    model = _ScaledPINN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.rand(8, 1)
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        loss = model(x.clone()) + model(x.clone() + 1.0)  # interior and boundary points
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    first = nw.report.diagnoses[0]
    assert first.code == "NW112"
    assert "SqrtBackward0" in first.evidence[0]
    assert any("return h * torch.sqrt(self.w)" in e for e in first.evidence)
