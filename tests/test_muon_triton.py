"""FlashMuon's Triton kernels (phases 1 and 3: kernels/triton/muon.py) against the eager reference, bit for bit,
under the interpreter on CPU: every parameter dtype, master-weight width and momentum storage, Nesterov and
plain momentum, unaligned rows, 3-d weights, tall matrices (whose orthogonalized update is a transpose, read
in tiles), a non-finite gradient."""

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
    opt = FlashMuon(params, lr=0.02, nesterov=nesterov, momentum=0.3 if not nesterov else 0.95, flatten=False,
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
@pytest.mark.parametrize("case", [("bf16", 24, "q-comp", True), ("fp16", 32, "q-linear", False),
                                  ("fp32", None, "fp32m", True)], ids=_ids)
def test_programs_of_several_blocks_match_the_reference(case):
    """Launch shapes change no bit: blocks of 2 groups, 3 blocks a program (tensors end inside a program's
    blocks and inside a block), against the reference."""
    from flashdist.kernels.triton import config

    if not _interpreter.HAS_TRITON:
        pytest.skip("triton is not installed")
    launch = config.KernelLaunch(groups=2, blocks=3)
    with config.using(config.DEFAULT.replace(muon_momentum=launch, muon_apply=launch, muon_apply_transposed=launch)):
        got = _stepped(case, "triton")
    want = _stepped(case, "reference")
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


@pytest.mark.interpreted
def test_strided_gradients_and_learning_rates_of_several_values_are_refused_before_any_change():
    """The kernels read flat storage: a gradient that is not contiguous (a transposed layout) is refused in one
    line before anything changes, where it would have been read in the wrong order; a learning rate tensor of
    two values is refused as the reference refuses it, not read as its first."""
    from flashdist.functional.muon import flash_muon

    if not _interpreter.HAS_TRITON:
        pytest.skip("triton is not installed")
    p = torch.nn.Parameter(torch.randn(48, 64).bfloat16())
    opt = FlashMuon([p], lr=0.02, backend="triton")
    p.grad = torch.randn(64, 48).bfloat16().t()
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"\[0\] \(shape \(48, 64\), torch.bfloat16\) has a gradient that is not "
                       r"contiguous \(strides") as refused:
        opt.step()
    assert "\n" not in str(refused.value) and torch.equal(p.detach(), before)
    assert all(not torch.count_nonzero(v) for v in opt.state[p].values())  # (made for the step: zeros, step 0)
    p.grad = p.grad.contiguous()
    opt.step()  # the same gradient, contiguous, steps
    buf = torch.zeros(48, 64)
    for backend in ("triton", "reference"):
        with pytest.raises(RuntimeError, match="2 elements"):
            flash_muon([p.detach()], [p.grad], [buf], None, None, cols=None, shapes=[(48, 64)],
                       lr=torch.tensor([0.02, 5.0]), weight_decay=0.1, momentum=0.95, nesterov=True,
                       ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7, adjust_lr_fn=None,
                       backend=backend)


@pytest.mark.interpreted
@pytest.mark.parametrize("tile", [(16, 32), (2, 8), (4, 128)], ids=["16x32", "8x8", "1x128"])
def test_weight_update_reads_a_transposed_update_in_place_of_a_copy(monkeypatch, tile):
    """A tall matrix's orthogonalized update is the transpose of a contiguous one (Newton-Schulz works on the
    wide side): the kernel reads it in tiles (the launch says TRANSPOSED), with the bits of the reference,
    edges that end inside a tile included, at every tile shape the launch can ask for (rows x columns: the
    default 16 x 32, square, one row); other strides are copied first and launched as contiguous."""
    from flashdist.kernels import reference
    from flashdist.kernels.scalars import MuonScalars
    from flashdist.kernels.triton import config, muon

    if not _interpreter.HAS_TRITON:
        pytest.skip("triton is not installed")
    launched, kernel = [], muon._apply_kernel

    class Spy:  # records each launch's TRANSPOSED and tile, then launches
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((kwargs["TRANSPOSED"], kwargs["TILE_COLS"]))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(muon, "_apply_kernel", Spy())
    groups, tile_cols = tile
    launch = config.KernelLaunch(groups=groups, tile_cols=tile_cols)
    gen = torch.Generator().manual_seed(5)
    scalars = MuonScalars.make(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, lr_ratio=1.3)
    with config.using(config.DEFAULT.replace(muon_apply_transposed=launch)):
        for rows, cols in ((70, 33), (33, 1), (64, 32)):
            start = torch.randn(rows, cols, generator=gen)
            ortho = torch.randn(cols, rows, generator=gen).bfloat16().T  # strides (1, rows)
            ortho[3 % rows, 0] = float("inf")
            sliced = torch.randn(rows, 2 * cols, generator=gen).bfloat16()[:, ::2]
            for strided in (ortho, sliced):
                got, want = [(start.bfloat16(), torch.zeros(rows, cols, dtype=torch.int8)) for _ in range(2)]
                skipped = [torch.zeros((), dtype=torch.int32) for _ in range(2)]
                muon.muon_apply(*got, strided, scalars=scalars, skipped=skipped[0])
                reference.muon_apply_(*want, strided, scalars=scalars, skipped=skipped[1])
                assert all(torch.equal(a, b) for a, b in zip(got + (skipped[0],), want + (skipped[1],))), (rows, cols)
    assert launched == [(True, tile_cols), (False, 32)] * 3, launched


@pytest.mark.interpreted
def test_momentum_kernel_reads_the_gradient_the_cell_points_at():
    """A captured step's momentum launch reads the gradient's address from a device cell (G_CELL), which
    GraphedStep rewrites before each replay: the bits of the launch given the gradient itself, for each
    gradient dtype and momentum storage, whatever tensor stands in for the gradient's dtype and shape."""
    from flashdist.kernels.scalars import MuonScalars
    from flashdist.kernels.triton.muon import muon_momentum
    from flashdist.quant import codes as Q

    if not _interpreter.HAS_TRITON:
        pytest.skip("triton is not installed")
    gen = torch.Generator().manual_seed(3)
    scalars = MuonScalars.make(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, lr_ratio=1.0)
    for dtype, quantized in itertools.product((torch.bfloat16, torch.float16, torch.float32), (True, False)):
        grad = torch.randn(24, 40, generator=gen).to(dtype)
        start = torch.randn(24, 40, generator=gen)
        codes, scales = Q.quantize_exp_avg(start, 40, True) if quantized else (start, None)
        states = [(codes.clone(), scales.clone() if quantized else None) for _ in range(2)]
        cell = torch.tensor([[grad.data_ptr(), 0]], dtype=torch.int64)
        direct = muon_momentum(grad, *states[0], cols=40 if quantized else None, scalars=scalars, companded=True)
        via = muon_momentum(torch.zeros_like(grad), *states[1], cols=40 if quantized else None, scalars=scalars,
                            companded=True, grad_cell=cell[0])
        assert torch.equal(direct, via), (dtype, quantized)
        assert all(torch.equal(a, b) for a, b in zip(states[0], states[1]) if a is not None), (dtype, quantized)


@pytest.mark.interpreter_runner
def test_in_interpreter_process():
    if not _interpreter.HAS_TRITON:
        pytest.skip("triton is not installed")
    done = _interpreter.run_interpreted(__file__, "-k", "not test_in_interpreter_process")
    ran = len(CASES) + 10
    assert done.returncode == 0 and f"{ran} passed" in done.stdout, done.stdout[-6000:] + done.stderr[-3000:]
