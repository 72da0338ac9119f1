"""``save`` / ``load``: a thin, safe layer over torch.distributed.checkpoint (DCP) for model + optimizer.

- Atomic, and concurrent saves never mix: ``save`` writes into a temporary folder of its own and moves it into
  place under a lock; it never destroys what it did not write (:mod:`flashdist.checkpoint.publish`).
- Safe, and shards tied to their ``.metadata``: ``load`` reads the metadata with an unpickler that runs no
  code, non-tensor entries with ``weights_only=True``, and refuses a shard of another save or a damaged one,
  naming the file (:mod:`flashdist.checkpoint.dcp_files`).
- Checked before anything changes: missing or unexpected keys and shape mismatches raise an error naming
  the keys; a missing or truncated shard file raises an error naming the checkpoint. The model and the
  optimizer load from copies, so a failed load leaves them as they were (the cost: one extra copy of this
  rank's shard of the model and optimizer state during the load).
- Any world size: the model and the optimizer state are saved as DTensors with global shapes, so a
  checkpoint saved on N ranks loads on M (portable state re-quantizes, compressed state reshards exactly).
- One error: a failed save raises :class:`CheckpointWriteError` (an ``OSError`` and a
  :class:`CheckpointError`) naming the path and the cause, after removing only its own temporary folder.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..quant import rho as R
from ..quant.moment import QuantizedMoment
from ..optim.base import FlashOptimizer

from .dcp_files import SafeFileSystemReader, SafeLoadPlanner, TiedWriter, shard_writer, verify_shard
from .errors import CheckpointError, CheckpointWriteError, error_summary, write_failure
from .files import reason
from .names import TIED, is_ties, state_dict_ties
from .publish import Claim, resolve, temp_folder

# this module's public names, with those that moved to dcp_files, errors and publish (their old import path)
__all__ = ["CheckpointError", "CheckpointWriteError", "SafeFileSystemReader", "SafeLoadPlanner", "error_summary",
           "load", "optimizer_state_dict", "read_metadata", "resolve", "save", "shard_writer", "verify_shard"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _state(model, optimizer, extra, optimizer_format: str | None = None) -> dict:
    model_state = get_model_state_dict(model)
    return {"model": model_state,
            "optim": optimizer_state_dict(model, optimizer, format=optimizer_format),
            "extra": {**(extra if extra is not None else {}), TIED: state_dict_ties(model_state)}}


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                         format: str | None = None) -> dict:
    """torch.distributed.checkpoint's ``get_optimizer_state_dict(model, optimizer)`` (state keyed by
    parameter FQN, DTensors kept), with a flashdist optimizer's state in ``format`` ("portable" or
    "compressed"; None: the optimizer's ``state_dict_format``). The optimizer's setting is left as it is.
    Any other optimizer: its state dict as torch gives it (``format`` must then be None)."""
    if not isinstance(optimizer, FlashOptimizer):
        if format is not None:
            raise ValueError(f"flashdist: optimizer_state_dict's format applies to flashdist optimizers; "
                             f"{type(optimizer).__name__} has one format: pass format=None")
        return get_optimizer_state_dict(model, optimizer)
    with optimizer.state_dict_format_override(format or optimizer.state_dict_format):
        return get_optimizer_state_dict(model, optimizer)


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict | None = None) -> Path:
    """Save model, optimizer and ``extra`` (plain data: numbers, strings, lists, dicts, tensors) to the DCP
    directory ``path``, atomically. Every rank calls it. Returns the path.

    ``path`` must not exist, be an empty folder or hold a checkpoint (DCP files only); anything else raises
    :class:`CheckpointError` before a byte is written. A failure while writing raises
    :class:`CheckpointWriteError` on every rank, naming the path and the cause."""
    path = Path(path)
    if isinstance(extra, dict) and TIED in extra:
        raise ValueError(f"flashdist: checkpoint.save's extra holds the key {TIED!r}, which flashdist keeps its record "
                         "of the model's tied weights under: give that entry another name")
    claim, message = None, None
    if _rank() == 0:
        try:
            claim = Claim(path)
        except CheckpointError as e:
            message = (type(e).__name__, str(e))
    # all ranks write into the folder rank 0 created, under the id rank 0 drew
    save_id, message = _from_rank0((claim.save_id if claim else None, message))
    if message:
        _raise(message)
    tmp = temp_folder(path, save_id)
    try:
        failure = None
        try:
            state = _state(model, optimizer, extra)
        except Exception as e:  # noqa: BLE001 - every rank hears of it below, before any enters dcp.save
            failure = (f"flashdist: could not save checkpoint {path}: reading the model's and optimizer's state "
                       f"failed ({reason(e)})")
            if isinstance(e, (KeyError, TypeError, AttributeError)):  # a state dict of another shape
                failure += ("; save takes a torch.nn.Module and a torch.optim.Optimizer whose state_dict() has "
                            "torch's form ('state' and 'param_groups')")
        failures = _gather(failure)
        if not any(failures):
            try:
                dcp.save(state, storage_writer=TiedWriter(tmp, save_id))
            except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures in a BaseException
                failure = f"flashdist: could not save checkpoint {path}: {write_failure(e, tmp)}"
            failures = _gather(failure)
        message = None
        if any(failures):
            message = ("CheckpointWriteError", next(f for f in failures if f) + f"; {path} was not changed")
        elif claim is not None:
            try:
                claim.commit()
            except CheckpointError as e:
                message = (type(e).__name__, str(e))
    finally:
        if claim is not None:
            claim.release()  # removes the temporary folder unless it became the checkpoint
    message = _from_rank0(message)
    if message:
        _raise(message)
    return path


def _raise(message: tuple[str, str]):
    kind, text = message
    raise (CheckpointWriteError if kind == "CheckpointWriteError" else CheckpointError)(text)


def _from_rank0(obj):
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def read_metadata(path: str | os.PathLike) -> Metadata:
    return SafeFileSystemReader(str(resolve(path))).read_metadata()


def _template_for_extra(metadata: Metadata) -> dict:
    """A state-dict skeleton for the saved ``extra`` entries, rebuilt from the checkpoint's metadata."""
    extra: dict = {}
    mappings = metadata.planner_data or {}
    for key, meta in metadata.state_dict_metadata.items():
        route = mappings.get(key, tuple(key.split(".")))
        if not route or route[0] != "extra":
            continue
        value = None if isinstance(meta, BytesStorageMetadata) else torch.empty(meta.size, dtype=meta.properties.dtype)
        node = extra
        for part in route[1:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CheckpointError(f"flashdist: the checkpoint's entry {key[:80]!r} lies inside another entry; "
                                      "the checkpoint is damaged or crafted")
        if len(route) > 1:
            node[route[-1]] = value
    return extra


def _flat_shapes(state: dict) -> dict[str, tuple]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # noqa: PLC0415

    flat, _ = flatten_state_dict(state)
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in flat.items()}


