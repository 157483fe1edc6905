"""NW301's fixes for hand-written optimizers and gradient code: a LAMB trust ratio guarded
with torch.where (not a clamp that freezes zero-initialized weights), AGC's scale traced
to the division that makes it, a helper the optimizer calls searched too."""

import ast
import importlib.util
import textwrap

import torch

from nanwatch.rules import gradients as g


def _load(tmp_path, name, src):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(src))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, path


def test_lamb_trust_ratio_fix_is_a_where_guard_that_keeps_zero_params_training():
    src = "w_norm = p.norm()\nu_norm = update.norm()\ntrust_ratio = w_norm / u_norm\n"
    ops = g._zero_ops(ast.parse(src), src.splitlines())
    assert [o[0] for o in ops] == [3]
    fixed = ops[0][3]
    assert fixed == (
        "trust_ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, "
        "torch.ones_like(w_norm))"
    )
    ast.parse(fixed)
    for w, u in [(0.0, 2.0), (3.0, 0.0), (0.0, 0.0), (3.0, 2.0)]:
        env = {"torch": torch, "w_norm": torch.tensor(w), "u_norm": torch.tensor(u)}
        exec(fixed, env)
        t = env["trust_ratio"]
        assert torch.isfinite(t) and t > 0  # a zero weight (ReZero alpha) still moves
    # a plain division by a norm keeps its floor
    src = "x = g / v.norm()\n"
    fixed = g._zero_ops(ast.parse(src), src.splitlines())[0][3]
    assert fixed == "x = g / v.norm().clamp_min(1e-12)"


def test_helper_function_called_by_step_is_searched_and_normalize_gets_eps(tmp_path):
    mod, _ = _load(
        tmp_path,
        "fg2_muon",
        """
        import torch

        def ortho(G):
            X = G.float()
            X = X / X.norm()
            return X

        class Muon15(torch.optim.Optimizer):
            def __init__(self, params):
                super().__init__(params, dict(lr=0.1))

            @torch.no_grad()
            def step(self):
                for group in self.param_groups:
                    for p in group["params"]:
                        p.add_(ortho(p.grad), alpha=-group["lr"])
        """,
    )
    found = g._step_source(mod.Muon15)
    assert found is not None
    ops = found[2]
    assert [(o[0], o[1], o[4]) for o in ops] == [(6, "X = X / X.norm()", "ortho")]
    fixed = ops[0][3]
    assert fixed == "X = X / (X.norm() + 1e-7)"
    env = {"X": torch.zeros(3, 3)}
    exec(fixed, env)
    assert torch.isfinite(env["X"]).all()


def test_agc_scale_traced_to_its_division_and_both_norms_floored(tmp_path):
    src = textwrap.dedent(
        """
        import torch

        def unitwise_norm(t):
            return t.abs() if t.ndim <= 1 else t.norm(dim=1, keepdim=True)

        def train(model, opt, clip=0.01):
            for p in model.parameters():
                max_norm = unitwise_norm(p) * clip
                scale = (max_norm / unitwise_norm(p.grad)).clamp(max=1.0)
                p.grad.mul_(scale)
            opt.step()
        """
    )
    path = tmp_path / "fg2_agc.py"
    path.write_text(src)
    tree = ast.parse(src)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    stmt = next(n for n in ast.walk(fn) if isinstance(n, ast.stmt) and g._write_of(n))
    target = g._write_of(stmt)[0]
    got = g._traced_division(src, fn, stmt, target)
    assert got is not None
    division, line, fixes = got
    assert division == "max_norm / unitwise_norm(p.grad)" and line == 10
    assert fixes == (
        "max_norm = unitwise_norm(p).clamp_min(1e-3) * clip",
        "scale = (max_norm / unitwise_norm(p.grad).clamp_min(1e-6)).clamp(max=1.0)",
    )
    # applied to a dead unit (weight 0, gradient 0): finite, and the unit can still move
    p = torch.zeros(4)
    p.grad = torch.zeros(4)
    env = {"unitwise_norm": lambda t: t.abs(), "p": p, "clip": 0.01}
    for f in fixes:
        exec(f, env)
    assert torch.isfinite(env["scale"]).all() and (env["scale"] > 0).all()
