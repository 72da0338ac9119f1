"""A ``torch.compile``'d model trained by FlashAdamW: the optimizer steps the compiled module's parameters (the
same tensors as the eager module's), its state stays quantized, the in-place updates cause no recompilation,
and training matches the eager model trained by the same optimizer.

- ``aot_eager`` (AOTAutograd, decompositions and functionalization, then eager aten kernels) runs the same
  kernels in the same dtypes as eager: losses, weights and optimizer state must be identical, bit for bit.
- ``inductor`` (the default backend; C++ code on CPU) fuses elementwise chains and keeps their intermediates
  in fp32 where eager rounds each bf16 op, so gradients differ by a few bf16 ulps. Adam normalises each
  update to about ``lr`` in size, so one step's update can differ by at most about ``2 * lr`` (a sign flip)
  and usually by far less: the test bounds the largest weight difference by ``2 * lr * steps``, the mean one
  by 5% of how far the weights moved, and the losses to 1% relative. Marked slow: inductor's first C++
  compile of the forward and backward takes tens of seconds on a small CPU (cached afterwards).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flashdist import FlashAdamW

LR, STEPS = 1e-3, 6


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).to(torch.bfloat16)


def _train(model, steps: int = STEPS):
    optimizer = FlashAdamW(model.parameters(), lr=LR, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g).to(torch.bfloat16)
        y = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), optimizer


def _run_both(backend: str):
    eager = _model()
    initial = {n: p.detach().clone() for n, p in eager.named_parameters()}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(copy.deepcopy(eager), backend=backend)
    compiled_losses, compiled_opt = _train(compiled)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    eager_losses, eager_opt = _train(eager)
    module = compiled._orig_mod
    assert graphs == 1, f"the compiled model was recompiled ({graphs} graphs) by the optimizer's updates"
    for p in module.parameters():  # the optimizer holds the compiled module's own parameters
        assert any(p is q for group in compiled_opt.param_groups for q in group["params"])
    return eager, module, initial, (eager_losses, compiled_losses), (eager_opt, compiled_opt)


def _assert_quantized(module, optimizer):
    for name, p in module.named_parameters():
        state = optimizer.state[p]
        assert state["rho"].dtype == torch.int8, name
        if p.dim() >= 2:
            assert state["exp_avg_codes"].dtype == torch.int8 and state["exp_avg_sq_codes"].dtype == torch.uint8
            assert "exp_avg" not in state, name


def test_compiled_model_aot_eager_is_bit_exact():
    eager, module, _, (eager_losses, compiled_losses), (eager_opt, compiled_opt) = _run_both("aot_eager")
    assert torch.equal(compiled_losses, eager_losses)
    _assert_quantized(module, compiled_opt)
    for (name, p), q in zip(module.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), name
        mine, theirs = compiled_opt.state[p], eager_opt.state[q]
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), f"{name}:{key}"


@pytest.mark.slow
def test_compiled_model_inductor_matches_eager():
    eager, module, initial, (eager_losses, compiled_losses), (_, compiled_opt) = _run_both("inductor")
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-2, atol=0.0)
    _assert_quantized(module, compiled_opt)
    for (name, p), q in zip(module.named_parameters(), eager.parameters()):
        diff = (p.float() - q.float()).abs()
        moved = (q.float() - initial[name].float()).abs().mean()
        assert diff.max() <= 2 * LR * STEPS, f"{name}: max difference {diff.max():.3g}"
        assert diff.mean() <= 0.05 * moved, f"{name}: mean difference {diff.mean():.3g}, moved {moved:.3g}"


def test_state_dict_and_load_state_dict_are_not_traced():
    """torch.compile of a function that saves or loads the optimizer's state runs them as they are (disabled
    for dynamo: their checks and the Python-side caches are not traceable), with no graph and no break."""
    param = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
    param.grad = torch.randn_like(param)
    opt = FlashAdamW([param])
    opt.step()
    saved = opt.state_dict()
    for fn in (lambda: opt.state_dict(), lambda: opt.load_state_dict(saved)):
        explained = torch._dynamo.explain(fn)()
        assert explained.graph_count == 0 and explained.graph_break_count <= 0, explained