def _other_state_dtypes(state: dict, metadata) -> list[tuple[str, torch.dtype, torch.dtype]]:
    """The optimizer state entries (not the step counts) whose saved dtype is not the live tensor's, as
    ``(key, saved dtype, live dtype)``."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # noqa: PLC0415

    flat, _ = flatten_state_dict({"optim": state["optim"]})
    out = []
    for key, live in flat.items():
        saved = metadata.state_dict_metadata.get(key)
        dtype = getattr(getattr(saved, "properties", None), "dtype", None)
        if (key.startswith("optim.state.") and not key.endswith(".step") and isinstance(live, torch.Tensor)
                and dtype is not None and dtype != live.dtype):
            out.append((key, dtype, live.dtype))
    return sorted(out, key=lambda entry: entry[0])


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _clone(state):
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load a checkpoint written by :func:`save` (at any world size) into ``model`` and ``optimizer``; returns
    the saved ``extra``. Every rank calls it. Raises :class:`CheckpointError` naming what does not match,
    or the shard file that belongs to another save or is damaged, with the model and optimizer unchanged."""
    had_state = {id(p) for p, s in optimizer.state.items() if s}
    try:
        return _load(path, model, optimizer)
    except BaseException:
        if isinstance(optimizer, FlashOptimizer):
            # the zero state made for parameters never stepped (DCP loads into a template of the live state)
            # goes again: a refused load leaves the optimizer as it was
            for p in [p for p in optimizer.state if id(p) not in had_state]:
                del optimizer.state[p]
            optimizer.clear_plans()
        raise


