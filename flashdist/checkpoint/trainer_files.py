"""A Hugging Face Trainer ``checkpoint-N`` folder, or an Accelerate ``save_state`` folder, as a checkpoint
source (the interface of :class:`flashdist.checkpoint.sources.Source`: ``rest``, ``specs``, ``get``), read
tensor by tensor: ``{"model": {fqn: weight}, "optim": optimizer.pt, "extra": {"step": global_step}}``.

What the folder holds (transformers 5.x, ``Trainer._save_checkpoint``): the model's weights as
``model.safetensors``, shards ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, or
``pytorch_model.bin`` (``save_safetensors=False``; shards with ``pytorch_model.bin.index.json``); the
optimizer's ``optimizer.pt``, ``torch.save(optimizer.state_dict())``: state keyed by index, in the Trainer's
groups (decay, then no decay, each in the model's order, frozen parameters left out), without ``param_names``;
``config.json``, ``trainer_state.json`` and files flashdist does not read (scheduler, rng, training args).

Under FSDP with a sharded state dict (FSDP2's, Accelerate's ``SHARDED_STATE_DICT``) both write the model and the
optimizer as two DCP checkpoints instead, ``pytorch_model_fsdp_0`` and ``optimizer_0`` (the state keyed by
parameter name): :func:`flashdist.checkpoint.sources.read_fsdp_folder` reads them.

An Accelerate ``save_state`` folder (accelerate 1.x, one model and one optimizer) has the same parts under
other names: ``model.safetensors`` (or ``pytorch_model.bin``) and ``optimizer.bin``, the optimizer's
``state_dict()`` keyed by index in its own groups, beside random states and scheduler files flashdist does not
read. It usually has no ``config.json``: the indices are then named by the state dict's ``param_names`` (torch
writes them when the optimizer was built from ``model.named_parameters()``), or the export refuses in one
line. A folder of several models or optimizers (``model_1.safetensors``, ``optimizer_1.bin``) is refused.

The names of the optimizer's indices come from the model's parameter order (see
:mod:`flashdist.checkpoint.names`), which the weight files do not keep (safetensors sorts its keys): the model
is built on the meta device from ``config.json`` by the transformers class its ``architectures`` names, and its
``named_parameters()`` give the order. Without transformers or a config the order is unknown and only
``param_names`` can name the state.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import CheckpointError
from .files import check_nesting, check_safetensors_file, check_torch_file, inside, read_json, reason, regular_size
from .names import ORDER_UNKNOWN
from .output import SAFETENSORS_DTYPES

SAFETENSORS_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"
WEIGHTS = ("model.safetensors", SAFETENSORS_INDEX, "pytorch_model.bin", BIN_INDEX)
OPTIMIZERS = ("optimizer.pt", "optimizer.bin")  # the Trainer's, Accelerate's save_state's


def optimizer_file(path: str | os.PathLike) -> Path | None:
    """The folder's optimizer state file (the Trainer's ``optimizer.pt``, Accelerate's ``optimizer.bin``)."""
    return next((Path(path) / name for name in OPTIMIZERS if (Path(path) / name).is_file()), None)


def is_trainer_folder(path: str | os.PathLike) -> bool:
    """A folder with an optimizer state file and the model's weights as the Trainer or Accelerate write them."""
    path = Path(path)
    return path.is_dir() and optimizer_file(path) is not None and any((path / w).is_file() for w in WEIGHTS)


def is_adapter_folder(path: str | os.PathLike) -> bool:
    """A PEFT adapter-only folder (``adapter_config.json``, the Trainer's ``checkpoint-N`` of a PEFT model): the
    adapters' weights without the base model, and an optimizer state keyed by index whose order is the adapters'
    order in the model, which the folder does not keep (safetensors sorts its keys). Refused by the readers."""
    return Path(path).is_dir() and (Path(path) / "adapter_config.json").is_file()


FSDP_MODEL, FSDP_OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"  # Accelerate's sharded FSDP save


def is_fsdp_folder(path: str | os.PathLike) -> bool:
    """A folder the Trainer (``checkpoint-N``) or Accelerate's ``save_state`` wrote under FSDP with a sharded
    state dict: the model and the optimizer each as a DCP checkpoint of its own."""
    path = Path(path)
    return all((path / name / ".metadata").is_file() for name in (FSDP_MODEL, FSDP_OPTIMIZER))


