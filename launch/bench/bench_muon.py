"""Time one Muon step on one GPU: flashdist's FlashMuon next to torch.optim.Muon, with the same Newton-Schulz work.

Run on a GPU machine from the repository root:

    python launch/bench/bench_muon.py --out bench_muon.json

Workload: the matrices of the Llama-3.2-1B shapes that Muon takes (16 layers x 7 projections, 973 M of the
model's 1,236 M parameters; the embedding and the norms take AdamW in a real run and are left out here so
that both optimizers do exactly the same Newton-Schulz work). Each row is the median of 20 steps after 5
warm-up steps, timed with CUDA events around ``optimizer.step()``, on random non-zero gradients.

Rows:
- torch.optim.Muon with fp32 parameters (fp32 momentum: its usual mixed-precision setup) and with bf16
  parameters (bf16 momentum, no master weights);
- flashdist FlashMuon, 24-bit (bf16 parameters + int8 rho, 8-bit companded momentum), the same with
  ``graphed=True`` (the step captured in a CUDA graph and replayed: no Python or launch work per step), and
  with ``quantize_states=False`` (fp32 momentum);
- "Newton-Schulz only": ``flashdist.kernels.reference.newton_schulz`` on the same matrices (bf16, 5 steps),
  the part both optimizers share, so that step - NS is each one's elementwise time.
"B/param held" is the optimizer's parameters + gradients + state over the parameter count (measured).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys

import torch

import flashdist
from flashdist.kernels.reference import newton_schulz
from flashdist.optim.muon import NS_COEFFICIENTS

if __package__:  # python -m launch.bench.bench_muon
    from .bench_step import copy_bandwidth, time_cuda
else:  # python launch/bench/bench_muon.py: its own folder is on sys.path
    from bench_step import copy_bandwidth, time_cuda

# launch configurations of each elementwise kernel tried by --kernels: (groups, blocks, warps, prefetch), and for
# the transposed updates the tile's columns (KernelLaunch.tile_cols; its rows are groups * 32 // tile_cols)
KERNEL_SWEEP = {
    "momentum": [(16, 4, 1, True), (16, 1, 1, False), (16, 2, 1, True), (32, 1, 1, False), (16, 4, 2, True)],
    "apply": [(16, 1, 4, False), (32, 1, 8, False), (16, 2, 4, False), (16, 4, 4, True)],
    # the tall matrices' updates as Newton-Schulz returns them (transposes), read in tiles
    "apply_transposed": [(16, 1, 4, False, 32), (8, 1, 4, False, 32), (32, 1, 4, False, 32), (64, 1, 4, False, 64),
                         (128, 1, 4, False, 64), (128, 1, 8, False, 64), (64, 1, 4, False, 128),
                         (128, 1, 8, False, 128), (256, 1, 8, False, 128)],
}


def muon_shapes():
    h, inter, kv, layers = 2048, 8192, 512, 16
    return [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)] * layers


def held_bytes(params, opt) -> int:
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    total += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))
    return total


def run_case(name: str, dtype: torch.dtype, build) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(0.02 * torch.randn(s, device="cuda", generator=gen).to(dtype))
              for s in muon_shapes()]
    for p in params:
        p.grad = (1e-3 * torch.randn(p.shape, device="cuda", generator=gen)).to(dtype)
    opt = build(params)
    ms = time_cuda(opt.step)[0]
    numel = sum(p.numel() for p in params)
    row = {"case": name, "step_ms": round(ms, 3), "bytes_per_param_held": round(held_bytes(params, opt) / numel, 4),
           "numel": numel}
    del opt, params
    return row


def newton_schulz_only() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    updates = [torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16) for s in muon_shapes()]

    def all_ns():
        for u in updates:
            newton_schulz(u, coefficients=NS_COEFFICIENTS, steps=5, eps=1e-7)

    return {"case": "Newton-Schulz only (bf16, 5 steps)", "step_ms": round(time_cuda(all_ns)[0], 3)}


def kernel_rows(bw: float, sweep) -> list[dict]:
    """Phases 1 and 3 alone (``kernels/triton/muon.py``), one launch per matrix over all the matrices, for each
    launch configuration: ms of a pass (median of 20), launched from Python and replayed from a CUDA graph (no
    host work: the kernels' own time), and the replay's fraction of the memory floor (bytes moved over the
    copy bandwidth: phase 1 reads the bf16 gradient, the codes and scales and writes them and U; phase 3 reads
    O, the bf16 parameter and rho and writes the last two). Phase 3 twice: on contiguous updates, and on the
    updates as Newton-Schulz returns them (the tall matrices' as transposes, ``muon_apply_transposed``'s
    launch varied)."""
    from flashdist.kernels.scalars import MuonScalars
    from flashdist.kernels.triton import config as launch_config
    from flashdist.kernels.triton.muon import muon_apply, muon_momentum
    from flashdist.quant import codes as Q

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = muon_shapes()
    grads = [(1e-3 * torch.randn(s, device="cuda", generator=gen)).bfloat16() for s in shapes]
    state = [Q.quantize_exp_avg(1e-3 * torch.randn(s, device="cuda", generator=gen), s[1], True) for s in shapes]
    params = [(0.02 * torch.randn(s, device="cuda", generator=gen)).bfloat16() for s in shapes]
    rhos = [torch.zeros(s, device="cuda", dtype=torch.int8) for s in shapes]
    orthos = [torch.randn(s, device="cuda", generator=gen).bfloat16() for s in shapes]
    # as Newton-Schulz returns them: a tall matrix's update is the transpose of a contiguous one
    ns_orthos = [o if o.shape[0] <= o.shape[1] else o.T.contiguous().T for o in orthos]
    skipped = torch.zeros((), dtype=torch.int32, device="cuda")
    scalars = MuonScalars.make(lr=1e-6, weight_decay=0.0, momentum=0.95, nesterov=True, lr_ratio=1.0)
    numel = sum(g.numel() for g in grads)
    floors = {"momentum": numel * (2 + 2 * (1 + 2 / Q.GROUP) + 2) / bw * 1e3, "apply": numel * (2 + 3 + 3) / bw * 1e3}

    def momentum():
        for g, (codes, scales) in zip(grads, state):
            muon_momentum(g, codes, scales, cols=g.shape[1], scalars=scalars, companded=True)

    def apply():
        for p, r, o in zip(params, rhos, orthos):
            muon_apply(p, r, o, scalars=scalars, skipped=skipped)

    def apply_transposed():
        for p, r, o in zip(params, rhos, ns_orthos):
            muon_apply(p, r, o, scalars=scalars, skipped=skipped)

    rows = []
    floors["apply_transposed"] = floors["apply"]
    for name, fn in (("momentum", momentum), ("apply", apply), ("apply_transposed", apply_transposed)):
        for groups, blocks, warps, prefetch, *tile in sweep[name]:
            tile_cols = tile[0] if tile else 32
            launch = launch_config.KernelLaunch(groups=groups, blocks=blocks, warps=warps, prefetch=prefetch,
                                                tile_cols=tile_cols)
            with launch_config.using(launch_config.current().replace(**{f"muon_{name}": launch})):
                ms = time_cuda(fn)[0]
                fn()  # (compiled before the capture)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                replay_ms = time_cuda(graph.replay)[0]
                del graph
            row = {"kernel": name, "groups": groups, "blocks": blocks, "warps": warps, "prefetch": prefetch,
                   "tile_cols": tile_cols if name == "apply_transposed" else None, "ms": round(ms, 3),
                   "replay_ms": round(replay_ms, 3), "of_floor": round(floors[name] / replay_ms, 3)}
            tile = f" tile {groups * 32 // tile_cols}x{tile_cols}" if name == "apply_transposed" else ""
            print(f"{name:16s} groups {groups:3d} blocks {blocks} warps {warps} prefetch {prefetch!s:5}{tile}: "
                  f"{ms:6.3f} ms, replayed {replay_ms:6.3f} ms ({row['of_floor']:.2f} of floor)", flush=True)
            rows.append(row)
    print(f"floors: momentum {floors['momentum']:.3f} ms, apply {floors['apply']:.3f} ms ({numel / 1e6:.0f} M values)")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--kernels", action="store_true",
                    help="time the two elementwise kernels alone over a sweep of launch configurations instead")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_muon: needs a CUDA device", file=sys.stderr)
        return 2
    if args.kernels:
        bw = copy_bandwidth()
        result = {"benchmark": "bench_muon --kernels", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth": bw,
                  "triton": getattr(__import__("triton"), "__version__", None), "rows": kernel_rows(bw, KERNEL_SWEEP)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    lr, wd = 0.02, 0.1
    rows = [newton_schulz_only()]
    if hasattr(torch.optim, "Muon"):
        rows.append(run_case("torch.optim.Muon, fp32 params", torch.float32,
                             lambda ps: torch.optim.Muon(ps, lr=lr, weight_decay=wd)))
        rows.append(run_case("torch.optim.Muon, bf16 params", torch.bfloat16,
                             lambda ps: torch.optim.Muon(ps, lr=lr, weight_decay=wd)))
    rows.append(run_case("flashdist FlashMuon, 24-bit, 8-bit momentum", torch.bfloat16,
                         lambda ps: flashdist.FlashMuon(ps, lr=lr, weight_decay=wd)))
    rows.append(run_case("flashdist FlashMuon, 24-bit, 8-bit momentum, graphed", torch.bfloat16,
                         lambda ps: flashdist.FlashMuon(ps, lr=lr, weight_decay=wd, graphed=True)))
    rows.append(run_case("flashdist FlashMuon, 24-bit, fp32 momentum", torch.bfloat16,
                         lambda ps: flashdist.FlashMuon(ps, lr=lr, weight_decay=wd, quantize_states=False)))
    ns = rows[0]["step_ms"]
    print(f"{'case':56s} {'step ms':>9s} {'- NS ms':>9s} {'B/param':>8s}")
    for row in rows:
        if "numel" in row:
            row["elementwise_ms"] = round(row["step_ms"] - ns, 3)
        print(f"{row['case']:56s} {row['step_ms']:9.2f} {row.get('elementwise_ms', float('nan')):9.2f} "
              f"{row.get('bytes_per_param_held', float('nan')):8.3f}")
    result = {"benchmark": "bench_muon", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": getattr(__import__("triton"), "__version__", None), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