def _load(path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    where = resolve(path)
    reader = SafeFileSystemReader(str(where))
    metadata = reader.read_metadata()
    # Read the optimizer state in the format it was saved in, whatever this optimizer saves:
    # load_state_dict takes both
    fmt = (_saved_format(metadata) or "portable") if isinstance(optimizer, FlashOptimizer) else None
    state = _clone(_state(model, optimizer, None, fmt))
    state["extra"] = _template_for_extra(metadata)
    want = {k: v for k, v in _flat_shapes(state).items() if not k.startswith("extra.")}
    have = {k: getattr(m, "size", None) for k, m in metadata.state_dict_metadata.items() if not k.startswith("extra.")}
    missing = sorted(k for k in want if k not in have)
    # a param-group option newer than the checkpoint (FlashMuon's flatten) keeps this optimizer's value, as
    # load_state_dict keeps a group key the state dict lacks
    newer = _newer_group_options(state, missing, getattr(optimizer, "newer_group_options", ()))
    missing = [k for k in missing if k not in newer["keys"]]
    unexpected = sorted(k for k in have if k not in want)
    wrong = sorted(k for k, shape in want.items() if k in have and shape is not None and have[k] is not None
                   and tuple(have[k]) != shape)
    # DCP reads into the live tensors, casting what it reads: a flashdist optimizer's state of another dtype
    # (an int16 rho or int32 codes, from a damaged or crafted file) would wrap without a word
    cast = _other_state_dtypes(state, metadata) if isinstance(optimizer, FlashOptimizer) else []
    if cast:
        rho_bits = {R.MASTER_WEIGHT_BITS_OF.get(saved) for key, saved, _ in cast if key.endswith(".rho")}
        setting = (f"master_weight_bits={rho_bits.pop()}, as its rho says"
                   if all(key.endswith(".rho") for key, _, _ in cast) and len(rho_bits) == 1 and None not in rho_bits
                   else "the settings it was saved with (master_weight_bits, the parameters' dtype)")
        shown_cast = [f"{key} ({_name(saved)} vs {_name(live)})" for key, saved, live in cast[:8]]
        raise CheckpointError(f"flashdist: checkpoint {where} holds optimizer state of another dtype than this "
                              f"optimizer keeps: {', '.join(shown_cast)}{' ...' if len(cast) > 8 else ''}: build "
                              f"the optimizer with {setting}; where it was, the checkpoint is damaged or crafted")
    if missing or unexpected or wrong:
        details = []
        if missing:
            details.append(f"missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            details.append(f"not in this model/optimizer: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if wrong:
            details.append("other shapes: " + ", ".join(f"{k} {tuple(have[k])} vs {want[k]}" for k in wrong[:8]))
        hint = _optimizer_hint(have, want)
        if hint:
            details.insert(0, hint)
        raise CheckpointError(f"flashdist: checkpoint {where} does not match this model and optimizer: "
                              + "; ".join(details))
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures in a BaseException
        raise CheckpointError(f"flashdist: could not read checkpoint {where}: {error_summary(e)}; the model and "
                              "optimizer were not changed") from e
    _restore_newer_group_options(state, newer, where)
    # the optimizer validates everything before it copies; a refusal (other master_weight_bits, format version,
    # ...) is a CheckpointError on every rank, told by the ranks that refused
    failure = None
    try:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        failure = f"flashdist: checkpoint {where} does not load into this optimizer: {error_summary(e)}"
    failures = _gather(failure)
    if any(failures):
        if failure:
            raise CheckpointError(failure + "; the model and optimizer were not changed")
        rank, text = next((r, f) for r, f in enumerate(failures) if f)
        raise CheckpointError(f"{text} (on rank {rank}); this rank's model was not changed")
    set_model_state_dict(model, state["model"])
    if is_ties(state["extra"].get(TIED)):
        del state["extra"][TIED]  # (flashdist's record, for an export)
    return state["extra"]


def _newer_group_options(state: dict, missing: list[str], options) -> dict:
    """The ``optim.param_groups.<i>.<option>`` keys of ``missing`` whose option is one of ``options`` (the
    optimizer's ``newer_group_options``: added since its first checkpoints), taken out of the load template
    ``state``, with the live value of each option per parameter (by FQN: the checkpoint's groups may list the
    parameters in another order). Any other missing key still refuses the checkpoint."""
    keys, by_param = [], {}
    groups = state["optim"].get("param_groups")
    for key in missing:
        parts = key.split(".")
        if (len(parts) == 4 and parts[:2] == ["optim", "param_groups"] and parts[2].isdigit()
                and isinstance(groups, list) and int(parts[2]) < len(groups) and parts[3] in options):
            group = groups[int(parts[2])]
            if parts[3] in group and not isinstance(group[parts[3]], (torch.Tensor, dict, list)):
                keys.append(key)
                value = group.pop(parts[3])
                for fqn in group.get("params", []):
                    if isinstance(fqn, str):
                        by_param.setdefault(parts[3], {})[fqn] = value
    return {"keys": keys, "by_param": by_param}


def _restore_newer_group_options(state: dict, newer: dict, where) -> None:
    """Put back, in each group the checkpoint loaded, the live value of the options ``_newer_group_options``
    took out, found by the group's parameters; a checkpoint group whose parameters had different live values
    is refused. A FlashMuon group with weights of more than 2 dims and ``flatten=False`` is told that the
    checkpoint, saved before the option, trained each of them as one matrix."""
    for option, values in newer["by_param"].items():
        for group in state["optim"].get("param_groups", []):
            fqns = group.get("params", []) if isinstance(group, dict) else []
            fqns = [f for f in fqns if isinstance(f, str)] if isinstance(fqns, list) else []  # (a crafted file)
            found = {values[f] for f in fqns if f in values}
            if len(found) > 1:
                raise CheckpointError(f"flashdist: checkpoint {where} was saved before the param-group option "
                                      f"{option!r} and groups parameters that this optimizer gives different "
                                      f"values of it; group them as the checkpoint does")
            if found:
                group[option] = found.pop()
                saved = state["optim"].get("state", {})
                saved = saved if isinstance(saved, dict) else {}
                stacks = any(isinstance(t, torch.Tensor) and t.ndim > 2 for f in fqns
                             for t in (saved.get(f) if isinstance(saved.get(f), dict) else {}).values())
                if option == "flatten" and group[option] is False and stacks:
                    warnings.warn(f"flashdist: checkpoint {where} was saved before FlashMuon's flatten option, when "
                                  "a weight of more than 2 dims was orthogonalized as one (shape[0], rest) matrix "
                                  "(flatten=True); this optimizer's flatten=False group goes on orthogonalizing "
                                  "each matrix of its stacks on its own", UserWarning, stacklevel=3)


def _saved_format(metadata) -> str | None:
    """"compressed" when the checkpoint's optimizer state holds codes, "portable" when it holds float
    moments only, None when it holds neither (no quantized parameter: the two formats are the same)."""
    keys = [k for k in metadata.state_dict_metadata if k.startswith("optim.state.")]
    if QuantizedMoment.any_codes(keys):
        return "compressed"
    return None


_OPTIMIZERS_BY_MOMENTS = {("exp_avg", "exp_avg_sq"): "FlashAdamW/FlashAdam", ("exp_avg",): "FlashLion",
                          ("momentum_buffer",): "FlashSGD/FlashSGDW with momentum, or FlashMuon on matrices only",
                          ("exp_avg", "exp_avg_sq", "momentum_buffer"): "FlashMuon",
                          (): "FlashSGD without momentum"}


def _optimizer_hint(have, want) -> str:
    """Why the optimizer-state keys differ, when that is the reason: another optimizer, the other state-dict
    format, or rho on one side only. Empty when the state keys agree."""
    def state_keys(keys):  # the last part of optim.state.<fqn>.<key>
        return {k.rsplit(".", 1)[-1] for k in keys if k.startswith("optim.state.")}

    def moments(keys):
        return tuple(sorted({QuantizedMoment.split_key(k)[0] for k in keys} - {"step", "rho"}))

    def fmt(keys):
        return "compressed" if QuantizedMoment.any_codes(keys) else "portable"

    saved, mine = state_keys(have), state_keys(want)
    if saved == mine or not saved or not mine:
        return ""
    if moments(saved) != moments(mine):
        a, b = moments(saved), moments(mine)
        return (f"the checkpoint's optimizer state holds {list(a) or 'no moments'} "
                f"({_OPTIMIZERS_BY_MOMENTS.get(a, 'another optimizer')}), this optimizer's {list(b) or 'none'} "
                f"({_OPTIMIZERS_BY_MOMENTS.get(b, 'another optimizer')}): build the optimizer the checkpoint was saved "
                "with")
    if fmt(saved) != fmt(mine):  # load() reads either format: only 8-bit codes against fp32 moments get here
        return ("the checkpoint's optimizer state is compressed (8-bit codes), this optimizer keeps fp32 moments "
                "(quantize_states=False): build it with quantize_states=True, or `flashdist convert --format "
                "portable` the checkpoint")
    if ("rho" in saved) != ("rho" in mine):
        return (f"the checkpoint's optimizer state {'has' if 'rho' in saved else 'has no'} rho, this optimizer "
                f"{'keeps' if 'rho' in mine else 'keeps no'} rho: build it with the master_weight_bits and parameter "
                "dtype the checkpoint was saved with")
    return ""
