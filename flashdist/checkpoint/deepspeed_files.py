"""DeepSpeed ZeRO checkpoint folders: the one place flashdist finds and opens DeepSpeed's files.

Used by the converter (:mod:`flashdist.checkpoint.deepspeed_import`, ``flashdist convert | inspect | export``)
and by the DeepSpeed integration (:func:`flashdist.integrations.deepspeed.fold_rho`, ``to_universal``, the
universal-checkpoint load), so both find a checkpoint's tag folder and read its files the same way.

Safety. Every file is read with ``torch.load(weights_only=True)``: tensors and plain data, plus the few
DeepSpeed classes DeepSpeed 0.19 pickles into its files (:data:`DEEPSPEED_GLOBALS`: the ZeRO stage enum, the
loss scalers, the fragment addresses of ``param_slice_mappings``). Building one of those only sets its
attributes; a file naming any other class is refused with a one-line :class:`CheckpointError` that names the
file and the class, before anything is written. By default the DeepSpeed objects come back as inert stand-ins
(DeepSpeed need not be installed and is not imported); ``deepspeed_objects=True`` gives DeepSpeed's own
classes, for a file that is saved again for DeepSpeed to load.

Layout of one checkpoint (``engine.save_checkpoint(save_dir, tag)``)::

    save_dir/latest                                      the newest tag
    save_dir/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   one per data-parallel rank
    save_dir/<tag>/mp_rank_00_model_states.pt            ZeRO 1/2: the whole model, world size, shapes
    save_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt          ZeRO 3: one per rank instead
"""

from __future__ import annotations

import enum
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .files import check_nesting, check_torch_file, inside, read_bounded, shown

DEEPSPEED_GLOBALS = ("deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.utils.tensor_fragment.fragment_address")
"""The classes DeepSpeed's ZeRO files may pickle besides tensors and plain data: the optimizer file's
``zero_stage`` and ``loss_scaler`` (DynamicLossScaler under fp16) and ``param_slice_mappings``."""

HINT = ("flashdist reads checkpoints that engine.save_checkpoint wrote with a flashdist optimizer "
        "(flashdist.integrations.deepspeed.initialize)")

