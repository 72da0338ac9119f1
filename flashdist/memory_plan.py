"""Will a model fit? Per-GPU memory of training with flashdist's FlashAdamW and with torch's AdamW (fp32 master
weights), or FlashMuon and torch.optim.Muon (``optimizer="muon"``: the decoder layers' matrices take Muon, the
embedding, head and norms AdamW, as ``muon_param_groups`` splits them), part by part, for a decoder (a preset,
a Hugging Face ``config.json``) or a parameter count, a number of GPUs and their memory, and a sharding mode;
the largest batch that fits. ``flashdist plan`` prints it; docs/scaling.md's tables come from it;
tests/test_memory_plan.py checks it against the measured 8B peaks (docs/results/fit-8b-1xh200-2026-12-02.json
and fit-8b-flashmuon-1xh200-2026-12-04.json: within 10% of every peak, within 1% of the fixed part).

Per GPU, for P parameters (bytes per parameter from :func:`flashdist.bytes_per_param`: weights = master + rho,
gradient, optimizer state = the moments), S = the GPUs a part is sharded over:

- ``fsdp2`` and ``zero3``: every part / S (S = all GPUs); ``hsdp``: / S = ``gpus_per_node``; ``tp``: / S =
  all GPUs (tensor parallel over them; activations / S too, with sequence parallelism);
- ``zero1``: the optimizer state and the master weights / S; the bf16 model weights (2 B) and the gradients whole;
  ``zero2``: the gradients / S as well. (AdamW's fp32 master is sharded beside a whole bf16 model copy.)
- ``offload``: the optimizer state and the master weights (beyond the bf16 weight) live in host memory
  (``host_gib``); ``gradient_release``: no gradient is held between steps (the step runs in backward).
- buffers (FSDP2's unsharded parameters, with ``fully_shard`` per decoder layer and at the root): the root's
  bf16 parameters (embedding, head, norm) for the whole step, plus the larger of two bf16 decoder layers with
  one layer's bf16 gradient and fp32 reduce copy, and the root's bf16 gradient with its fp32 copy.
- activations, per sequence of ``seq`` tokens (bf16 saved tensors, SDPA attention):
  ``seq x [L_kept x 2(6h + 2kv + 4m) + L_recomputed x 2h + (2(6h + 2kv + 4m) if any layer is recomputed)
  + 12 V]`` bytes: h hidden, kv the key/value width, m the MLP width, V the vocabulary; a kept layer saves its
  inputs, norms, q, k, v, attention output and SwiGLU's four m-wide tensors; a recomputed one its input (and
  one layer's worth while it recomputes); the logits take 12 B per vocabulary entry (bf16 logits and gradient,
  fp32 log-softmax and gradient). With ``--params`` alone there is no shape: activations and buffers are 0 and
  no batch is proposed.

Not counted: the CUDA context and NCCL buffers (1-3 GiB), the allocator's fragmentation.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .memory import bytes_per_param

GIB = 2**30
PARAM_BYTES, GRAD_REDUCE_BYTES = 2, 4  # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
LOGIT_BYTES = 12  # per token and vocabulary entry: bf16 logits + bf16 grad + fp32 log-softmax + fp32 grad
MODES = ("fsdp2", "hsdp", "tp", "zero1", "zero2", "zero3")
OPTIMIZERS = {"flashdist": "flash_adamw", "adamw": "adamw"}  # row -> flashdist.bytes_per_param kind
# --optimizer muon: (matrices' kind, the rest's kind) per row; the rest (embedding, head, norms) takes AdamW
MUON_OPTIMIZERS = {"flashdist": ("flash_muon", "flash_adamw"), "muon": ("muon", "adamw")}
FAMILIES = ("adamw", "muon")


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder: grouped-query attention, SwiGLU MLP, RMSNorm; ``tied``: the head is the embedding."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int = 128256
    tied: bool = False

    def layer_params(self) -> int:
        kv = self.kv_heads * (self.hidden // self.heads)
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.mlp + 2 * self.hidden

    def layer_matrix_params(self) -> int:
        """A decoder layer's matrices (what Muon takes): its parameters less its two norms."""
        return self.layer_params() - 2 * self.hidden

    def root_params(self) -> int:
        return (1 if self.tied else 2) * self.vocab * self.hidden + self.hidden  # embedding, head, final norm

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()

    def layer_activation_bytes(self) -> int:
        """Bytes one decoder layer saves for backward, per token (see the module docstring)."""
        kv = self.kv_heads * (self.hidden // self.heads)
        return 2 * (6 * self.hidden + 2 * kv + 4 * self.mlp)

    def activation_bytes(self, seq: int, recomputed: int = 0) -> int:
        """Bytes of activations per sequence of ``seq`` tokens with ``recomputed`` layers checkpointed."""
        recomputed = min(max(recomputed, 0), self.layers)
        per_token = ((self.layers - recomputed) * self.layer_activation_bytes() + recomputed * 2 * self.hidden
                     + (self.layer_activation_bytes() if recomputed else 0) + LOGIT_BYTES * self.vocab)
        return seq * per_token

    def buffer_bytes(self) -> int:
        grad_bytes = PARAM_BYTES + GRAD_REDUCE_BYTES
        return self.root_params() * PARAM_BYTES + max(self.layer_params() * (2 * PARAM_BYTES + grad_bytes),
                                                      self.root_params() * grad_bytes)


PRESETS = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, mlp=8192, tied=True),
    "llama-3.1-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336),
    "llama-3.1-70b": Shape(hidden=8192, layers=80, heads=64, kv_heads=8, mlp=28672),
    "llama-3.1-405b": Shape(hidden=16384, layers=126, heads=128, kv_heads=8, mlp=53248),
}


