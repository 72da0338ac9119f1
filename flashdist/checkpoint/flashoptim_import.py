"""flashoptim (the FlashOptim paper's own library) FlashAdamW / FlashAdam checkpoints -> the checkpoint dict of
``flashdist.checkpoint``, for users who migrate.

Input: a torch file (or the dict itself) holding the model's and flashoptim's optimizer state dicts::

    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "flashoptim.pt")

(``"model_state_dict"`` / ``"optimizer_state_dict"`` and ``"optim"`` are accepted too; other top-level keys are
ignored). The model's parameters are needed: flashoptim keeps the master weight as the bf16 parameter plus
its ECC bits. Output: the nested dict that :func:`flashdist.checkpoint.save` writes, full CPU tensors::

    {"model": {fqn: parameter (model dtype; a bf16/fp16 parameter re-split with rho) or buffer},
     "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq", "rho"}}, "param_groups": [{..., "params": [fqn]}]},
     "extra": {"step": the largest per-parameter step}}

the layout of a file that ``flashdist convert DCP_DIR out.pt --to torch`` writes (portable optimizer state).

Which parameter is which: flashoptim's state dict numbers the parameters. An optimizer built from
``model.named_parameters()`` (torch >= 2.5) saves each group's ``param_names``, used as they are; otherwise the
parameters are matched, in order, to the model state's floating-point entries of the same shape (and dtype,
where the state tells it), which must have exactly one solution (``model.parameters()`` order; buffers and
frozen parameters skipped), else a :class:`CheckpointError` asks for names (``param_names=``).

flashoptim's format (0.1.4, read from its source; per parameter, numbered, under ``state``):

- ``step``: int64 0-d tensor, the optimizer steps taken.
- ``exp_avg::quantized`` (int8, the parameter's shape) and ``exp_avg::scales`` (fp16, one per group of 32
  consecutive values of the flattened tensor, ``ceil(numel / 32)``; stored as a bf16 *view* of the fp16 bits
  when the parameter is bf16): softsign-companded. Value = ``x * scale`` with ``y = q / 127`` and
  ``x = y / (2 - |y|)``.
- ``exp_avg_sq::quantized`` (uint8) and ``exp_avg_sq::scales`` (same layout): sqrt-companded, no softsign.
  Value = ``(q / 255 * scale)^2``.
- ``exp_avg`` / ``exp_avg_sq`` as float tensors instead, when saved with ``compress_state_dict=False`` (fp32,
  dequantized) or ``quantize=False`` (the parameter's dtype).
- ``error_bits`` (bf16/fp16 parameters with ``master_weight_bits`` 24 or 32): the ECC code ``c``, int8 for 24
  bits (saved converted by value to the parameter's dtype), int16 for 32 (saved as a bit view in the
  parameter's dtype). Master weight = ``p + c / C * 2^(E - m - 1)``, ``C`` = 127 or 32767, ``E`` the unbiased
  exponent of the bf16/fp16 parameter ``p`` (``1 - bias`` for zero and subnormals), ``m`` its mantissa bits (7
  or 10): ``c`` counts half-ulps of ``p`` in ``1/C`` steps. flashdist's rho counts ``h / 128`` (int8) steps,
  so the master weight is rebuilt as fp32 and split again (:func:`flashdist.quant.rho.split`): 24 bits keep it
  to ``2^-16`` relative (both formats are 24-bit), ``master_weight_bits=32`` (int16 rho) keeps every fp32 bit.
- param groups: ``lr``, ``betas``, ``eps``, ``weight_decay`` (kept), ``initial_lr``, ``master_bytewidth`` (3:
  24 bits, 4: 32, 0: none), ``quantize``. FlashAdamW and FlashAdam save the same keys (coupled or decoupled weight decay
  is not recorded, nor ``decouple_lr``): build the flashdist optimizer of the same kind.

Arithmetic: flashoptim decodes in its Triton kernels, on NVIDIA GPUs, where Triton's fp32 ``/`` is not IEEE
division: ``a / C`` by a constant comes out as ``a * fl(1/C)``, and ``y / (2 - |y|)`` as ``y`` times the
hardware's approximate reciprocal (``rcp.approx``), one ulp off the correctly rounded one at 14 of the 128
divisors (:data:`_RCP_ULPS`, measured on an H200, tests/data/flashoptim_tiny.pt). The decoding here does the
same fp32 operations in the same order, so the moments and master weights are flashoptim's bit for bit
(tests/test_convert_flashoptim.py checks them against flashoptim's own ``materialize()`` and
``get_fp32_model_state_dict``).
"""

