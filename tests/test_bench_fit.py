"""launch/bench/bench_fit.py: the search for each optimizer's fastest configuration that fits, on a model of memory
and speed where the answer is known, and the benchmark itself on the CPU."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.bench import bench_fit

ROOT = Path(__file__).resolve().parents[1]
LAYERS, BATCHES, BUDGET, FIXED = 8, [1, 2, 3, 4, 6, 8, 12, 16], 60.0, 20.0


def model(batch: int, checkpointed: int) -> tuple[float, float]:
    """Peak GiB and tokens/s of a GPU as the search sees it: activations grow with the batch and with the layers
    that keep theirs; recomputing costs a third of a layer's time; throughput stops growing at batch 6."""
    peak = FIXED + batch * (0.5 + 1.5 * (LAYERS - checkpointed))
    tokens = min(batch, 6) * 1000 / (1 + checkpointed / (3 * LAYERS))
    return peak, tokens


class Gpu:
    def __init__(self, memory: float = BUDGET):
        self.memory, self.runs, self.too_big = memory, [], []

    def measure(self, batch: int, checkpointed: int) -> dict:
        peak, tokens = model(batch, checkpointed)
        self.runs.append((batch, checkpointed))
        if peak > self.memory:
            self.too_big.append((batch, checkpointed))
            raise bench_fit.OutOfMemory(f"{peak:.0f} GiB")
        return {"tokens_per_s": tokens, "peak_gib": peak}


@pytest.mark.parametrize("budget, memory", [(BUDGET, BUDGET), (30.0, 30.0), (30.0, 140.0)],
                         ids=["all-counts-fit", "no-recompute-does-not-fit", "budget-below-the-gpu"])
def test_search_finds_the_fastest_configuration_that_fits(budget, memory):
    gpu = Gpu(memory)
    counts = bench_fit.checkpointed_counts([1.0, 0.5, 0.25, 0.0], LAYERS)
    assert counts == [8, 4, 2, 0]
    trials = bench_fit.search(gpu.measure, counts, BATCHES, budget, FIXED)
    fits = [(b, k) for b, k in itertools.product(BATCHES, counts) if model(b, k)[0] <= budget]
    want = max(fits, key=lambda c: model(*c)[1])
    got = bench_fit.best(trials)
    assert (got["batch"], got["checkpointed"]) == want == ((6, 4) if budget == BUDGET else (6, 8))
    # the memory line predicts every batch after a count's first: a trial goes over the budget only as the first
    # of a count (predicted from a count that recomputes more layers, a lower bound), and that ends the search
    over = gpu.too_big + [(t["batch"], t["checkpointed"]) for t in trials if t.get("over_budget")]
    assert over == ([] if budget == BUDGET else [(1, 0)])
    if over:
        assert ("error" if memory == budget else "over_budget") in trials[-1]
    assert any("skipped" in t for t in trials)
    assert len(gpu.runs) < len(BATCHES) * len(counts) * 0.6  # the grid has 32


def test_search_without_memory_measurements_tries_every_batch_until_saturation():
    gpu = Gpu()
    trials = bench_fit.search(lambda b, k: {**gpu.measure(b, k), "peak_gib": None}, [8], [1, 2, 4, 6, 8, 12, 16],
                              None)
    assert [t["batch"] for t in trials] == [1, 2, 4, 6, 8]  # 8 gains nothing over 6: the search stops there


def test_bad_options_are_refused(capsys):
    for argv, message in ((["--batches", "4", "2"], "--batches"), (["--checkpointed", "1.5"], "--checkpointed"),
                          (["--memory-gib", "0"], "--memory-gib")):
        with pytest.raises(SystemExit):
            bench_fit.parse_args(argv)
        assert message in capsys.readouterr().err


def test_benchmark_runs_on_the_cpu(tmp_path):
    """The tiny Llama on one gloo rank: every trial a real training step, the layers' checkpointing switched
    between trials, the best configuration of each optimizer in the JSON and the table."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "fit.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "launch" / "bench" / "bench_fit.py"), "--model", "tiny", "--cpu", "--seq", "16", "--max-batch", "2",
           "--checkpointed", "1", "0", "--cases", "adamw_fp32_master", "flash_24bit_release", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert list(cases) == ["adamw_fp32_master", "flash_24bit_release"]
    for entry in cases.values():
        assert {(t["batch"], t["checkpointed"]) for t in entry["trials"]} <= {(1, 2), (2, 2), (1, 0), (2, 0)}
        assert entry["best"]["tokens_per_s"] > 0 and "error" not in entry
    assert "FlashAdamW 24-bit + gradient release" in proc.stdout and "vs AdamW's best" in proc.stdout


def test_search_keeps_its_trials_when_a_trial_fails_otherwise():
    def measure(batch, checkpointed):
        if batch == 3:
            raise RuntimeError("NCCL watchdog timed out")
        return {"tokens_per_s": 1000.0 * batch, "peak_gib": FIXED + batch}

    trials = bench_fit.search(measure, [8, 4], BATCHES, BUDGET, FIXED)
    assert [t["batch"] for t in trials] == [1, 2, 3] and "NCCL" in trials[-1]["error"]
    assert bench_fit.best(trials)["batch"] == 2


def test_intercept_keeps_working_memory_from_counting_as_activations():
    """A step's working memory that does not grow with the batch (gathered layers, the loss's logits), above
    fixed_gib: the line through fixed_gib alone skips every count's second batch; a step without activations
    (the intercept) gives the true line, and the search finds the fastest configuration that fits, with no
    trial over the budget."""
    work = 25.0

    def measure(batch, checkpointed):
        peak = model(batch, checkpointed)[0] + work
        if peak > BUDGET:
            raise bench_fit.OutOfMemory(f"{peak:.0f} GiB")
        return {"tokens_per_s": model(batch, checkpointed)[1], "peak_gib": peak}

    asked = []

    def intercept(checkpointed):
        asked.append(checkpointed)
        return FIXED + work

    counts = [8, 4]
    steep = bench_fit.search(measure, counts, BATCHES, BUDGET, FIXED)
    assert [t["batch"] for t in steep if "tokens_per_s" in t] == [1, 1]
    trials = bench_fit.search(measure, counts, BATCHES, BUDGET, FIXED, intercept=intercept)
    fits = [(b, k) for b, k in itertools.product(BATCHES, counts) if model(b, k)[0] + work <= BUDGET]
    got = bench_fit.best(trials)
    assert (got["batch"], got["checkpointed"]) == max(fits, key=lambda c: model(*c)[1]) == (6, 8)
    assert asked == counts and not any("error" in t for t in trials)
    assert {t["checkpointed"]: t["intercept_gib"] for t in trials if "intercept_gib" in t} == {8: 45.0, 4: 45.0}