def shape_from_hf_config(path: str | Path) -> Shape:
    """The shape of a Hugging Face decoder from its ``config.json`` (a file, or the folder holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"flashdist: cannot read the model config {path}: {e}") from e
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the decoder
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"flashdist: {path} lacks {missing}: give a decoder's config.json, or --params N")
    return Shape(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
                 kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"], mlp=cfg["intermediate_size"],
                 vocab=cfg["vocab_size"], tied=bool(cfg.get("tie_word_embeddings", False)))


def resolve_model(model: str) -> Shape:
    """A preset name (``llama-3.1-8b``, ``8b``) or the path of a Hugging Face config.json."""
    key = model.lower()
    for name, shape in PRESETS.items():
        if key in (name, name.split("-")[-1], name.replace("llama-", "")):
            return shape
    if Path(model).exists():
        return shape_from_hf_config(model)
    raise ValueError(f"flashdist: unknown model {model!r}: give one of {sorted(PRESETS)}, a config.json, "
                     "or --params N")


def _per_param(kinds: list[tuple[str, float]], gradient_release: bool) -> dict[str, float]:
    """Bytes per parameter of each part over ``kinds`` ((kind, share of the parameters) pairs)."""
    out = {"master": 0.0, "grad": 0.0, "state": 0.0, "total": 0.0}
    for kind, share in kinds:
        b = bytes_per_param(kind, gradient_release=gradient_release)
        out["master"] += share * (b["master"] + b["ecc"])
        out["grad"] += share * b["grad"]
        out["state"] += share * (b["m"] + b.get("v", 0.0))
        out["total"] += share * b["total"]
    return out


def _parts(kinds: list[tuple[str, float]], params: float, mode: str, gpus: int, gpus_per_node: int, offload: bool,
           gradient_release: bool) -> dict:
    b = _per_param(kinds, gradient_release)
    shards = gpus_per_node if mode == "hsdp" and gpus > gpus_per_node else gpus
    master, state = b["master"], b["state"]
    if mode in ("zero1", "zero2"):  # bf16 model weights whole; the rest of the master sharded beside them
        weights = PARAM_BYTES * params + (master - PARAM_BYTES) * params / shards
        grads = b["grad"] * params / (shards if mode == "zero2" else 1)
    else:
        weights, grads = master * params / shards, b["grad"] * params / shards
    state = state * params / shards
    host = 0.0
    if offload:  # the optimizer state and the master beyond the bf16 weight go to host memory
        gpu_weights = PARAM_BYTES * params / (1 if mode in ("zero1", "zero2") else shards)
        host = state + weights - gpu_weights
        weights, state = gpu_weights, 0.0
    return {"bytes_per_param": b["total"], "weights": weights, "grads": grads, "optimizer_state": state,
            "host": host, "shards": shards}


def plan(*, model: str | Shape | None = None, params: float | None = None, gpus: int = 1,
         gpu_memory_gib: float = 80.0, mode: str = "fsdp2", gpus_per_node: int = 8, offload: bool = False,
         gradient_release: bool = False, seq: int = 2048, batch: int = 1, recomputed: int = 0,
         optimizer: str = "adamw") -> dict:
    """Per-GPU GiB of each part with flashdist and with torch, whether ``batch`` sequences per GPU fit in
    ``gpu_memory_gib``, and the largest batch that does (None without a shape). See the module docstring.
    ``optimizer``: "adamw" (FlashAdamW against torch's AdamW) or "muon" (FlashMuon against torch.optim.Muon
    with fp32 master weights, each with AdamW for the embedding, head and norms: ``muon_param_groups``'s
    split; with ``params`` alone every parameter counts as a matrix)."""
    if mode not in MODES:
        raise ValueError(f"flashdist: mode {mode!r}: expected one of {', '.join(MODES)}")
    if optimizer not in FAMILIES:
        raise ValueError(f"flashdist: optimizer {optimizer!r}: expected one of {', '.join(FAMILIES)}")
    if gpus < 1 or gpus_per_node < 1 or seq < 1 or batch < 1:
        raise ValueError("flashdist: gpus, gpus_per_node, seq and batch must be positive")
    shape = resolve_model(model) if isinstance(model, str) else model
    if shape is None and params is None:
        raise ValueError("flashdist: give a model (a preset or a config.json) or a parameter count")
    n = float(params if params is not None else shape.params())
    if gradient_release and mode in ("zero1", "zero2", "zero3"):
        raise ValueError(f"flashdist: gradient release runs under FSDP2 (mode fsdp2, hsdp or tp), not {mode}")
    if optimizer == "muon" and mode in ("zero1", "zero2", "zero3"):
        raise ValueError(f"flashdist: FlashMuon does not run under DeepSpeed ZeRO ({mode}: its flat partitions hold "
                         "no whole matrices for Newton-Schulz); plan it with mode fsdp2, hsdp or tp")
    tp = gpus if mode == "tp" else 1
    activations_per_seq = shape.activation_bytes(seq, recomputed) / tp if shape else 0.0
    buffers = shape.buffer_bytes() / tp if shape else 0.0
    result = {"model": asdict(shape) if shape else None, "params": n, "gpus": gpus, "mode": mode,
              "gpu_memory_gib": gpu_memory_gib, "offload": offload, "gradient_release": gradient_release,
              "seq": seq, "batch": batch, "recomputed_layers": recomputed, "optimizer": optimizer,
              "optimizers": {}}
    matrices = shape.layers * shape.layer_matrix_params() / n if shape else 1.0  # (Muon's share)
    rows = ({name: [(kind, 1.0)] for name, kind in OPTIMIZERS.items()} if optimizer == "adamw" else
            {name: [(muon, matrices), (rest, 1.0 - matrices)] for name, (muon, rest) in MUON_OPTIMIZERS.items()})
    for name, kinds in rows.items():
        release = gradient_release and name == "flashdist"  # torch's optimizers have no gradient release
        p = _parts(kinds, n, mode, gpus, gpus_per_node, offload, release)
        fixed = p["weights"] + p["grads"] + p["optimizer_state"] + buffers
        total = fixed + batch * activations_per_seq
        room = gpu_memory_gib * GIB - fixed
        largest = (max(int(room // activations_per_seq), 0) if activations_per_seq else None)
        result["optimizers"][name] = {
            "bytes_per_param": p["bytes_per_param"], "sharded_over": p["shards"],
            "weights_gib": p["weights"] / GIB, "grads_gib": p["grads"] / GIB,
            "optimizer_state_gib": p["optimizer_state"] / GIB, "buffers_gib": buffers / GIB,
            "activations_gib": batch * activations_per_seq / GIB, "total_gib": total / GIB,
            "host_gib": p["host"] / GIB, "fits": total <= gpu_memory_gib * GIB, "largest_batch": largest}
    return result


def format_plan(result: dict) -> str:
    """The plan as a table: one column per optimizer."""
    opts = result["optimizers"]
    shape = result["model"]
    head = (f"{result['params'] / 1e9:.2f} B parameters, {result['gpus']} GPU(s) of {result['gpu_memory_gib']:g} GiB, "
            f"{result['mode']}" + (", Muon" if result.get("optimizer") == "muon" else "")
            + (", offload" if result["offload"] else "")
            + (", gradient release (flashdist)" if result["gradient_release"] else ""))
    if shape:
        head += (f"; {result['batch']} sequence(s) of {result['seq']} tokens per GPU, "
                 f"{result['recomputed_layers']} of {shape['layers']} layers recomputed")
    rows = [("weights", "weights_gib"), ("gradients", "grads_gib"), ("optimizer state", "optimizer_state_gib"),
            ("buffers (FSDP2)", "buffers_gib"), ("activations", "activations_gib"), ("total", "total_gib")]
    lines = [head, "", f"{'GiB per GPU':<24}" + "".join(f"{name:>14}" for name in opts)]
    for label, key in rows:
        lines.append(f"{label:<24}" + "".join(f"{o[key]:>14.2f}" for o in opts.values()))
    if result["offload"]:
        lines.append(f"{'host memory (offload)':<24}" + "".join(f"{o['host_gib']:>14.2f}" for o in opts.values()))
    lines.append(f"{'bytes per parameter':<24}" + "".join(f"{o['bytes_per_param']:>14.3f}" for o in opts.values()))
    lines.append(f"{'fits':<24}" + "".join(f"{'yes' if o['fits'] else 'no':>14}" for o in opts.values()))
    lines.append(f"{'largest batch per GPU':<24}" + "".join(
        f"{'-' if o['largest_batch'] is None else o['largest_batch']:>14}" for o in opts.values()))
    return "\n".join(lines)


__all__ = ["FAMILIES", "MODES", "PRESETS", "Shape", "format_plan", "plan", "resolve_model", "shape_from_hf_config"]