from __future__ import annotations

import math
import os
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..optim.layout import check_master_weight_bits
from ..quant import rho as R
from .errors import CheckpointError
from .files import check_nesting, check_torch_file, structure_only
from .state import FORMAT_VERSION

GROUP_SIZE = 32  # flashoptim's quantization group: consecutive values of the flattened tensor
_MODEL_KEYS = ("model", "model_state_dict")
_OPTIM_KEYS = ("optimizer", "optimizer_state_dict", "optim")
_BITS = {0: None, 3: 24, 4: 32}  # flashoptim's master_bytewidth -> master_weight_bits
_FORMATS = {torch.bfloat16: (7, 127), torch.float16: (10, 15)}  # mantissa bits, exponent bias
# |q| of an exp_avg code -> ulps by which the GPU's rcp.approx(2 - |q| * fl(1/127)) differs from the correctly
# rounded reciprocal (every other |q| in 0..127: none)
_RCP_ULPS = {29: 1, 38: 1, 43: 1, 48: 1, 64: 1, 71: 1, 73: 1, 76: 1, 95: 1, 107: -1, 110: 1, 114: 1, 121: 1, 123: -1}
_HINT = ("expected a torch file holding {'model': model.state_dict(), 'optimizer': optimizer.state_dict()} of a "
         "flashoptim FlashAdamW or FlashAdam")


# ----- recognising and loading ------------------------------------------------------------------------


def is_flashoptim_file(path: str | os.PathLike) -> bool:
    """Cheap test: a torch file whose pickle (not its tensors) names flashoptim's ``master_bytewidth``."""
    try:
        with zipfile.ZipFile(path) as z:
            pickles = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pickles) != 1 or z.getinfo(pickles[0]).file_size > 256 * 2**20:
                return False
            return b"master_bytewidth" in z.read(pickles[0])
    except Exception:  # noqa: BLE001 - a damaged zip (bad names, unknown versions): torch.load says what is wrong
        return False


def _load(path: Path, structure: bool = False) -> Any:
    check_torch_file(path)
    try:
        value = torch.load(path, map_location="cpu", weights_only=True, mmap=structure)
    except Exception as e:  # noqa: BLE001 - truncated zip, refused pickle global, ...
        text = str(e).strip().splitlines()
        first = next((line for line in text if "GLOBAL" in line), text[0] if text else type(e).__name__)
        raise CheckpointError(f"flashdist: could not read {path}: {first.strip()[:300]}") from None
    check_nesting(value, path)
    return structure_only(value) if structure else value