_OPTIM_FILE = re.compile(r"^(?P<prefix>.*?)zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
_MODEL_FILE_3 = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
ZERO12_MODEL_FILE = "mp_rank_00_model_states.pt"


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A DeepSpeed checkpoint folder, tag or tag file that is not there."""


# ----- reading one file --------------------------------------------------------------------------------


class _ZeroStage(enum.IntEnum):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 4


class _Inert:
    """Stand-in for a pickled DeepSpeed object (fragment addresses, loss scalers): its attributes, no code."""


def _globals(deepspeed_objects: bool) -> list:
    if not deepspeed_objects:
        return [(_ZeroStage if name.endswith("ZeroStageEnum") else _Inert, name) for name in DEEPSPEED_GLOBALS]
    import importlib

    out = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        out.append((getattr(importlib.import_module(module), attr), name))
    return out


_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")


def load_file(path: str | os.PathLike, *, deepspeed_objects: bool = False) -> dict:
    """One file of a DeepSpeed checkpoint (a dict), read with ``torch.load(weights_only=True)`` and
    :data:`DEEPSPEED_GLOBALS` allowed, tensors memory-mapped on the CPU.

    ``deepspeed_objects``: False (default) gives inert stand-ins for DeepSpeed's objects; True gives DeepSpeed's
    own classes (DeepSpeed must be installed), so that ``torch.save`` of the result is a file DeepSpeed loads.
    Raises :class:`CheckpointError` naming the file (and the class, for a refused one)."""
    path = Path(path)
    real = inside(path.parent, path.name)  # a link out of the checkpoint's folder, a FIFO, ... is refused
    check_torch_file(real)  # regular, a zip of stored records, its pickles within the metadata budget
    try:
        with torch.serialization.safe_globals(_globals(deepspeed_objects)):
            value = torch.load(real, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        found = _REFUSED_GLOBAL.search(str(e))
        if found:
            raise CheckpointError(f"flashdist: {path} holds a pickled {found[1]}, which DeepSpeed does not write "
                                  "into its checkpoints; refused (torch.load weights_only=True, DeepSpeed's classes "
                                  "allowed). Read only checkpoints that engine.save_checkpoint wrote") from None
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise CheckpointError(f"flashdist: {path} holds objects other than tensors, plain data and DeepSpeed's "
                              f"classes and was refused (weights_only=True): {first.strip()[:200]}") from None
    except Exception as e:  # noqa: BLE001 - truncated zip, not a torch file, ...
        text = str(e).strip().splitlines()
        raise CheckpointError(f"flashdist: could not read {path}: {text[0][:200] if text else type(e).__name__}") \
            from None
    check_nesting(value, path)
    if not isinstance(value, dict):
        raise CheckpointError(f"flashdist: {path} is not a DeepSpeed checkpoint file (it holds a "
                              f"{type(value).__name__})")
    return value


# ----- the folder of one checkpoint --------------------------------------------------------------------


def tag_folder(path: str | os.PathLike, tag: str | None = None) -> Path:
    """The folder of one DeepSpeed checkpoint: ``path/<tag>`` (``tag`` default: the ``latest`` file), or
    ``path`` itself when it holds the ``*_optim_states.pt`` files. The tag must name a folder inside ``path``."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"flashdist: {path} is not a directory")
    if tag is None and any(path.glob("*_optim_states.pt")):
        return path
    source = None
    if tag is None:
        latest = path / "latest"
        if not os.path.lexists(latest):
            raise CheckpointNotFoundError(f"flashdist: {path} has no 'latest' file and no *_optim_states.pt files; "
                                          "pass the checkpoint tag (--tag)")
        tag, source = read_tag(latest), latest
    # a tag names a folder inside this one: a 'latest' file (or --tag) pointing elsewhere is refused, so a
    # copied or crafted folder cannot make flashdist read another checkpoint
    real = inside(path, tag, source=source)
    folder = path / tag
    if not real.is_dir():
        raise CheckpointNotFoundError(f"flashdist: the DeepSpeed checkpoint {folder} does not exist or is not a folder "
                                      f"(tag {shown(tag)}{' from ' + str(source) if source else ''})")
    if (folder / "zero").is_dir() and not any(folder.glob("*_optim_states.pt")):
        raise CheckpointError(f"flashdist: {folder} is a DeepSpeed universal checkpoint; convert the checkpoint "
                              "it was made from (engine.save_checkpoint's folder)")
    return folder


_TAG = re.compile(r"/?[\w.+=@,:-]+(/[\w.+=@,:-]+)*")
MAX_TAG_BYTES = 4096


def read_tag(latest: str | os.PathLike) -> str:
    """The tag in a DeepSpeed ``latest`` (or ``latest_universal``) file, a regular file of at most
    :data:`MAX_TAG_BYTES` (:mod:`flashdist.checkpoint.files`). A file that does not hold one tag (letters,
    digits, ``._-+=@,:/``) is refused without printing what it holds."""
    latest = Path(latest)
    data = read_bounded(inside(latest.parent, latest.name), MAX_TAG_BYTES, expected="a DeepSpeed 'latest' file")
    try:
        tag = data.decode().strip()
    except UnicodeDecodeError:
        tag = None
    if not tag:
        raise CheckpointError(f"flashdist: {latest} {'is empty' if tag == '' else 'does not hold a checkpoint tag'}; "
                              "pass the checkpoint tag (--tag)")
    if not _TAG.fullmatch(tag):
        raise CheckpointError(f"flashdist: {latest} does not hold a checkpoint tag (one name of letters, digits and "
                              "._-+=@,:/); pass the checkpoint tag (--tag)")
    return tag


def optimizer_files(folder: Path) -> tuple[dict[int, Path], str]:
    """rank -> ZeRO optimizer file of a tag folder, and the file-name prefix (``bf16_`` under bf16). Refuses a
    folder without them, and MoE and tensor/pipeline-parallel layouts (data-parallel ZeRO only)."""
    names = sorted(p.name for p in folder.glob("*_optim_states.pt"))
    if not names:
        raise CheckpointNotFoundError(f"flashdist: {folder} holds no DeepSpeed ZeRO optimizer files "
                                      "(*_optim_states.pt). " + HINT)
    if any("expp_rank" in n for n in names) or any(folder.glob("*expert*_model_states.pt")):
        raise CheckpointError(f"flashdist: {folder} is a DeepSpeed MoE checkpoint (expert files); flashdist reads "
                              "data-parallel ZeRO checkpoints only")
    files: dict[int, Path] = {}
    prefixes = set()
    for name in names:
        m = _OPTIM_FILE.match(name)
        if m is None:
            raise CheckpointError(f"flashdist: {folder / name} is not named like a ZeRO optimizer file "
                                  "(zero_pp_rank_<r>_mp_rank_<m>_optim_states.pt)")
        if int(m["mp"]) != 0:
            raise CheckpointError(f"flashdist: {folder / name} belongs to model-parallel rank {int(m['mp'])}; "
                                  "tensor/pipeline-parallel DeepSpeed checkpoints are not supported (data-parallel "
                                  "ZeRO only)")
        prefixes.add(m["prefix"])
        files[int(m["rank"])] = folder / name
    if len(prefixes) > 1:
        raise CheckpointError(f"flashdist: {folder} mixes optimizer files of two kinds ({sorted(prefixes)}); "
                              "was another checkpoint saved into the same folder?")
    return files, prefixes.pop()


def stage3_model_files(folder: Path) -> dict[int, Path]:
    """rank -> ZeRO-3 model-states file of a tag folder (empty under ZeRO 1/2)."""
    return {int(m["rank"]): folder / n for n in os.listdir(folder) if (m := _MODEL_FILE_3.match(n))}


def missing(folder: Path, what: str, name: str, rank: int, world: int) -> CheckpointError:
    """The error for a rank's file that is not in the folder."""
    return CheckpointError(f"flashdist: {folder} lacks {name} ({what} of rank {rank} of {world}): the checkpoint "
                           "is incomplete. Copy every rank's files into the folder, or save the checkpoint again")


def model_states_file(folder: Path) -> Path:
    """The model-states file that holds the world size and the parameter shapes: ``mp_rank_00_model_states.pt``
    (ZeRO 1/2) or rank 0's ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (ZeRO 3)."""
    if os.path.lexists(folder / ZERO12_MODEL_FILE):  # a FIFO or a link out is refused when it is read
        return folder / ZERO12_MODEL_FILE
    stage3 = stage3_model_files(folder)
    if 0 in stage3:
        return stage3[0]
    if stage3:
        raise missing(folder, "ZeRO-3 model states", "zero_pp_rank_0_mp_rank_00_model_states.pt", 0, max(stage3) + 1)
    raise CheckpointError(f"flashdist: {folder} has no model-states file ({ZERO12_MODEL_FILE} or "
                          "zero_pp_rank_0_mp_rank_00_model_states.pt). " + HINT)


# ----- one rank's optimizer file -----------------------------------------------------------------------


@dataclass
class OptimizerFile:
    """One rank's ZeRO optimizer file, parsed. ``contents`` is the file as loaded; ``state`` and ``masters`` are
    the objects inside it, so a change to them is what ``torch.save(contents)`` writes."""

    path: Path
    contents: dict
    stage: int
    """ZeRO stage, 1-3."""
    state: dict
    """The optimizer's own ``state_dict()``: ``{"state": {index: {...}}, "param_groups": [...]}``."""
    masters: list
    """The flat master partitions (fp32, or bf16 in bf16-master mode), one per optimizer parameter in the order
    of the param groups' ``params``: per param group (ZeRO 1/2) or sub-group (ZeRO 3)."""
    partition_count: Any
    paddings: list | None
    """``param_alignment_paddings`` (ZeRO 1/2): the padding after each parameter in its group's partitions."""

    def partitions(self) -> list[tuple[int, dict, torch.Tensor]]:
        """(param-group index, optimizer state entry or {}, master partition) for each master partition."""
        out = []
        states = self.state.get("state", {})
        k = 0
        for g, group in enumerate(self.state["param_groups"]):
            for pid in group["params"]:
                out.append((g, states.get(pid) or {}, self.masters[k]))
                k += 1
        return out


def check_stage(stage: Any, where: Path) -> int:
    """A file's ZeRO stage as an int; refuses anything but 1, 2 and 3."""
    if stage not in (1, 2, 3):
        raise CheckpointError(f"flashdist: {where} has ZeRO stage {stage!r}; flashdist reads ZeRO stages 1, 2 and 3")
    return int(stage)


def parse_optimizer_file(contents: dict, path: Path) -> OptimizerFile:
    """The parts of a loaded ZeRO optimizer file (:func:`load_file`) flashdist uses; refuses files of another
    kind, elastic checkpoints, and files whose masters and optimizer parameters do not pair up."""
    zsd = contents.get("optimizer_state_dict")
    if not isinstance(zsd, dict) or "zero_stage" not in zsd:
        raise CheckpointError(f"flashdist: {path} is not a DeepSpeed ZeRO optimizer file. " + HINT)
    stage = check_stage(zsd["zero_stage"], path)
    if stage == 3:
        base, masters = zsd.get("optimizer_state_dict"), zsd.get("fp32_flat_groups")
    else:
        base, masters = zsd.get("base_optimizer_state"), zsd.get("single_partition_of_fp32_groups")
    if isinstance(base, list):
        raise CheckpointError(f"flashdist: {path} was saved with zero_optimization.elastic_checkpoint; flashdist "
                              "reads checkpoints saved without it")
    if not isinstance(base, dict) or not isinstance(masters, list) or "param_groups" not in base:
        raise CheckpointError(f"flashdist: {path} has no optimizer state or master partitions. " + HINT)
    count = sum(len(group["params"]) for group in base["param_groups"])
    if count != len(masters):
        raise CheckpointError(f"flashdist: {path} has {len(masters)} master partitions and {count} optimizer "
                              "parameters. " + HINT)
    return OptimizerFile(path, contents, stage, base, masters, zsd.get("partition_count"),
                         zsd.get("param_alignment_paddings"))


def read_optimizer_file(path: str | os.PathLike, *, deepspeed_objects: bool = False) -> OptimizerFile:
    """:func:`load_file` and :func:`parse_optimizer_file` of one ``*_optim_states.pt``."""
    return parse_optimizer_file(load_file(path, deepspeed_objects=deepspeed_objects), Path(path))
