"""Make the flashoptim fixtures of tests/test_convert_flashoptim.py (run once, on a CUDA machine).

flashoptim (the FlashOptim paper's library, 0.1.4) runs its optimizer step, quantization and ECC only as Triton
kernels on CUDA, so its state dicts cannot be made on the CPU. This script trains tiny bf16 models with
``flashoptim.FlashAdamW`` for 3 steps on seeded data and saves, per file, what a user migrating would save::

    {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

plus oracles computed by flashoptim itself on the GPU (keys the converter ignores):

- ``fp32_masters``: ``optimizer.get_fp32_model_state_dict(model)`` (flashoptim's own master-weight
  reconstruction from the bf16 parameter and its ECC bits),
- ``moments``: ``optimizer.state[p][name].materialize()`` (flashoptim's own dequantization), by parameter name,
- ``next_step`` (first file only): the gradients of a 4th step and flashoptim's fp32 masters after it,
- ``division``: what Triton's fp32 ``/`` gives for every code (flashoptim's ``dequantize`` with unit scales,
  and ``ecc / 127`` as its ECC kernel divides), to tell division rounding apart from format errors,
- ``versions``.

Usage (CUDA): ``python tests/data/make_flashoptim_fixture.py OUT_DIR``; the files are copied to tests/data/.
``--cpu-dry-run``: a smoke test of this script on the CPU under Triton's interpreter (IEEE numpy arithmetic,
flashoptim's CUDA checks patched out); its files are not fixtures.
"""

from __future__ import annotations

import os
import platform
import sys
import traceback
from pathlib import Path

DRY = "--cpu-dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch import nn  # noqa: E402

if DRY:
    torch.cuda.is_available = lambda: True

import flashoptim  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from flashoptim import optimizers as FO  # noqa: E402

if DRY:
    FO._get_sm_count = lambda device=None: 2
    for _kernel in (FO._triton_quantize_kernel, FO._triton_dequantize_kernel):
        _kernel.configs = _kernel.configs[:1]  # a single config: no benchmarking (needs a GPU)
    import types  # the interpreter has no libdevice: numpy stand-ins for the two functions flashoptim uses

    FO.libdevice = types.SimpleNamespace(pow=lambda a, b: tl.exp2(tl.log2(a) * b),
                                         copysign=lambda x, y: tl.where(y < 0, -tl.abs(x), tl.abs(x)))

    def _set_data(self, data):  # flashoptim's set_data without its is_cuda check
        if self._try_quantize:
            self._data = None
            self._quantized, self._scales = FO.quantize(data, signed=self._signed, sqrt=self._sqrt,
                                                        softsign=self._softsign)
        else:
            self._data = data.to(dtype=self._storage_dtype)
            self._quantized = self._scales = None

    FO._MaybeQuantizedTensor.set_data = _set_data

DEV = "cpu" if DRY else "cuda"
STEPS = 3


class Tiny(nn.Module):
    """Two bf16 linears and an fp32 LayerNorm (kept fp32, as flashoptim's cast_model keeps norms), a buffer."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int):
        super().__init__()
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, d_out))
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x):
        h = self.fc2(nn.functional.gelu(self.fc1(x)))
        return self.norm(h.float()) + self.offset


def cpu(obj):
    """A deep copy on the CPU (state dicts share the live tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu(v) for v in obj)
    return obj


def make(dims, named: bool, groups: bool, bits: int, compress: bool, seed: int, next_step: bool) -> dict:
    torch.manual_seed(seed)
    model = Tiny(*dims)
    model.fc1.to(torch.bfloat16)
    model.fc2.to(torch.bfloat16)
    model.to(DEV)
    gen = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(STEPS + 1, 16, dims[0], generator=gen)
    ys = torch.randn(STEPS + 1, 16, dims[2], generator=gen)

    def loss(i):
        return (model(xs[i].to(DEV, torch.bfloat16)) - ys[i].to(DEV)).pow(2).mean()

    items = list(model.named_parameters()) if named else list(model.parameters())
    if groups:
        decay = [it for it in items if (it[1] if named else it).ndim >= 2]
        no_decay = [it for it in items if (it[1] if named else it).ndim < 2]
        params = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    else:
        params = items
    opt = flashoptim.FlashAdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.05, master_weight_bits=bits,
                                compress_state_dict=compress)
    for i in range(STEPS):
        opt.zero_grad()
        loss(i).backward()
        opt.step()
    out = {"model": cpu(model.state_dict()), "optimizer": cpu(opt.state_dict()),
           "fp32_masters": cpu(opt.get_fp32_model_state_dict(model)),
           "moments": {n: {k: cpu(opt.state[p][k].materialize().float()) for k in ("exp_avg", "exp_avg_sq")}
                       for n, p in model.named_parameters()}}
    if next_step:
        opt.zero_grad()
        loss(STEPS).backward()
        grads = {n: cpu(p.grad) for n, p in model.named_parameters()}
        opt.step()
        out["next_step"] = {"grads": grads, "fp32_masters": cpu(opt.get_fp32_model_state_dict(model))}
    return out