def _split_input(obj: Any, model_state: dict | None, where: str) -> tuple[dict, dict]:
    if not isinstance(obj, dict):
        raise CheckpointError(f"flashdist: {where} holds a {type(obj).__name__}; " + _HINT)
    if "state" in obj and "param_groups" in obj:
        optim, model = obj, None
    else:
        optim = next((obj[k] for k in _OPTIM_KEYS if k in obj), None)
        model = next((obj[k] for k in _MODEL_KEYS if k in obj), None)
        if optim is None:
            raise CheckpointError(f"flashdist: {where} has no optimizer state dict (none of "
                                  f"{list(_OPTIM_KEYS)} among its keys {sorted(map(str, obj))[:8]}); " + _HINT)
    if model_state is not None:
        model = model_state
    if model is None:
        raise CheckpointError(f"flashdist: {where} holds flashoptim's optimizer state without the model's "
                              "(its bf16 parameters are half of each master weight); " + _HINT)
    if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise CheckpointError(f"flashdist: {where}: the model state is not a dict of tensors "
                              "(model.state_dict())")
    if (not isinstance(optim, dict) or not isinstance(optim.get("state"), dict)
            or not isinstance(optim.get("param_groups"), list) or not optim["param_groups"]):
        raise CheckpointError(f"flashdist: {where}: the optimizer state dict has no 'state' and 'param_groups'; "
                              + _HINT)
    for gi, group in enumerate(optim["param_groups"]):
        if not isinstance(group, dict) or "master_bytewidth" not in group:
            raise CheckpointError(f"flashdist: {where}: param group {gi} has no master_bytewidth: not a flashoptim "
                                  "optimizer state dict; " + _HINT)
        missing = [k for k in ("params", "lr", "betas", "eps", "weight_decay") if k not in group]
        if missing:
            raise CheckpointError(f"flashdist: {where}: param group {gi} lacks {missing}: not a flashoptim "
                                  "FlashAdamW/FlashAdam state dict")
        if group["master_bytewidth"] not in _BITS:
            raise CheckpointError(f"flashdist: {where}: param group {gi} has master_bytewidth "
                                  f"{group['master_bytewidth']!r}, flashoptim writes 0, 3 or 4")
    return model, optim


# ----- which model entry each optimizer parameter is ------------------------------------------------------


def _hint_of(entry: dict) -> tuple[tuple | None, torch.dtype | None]:
    """(shape, dtype or None) of the parameter of a saved state entry; (None, None) without state."""
    shape = None
    for key in ("error_bits", "exp_avg::quantized", "exp_avg", "exp_avg_sq::quantized", "exp_avg_sq"):
        if isinstance(entry.get(key), torch.Tensor):
            shape = tuple(entry[key].shape)
            break
    dtype = None
    if isinstance(entry.get("error_bits"), torch.Tensor) and entry["error_bits"].is_floating_point():
        dtype = entry["error_bits"].dtype  # saved in the parameter's dtype
    elif isinstance(entry.get("exp_avg::scales"), torch.Tensor) and entry["exp_avg::scales"].dtype == torch.bfloat16:
        dtype = torch.bfloat16  # fp16 scales are saved as a bf16 view for bf16 parameters only
    return shape, dtype


def _names(model: dict, optim: dict, param_names: list[str] | None, where: str) -> list[list[str]]:
    """The model-state key of each parameter of each param group."""
    groups = optim["param_groups"]
    ids = [pid for g in groups for pid in g["params"]]
    if param_names is None and all(isinstance(g.get("param_names"), list) and len(g["param_names"]) == len(g["params"])
                                   for g in groups):
        param_names = [n for g in groups for n in g["param_names"]]
    if param_names is not None:
        if len(param_names) != len(ids):
            raise CheckpointError(f"flashdist: {where}: {len(param_names)} parameter names for the optimizer's "
                                  f"{len(ids)} parameters")
        absent = [n for n in param_names if n not in model]
        if absent:
            raise CheckpointError(f"flashdist: {where}: the optimizer's parameters {absent[:4]} are not in the model "
                                  "state dict; are the two from one model?")
        names = list(param_names)
    else:
        hints = [_hint_of(optim["state"].get(pid) or {}) for pid in ids]
        entries = [(k, v) for k, v in model.items() if v.is_floating_point()]

        def fits(hint, value: torch.Tensor) -> bool:
            shape, dtype = hint
            return (shape is None or tuple(value.shape) == shape) and (dtype is None or value.dtype == dtype)

        # order-preserving matches of the optimizer's parameters among the entries: counted (capped at 2)
        ways = [1] * (len(entries) + 1)
        for hint in hints:
            nxt = [0] * (len(entries) + 1)
            for j, (_, value) in enumerate(entries):
                nxt[j + 1] = min(2, nxt[j] + (ways[j] if fits(hint, value) else 0))
            ways = nxt
        if ways[-1] != 1:
            why = ("no order-preserving match: the model state lacks parameters of these shapes" if ways[-1] == 0
                   else "several order-preserving matches (tied weights or buffers of a parameter's shape)")
            raise CheckpointError(f"flashdist: {where}: the optimizer's parameters carry no names and their shapes "
                                  f"give {why}; build flashoptim's optimizer from model.named_parameters() "
                                  "(torch >= 2.5 saves the names), or pass param_names")
        names, j = [], 0
        for hint in hints:  # the first match of each in turn is the only one
            while not fits(hint, entries[j][1]):
                j += 1
            names.append(entries[j][0])
            j += 1
    if len(set(names)) != len(names):
        raise CheckpointError(f"flashdist: {where}: a model entry is named for two optimizer parameters")
    out, k = [], 0
    for g in groups:
        out.append(names[k:k + len(g["params"])])
        k += len(g["params"])
    return out


