"""``graphed=True`` in the loops clients run, on one GPU: captures, replays and time against the same run
without the option, with the clients' default ``zero_grad(set_to_none=True)`` (new gradient tensors at every
step).

- ``trainer``: the Hugging Face Trainer, tiny Llama (tests/integrations/_tiny_llama.py), ``optim="flash_adamw"``
  with and without ``optim_args="graphed=True"``, with and without ``max_grad_norm``; the losses of both runs
  are compared (they must be equal).
- ``accelerate``: Accelerate's plain loop (``accelerator.prepare``, ``accelerator.backward``,
  ``clip_grad_norm_``, ``optimizer.step()``, ``optimizer.zero_grad()``), the same model.
- ``step``: the optimizer step alone, gradients replaced by new tensors before each step, on many small
  tensors (2,000 x 256x256) and on the tiny Llama's: median step time, eager against graphed.

Each configuration first runs untimed (kernel compilation), then ``--repeats`` timed runs alternate with and
without the option; the fastest of each is kept. Prints a table and writes JSON.

    python launch/bench/graphed_clients.py --steps 300 --out runs/graphed_clients.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import flashdist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integrations"))


def _counts(opt) -> dict:
    opt = getattr(opt, "optimizer", opt)  # Accelerate's AcceleratedOptimizer wraps it
    graph = getattr(opt, "_graph", None)
    if graph is None:
        return {"captures": 0, "replays": 0, "eager_steps": None}
    return {"captures": graph.captures, "replays": graph.replays, "eager_steps": graph.eager_steps}


def _data(n: int, length: int = 32):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = (torch.randint(0, 128, (1,), generator=g) + torch.arange(length)) % 128
        rows.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    return rows


def trainer_run(steps: int, graphed: bool, clip: float) -> dict:
    import transformers
    from _tiny_llama import tiny_llama

    from flashdist.integrations import transformers as fd_hf

    optim_args = "graphed=True" if graphed else None
    with tempfile.TemporaryDirectory() as out:
        kwargs = dict(output_dir=out, learning_rate=1e-3, max_steps=steps, per_device_train_batch_size=8,
                      logging_steps=max(1, steps // 10), report_to=[], seed=0, dataloader_num_workers=0,
                      disable_tqdm=True, save_strategy="no", max_grad_norm=clip, weight_decay=0.1)
        try:
            fd_hf.register()
            args = transformers.TrainingArguments(optim="flash_adamw", optim_args=optim_args, **kwargs)
            extra = {}
            route = "optim=flash_adamw"
        except ImportError:  # an untested Transformers: the public route
            args = transformers.TrainingArguments(**kwargs)
            extra = {"optimizer_cls_and_kwargs": fd_hf.optimizer_cls_and_kwargs("flash_adamw", args, optim_args)}
            route = "optimizer_cls_and_kwargs"
        trainer = transformers.Trainer(model=tiny_llama().cuda(), args=args, train_dataset=_data(steps * 8),
                                       **extra)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        return {"seconds": seconds, "losses": losses, "route": route, **_counts(trainer.optimizer)}


def accelerate_run(steps: int, graphed: bool, clip: float) -> dict:
    import accelerate
    from _tiny_llama import tiny_llama

    accelerator = accelerate.Accelerator()
    # on the GPU before the optimizer is built: flashdist makes state at construction, which does not follow a
    # model that prepare() moves afterwards
    model = tiny_llama().to(accelerator.device)
    opt = flashdist.FlashAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, graphed=graphed)
    model, opt = accelerator.prepare(model, opt)
    data = _data(steps * 8)
    losses = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(steps):
        batch = {key: torch.stack([r[key] for r in data[8 * k:8 * k + 8]]).to(accelerator.device)
                 for key in data[0]}
        loss = model(**batch).loss
        accelerator.backward(loss)
        if clip:
            accelerator.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()  # set_to_none=True
        if k % max(1, steps // 10) == 0:
            losses.append(loss.detach())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "losses": [float(x) for x in losses], **_counts(opt)}


def step_run(shapes: list, steps: int, graphed: bool) -> dict:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16)) for s in shapes]
    grads = [torch.randn_like(p) * 1e-2 for p in params]
    opt = flashdist.FlashAdamW(params, lr=1e-3, weight_decay=0.1, graphed=graphed)
    times = []
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()  # a new tensor, as after zero_grad(set_to_none=True) and a backward pass
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        opt.zero_grad()
    times = sorted(times[3:])
    return {"step_ms": 1e3 * times[len(times) // 2], **_counts(opt)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per timed run")
    parser.add_argument("--warmup", type=int, default=10, help="steps of the untimed run before each timed one")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each configuration (the fastest kept)")
    parser.add_argument("--parts", default="trainer,accelerate,step")
    parser.add_argument("--out", default="runs/graphed_clients.json")
    args = parser.parse_args()
    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)
    parts = args.parts.split(",")
    rows = []
    for clip in (0.0, 1.0):
        for client, run in (("trainer", trainer_run), ("accelerate", accelerate_run)):
            if client not in parts:
                continue
            best = {}
            for graphed in (False, True):
                run(args.warmup, graphed, clip)
            for _ in range(args.repeats):  # alternated; the fastest of each kept
                for graphed in (False, True):
                    result = run(args.steps, graphed, clip)
                    print(f"{client} clip={clip} graphed={graphed}: {result['seconds']:.2f} s, "
                          f"{result['captures']} captures, {result['replays']} replays", flush=True)
                    if graphed not in best or result["seconds"] < best[graphed]["seconds"]:
                        best[graphed] = result
            for graphed, result in best.items():
                rows.append({"client": client, "clip": clip, "graphed": graphed, "steps": args.steps,
                             "repeats": args.repeats, **result})
    if "step" in parts:
        from _tiny_llama import tiny_llama

        llama_shapes = [tuple(p.shape) for p in tiny_llama().parameters()]
        for name, shapes in (("2000 x 256x256", [(256, 256)] * 2000), ("tiny Llama", llama_shapes)):
            for graphed in (False, True):
                result = step_run(shapes, 50, graphed)
                rows.append({"client": f"step: {name}", "graphed": graphed, "steps": 50, **result})
    for row in rows:  # the graphed run against the one without the option
        if row["graphed"] and "seconds" in row:
            base = next(r for r in rows if not r["graphed"] and r["client"] == row["client"] and r["clip"] == row["clip"])
            row["speedup"] = base["seconds"] / row["seconds"]
            row["same_losses"] = base["losses"] == row["losses"]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "transformers": transformers.__version__,
            "accelerate": __import__("accelerate").__version__, "flashdist": flashdist.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta))
    print(f"{'run':<28} {'graphed':>7} {'steps':>5} {'time':>10} {'captures':>8} {'replays':>7} {'eager':>5} "
          f"{'speedup':>7} {'same loss':>9}")
    for r in rows:
        run = r["client"] + (f" clip={r['clip']}" if "clip" in r else "")
        t = f"{r['seconds']:.2f} s" if "seconds" in r else f"{r['step_ms']:.3f} ms"
        print(f"{run:<28} {str(r['graphed']):>7} {r['steps']:>5} {t:>10} {r['captures']:>8} {r['replays']:>7} "
              f"{str(r['eager_steps']):>5} {r.get('speedup', float('nan')):>7.2f} {str(r.get('same_losses', '')):>9}")


if __name__ == "__main__":
    main()