@triton.jit
def _ecc_div_kernel(ecc_ptr, out_ptr, n, SIGNED_MAX_VAL: tl.constexpr, BLOCK: tl.constexpr):
    # the division of flashoptim's ECC decoding: the integer code as fp32, divided by its constexpr max
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ecc = tl.load(ecc_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, ecc.to(tl.float32) / SIGNED_MAX_VAL, mask=mask)


def division_tables() -> dict:
    out = {}
    m = torch.arange(-128, 128, dtype=torch.int16).clamp(min=-127).to(torch.int8).to(DEV)  # 256 = 8 groups
    ones = torch.ones(8, dtype=torch.float16, device=DEV)
    out["exp_avg_normalized"] = cpu(FO.dequantize(m, ones, signed=True, softsign=True, sqrt=False))
    out["exp_avg_codes"] = cpu(m)
    v = torch.arange(0, 256, dtype=torch.int16).to(torch.uint8).to(DEV)
    out["exp_avg_sq_normalized"] = cpu(FO.dequantize(v, ones, signed=False, softsign=False, sqrt=False))
    out["exp_avg_sq_codes"] = cpu(v)
    for dtype, top in ((torch.int8, 127), (torch.int16, 32767)):
        codes = torch.arange(-top, top + 1, dtype=torch.int32).to(dtype).to(DEV)
        res = torch.empty(codes.shape, dtype=torch.float32, device=DEV)
        _ecc_div_kernel[(triton.cdiv(codes.numel(), 1024),)](codes, res, codes.numel(), SIGNED_MAX_VAL=top,
                                                              BLOCK=1024)
        res = res.cpu()
        ieee = codes.cpu().float() / top
        differ = (res != ieee).nonzero().flatten()
        out[f"ecc{top}_codes_differing_from_ieee"] = codes.cpu()[differ].clone()
        out[f"ecc{top}_triton_at_those_codes"] = res[differ].clone()
        out[f"ecc{top}_codes_total"] = codes.numel()
    return out


def main() -> int:
    dest = Path([a for a in sys.argv[1:] if not a.startswith("--")][0])
    dest.mkdir(parents=True, exist_ok=True)
    versions = {"torch": str(torch.__version__), "triton": str(triton.__version__),
                "flashoptim": str(flashoptim.__version__),
                "python": platform.python_version(), "cuda": str(torch.version.cuda),
                "device": torch.cuda.get_device_name() if not DRY else "cpu (Triton interpreter, dry run)"}
    print(versions, flush=True)
    runs = {  # file -> (dims, named parameters, two param groups, master_weight_bits, compress_state_dict, ...)
        "flashoptim_tiny": ((64, 96, 40), True, True, 24, True, 0, True),
        "flashoptim_unnamed_fp32moments": ((32, 48, 24), False, False, 24, False, 1, False),
        "flashoptim_32bit": ((32, 48, 24), True, False, 32, True, 2, False),
    }
    status = 0
    for name, (dims, named, groups, bits, compress, seed, nxt) in runs.items():
        try:
            out = make(dims, named, groups, bits, compress, seed, nxt)
            out["versions"] = dict(versions, master_weight_bits=bits, compress_state_dict=compress,
                                   named_parameters=named)
            if name == "flashoptim_tiny":
                try:
                    out["division"] = division_tables()
                except Exception:  # noqa: BLE001 - the fixture itself matters more
                    traceback.print_exc()
            torch.save(out, dest / f"{name}.pt")
            print(f"wrote {dest / (name + '.pt')} ({(dest / (name + '.pt')).stat().st_size} bytes)", flush=True)
        except Exception:  # noqa: BLE001 - keep making the others
            traceback.print_exc()
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