# ----- decoding flashoptim's tensors --------------------------------------------------------------------


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2^n as fp32, exactly, for integer ``n`` in the normal range (built from the exponent bits)."""
    return ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def _recip(c: float) -> torch.Tensor:
    return torch.tensor(1.0, dtype=torch.float32) / c  # fl(1/c): what a / c by a constant comes out as on the GPU


def _exp_avg_rcp() -> torch.Tensor:
    """For |q| = 0..127: the reciprocal of ``2 - |q| * fl(1/127)`` that the GPU multiplies by."""
    k = torch.arange(128, dtype=torch.float32)
    r = torch.tensor(1.0, dtype=torch.float32) / (2.0 - k * _recip(127.0))
    bits = r.view(torch.int32).clone()
    for q, ulps in _RCP_ULPS.items():
        bits[q] += ulps
    return bits.view(torch.float32)


def _codes(value: torch.Tensor, low: int, high: int, what: str) -> torch.Tensor:
    if value.is_meta:  # the structure only (inspect): no values to check
        return value.to(torch.int32)
    if value.is_floating_point():  # torch's Optimizer.load_state_dict casts state to the parameter's dtype
        if not torch.equal(value, value.round()):
            raise CheckpointError(f"flashdist: {what} holds non-integer codes")
        value = value.to(torch.int32)
    value = value.to(torch.int32)
    if value.numel() and (int(value.min()) < low or int(value.max()) > high):
        raise CheckpointError(f"flashdist: {what} holds codes outside [{low}, {high}]")
    return value


def _scales(value: torch.Tensor, groups: int, what: str) -> torch.Tensor:
    if value.dtype == torch.bfloat16:
        value = value.view(torch.float16)  # fp16 bits saved as a bf16 view (bf16 parameters)
    if not value.is_floating_point():
        raise CheckpointError(f"flashdist: {what} is {value.dtype}, expected fp16 scales")
    if value.numel() != groups:
        raise CheckpointError(f"flashdist: {what} has {value.numel()} scales, the parameter's {groups} groups of "
                              f"{GROUP_SIZE} need {groups}")
    return value.to(torch.float16).float().reshape(-1)


def _moment(entry: dict, name: str, shape: tuple, where: str) -> torch.Tensor:
    numel = math.prod(shape)
    if isinstance(entry.get(name), torch.Tensor):  # compress_state_dict=False (fp32) or quantize=False
        value = entry[name]
        if not value.is_floating_point() or tuple(value.shape) != shape:
            raise CheckpointError(f"flashdist: {where}: state '{name}' is {value.dtype} {tuple(value.shape)}, "
                                  f"expected a float tensor of the parameter's shape {shape}")
        return value.float().clone()
    qkey, skey = f"{name}::quantized", f"{name}::scales"
    absent = [k for k in (qkey, skey) if not isinstance(entry.get(k), torch.Tensor)]
    if absent:
        raise CheckpointError(f"flashdist: {where}: the state lacks {absent} (has {sorted(entry)})")
    if tuple(entry[qkey].shape) != shape:
        raise CheckpointError(f"flashdist: {where}: state '{qkey}' has shape {tuple(entry[qkey].shape)}, the "
                              f"parameter {shape}")
    signed = name == "exp_avg"
    q = _codes(entry[qkey].reshape(-1), -127 if signed else 0, 127 if signed else 255, f"{where} '{qkey}'")
    groups = -(-numel // GROUP_SIZE)
    scale = _scales(entry[skey], groups, f"{where} '{skey}'")
    scale = scale.repeat_interleave(GROUP_SIZE)[:numel]
    if signed:  # y = q / 127 (as q * fl(1/127)); x = y / (2 - |y|) (as y * rcp); times the fp16 scale
        y = q.float() * _recip(127.0)
        x = y * _exp_avg_rcp().to(q.device)[q.abs().long()]
        return (x * scale).reshape(shape)
    s = q.float() * _recip(255.0) * scale  # q / 255 times the scale of sqrt(v), squared
    return (s * s).reshape(shape)


def _error_codes(value: torch.Tensor, param: torch.Tensor, bytewidth: int, where: str) -> torch.Tensor:
    width = bytewidth - param.element_size()
    if width not in (1, 2):
        raise CheckpointError(f"flashdist: {where}: error_bits with master_bytewidth {bytewidth} for a "
                              f"{param.dtype} parameter")
    want = torch.int8 if width == 1 else torch.int16
    if tuple(value.shape) != tuple(param.shape):
        raise CheckpointError(f"flashdist: {where}: error_bits has shape {tuple(value.shape)}, the parameter "
                              f"{tuple(param.shape)}")
    if value.dtype == want:
        return value.to(torch.int32)
    if value.is_floating_point() and width == 2 and value.element_size() == 2:
        return value.view(torch.int16).to(torch.int32)  # int16 codes saved as a bit view
    if value.is_floating_point() and width == 1:
        return _codes(value, -127, 127, f"{where} 'error_bits'")  # int8 saved by value
    raise CheckpointError(f"flashdist: {where}: error_bits is {value.dtype}, expected int8/int16 codes or the "
                          f"parameter's dtype {param.dtype}")


def master_weight(param: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """flashoptim's fp32 master weight from a bf16/fp16 parameter and its int ECC codes (int8: 24 bits, int16:
    32): ``p + c / C * 2^(E - m - 1)`` as its kernels compute it (``(c * fl(1/C) * 2^h) * 2^(s - h)`` with
    ``s = E - m - 1``, ``h = floor(s / 2)``; the powers of two are exact)."""
    mbits, bias = _FORMATS[param.dtype]
    if codes.dtype not in (torch.int8, torch.int16):
        raise ValueError("flashdist: ECC codes must be int8 or int16")
    top = 127.0 if codes.dtype == torch.int8 else 32767.0
    biased = (param.view(torch.int16).to(torch.int32) & 0x7FFF) >> mbits
    scale_log = torch.where(biased == 0, 1 - bias, biased - bias) - mbits - 1
    h = torch.div(scale_log, 2, rounding_mode="floor")
    e = codes.to(torch.float32) * _recip(top) * _pow2(h) * _pow2(scale_log - h)
    return param.float() + e


def _place(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()  # a meta storage has no address: its own object tells it apart
    return (storage._cdata if t.is_meta else storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype)


# ----- the whole checkpoint -----------------------------------------------------------------------------


def read_flashoptim(src: str | os.PathLike | dict, model_state: dict | None = None, *,
                    master_weight_bits: int | None = None, param_names: list[str] | None = None,
                    structure: bool = False) -> dict:
    """A flashoptim FlashAdamW/FlashAdam checkpoint as the nested checkpoint dict of
    :func:`flashdist.checkpoint.save` (portable optimizer state keyed by FQN; see the module docstring).

    ``src``: a torch file path (loaded with ``weights_only=True``) or the loaded dict: ``{"model": ...,
    "optimizer": ...}``, or flashoptim's optimizer state dict alone with ``model_state``.
    ``master_weight_bits``: 24 (int8 rho) or 32 (int16 rho: flashoptim's fp32 master weights bit for bit) for the
    output; default: flashoptim's setting (``master_bytewidth``). ``param_names``: the model-state key of each
    optimizer parameter in order, when the state dict has none and the shapes do not tell. ``structure`` (a path
    ``src``): the same dict with meta tensors and the real step counts, the file mapped and no tensor data read
    (:func:`~flashdist.checkpoint.files.structure_only`; the codes' ranges are not checked), for ``inspect``.
    Raises :class:`CheckpointError` (a ``ValueError``) with a one-line reason."""
    if isinstance(src, dict):
        where, obj = "the flashoptim state dict", src
    else:
        path = Path(src)
        if not path.is_file():
            raise CheckpointError(f"flashdist: no such file: {path}" if not path.exists() else
                                  f"flashdist: {path} is a directory; " + _HINT)
        where, obj = str(path), _load(path, structure)
    model, optim = _split_input(obj, model_state, where)
    check_master_weight_bits(master_weight_bits, error=CheckpointError)
    names = _names(model, optim, param_names, where)
    saved = optim["state"]
    out_model = dict(model)
    state: dict[str, dict] = {}
    param_groups = []
    replaced: dict[tuple, torch.Tensor] = {}  # where a replaced parameter's data lies -> its new tensor (tied aliases)
    steps = []
    for group, group_names in zip(optim["param_groups"], names):
        flashoptim_bits = _BITS[group["master_bytewidth"]]
        bits = flashoptim_bits if master_weight_bits is None else master_weight_bits
        for pid, name in zip(group["params"], group_names):
            param = model[name]
            at = f"{where}: parameter {name}"
            entry = saved.get(pid) or {}
            if not isinstance(entry, dict):
                raise CheckpointError(f"flashdist: {at}: its state is a {type(entry).__name__}, not a dict")
            if entry and ("exp_avg_sq" not in entry and "exp_avg_sq::quantized" not in entry):
                raise CheckpointError(f"flashdist: {at}: the state has no exp_avg_sq (keys {sorted(entry)}); only "
                                      "flashoptim's FlashAdamW and FlashAdam are converted")
            shape = tuple(param.shape)
            if not entry:  # never stepped: a fresh state
                theta = param.float()
                out = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(shape), "exp_avg_sq": torch.zeros(shape)}
            else:
                if not isinstance(entry.get("step"), (torch.Tensor, int, float)):
                    raise CheckpointError(f"flashdist: {at}: the state has no 'step' (keys {sorted(entry)})")
                step = float(entry["step"])
                steps.append(step)
                out = {"step": torch.tensor(step, dtype=torch.float32),
                       "exp_avg": _moment(entry, "exp_avg", shape, at),
                       "exp_avg_sq": _moment(entry, "exp_avg_sq", shape, at)}
                if isinstance(entry.get("error_bits"), torch.Tensor):
                    if param.dtype not in _FORMATS:
                        raise CheckpointError(f"flashdist: {at}: error_bits for a {param.dtype} parameter")
                    codes = _error_codes(entry["error_bits"], param, int(group["master_bytewidth"]), at)
                    width = torch.int8 if int(group["master_bytewidth"]) - param.element_size() == 1 else torch.int16
                    theta = master_weight(param, codes.to(width))
                else:
                    theta = param.float()
            if R.splits(param.dtype, bits):
                new, out["rho"] = R.split(theta, param.dtype, R.rho_dtype(bits))
            else:
                new = param.clone()
            if param.is_floating_point() and param.numel():
                replaced[_place(param)] = new
            out_model[name] = new
            state[name] = out
        # flashdist's keys only (flashdist.checkpoint.load wants exactly the loading optimizer's): initial_lr,
        # master_bytewidth, quantize and any key of the user's are left out
        keep = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
        keep.update(params=list(group_names), master_weight_bits=bits,
                    quantize_states=bool(group.get("quantize", True)), companded=True, flat_layout=False,
                    flashdist_format="portable", flashdist_version=FORMAT_VERSION,
                    flashdist_param_dtypes=[str(out_model[n].dtype).removeprefix("torch.") for n in group_names])
        param_groups.append(keep)
    for key, value in model.items():  # tied weights: every key of a replaced parameter gets the new tensor
        if key not in state and value.is_floating_point() and value.numel():
            new = replaced.get(_place(value))
            if new is not None:
                out_model[key] = new
    return {"model": out_model, "optim": {"state": state, "param_groups": param_groups},
            "extra": {"step": int(max(steps, default=0))}}