def fsdp_global_step(folder: Path) -> int | None:
    """The Trainer's ``global_step`` of an FSDP folder (``trainer_state.json``), or None (Accelerate's)."""
    if not (folder / "trainer_state.json").is_file():
        return None
    try:
        return int(_json(inside(folder, "trainer_state.json"))["global_step"])
    except (CheckpointError, ValueError, KeyError, TypeError):
        return None


def _load(path: Path):
    check_torch_file(path)  # a FIFO or a device is refused before it is opened; the zip's records are checked
    try:
        value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - truncated zip, refused pickle global, ...
        raise CheckpointError(f"flashdist: could not read {path}: {str(e).splitlines()[0][:300]}") from None
    check_nesting(value, path)
    return value


def _layer_count(config: dict) -> int:
    """The layers a model config describes: every whole number under a key that names layers
    (``num_hidden_layers``, ``n_layer``, ``decoder_layers``, ``num_decoder_layers``, ...), in its sub-configs
    too; building the model costs time and memory in proportion."""
    total, stack = 0, [config]
    while stack:
        node = stack.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                stack.append(value)
            elif "layer" in str(key).lower() and isinstance(value, int) and not isinstance(value, bool) and value > 0:
                total += value
    return total


def _json(path: Path):
    return read_json(path)  # an index of a model's shards, trainer_state.json: within the metadata budget


def _weight_files(folder: Path) -> list[Path]:
    """The model's weight files, each confined to ``folder`` and a regular file (:mod:`.files`)."""
    for index in (SAFETENSORS_INDEX, BIN_INDEX):
        if (folder / index).is_file():
            try:
                names = sorted(set(_json(inside(folder, index))["weight_map"].values()))
            except (KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"flashdist: cannot read {folder / index}: {reason(e)}") from None
            if not all(isinstance(n, str) and n and Path(n).name == n for n in names):
                raise CheckpointError(f"flashdist: {folder / index} names shard files outside its folder")
            files = [inside(folder, n, source=folder / index) for n in names]
            break
    else:
        files = [inside(folder, "model.safetensors" if (folder / "model.safetensors").is_file()
                        else "pytorch_model.bin")]
    for file in files:
        regular_size(file)
    return files


_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}


