"""FlashMuon on a CUDA device (pytest -m gpu): the compiled Triton kernels of its elementwise phases against the
eager reference on the same device, bit for bit (rows that end inside a group, and a tall matrix of whole
groups: the momentum update's prefetch over several blocks a program, the weight update's transposed tiles),
and the whole step against torch.optim.Muon on CUDA with fp32 state (bitwise where torch's CUDA lerp and
add(alpha=) are one FMA each, as its CPU kernels are)."""

from __future__ import annotations

import pytest
import torch

from flashdist import FlashMuon
from tests.test_muon_triton import CASES, _ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _stepped(case, backend: str) -> list[torch.Tensor]:
    from tests.cases import DTYPES, MOMENTS

    dtype, bits, moments, nesterov = case
    quantize, companded = MOMENTS[moments]
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(DTYPES[dtype]).cuda())
              for shape in ((5, 70), (40, 16), (3, 4, 24), (1024, 1100), (1536, 512))]
    opt = FlashMuon(params, lr=0.02, nesterov=nesterov, master_weight_bits=bits, quantize_states=quantize,
                    companded=companded, backend=backend, flatten=False)
    for step in range(3):
        for p in params:
            g = torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-4, 3, p.shape, generator=gen)
            if step == 2 and p.ndim == 3:
                g[1, 2, 5] = float("nan")
            p.grad = g.to(p.dtype).cuda()
        opt.step()
    return [t for p in params for t in (p.detach(), opt.master_weight(p), *opt.state[p].values())] + [opt.skipped]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_compiled_kernels_match_the_cuda_reference(case):
    got, want = _stepped(case, "triton"), _stepped(case, "reference")
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), f"tensor {i} differs from the reference's"


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_on_cuda(nesterov):
    gen = torch.Generator().manual_seed(1)
    shapes = ((64, 256), (256, 64), (127, 129))
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda()) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    flash = FlashMuon(params, lr=0.02, nesterov=nesterov, quantize_states=False, master_weight_bits=None)
    torch_muon = torch.optim.Muon(ref, lr=0.02, nesterov=nesterov)
    for _ in range(4):
        for p, r in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=gen).cuda()
            r.grad = p.grad.clone()
        flash.step()
        torch_muon.step()
        for p, r in zip(params, ref):
            assert torch.equal(flash.state[p]["momentum_buffer"], torch_muon.state[r]["momentum_buffer"])
            assert torch.equal(p, r)
