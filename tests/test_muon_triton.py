"""FlashMuon's Triton kernels (phases 1 and 3: kernels/triton/muon.py) against the eager reference, bit for bit,
under the interpreter on CPU: every parameter dtype, master-weight width and momentum storage, Nesterov and
plain momentum, unaligned rows, 3-d weights, a non-finite gradient."""

from __future__ import annotations

import _interpreter  # first: it decides whether this process interprets triton  # isort: skip

import itertools

import pytest
import torch

from flashdist import FlashMuon
from tests.cases import DTYPES, MOMENTS

# every dtype x master-weight width x momentum storage with Nesterov; plain momentum (the other lerp branch of
# the update) once per momentum storage
CASES = ([(d, b, m, True) for d, b, m in itertools.product(DTYPES, (24, 32, None), MOMENTS) if d != "fp32" or b is None]
         + [("bf16", 24, m, False) for m in MOMENTS])


def _ids(case):
    d, b, m, n = case
    return f"{d}-{b or 'nosplit'}-{m}-{'nesterov' if n else 'plain'}"


def _stepped(case, backend: str, lr_of=None) -> list[torch.Tensor]:
    dtype, bits, moments, nesterov = case
    quantize, companded = MOMENTS[moments]
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(DTYPES[dtype]))
              for shape in ((5, 70), (40, 16), (3, 4, 24))]
    opt = FlashMuon(params, lr=0.02, nesterov=nesterov, momentum=0.3 if not nesterov else 0.95,
                    master_weight_bits=bits, quantize_states=quantize, companded=companded, backend=backend)
    for step in range(3):
        if lr_of is not None:
            opt.param_groups[0]["lr"] = lr_of(step)
        for p in params:
            g = torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-4, 3, p.shape, generator=gen)
            if step == 2 and p.ndim == 3:
                g[1, 2, 5] = float("nan")
            p.grad = g.to(p.dtype)
        opt.step()
    return [t for p in params for t in (p.detach(), opt.master_weight(p), *opt.state[p].values())] + [opt.skipped]


@pytest.mark.interpreted  # where triton is not interpreted in this process, test_in_interpreter_process runs these
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_triton_matches_reference_bitwise(case):
    if not _interpreter.HAS_TRITON:
        pytest.skip("triton is not installed")
    got, want = _stepped(case, "triton"), _stepped(case, "reference")
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs from the reference's"


@pytest.mark.interpreted
@pytest.mark.parametrize("lr_dtype", [torch.float64, torch.float32], ids=["fp64-lr", "fp32-lr"])
def test_learning_rate_in_a_tensor_is_read_by_the_kernel_with_the_host_bits(lr_dtype):
    """A learning rate held in a tensor on the parameters' device (what a capturable step and a CUDA graph read)
    goes to the weight update's kernel, which computes ``1 - lr * wd`` and the adjusted lr from it as the host
    does: the bits of the float learning rate, at a learning rate that changes every step."""
    if not _interpreter.HAS_TRITON:
        pytest.skip("triton is not installed")
    lrs = [torch.tensor(0.02 / (k + 1) ** 1.3, dtype=lr_dtype) for k in range(3)]
    got = _stepped(CASES[0], "triton", lambda k: lrs[k])
    want = _stepped(CASES[0], "reference", lambda k: float(lrs[k]))
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs from the float learning rate's"


@pytest.mark.interpreter_runner
def test_in_interpreter_process():
    if not _interpreter.HAS_TRITON:
        pytest.skip("triton is not installed")
    done = _interpreter.run_interpreted(__file__, "-k", "test_triton_matches_reference_bitwise or learning_rate_in")
    assert done.returncode == 0 and f"{len(CASES) + 2} passed" in done.stdout, done.stdout[-6000:] + done.stderr[-3000:]