class TrainerSource:
    """A Trainer ``checkpoint-N`` folder opened for streaming. ``model_order``: the model's parameter names in
    ``named_parameters()`` order, or None with ``order_unknown`` saying why."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.folder = Path(path)
        found = optimizer_file(self.folder)
        if found is None:
            raise CheckpointError(f"flashdist: {self.folder} has no {' or '.join(OPTIMIZERS)}")
        self.optimizer = inside(self.folder, found.name)
        extra = [n for n in ("optimizer_1.bin", "model_1.safetensors", "pytorch_model_1.bin")
                 if (self.folder / n).exists()]
        if extra:
            raise CheckpointError(f"flashdist: {self.folder} holds several models or optimizers ({extra[0]}); "
                                  "flashdist reads a folder of one model and one optimizer: save each with "
                                  "flashdist.checkpoint.save")
        self.where: dict[str, Path] = {}
        specs: dict[tuple, tuple] = {}
        for file in _weight_files(self.folder):
            if file.suffix == ".safetensors":
                check_safetensors_file(file)
                try:
                    with safe_open(str(file), framework="pt") as f:
                        for key in f.keys():
                            sl = f.get_slice(key)
                            if sl.get_dtype() not in _DTYPES:
                                raise CheckpointError(f"flashdist: {file}: '{key}' is {sl.get_dtype()}, not supported")
                            specs[("model", key)] = (tuple(sl.get_shape()), _DTYPES[sl.get_dtype()])
                            self.where[key] = file
                except CheckpointError:
                    raise
                except Exception as e:  # noqa: BLE001
                    raise CheckpointError(f"flashdist: could not read {file}: {str(e).splitlines()[0][:300]}") from None
            else:
                for key, t in _load(file).items():
                    specs[("model", key)] = (tuple(t.shape), t.dtype)
                    self.where[key] = file
        optim = _load(self.optimizer)
        if not isinstance(optim, dict) or not isinstance(optim.get("state"), dict):
            raise CheckpointError(f"flashdist: {self.optimizer} is not an optimizer state dict")
        state = {}
        for key, entry in optim["state"].items():  # the tensors are all here: torch's packing keeps no others
            state[key] = {}
            for field, value in (entry.items() if isinstance(entry, dict) else ()):
                if isinstance(value, torch.Tensor):
                    specs[("optim", "state", key, field)] = (tuple(value.shape), value.dtype)
                    value = None
                state[key][field] = value
        rest = {"model": {},
                "optim": {"state": state, "param_groups": optim.get("param_groups", [])},
                "extra": {"step": self._global_step()}}
        self.model_order, self.order_unknown = self._model_order(sum(r[0] == "model" for r in specs))
        if self.model_order is not None:  # the weights in the model's order, which a convert output then keeps
            first = [("model", n) for n in self.model_order if ("model", n) in specs]
            placed = set(first)
            specs = {r: specs[r] for r in first + [r for r in specs if r not in placed]}
        else:  # kept with the checkpoint: its weights' order (sorted) must never be taken for the model's
            rest["extra"][ORDER_UNKNOWN] = self.order_unknown
        rest["model"] = {r[1]: None for r in specs if r[0] == "model"}
        self.rest, self.specs = rest, specs

    def _global_step(self):
        try:
            return int(_json(inside(self.folder, "trainer_state.json"))["global_step"])
        except (CheckpointError, ValueError, KeyError, TypeError):
            return None

    def _model_order(self, weights: int) -> tuple[list[str] | None, str | None]:
        """The parameter names of the model ``config.json`` describes, built on the meta device (no weights).
        The file is read as the checkpoint's other metadata is (inside the folder, within the metadata
        budget); a config of more layers than the checkpoint has ``weights`` describes another model, and
        is not built (building costs time and memory in its layers)."""
        if not (self.folder / "config.json").is_file():
            return None, f"{self.folder} has no config.json to build the model's parameter order from"
        try:
            import transformers
        except ImportError:
            return None, "transformers is not installed (it gives the model's parameter order)"
        try:
            values = _json(inside(self.folder, "config.json"))
        except CheckpointError as e:  # (a link out, beyond the budget, not JSON: not read, the order unknown)
            return None, str(e).removeprefix("flashdist: ")
        if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
            return None, "config.json names no model_type"
        layers = _layer_count(values)
        if layers > weights:
            return None, (f"config.json describes {layers:,} layers, more than the checkpoint's {weights:,} weights: "
                          "not this checkpoint's model")
        try:
            config = transformers.AutoConfig.for_model(values["model_type"],
                                                       **{k: v for k, v in values.items() if k != "model_type"})
            arch = (getattr(config, "architectures", None) or [None])[0]
            cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
            if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
                return None, f"config.json names no transformers model class ({arch!r})"
            with torch.device("meta"):
                model = cls(config)
        except Exception as e:  # noqa: BLE001 - any failure to build it leaves the order unknown, said why
            return None, f"cannot build the model from config.json: {str(e).splitlines()[0][:200]}"
        return [n for n, _ in model.named_parameters()], None

    def get(self, routes):
        from safetensors import safe_open

        out: dict[tuple, torch.Tensor] = {}
        by_file: dict[Path, list[tuple]] = {}
        for r in routes:
            by_file.setdefault(self.where[r[1]] if r[0] == "model" else self.optimizer, []).append(r)
        for file, rs in by_file.items():
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as f:  # mapped for this read only
                    out.update({r: f.get_tensor(r[1]).clone() for r in rs})
            else:
                loaded = _load(file)
                out.update({r: (loaded[r[1]] if r[0] == "model" else loaded["state"][r[2]][r[3]]).clone() for r in rs})
        return out

    def read(self) -> dict:
        """The whole checkpoint as a nested dict (full CPU tensors)."""
        got = self.get(list(self.specs))
        model = {r[1]: got[r] for r in self.specs if r[0] == "model"}
        state = {k: {f: got.get(("optim", "state", k, f), v) for f, v in e.items()}
                 for k, e in self.rest["optim"]["state"].items()}
        return {"model": model, "optim": {"state": state, "param_groups": self.rest["optim"]["param_groups"]},
                "extra": dict(self.rest["extra"])}
