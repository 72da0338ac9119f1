"""A Hugging Face model folder from a checkpoint's master weights: what ``from_pretrained`` loads.

The folder holds the weights under the model's own names (the FQNs ``flashdist.checkpoint.save`` keeps, which
for a transformers model are its state-dict keys) as safetensors: one ``model.safetensors``, or shards of at
most ``max_shard_size`` named and indexed as transformers names them (``model-00001-of-00003.safetensors``,
``model.safetensors.index.json``), the split made by ``huggingface_hub.split_torch_state_dict_into_shards``;
plus ``config.json`` when a config is given (its dtype set to the weights'). Tensors are written one at a time
(peak memory: the largest).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from .errors import CheckpointError
from .files import read_bounded
from .output import Spec, atomic_output, write_safetensors


def _read_config(config: Path) -> dict:
    try:  # a regular file of at most 64 MiB: a FIFO or a device is refused, never read
        loaded = json.loads(read_bounded(config, 64 << 20, expected="a config file").decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"flashdist: cannot read the model config {config}: {str(e).splitlines()[0]}") from None
    if not isinstance(loaded, dict) or "model_type" not in loaded:
        raise CheckpointError(f"flashdist: {config} is not a transformers model config (a JSON object with "
                              "'model_type'; model.config.save_pretrained writes one)")
    return loaded


def _config_for(loaded: dict, specs: dict[str, Spec]) -> str:
    """The config as written into the folder: its dtype (``dtype``, or ``torch_dtype`` before transformers 5)
    says the dtype of the weights written, when they share one: from_pretrained loads in the config's dtype by
    default, and fp32 masters under a copied "bfloat16" would load rounded to bf16."""
    dtypes = {dtype for _, dtype in specs.values() if dtype.is_floating_point}
    if len(dtypes) == 1:
        name = str(next(iter(dtypes))).removeprefix("torch.")
        loaded = {**loaded, **{key: name for key in ("dtype", "torch_dtype") if loaded.get(key) is not None}}
    return json.dumps(loaded, indent=2, sort_keys=True) + "\n"


def write_hf_folder(dst: Path, specs: dict[str, Spec], fetch: Callable[[str], torch.Tensor], *,
                    config: str | Path | None = None, max_shard_size: int | str = "5GB",
                    progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Write the folder ``dst`` (through a temporary folder renamed into place) from ``specs`` (name -> (shape,
    dtype)) and ``fetch(name)``."""
    from huggingface_hub import constants, split_torch_state_dict_into_shards

    loaded = _read_config(Path(config)) if config is not None else None
    try:
        split = split_torch_state_dict_into_shards(
            {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in specs.items()},
            max_shard_size=max_shard_size, filename_pattern=constants.SAFETENSORS_WEIGHTS_FILE_PATTERN)
    except ValueError as e:
        raise CheckpointError(f"flashdist: bad max shard size {max_shard_size!r} ({e}); give bytes or e.g. '5GB'") \
            from None
    with atomic_output(dst, directory=True) as tmp:
        for filename, names in split.filename_to_tensors.items():
            write_safetensors(tmp / filename, {n: specs[n] for n in names}, fetch, {"format": "pt"}, progress)
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (tmp / constants.SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if loaded is not None:
            (tmp / "config.json").write_text(_config_for(loaded, specs))
    return dst
