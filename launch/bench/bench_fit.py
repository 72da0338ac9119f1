"""The comparison a user makes before a run: for each optimizer, the fastest configuration that fits the GPUs
(sequences per rank, and how many decoder layers recompute their activations), searched by this benchmark,
and its tokens/s against AdamW's best (issue #21). Llama shapes under FSDP2, as launch/bench/bench_scaling.py builds
them (``bench_fsdp.build``: bf16 compute, fp32 reduction, one FSDP group per decoder layer).

    torchrun --standalone --nproc_per_node=1 launch/bench/bench_fit.py --model 8b --out runs/fit_w1.json   # one H200
    torchrun --standalone --nproc_per_node=2 launch/bench/bench_fit.py --model 8b --out runs/fit_w2.json   # two
    torchrun --standalone --nproc_per_node=1 launch/bench/bench_fit.py --model tiny --cpu --seq 32 --max-batch 4  # smoke

The search (``search``), per optimizer, on one model built once: the count of layers that recompute their
activations goes from all of them down to none (``--checkpointed``, fractions of the layers), and at each count
the batch sizes of ``--batches`` in increasing order. A batch is run only if its peak memory (what the CUDA
allocator reserves, the largest over the ranks), predicted from what was measured, stays under
``--memory-gib``: the peak grows linearly with the batch, so two measured batches of a count predict the
others; after one, the line through the memory a step holds whatever the batch (parameters, gradients,
optimizer state) predicts more than that, and where that line would skip the second batch, the line through
the peak of a step on a sequence of 8 tokens (no activations to speak of, but the working memory of a step:
gathered layers, the loss's logits, workspaces) predicts it instead; the smallest batch of a count is predicted
from the previous count's line (more recomputed layers need less memory: a lower bound, on which only the
first batch of each count relies). A count stops at the first batch that does not fit and when a batch gains
less than the fraction ``--min-gain`` of tokens/s over the one before (the GPU is saturated); the search stops
at the first count where no batch fits. An out-of-memory error all the same ends that count and rebuilds the
model; with several ranks it can leave the others waiting in a collective, which the prediction is there to
avoid. Each trial: ``--warmup`` steps, then ``--steps`` timed (median, the slowest rank's), with forward,
backward, step and zero_grad, as bench_fsdp.run_case times them.
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` keeps the allocator's fragmentation, and so the reserved
peaks, low.

Writes the trials and the best configuration of every optimizer as JSON (``--out``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

if __package__:  # python -m launch.bench.bench_fit
    from . import bench_fsdp, bench_scaling
    from ..benchlib import exit_now, free_memory, in_process_group, rank_and_device, run_meta, timed_steps, write_json
    from ..llama import LlamaConfig
else:  # run as a file (python or torchrun launch/bench/bench_fit.py): its own folder is on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: benchlib, llama
    import bench_fsdp
    import bench_scaling
    from benchlib import exit_now, free_memory, in_process_group, rank_and_device, run_meta, timed_steps, write_json
    from llama import LlamaConfig

CASES = bench_fsdp.CASES
LABELS = bench_scaling.LABELS


class OutOfMemory(Exception):
    """A trial that did not fit (raised by ``measure`` for torch's out-of-memory errors)."""


def search(measure: Callable[[int, int], dict], counts: list[int], batches: list[int], memory_gib: float | None,
           fixed_gib: float = 0.0, min_gain: float = 0.02,
           intercept: Callable[[int], float | None] | None = None) -> list[dict]:
    """The trials of the search described in the module doc. ``measure(batch, checkpointed)`` runs one trial and
    returns ``{"tokens_per_s", "peak_gib"}`` (peak None where it cannot be measured: then every batch is tried)
    or raises ``OutOfMemory``. ``fixed_gib``: the memory a step holds whatever the batch. ``intercept(k)``: the
    peak of a step with ``k`` recomputed layers on a batch too short to hold activations (None where not
    measured), asked for only where the line through ``fixed_gib`` would skip a count's second batch: that
    line counts the batch-independent working memory of a step (gathered layers, logits of the loss,
    workspaces) as growing with the batch. Returns every trial in order: the measured ones with their
    results (``"over_budget"`` where the peak measured exceeds the budget that the GPU's memory does not
    enforce: such a trial does not count), the others with ``"skipped"`` (predicted over the budget) or
    ``"error"``; an intercept asked for is recorded as ``{"checkpointed": k, "intercept_gib": ...}``."""
    trials: list[dict] = []
    slope = None  # GiB per sequence at the previous count: a lower bound for this count's first batch
    for k in counts:
        fitted = []  # (batch, peak) measured at this count
        best_here = None
        for b in batches:
            if memory_gib is not None:
                if len(fitted) >= 2:  # the line through this count's last two peaks
                    (b1, p1), (b2, p2) = fitted[-2:]
                    predicted = p2 + (p2 - p1) / (b2 - b1) * (b - b2)
                else:  # through the fixed memory: a steeper line (memory that does not grow counts as growing)
                    per = (fitted[-1][1] - fixed_gib) / fitted[-1][0] if fitted else slope
                    predicted = None if per is None else fixed_gib + per * b
                    if fitted and predicted > memory_gib and intercept is not None:
                        base = intercept(k)  # the line through a step without activations instead
                        if base is not None:
                            trials.append({"checkpointed": k, "intercept_gib": base})
                            (b1, p1), = fitted
                            predicted = base + (p1 - base) / b1 * b
                if predicted is not None and predicted > memory_gib:
                    trials.append({"batch": b, "checkpointed": k, "skipped": f"predicted {predicted:.1f} GiB"})
                    break
            try:
                r = measure(b, k)
            except OutOfMemory as e:
                trials.append({"batch": b, "checkpointed": k, "error": str(e)[:200]})
                break
            except Exception as e:  # anything else ends the search; the trials so far stand
                trials.append({"batch": b, "checkpointed": k, "error": f"{type(e).__name__}: {e}"[:400]})
                return trials
            trials.append({"batch": b, "checkpointed": k, **r})
            if r.get("peak_gib") is not None:
                if memory_gib is not None and r["peak_gib"] > memory_gib:  # ran, on a GPU larger than the budget
                    trials[-1]["over_budget"] = True
                    break
                fitted.append((b, r["peak_gib"]))
            if best_here is not None and r["tokens_per_s"] < best_here * (1 + min_gain):
                break  # saturated: a larger batch gains too little
            best_here = max(best_here or 0.0, r["tokens_per_s"])
        if best_here is None:
            break  # not even the smallest batch fits: fewer recomputed layers need more memory still
        if fitted:  # (a steep line: safe for the next count's first batch)
            slope = (fitted[-1][1] - fixed_gib) / fitted[-1][0]
    return trials


def best(trials: list[dict]) -> dict | None:
    done = [t for t in trials if "tokens_per_s" in t and not t.get("over_budget")]
    return max(done, key=lambda t: t["tokens_per_s"]) if done else None


def checkpointed_counts(fractions: list[float], n_layers: int) -> list[int]:
    """Layer counts from fractions of the layers, most first, without repeats."""
    return sorted({round(f * n_layers) for f in fractions}, reverse=True)


class Toggle(torch.nn.Module):
    """A decoder layer that recomputes its activations in backward while ``checkpointed`` is set (torch's
    non-reentrant checkpoint, as bench_fsdp's ``checkpoint_wrapper``): the count of checkpointed layers changes
    between trials without building the model again."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer
        self.checkpointed = True

    def forward(self, *args, **kwargs):
        if self.checkpointed and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.layer, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
        return self.layer(*args, **kwargs)


class Case:
    """One optimizer's model, built on demand (again after an out-of-memory trial), and its trials."""

    def __init__(self, case: str, cfg: LlamaConfig, args, device: torch.device, rank: int):
        self.case, self.cfg, self.args, self.device, self.rank = case, cfg, args, device, rank
        self.model = self.opt = self.release = None
        self.fixed_gib = self.after_backward_gib = 0.0

    def build(self) -> None:
        self.drop()
        self.model, self.opt, self.release = bench_fsdp.build(self.case, self.cfg, self.device, self.args.cpu,
                                                              wrap_layer=Toggle)
        # the memory a step holds whatever the batch: parameters, gradients and optimizer state, allocated after
        # the backward pass of a batch of one (its activations freed), at the second step (the state exists)
        x = self._batch(1)
        timed_steps(lambda: self._step(x), 1, 1, self.device)
        self.fixed_gib = self._max_over_ranks(self.after_backward_gib)

    def drop(self) -> None:
        if self.release is not None:
            self.release.remove()
        self.model = self.opt = self.release = None
        free_memory(self.device)

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def _batch(self, b: int, seq: int | None = None) -> torch.Tensor:
        g = torch.Generator(device="cpu").manual_seed(self.rank)
        return torch.randint(0, self.cfg.vocab, (b, (seq or self.args.seq) + 1), generator=g).to(self.device)

    def intercept(self, checkpointed: int) -> float | None:
        """The reserved peak (largest over the ranks) of a step on one sequence of 8 tokens with ``checkpointed``
        layers recomputed: the memory of a step without activations (None on the CPU, or where even that ran out
        of memory: the model is then built again, as after a failed trial)."""
        if not self._cuda or self.model is None:
            return None
        for i, layer in enumerate(self.model.layers):
            layer.checkpointed = i < checkpointed
        x = self._batch(1, seq=8)
        free_memory(self.device)
        try:
            timed_steps(lambda: self._step(x), 0, 1, self.device)
        except torch.OutOfMemoryError:
            failed = True
        else:
            failed = False
        if failed:  # (outside the handler, whose traceback holds the step's tensors)
            self.drop()
            return None
        return self._max_over_ranks(torch.cuda.max_memory_reserved() / 2**30)

    def _step(self, x: torch.Tensor) -> torch.Tensor:
        """One training step on the batch ``x``, as bench_fsdp.run_case times it; notes the memory held after the
        backward pass."""
        loss = self.model(x[:, :-1], x[:, 1:])
        loss.backward()
        if self._cuda:
            self.after_backward_gib = torch.cuda.memory_allocated() / 2**30
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def _max_over_ranks(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def measure(self, batch: int, checkpointed: int) -> dict:
        failed = None
        try:
            if self.model is None:
                self.build()
            for i, layer in enumerate(self.model.layers):
                layer.checkpointed = i < checkpointed
            x = self._batch(batch)
            free_memory(self.device)  # the reserved peak below is this trial's (timed_steps resets it)
            timed = timed_steps(lambda: self._step(x), self.args.warmup, self.args.steps, self.device)
        except RuntimeError as e:  # torch.OutOfMemoryError, or an allocation failure of cuBLAS or NCCL
            if not isinstance(e, torch.OutOfMemoryError) and "ALLOC" not in str(e) and "out of memory" not in str(e):
                raise
            failed = f"{type(e).__name__}: {e}"
        if failed is not None:  # outside the handler, whose traceback holds the trial's tensors
            self.drop()  # FSDP2's state after a failed backward is not trusted: the next trial builds again
            raise OutOfMemory(failed)
        # reserved, not allocated: what the allocator holds (fragmentation included) is what must fit the GPU
        peak = self._max_over_ranks(torch.cuda.max_memory_reserved() / 2**30) if self._cuda else None
        step_s = self._max_over_ranks(timed["step_ms_median"] / 1e3)  # every rank takes the same decisions
        world = dist.get_world_size()
        row = {"tokens_per_s": batch * self.args.seq * world / step_s, "step_ms": 1e3 * step_s, "peak_gib": peak}
        if self.rank == 0:
            print(json.dumps({"case": self.case, "batch": batch, "checkpointed": checkpointed, **row}), flush=True)
        return row


def run(args) -> dict:
    rank, world, device = rank_and_device()
    cfg = LlamaConfig.named(args.model)
    memory = args.memory_gib
    if memory is None and device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory / 2**30 - 2.0  # allocator and NCCL headroom
    counts = checkpointed_counts(args.checkpointed, cfg.layers)
    batches = [b for b in args.batches if b <= args.max_batch]
    result: dict = {"meta": run_meta(args, world, device, config=vars(cfg), memory_gib=memory, counts=counts,
                                     batches=batches), "cases": {}}
    for case in args.cases:
        c = Case(case, cfg, args, device, rank)
        t0 = time.perf_counter()
        try:
            c.build()
            trials = search(c.measure, counts, batches, memory, c.fixed_gib, args.min_gain, c.intercept)
            entry = {"fixed_gib": c.fixed_gib, "trials": trials, "best": best(trials)}
        except Exception as e:  # a case this machine cannot run at all is a finding, not a crash (run_or_record)
            entry = {"error": f"{type(e).__name__}: {e}"[:400], "trials": [], "best": None}
        finally:
            c.drop()
        entry["search_s"] = time.perf_counter() - t0
        result["cases"][case] = entry
        if rank == 0:
            write_json(args.out, result)
    if rank == 0:
        print_table(result, args, cfg)
    return result


def print_table(result: dict, args, cfg: LlamaConfig) -> None:
    meta = result["meta"]
    base = (result["cases"].get("adamw_fp32_master") or {}).get("best")
    budget = f"{meta['memory_gib']:.1f} GiB" if meta["memory_gib"] is not None else "not measured (CPU)"
    print(f"\n{args.model} Llama shapes, FSDP2 on {meta['world']} rank(s), {meta['device']}, sequences of {args.seq}; "
          f"memory budget per rank {budget}; the fastest configuration found for each optimizer")
    print("| optimizer | sequences per rank | layers recomputed | peak GiB/rank | step ms | tokens/s | vs AdamW's best "
          "| trials |")
    print("|---|---|---|---|---|---|---|---|")
    for case, entry in result["cases"].items():
        b = entry["best"]
        if b is None:
            print(f"| {LABELS.get(case, case)} | - | - | - | - | {entry.get('error', 'nothing fits')[:80]} | - | "
                  f"{sum('batch' in t for t in entry['trials'])} |")
            continue
        peak = f"{b['peak_gib']:.1f}" if b.get("peak_gib") is not None else "-"
        rel = f"{b['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        print(f"| {LABELS.get(case, case)} | {b['batch']} | {b['checkpointed']} of {cfg.layers} | {peak} | "
              f"{b['step_ms']:.0f} | {b['tokens_per_s']:,.0f} | {rel} | {sum('batch' in t for t in entry['trials'])} |")



def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b", choices=["8b", "1b", "tiny"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=bench_fsdp.ALL_CASES)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32],
                    help="sequences per rank to try, in increasing order")
    ap.add_argument("--max-batch", type=int, default=64, help="leave out larger batches of --batches")
    ap.add_argument("--checkpointed", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.0],
                    help="fractions of the decoder layers that recompute their activations")
    ap.add_argument("--memory-gib", type=float, default=None,
                    help="peak memory budget per rank (default: the GPU's memory less 2 GiB; none on the CPU)")
    ap.add_argument("--min-gain", type=float, default=0.02,
                    help="stop growing the batch when tokens/s gains less than this fraction")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (smoke runs)")
    ap.add_argument("--out", default=None, help="JSON file for the trials and the best configurations")
    args = ap.parse_args(argv)
    if args.batches != sorted(set(args.batches)) or args.batches[0] < 1:
        ap.error(f"--batches must be positive and increasing, got {args.batches}")
    if not all(0.0 <= f <= 1.0 for f in args.checkpointed):
        ap.error(f"--checkpointed takes fractions of the layers in [0, 1], got {args.checkpointed}")
    if args.memory_gib is not None and args.memory_gib <= 0:
        ap.error(f"--memory-gib must be positive, got {args.memory_gib}")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    return args


def main(argv=None) -> None:
    in_process_group(run, parse_args(argv))


if __name__ == "__main__":
    main()
    exit_now()  # gloo's worker threads and the interpreter's shutdown: benchlib.exit_now
