"""The conformance matrix as one table: which client drives which engine, with which optimizer, through
which stages of a run's life; which cells are refused (and why), and which wait for a fix.

A cell is ``client/engine/optimizer/stage``. Adding an optimizer is one entry of :data:`OPTIMIZERS`; adding a
client or an engine is one entry of :data:`PATHS` plus its runner in test_matrix.py. Every stage of
:data:`STAGES` that a path cannot take is in :data:`REFUSED` with its reason (docs/integrations.md lists
them); where flashdist itself refuses the path (the CLI on a Lightning .ckpt), the cell asserts the refusal is
one line."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashdist import FlashAdam, FlashAdamW, FlashLion, FlashMuon, FlashSGD, FlashSGDW, muon_param_groups


@dataclass(frozen=True)
class Entry:
    """One optimizer of the family: its class, the options a cell trains with, how a user builds its param
    groups from a model (``groups``; None: ``model.named_parameters()``)."""

    cls: type
    kwargs: dict = field(default_factory=dict)
    groups: Callable[[torch.nn.Module], list] | None = None

    def build(self, model, **overrides):
        """The optimizer for ``model`` (a module: its param groups as a user builds them) or for parameters
        given as any torch optimizer takes them (only where the entry needs no model to build its groups)."""
        if isinstance(model, torch.nn.Module):
            params = self.groups(model) if self.groups else model.named_parameters()
        elif self.groups:
            raise TypeError(f"{self.cls.__name__}'s param groups come from the model: pass the module to build()")
        else:
            params = model
        return self.cls(params, **{**self.kwargs, **overrides})


OPTIMIZERS: dict[str, Entry] = {
    "FlashAdamW": Entry(FlashAdamW, dict(lr=1e-2, weight_decay=0.1)),
    "FlashAdam": Entry(FlashAdam, dict(lr=1e-2, weight_decay=1e-3)),
    "FlashSGD": Entry(FlashSGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "FlashSGDW": Entry(FlashSGDW, dict(lr=1e-2, momentum=0.9, weight_decay=0.1)),
    "FlashLion": Entry(FlashLion, dict(lr=1e-3, weight_decay=0.1)),
    # matrices (>= 2 dims, the 3-d one too) take Muon, biases AdamW (flashdist.muon_param_groups); the clients
    # that choose by name build the same split themselves (optim="flash_muon", torchtitan's flash_muon)
    "FlashMuon": Entry(FlashMuon, dict(lr=2e-2, weight_decay=0.1, momentum=0.9), groups=muon_param_groups),
}

STAGES = ("train", "first-step-memory", "outside-write", "noop-option", "save", "resume-same", "resume-other",
          "export-fp32", "export-hf", "inspect")
"""train: state only for trainable parameters in param_groups; first-step-memory: before the first step the
optimizer holds no more than AdamW; outside-write: a weight written outside the optimizer is its own master;
noop-option: ``graphed=True`` where no graph can be made says so once;
save: the masters read back from the checkpoint the client writes equal the live ones; resume-same /
resume-other: a run resumed at the same / another world size equals the uninterrupted one; export-fp32 /
export-hf: ``flashdist export`` (safetensors / ``--hf`` folder) of that checkpoint gives the live masters;
inspect: ``flashdist inspect`` reads it."""

PATHS: dict[str, tuple[str, ...]] = {
    "plain": ("one-process", "ddp", "fsdp2"),
    # fsdp2: optim= builds the optimizer before Accelerate shards; zero2/zero3: the DeepSpeed config names the
    # optimizer ("type": "FlashAdamW"), the Trainer fills its "auto" values (fp32 on a CPU: no rho)
    "trainer": ("one-process", "fsdp2", "zero2", "zero3"),
    "peft-trainer": ("one-process",),       # PEFT's default fp32 adapters
    "peft-trainer-bf16": ("one-process",),  # adapters cast to bf16
    # fsdp2: the optimizer built before prepare, as documented; zero2/zero3: DummyOptim + the config's type, bf16
    # master partitions + rho as in the deepspeed cells
    "accelerate": ("one-process", "fsdp2", "zero2", "zero3"),
    "lightning": ("one-process", "zero2", "zero3"),  # zero2/zero3: refused (Lightning's DeepSpeedStrategy needs CUDA)
    "torchtitan": ("fsdp2",),
    "deepspeed": ("zero2", "zero3"),        # flashdist.integrations.deepspeed.initialize, bf16 masters + rho
}
"""Client -> the engines the matrix runs it under. The Trainer and Accelerate under DeepSpeed run FlashAdamW
only (REFUSED says why), all four paths in one spawn of 2 ranks."""

REFUSED: dict[str, str] = {
    "*/one-process/*/resume-other": "one process has no other world size; resumes across world sizes are the "
                                    "multi-rank engines' cells",
    "torchtitan/*/*/export-hf": "torchtitan checkpoints hold torchtitan's model, not a Hugging Face one: export "
                                "to safetensors (export-fp32) and convert with torchtitan's own tools",
    "plain/*/*/export-hf": "a plain torch model has no Hugging Face config: export-fp32 writes the masters",
    "accelerate/*/*/export-hf": "the Accelerate cells train a plain torch model (no Hugging Face config): "
                                "export-fp32 writes the masters",
    "lightning/*/*/export-hf": "a LightningModule has no Hugging Face config: export-fp32 writes the masters",
    "peft-trainer*/*/*/export-hf": "an adapter checkpoint is not a full model; merge the adapters and export "
                                   "the merged model",
    "peft-trainer*/*/*/export-fp32": "an adapter checkpoint holds only the adapters, and its optimizer.pt is "
                                     "keyed by index in an order the folder does not keep (safetensors sorts its "
                                     "keys): no masters can be attached; PEFT's adapter_model.safetensors is the "
                                     "export, flashdist.checkpoint.save the exact masters",
    "peft-trainer*/*/*/inspect": "as export-fp32",
    "peft-trainer*/*/*/save": "as export-fp32 (resume-same checks the Trainer's own resume)",
    "lightning/*/*/export-fp32": "a Lightning .ckpt is one pickle of Lightning's own layout, which flashdist's "
                                 "readers do not take; save with flashdist.checkpoint.save for export",
    "lightning/*/*/inspect": "as export-fp32",
    "lightning/*/*/save": "as export-fp32 (no reader of a Lightning .ckpt's masters; resume-same checks the load)",
    **{f"{path}/*/noop-option": "an option's effect does not depend on the client or engine: checked in "
                                "plain/one-process and trainer/one-process"
       for path in ("plain/ddp", "plain/fsdp2", "peft-trainer*/*", "accelerate/*", "lightning/*", "torchtitan/*")},
    "trainer/fsdp2/*/noop-option": "an option's effect does not depend on the client or engine: checked in "
                                   "plain/one-process and trainer/one-process",
    "deepspeed/*/*/noop-option": "an option's effect does not depend on the client or engine: checked in "
                                 "plain/one-process and trainer/one-process",
    "deepspeed/*/*/export-hf": "the DeepSpeed cells train a plain torch model (no Hugging Face config): "
                               "export-fp32 writes the masters",
    "deepspeed/*/FlashMuon/*": "ZeRO hands the optimizer flat 1-d partitions of many parameters, so no rank holds "
                               "the whole matrices Newton-Schulz needs: the config is refused before DeepSpeed "
                               "starts (docs/deepspeed.md); train FlashMuon under FSDP2",
    **{f"deepspeed/*/{name}/resume-other": "DeepSpeed changes the world size through universal checkpoints, whose "
                                           "converter carries Adam's moments only: flashdist.integrations."
                                           "deepspeed.to_universal refuses the checkpoint; resume it at its world "
                                           "size, or move it to FSDP2 with flashdist convert --from deepspeed"
       for name in ("FlashSGD", "FlashSGDW", "FlashLion")},
    **{f"{client}/zero*/{name}/*": "the Trainer and Accelerate hand the DeepSpeed config's \"type\" to flashdist."
                                   "integrations.deepspeed the same way for every class: FlashAdamW's cells check "
                                   "the client's part, and every class runs under ZeRO-2/3 in the deepspeed/* "
                                   "cells (FlashMuon is refused there, before DeepSpeed starts)"
       for client in ("trainer", "accelerate") for name in OPTIMIZERS if name != "FlashAdamW"},
    "lightning/zero*/*/*": "Lightning's DeepSpeedStrategy runs on CUDA GPUs only (it refuses the CPU accelerator "
                           "when the Trainer starts), so the CPU matrix cannot drive it; with flashdist."
                           "integrations.deepspeed.register() it reaches the same deepspeed.initialize as "
                           "the trainer/zero* and accelerate/zero* cells",
    "trainer/zero*/*/noop-option": "an option's effect does not depend on the client or engine: checked in "
                                   "plain/one-process and trainer/one-process",
}

XFAIL: dict[str, str] = {}
"""Cell pattern -> the issue item whose fix the cell waits for (a strict xfail: it fails the suite once fixed)."""


def cell_id(client: str, engine: str, optimizer: str, stage: str) -> str:
    return f"{client}/{engine}/{optimizer}/{stage}"


def _first(table: dict[str, str], cell: str) -> str | None:
    return next((reason for pattern, reason in table.items() if fnmatch.fnmatchcase(cell, pattern)), None)


def refused(cell: str) -> str | None:
    """The reason this cell is refused, or None."""
    return _first(REFUSED, cell)


def expected_failure(cell: str) -> str | None:
    """The issue item whose fix this cell waits for, or None."""
    return _first(XFAIL, cell)


CELLS: list[tuple[str, str, str, str]] = [(c, e, o, s) for c, engines in PATHS.items() for e in engines
                                          for o in OPTIMIZERS for s in STAGES]
