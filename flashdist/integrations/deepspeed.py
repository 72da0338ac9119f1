"""DeepSpeed: flashdist optimizers named in the DeepSpeed JSON config, under ZeRO stages 1, 2 and 3.

    from flashdist.integrations import deepspeed as fd_deepspeed
    engine, optimizer, _, scheduler = fd_deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")

with ``"optimizer": {"type": "FlashAdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}`` in the config.
DeepSpeed's JSON accepts only DeepSpeed's own optimizer names, so flashdist takes the optimizer section out of
the config, checks it, and hands DeepSpeed a callable that builds the optimizer (``deepspeed.initialize(
optimizer=callable)``, which DeepSpeed calls with the model parameters). The rest of the config is
DeepSpeed's, unchanged, except that ``zero_allow_untested_optimizer`` is set (DeepSpeed asks for it for any
optimizer it does not ship).

What the optimizer sees. ZeRO hands the optimizer ONE flat 1-d partition per param group on each rank
(several parameters concatenated, cut at arbitrary points) and calls ``step()`` once per group. flashdist
builds the optimizer with ``flat_layout=True``: each partition's moments are 8-bit codes in groups of 32
consecutive values of the partition, created at the first step. DeepSpeed's bf16 settings choose the mode:

- default (``"bf16": {"enabled": true}``): DeepSpeed keeps fp32 master partitions. flashdist replaces the two
  fp32 Adam moments (8 bytes per parameter, over the ZeRO world size) by 8-bit codes (2.125 bytes).
- bf16 master weights (``"bf16": {"enabled": true, "bf16_master_weights_and_grads": true,
  "bf16_optimizer_states": true}``): DeepSpeed's master partitions are bf16, and flashdist keeps an int8 rho
  next to each, so the master weights keep 24-bit precision: 2 + 1 bytes instead of 4, and 2.125 bytes of
  moments instead of 8.

ZeRO-Offload (``"offload_optimizer": {"device": "cpu"}``, fp32 masters): DeepSpeed keeps the master partitions
on the CPU and calls the optimizer's ``step()`` there, so flashdist's fused CPU step runs on them and the 8-bit
state lives in host memory beside them; ``zero_force_ds_cpu_optimizer`` is set false for it.

Checkpoints (see docs/deepspeed.md). ``engine.save_checkpoint`` / ``load_checkpoint`` round-trip exactly at
the same world size: DeepSpeed stores the optimizer's portable state dict (fp32 ``exp_avg``/``exp_avg_sq`` of
partition shape, and rho). To change the world size, :func:`to_universal` runs DeepSpeed's ds_to_universal on
a copy whose master weights carry rho (DeepSpeed's converter drops every optimizer key but the moments and
the masters), and :func:`load_checkpoint` loads the universal checkpoint and restores rho from the 24-bit
masters (an engine made by :func:`initialize` does that in ``engine.load_checkpoint`` itself, for the clients
that call it: Accelerate's ``load_state``, the Trainer's resume). :func:`fp32_state_dict_from_zero_checkpoint`
is DeepSpeed's zero_to_fp32 with rho added back. Every file of a checkpoint folder is read through
:mod:`flashdist.checkpoint.deepspeed_files`, the reader the converter uses too (``torch.load(weights_only=True)``
with DeepSpeed's own classes allowed).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import shutil
import tempfile
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._compat import HAS_DEEPSPEED
from ..checkpoint import deepspeed_files, output
from ..checkpoint.files import inside
from ..quant import rho as R

_TYPE_PREFIX = "flashdist."
# Set by this integration; a config may repeat the value but not change it.
_FIXED_PARAMS = {"flat_layout": True}


def _require_deepspeed():
    if not HAS_DEEPSPEED:
        raise ImportError("flashdist.integrations.deepspeed needs DeepSpeed: pip install deepspeed (on a machine "
                          "without CUDA: DS_BUILD_OPS=0 pip install deepspeed, and run with DS_ACCELERATOR=cpu)")
    import deepspeed

    return deepspeed


# ----- the optimizer section ---------------------------------------------------------------------------


def optimizer_classes() -> dict[str, type]:
    """The flashdist optimizers a DeepSpeed config can name, keyed by lower-case class name."""
    from .. import optim

    classes = {}
    for name in optim.__all__:
        cls = getattr(optim, name)
        if (isinstance(cls, type) and issubclass(cls, optim.FlashOptimizer)
                and cls not in (optim.FlashOptimizer, optim.FlashMuon)):  # (FlashMuon: refused, _named_class)
            classes[name.lower()] = cls
    return classes


def _named_class(type_name: Any) -> type | None:
    """The flashdist class a config's ``optimizer.type`` names; None for a name that is DeepSpeed's."""
    if not isinstance(type_name, str):
        return None
    key = type_name.strip().lower()
    explicit = key.startswith(_TYPE_PREFIX)
    key = key[len(_TYPE_PREFIX):] if explicit else key
    classes = optimizer_classes()
    if key == "flashmuon":
        raise ValueError("flashdist: the DeepSpeed config asks for FlashMuon, which DeepSpeed cannot run: ZeRO hands "
                         "the optimizer flat 1-d partitions of many parameters, so no rank holds the whole matrices "
                         "Newton-Schulz needs; train FlashMuon under FSDP2 (fully_shard), or name DeepSpeed's Muon")
    if key in classes:
        return classes[key]
    if explicit or key.startswith("flash"):
        names = ", ".join(sorted(cls.__name__ for cls in classes.values()))
        raise ValueError(f"flashdist: the DeepSpeed config asks for optimizer type {type_name!r}, which flashdist "
                         f"does not have. flashdist optimizers: {names}")
    return None


@dataclass(frozen=True)
class OptimizerSpec:
    """A flashdist optimizer taken out of a DeepSpeed config; DeepSpeed calls it with the model parameters."""

    cls: type
    """The optimizer class, e.g. flashdist.FlashAdamW."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the class: the config's ``optimizer.params`` plus ``flat_layout=True``."""

    def __call__(self, params) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


def _optimizer_kwargs(cls: type, params: Any) -> dict:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError(f"flashdist: optimizer.params in the DeepSpeed config must be an object, got {params!r}")
    accepted = [name for name, p in inspect.signature(cls.__init__).parameters.items()
                if name not in ("self", "params") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        hint = " (FlashAdamW is AdamW; FlashAdam has Adam's L2 weight decay)" if "adam_w_mode" in unknown else ""
        raise ValueError(f"flashdist: optimizer.params of {cls.__name__} in the DeepSpeed config has "
                         f"{unknown}, which {cls.__name__} does not take{hint}. It takes: {', '.join(accepted)}")
    kwargs = dict(params)
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    for key, value in _FIXED_PARAMS.items():
        if key in kwargs and kwargs[key] != value:
            raise ValueError(f"flashdist: optimizer.params.{key}={kwargs[key]!r} in the DeepSpeed config: under "
                             f"DeepSpeed it is always {value!r} (ZeRO's flat partitions); remove it")
        kwargs[key] = value
    return kwargs


def offload_device(config: dict) -> str | None:
    """Where a DeepSpeed config puts the optimizer: ``"cpu"``, ``"nvme"``, or None when it stays with the model
    (``zero_optimization.offload_optimizer.device``, or the deprecated ``zero_optimization.cpu_offload``)."""
    zero = config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") or {}
    device = offload.get("device", "none") if isinstance(offload, dict) else "none"
    if device in (None, "none") and zero.get("cpu_offload"):
        device = "cpu"
    return None if device in (None, "none") else str(device)


def _check_combination(config: dict, cls: type) -> None:
    """Settings with which a flashdist optimizer cannot run under DeepSpeed: errors before anything starts."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        raise ValueError(f"flashdist: {cls.__name__} under DeepSpeed needs ZeRO (zero_optimization.stage 1, 2 or 3), "
                         f"the config has stage {stage!r}. Without ZeRO, use flashdist on the model directly "
                         f"({cls.__name__}(model.parameters()) with a bf16 model keeps 24-bit master weights).")
    bf16 = config.get("bf16") or config.get("bfloat16") or {}
    device = offload_device(config)
    if device not in (None, "cpu"):
        raise ValueError(f"flashdist: {cls.__name__} runs with zero_optimization.offload_optimizer.device 'cpu', the "
                         f"config has {device!r}: DeepSpeed's NVMe offload swaps optimizer state through its own "
                         "async_io op and assumes DeepSpeed's fp32 state layout. Use device 'cpu' (the 8-bit state "
                         "is small enough for host memory) or remove offload_optimizer")
    if device == "cpu" and config.get("zero_force_ds_cpu_optimizer") is True:
        raise ValueError(f"flashdist: the DeepSpeed config offloads the optimizer with zero_force_ds_cpu_optimizer: "
                         f"true, which lets only DeepSpeedCPUAdam step on the CPU. Remove the setting (flashdist sets "
                         f"it false: {cls.__name__}'s fused CPU step runs there instead)")
    if device == "cpu" and bf16.get("bf16_master_weights_and_grads"):
        raise ValueError("flashdist: bf16.bf16_master_weights_and_grads with zero_optimization.offload_optimizer: "
                         "DeepSpeed (0.19) allows bf16 master partitions under ZeRO-Offload only for its own "
                         "DeepSpeedCPUAdam (an exact type check when ZeRO starts). Remove "
                         "bf16_master_weights_and_grads and bf16_optimizer_states: the host then keeps fp32 masters "
                         "and flashdist's 8-bit moments (6.125 bytes per parameter), or drop offload_optimizer for "
                         "bf16 masters + rho on the accelerator (5.125)")
    if bf16.get("bf16_master_weights_and_grads") and bf16.get("enabled", False) in (False, "false", None):
        raise ValueError("flashdist: bf16.bf16_master_weights_and_grads is set but bf16.enabled is false: DeepSpeed "
                         "would train the fp32 model with bf16 master partitions (16-bit masters, and no memory "
                         "saved on the model). Set bf16.enabled: true for a bf16 model with bf16 masters + rho, or "
                         "remove bf16_master_weights_and_grads for fp32 masters")
    if bf16.get("bf16_master_weights_and_grads") and not bf16.get("bf16_optimizer_states"):
        raise ValueError("flashdist: bf16.bf16_master_weights_and_grads needs bf16.bf16_optimizer_states: true as "
                         "well (without it DeepSpeed requires ZeRO-Offload). flashdist keeps its own 8-bit moments "
                         "either way; the setting only tells DeepSpeed the optimizer state is not fp32")
    if config.get("zero_allow_untested_optimizer") is False:
        raise ValueError("flashdist: the DeepSpeed config sets zero_allow_untested_optimizer: false; DeepSpeed "
                         "needs it true for any optimizer it does not ship. Remove the setting.")


def prepare_config(config: dict) -> tuple[dict, OptimizerSpec | None]:
    """Split a DeepSpeed config (a dict) into the config DeepSpeed gets and the flashdist optimizer it names.

    Returns ``(config, None)`` unchanged when the optimizer section is absent or names a DeepSpeed optimizer.
    Otherwise the optimizer section is removed (DeepSpeed silently ignores it when an optimizer is passed, so
    leaving it would be misleading), ``zero_allow_untested_optimizer`` is set (and ``zero_force_ds_cpu_optimizer``
    cleared when the config offloads the optimizer to the CPU), and the optimizer's type,
    parameters and the combination with the rest of the config are checked: an unknown flashdist type, a bad
    parameter or an impossible combination raises ``ValueError`` here, before DeepSpeed starts."""
    if not isinstance(config, dict):
        raise TypeError(f"flashdist: prepare_config takes the config as a dict, got {type(config).__name__} (read a "
                        "JSON file with load_config)")
    section = config.get("optimizer")
    if not isinstance(section, dict):
        return config, None
    cls = _named_class(section.get("type"))
    if cls is None:
        return config, None
    extra = sorted(set(section) - {"type", "params"})
    if extra:
        raise ValueError(f"flashdist: the optimizer section of the DeepSpeed config has {extra}; it takes only "
                         "'type' and 'params'")
    kwargs = _optimizer_kwargs(cls, section.get("params"))
    _check_combination(config, cls)
    try:  # every hyper-parameter check the class makes, on a stand-in parameter (flat layout: no state)
        cls([torch.zeros(1, dtype=torch.bfloat16, requires_grad=True)], **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"flashdist: optimizer.params of {cls.__name__} in the DeepSpeed config: {e}") from e
    out = {k: v for k, v in config.items() if k != "optimizer"}
    out["zero_allow_untested_optimizer"] = True
    if offload_device(config) == "cpu":  # DeepSpeed otherwise refuses any CPU optimizer but DeepSpeedCPUAdam
        out["zero_force_ds_cpu_optimizer"] = False
    return out, OptimizerSpec(cls, kwargs)


def load_config(config) -> dict:
    """A DeepSpeed config given as a dict (copied) or as the path of a JSON file."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"flashdist: DeepSpeed config file {path!r} does not exist")
        with open(path) as f:
            text = f.read()
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            import hjson  # DeepSpeed reads configs with hjson too (comments, trailing commas)

            return json.loads(json.dumps(hjson.loads(text)))
    raise TypeError(f"flashdist: a DeepSpeed config is a dict or a path to a JSON file, got {type(config).__name__}")


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with flashdist optimizers in the config: same arguments, same return value
    ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    The config (``config=``, ``config_params=`` or ``args.deepspeed_config``; a dict or a JSON path) may name
    a flashdist optimizer, e.g. ``"optimizer": {"type": "FlashAdamW", "params": {"lr": 3e-4}}`` (also
    ``"flashdist.FlashAdamW"``; any class of flashdist.optim); its ``params`` are the class's keyword arguments.
    Any other config goes to DeepSpeed untouched. Raises ``ValueError`` before DeepSpeed starts for an unknown
    flashdist type, a bad parameter, an impossible combination (no ZeRO, NVMe offload, ZeRO-Offload with bf16
    master partitions, bf16_master_weights_and_grads without bf16_optimizer_states or with bf16 disabled;
    checked for a flashdist optimizer passed as ``optimizer=`` too), an ``optimizer=`` argument together with a
    flashdist optimizer in the config, or a flashdist optimizer passed as ``optimizer=`` without
    ``flat_layout=True`` (a callable that builds one is checked when DeepSpeed calls it). The flashdist optimizer
    itself is ``engine.basic_optimizer``; the engine's master writers are wrapped (:func:`keep_master_writes`)."""
    _require_deepspeed()
    ds_initialize = _deepspeed_initialize()
    bound = inspect.signature(ds_initialize).bind(*args, **kwargs)
    call = dict(bound.arguments)
    _check_optimizer_argument(call.get("optimizer"))
    ds_args = call.get("args")
    source = call.get("config")
    if source is None:
        source = call.get("config_params")
    from_args = source is None and getattr(ds_args, "deepspeed_config", None) is not None
    if from_args:
        source = ds_args.deepspeed_config
    config = load_config(source) if source is not None else None
    optimizer = call.get("optimizer")
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        call["optimizer"] = _CheckedCallable(optimizer, config)
    elif config is not None and _is_flash(optimizer):
        _check_combination(config, type(optimizer))
    if config is None:
        return _with_master_writes_kept(ds_initialize(**call))
    config, spec = prepare_config(config)
    if spec is None:
        return _with_master_writes_kept(ds_initialize(**call))
    if call.get("optimizer") is not None:
        raise ValueError(f"flashdist: the DeepSpeed config names {spec.cls.__name__} and an optimizer was passed "
                         "as well; pass one of the two")
    if from_args:
        ds_args = copy.copy(ds_args)
        ds_args.deepspeed_config = None
        call["args"] = ds_args
    call.pop("config_params", None)
    call["config"] = config
    call["optimizer"] = spec
    return _with_master_writes_kept(ds_initialize(**call))


def _with_master_writes_kept(result):
    """``deepspeed.initialize``'s result, its engine's master writers wrapped by :func:`keep_master_writes` and
    its ``load_checkpoint`` by :func:`keep_universal_masters`."""
    keep_master_writes(result[0])
    keep_universal_masters(result[0])
    return result


def keep_universal_masters(engine) -> None:
    """Make the engine's own ``load_checkpoint`` do what :func:`load_checkpoint` adds after a universal load (the
    24-bit masters split again into the bf16 partition and rho, the fp32 moments read again), for the clients
    that call it themselves: Accelerate's ``load_state``, the Trainer's ``resume_from_checkpoint``, Lightning.
    :func:`initialize` calls it. Without it, such a load in bf16-master mode rounds every master to bf16 (up to
    half a bf16 spacing) without a word. Nothing for an engine without a flashdist optimizer; idempotent."""
    if not _is_flash(getattr(engine, "basic_optimizer", None)) or getattr(engine, _RESTORES_UNIVERSAL, False):
        return
    load = engine.load_checkpoint
    signature = inspect.signature(load)

    def load_checkpoint(*args, **kwargs):
        result = load(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        _restore_after_load(engine, result, bound.arguments)
        return result

    load_checkpoint.__doc__ = load.__doc__
    engine.load_checkpoint = load_checkpoint
    setattr(engine, _RESTORES_UNIVERSAL, True)


_RESTORES_UNIVERSAL = "_flashdist_restores_universal_masters"


def keep_master_writes(engine) -> None:
    """Make a master weight written through DeepSpeed (``deepspeed.utils.safe_set_full_fp32_param``) exactly the
    written value, for a flashdist optimizer in bf16-master mode. :func:`initialize` calls it.

    DeepSpeed writes the value into its bf16 master partition through ``.data`` (no version counter moves), so
    the optimizer cannot see the write, and the partition's old rho would be added to the new weight (up to one
    bf16 spacing off, silently). The engine's writers (each parameter's ``set_full_hp_param`` under ZeRO 1/2,
    re-wrapped whenever DeepSpeed links them again, and the ZeRO-3 optimizer's) are wrapped: after DeepSpeed's
    write, the fp32 value is split into the bf16 partition and rho (:func:`_split_into`). Nothing for an engine
    without a flashdist optimizer, for fp32 master partitions (no rho) or for writes of optimizer state."""
    from ..optim.base import FlashOptimizer

    opt, zero = getattr(engine, "basic_optimizer", None), getattr(engine, "optimizer", None)
    if not isinstance(opt, FlashOptimizer) or getattr(zero, "_flashdist_keeps_master_writes", False):
        return
    if engine.zero_optimization_stage() == 3:
        write = zero.set_full_hp_param

        def set_full_hp_param_stage3(value, param, optim_state_key=None):
            write(value, param, optim_state_key)
            if optim_state_key is None and param.requires_grad:
                group, offset, numel = zero.grad_position[zero.get_param_id(param)]
                start = numel * zero._get_param_partition_rank(param)  # as DeepSpeed's own write cuts it
                theta = value.flatten().narrow(0, start, numel).float()
                _split_into(opt, zero.fp32_partitioned_groups_flat[group], theta, offset)

        zero.set_full_hp_param = set_full_hp_param_stage3
    elif hasattr(zero, "bit16_groups") and hasattr(zero, "_link_all_hp_params"):
        def wrap_parameters():
            for lps, master in zip(zero.bit16_groups, master_partitions(engine)):
                for lp in lps:
                    lp.set_full_hp_param = _kept_write(opt, lp, master, lp.set_full_hp_param)

        link = zero._link_all_hp_params

        def link_all_hp_params(*args, **kwargs):  # DeepSpeed links the parameters again after a load
            result = link(*args, **kwargs)
            wrap_parameters()
            return result

        zero._link_all_hp_params = link_all_hp_params
        wrap_parameters()
    else:
        return
    zero._flashdist_keeps_master_writes = True


def _kept_write(opt, lp: torch.Tensor, master: torch.Tensor, write):
    """``lp.set_full_hp_param`` (ZeRO 1/2), followed by the exact split of this rank's fragment of the value."""
    def set_full_hp_param(value, optim_state_key=None):
        write(value, optim_state_key)
        mapping = getattr(lp, "_hp_mapping", None)
        if optim_state_key is None and mapping is not None:
            lp_address, hp_address = mapping.lp_fragment_address, mapping.hp_fragment_address
            theta = value.flatten().narrow(0, lp_address.start, lp_address.numel).float()
            _split_into(opt, master, theta, hp_address.start)

    return set_full_hp_param


def _is_flash(optimizer) -> bool:
    from ..optim.base import FlashOptimizer

    return isinstance(optimizer, FlashOptimizer)


def _check_optimizer_argument(optimizer) -> None:
    """A flashdist optimizer built on the model parameters has row-layout state for tensors that ZeRO replaces
    by its flat partitions right after (their moments would stay fp32): refuse it, saying what works."""
    from ..optim import FlashMuon

    if isinstance(optimizer, FlashMuon) or optimizer is FlashMuon:  # (its class as the callable)
        raise ValueError("flashdist: FlashMuon was passed to DeepSpeed, which cannot run it: ZeRO hands the optimizer "
                         "flat partitions of many parameters, not the whole matrices Newton-Schulz needs; train "
                         "FlashMuon under FSDP2 (fully_shard), or use DeepSpeed's own Muon")
    if _is_flash(optimizer) and not all(g.get("flat_layout") for g in optimizer.param_groups):
        raise ValueError(f"flashdist: a {type(optimizer).__name__} built on the model was passed to DeepSpeed; ZeRO "
                         "swaps its parameters for flat partitions. Name it in the config's optimizer section, or "
                         f"pass a callable: optimizer=lambda params: {type(optimizer).__name__}(params, "
                         "flat_layout=True, ...)")


class _CheckedCallable:
    """A user's optimizer callable, with the check above applied to what it builds."""

    def __init__(self, build, config: dict | None = None):
        self.build = build
        self.config = config

    def __call__(self, params):
        optimizer = self.build(params)
        _check_optimizer_argument(optimizer)
        if self.config is not None and _is_flash(optimizer):
            _check_combination(self.config, type(optimizer))
        return optimizer


# ----- deepspeed.initialize as Accelerate, the Trainer and Lightning call it ----------------------------

_ORIGINAL_INITIALIZE = "_flashdist_original_initialize"


def _deepspeed_initialize():
    """DeepSpeed's own ``initialize``, also after :func:`register` replaced the module attribute."""
    deepspeed = _require_deepspeed()
    return getattr(deepspeed.initialize, _ORIGINAL_INITIALIZE, deepspeed.initialize)


def register() -> None:
    """Route ``deepspeed.initialize`` through :func:`initialize`, for frameworks that call DeepSpeed themselves
    (Accelerate's ``prepare``, the Transformers Trainer, Lightning's DeepSpeedStrategy). Afterwards:

    - a config naming a flashdist optimizer (``"type": "FlashAdamW"``) builds it with ``flat_layout=True`` (with
      Accelerate, pass ``accelerate.utils.DummyOptim(params)`` as the optimizer, as for any config optimizer);
    - a flashdist optimizer instance built without ``flat_layout=True`` is refused with the fix (its moments
      would stay fp32 on ZeRO's flat partitions), and the combinations :func:`initialize` lists are refused;
    - every other call goes to DeepSpeed unchanged.

    Idempotent. Without it, DeepSpeed does not know flashdist's names and raises its own ``AttributeError``
    (``torch.optim`` has no ``FlashAdamW``), and a flashdist optimizer instance is not checked."""
    deepspeed = _require_deepspeed()
    if hasattr(deepspeed.initialize, _ORIGINAL_INITIALIZE):
        return
    original = deepspeed.initialize

    def routed(*args, **kwargs):
        return initialize(*args, **kwargs)

    routed.__doc__ = initialize.__doc__
    routed.__wrapped__ = original
    setattr(routed, _ORIGINAL_INITIALIZE, original)
    deepspeed.initialize = routed


# ----- live engine: universal-checkpoint load with rho -------------------------------------------------


def _flash_optimizer(engine):
    from ..optim.base import FlashOptimizer

    basic = getattr(engine, "basic_optimizer", None)
    if not isinstance(basic, FlashOptimizer):
        raise TypeError(f"flashdist: this DeepSpeed engine's optimizer is {type(basic).__name__}, not a flashdist "
                        "optimizer (build the engine with flashdist.integrations.deepspeed.initialize)")
    return basic


def master_partitions(engine) -> list[torch.Tensor]:
    """This rank's flat master-weight partitions of a ZeRO engine: the tensors the optimizer steps (fp32, or
    bf16 in bf16-master mode), one per param group (ZeRO 1/2) or sub-group (ZeRO 3)."""
    zero = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        return list(zero.fp32_partitioned_groups_flat)
    for name in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):  # ZeRO 1/2, BF16_Optimizer
        if hasattr(zero, name):
            return list(getattr(zero, name))
    raise TypeError(f"flashdist: {type(zero).__name__} is not a DeepSpeed ZeRO optimizer")


@torch.no_grad()
def fp32_master_weights(engine) -> dict[str, torch.Tensor]:
    """The full fp32 master weights of a live engine, keyed by the model's parameter names, on every rank (one
    all-gather per parameter: every rank calls it): DeepSpeed's ``safe_get_full_fp32_param`` plus rho in
    bf16-master mode. Parameters without a gradient are returned as they are, in fp32."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = _flash_optimizer(engine)
    masters = master_partitions(engine)
    if engine.zero_optimization_stage() != 3 and hasattr(engine.optimizer, "bit16_groups"):
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        # ZeRO 1/2 link each parameter's view of the optimizer state once, right after the FIRST group's first
        # step, when the flat-layout state of the other groups does not exist yet: link every group again.
        for lps, master in zip(engine.optimizer.bit16_groups, masters):
            if master in opt.state:
                lazy_init_hp_params_optimizer_state(lps, master, opt.state)
    rho_dtype = next((opt.state[m]["rho"].dtype for m in masters if "rho" in opt.state.get(m, {})), None)
    master_dtype = engine.optimizer.master_weights_and_grads_dtype
    out = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p) if p.requires_grad else None
        if master is None:
            out[name] = p.detach().float().cpu()
            continue
        if rho_dtype is not None:
            rho = safe_get_full_optimizer_state(p, "rho")
            master = R.merge(master.to(master_dtype), rho.to(rho_dtype))
        out[name] = master.float().cpu()
    return out


@torch.no_grad()
def load_checkpoint(engine, load_dir: str, tag: str | None = None, **kwargs):
    """``engine.load_checkpoint(load_dir, tag, **kwargs)``, returning what it returns, plus what DeepSpeed's
    universal-checkpoint loader leaves out for flashdist.

    DeepSpeed's loader writes the float moments and the master weights straight into the optimizer (flashdist
    re-quantizes the moments, here or at the next step) and drops any other state. In bf16-master mode the
    master partitions are bf16, so it would round the 24-bit masters of a checkpoint made by
    :func:`to_universal` to bf16; this function splits them again into the bf16 master and rho, exactly. Every
    rank calls it. For non-universal loads it is ``engine.load_checkpoint``; on an engine made by
    :func:`initialize`, ``engine.load_checkpoint`` itself does the same (:func:`keep_universal_masters`)."""
    result = engine.load_checkpoint(load_dir, tag, **kwargs)
    if not getattr(engine, _RESTORES_UNIVERSAL, False):
        _restore_after_load(engine, result, dict(kwargs, load_dir=load_dir, tag=tag))
    return result


def _restore_after_load(engine, result, arguments: dict) -> None:
    """After ``engine.load_checkpoint(**arguments)`` returned ``result``: rho and the fp32 moments again, where
    it loaded the optimizer state of a universal checkpoint."""
    if not engine.load_universal_checkpoint() or not arguments.get("load_optimizer_states", True):
        return
    if arguments.get("load_module_only", False) or result is None or result[0] is None:
        return
    _restore_universal_masters(engine, universal_folder(arguments["load_dir"], arguments.get("tag")))


def universal_folder(load_dir: str, tag: str | None = None) -> str:
    """The ``zero`` folder of the universal checkpoint ``load_dir/<tag>`` (``tag`` default: the
    ``latest_universal`` file), confined to ``load_dir`` as every checkpoint reader is
    (:mod:`flashdist.checkpoint.files`): a tag or a link that leads out of it is refused in one line."""
    source = None
    if tag is None:
        source = os.path.join(load_dir, "latest_universal")
        tag = deepspeed_files.read_tag(source)
    return str(inside(load_dir, os.path.join(tag, "zero"), source=source))


def _read_universal(folder: str, name: str, key: str = "fp32") -> torch.Tensor:
    from deepspeed.checkpoint.constants import PARAM

    return deepspeed_files.load_file(inside(folder, os.path.join(name, f"{key}.pt")))[PARAM]


def _reload_float_moments(opt, zero, masters: list[torch.Tensor], folder: str, stage3: bool) -> None:
    """Put back the fp32 moments of a universal checkpoint where DeepSpeed's loader left them in the master
    partitions' dtype: it gathers them into ``zeros_like(master)``, which in bf16-master mode rounds each
    moment to bf16 before flashdist re-quantizes it (8-bit codes a level off here and there, where the
    universal files hold the exact moments). Read from the files again, as DeepSpeed cuts them."""
    for i, master in enumerate(masters):
        state = opt.state.get(master, {})
        keys = [k for k, v in state.items() if k in ("exp_avg", "exp_avg_sq") and isinstance(v, torch.Tensor)
                and v.dtype != torch.float32]
        for key in keys:
            moment = torch.zeros(master.numel(), dtype=torch.float32, device=master.device)
            if stage3:
                offset = 0
                for p in zero.fp16_groups[i]:
                    piece = zero.load_hp_checkpoint_state(os.path.join(folder, zero.param_names[p]), key, param=p)
                    moment.narrow(0, offset, piece.numel()).copy_(piece.reshape(-1))
                    offset += piece.numel()
            else:
                for lp in zero.bit16_groups[i]:
                    mapping = getattr(lp, "_hp_mapping", None)
                    if mapping is None:
                        continue
                    full = _read_universal(folder, zero.param_names[lp], key).reshape(-1)
                    lp_address, hp_address = mapping.lp_fragment_address, mapping.hp_fragment_address
                    moment.narrow(0, hp_address.start, hp_address.numel).copy_(
                        full.narrow(0, lp_address.start, lp_address.numel))
            state[key] = moment


def _restore_universal_masters(engine, folder: str) -> None:
    opt = _flash_optimizer(engine)
    zero = engine.optimizer
    masters = master_partitions(engine)
    stage3 = engine.zero_optimization_stage() == 3
    if stage3:  # ZeRO-3: one flat master per sub-group; the optimizer's groups are empty outside step()
        groups = [opt.param_groups[zero.sub_group_to_group_id[i]] for i in range(len(masters))]
    else:
        groups = opt.param_groups
    _reload_float_moments(opt, zero, masters, folder, stage3)
    for group, master in zip(groups, masters):
        opt.ensure_state(master, group)  # re-quantize the loaded float moments; create rho
    if not stage3:
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        # Point DeepSpeed's per-parameter views of the optimizer state (safe_get_full_optimizer_state) at the
        # state as it is now, rather than at the float moments the loader wrote.
        for lps, master in zip(zero.bit16_groups, masters):
            lazy_init_hp_params_optimizer_state(lps, master, opt.state)
    if not any("rho" in opt.state[m] for m in masters):
        return
    if stage3:
        for i, master in enumerate(masters):
            pieces = [zero.load_hp_checkpoint_state(os.path.join(folder, zero.param_names[p]), "fp32", param=p)
                      for p in zero.fp16_groups[i]]
            theta = torch.cat([t.reshape(-1).float() for t in pieces])
            _split_into(opt, master, theta, 0)
            zero.fp16_partitioned_groups_flat[i].data.copy_(master.data)
            updated = zero.unflatten(zero.fp16_partitioned_groups_flat[i], zero.fp16_partitioned_groups[i])
            for partitioned, q in zip(zero.fp16_partitioned_groups[i], updated):
                partitioned.data = q.data
        return
    for i, master in enumerate(masters):
        for lp in zero.bit16_groups[i]:
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:
                continue
            full = _read_universal(folder, zero.param_names[lp]).reshape(-1)
            lp_address, hp_address = mapping.lp_fragment_address, mapping.hp_fragment_address
            theta = full.narrow(0, lp_address.start, lp_address.numel).float()
            _split_into(opt, master, theta, hp_address.start)
    zero.update_lp_params()  # the bf16 model weights from the restored masters (an all-gather)


@torch.no_grad()
def _split_into(opt, master: torch.Tensor, theta: torch.Tensor, start: int) -> None:
    rho = opt.state[master].get("rho")
    if rho is None:
        return
    low, new_rho = R.split(theta.to(master.device), master.dtype, rho.dtype)
    master.narrow(0, start, theta.numel()).copy_(low)
    rho.narrow(0, start, theta.numel()).copy_(new_rho)


# ----- offline: checkpoint folders ---------------------------------------------------------------------


def _tag_folder(checkpoint_dir: str | os.PathLike, tag: str | None) -> Path:
    """The tag folder of a checkpoint, which must hold a data-parallel run's ZeRO optimizer files."""
    folder = deepspeed_files.tag_folder(checkpoint_dir, tag)
    deepspeed_files.optimizer_files(folder)
    return folder


def _fold_optimizer_file(file: deepspeed_files.OptimizerFile) -> None:
    """Replace the bf16/fp16 master partitions of one rank's ZeRO optimizer file by fp32 ``param + rho`` and drop
    rho, in place (partitions without rho, as in the fp32-master mode, stay as they are)."""
    for k, (_, entry, master) in enumerate(file.partitions()):
        rho = entry.pop("rho", None)
        if rho is not None:
            n = master.numel()
            file.masters[k] = R.merge(master.reshape(-1), rho.reshape(-1)[:n]).reshape(master.shape)


def _link_or_copy(source: str, target: str) -> None:
    """Files fold_rho does not change (model states: the whole model under ZeRO 1/2) are hard-linked where the
    file system allows it."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def fold_rho(checkpoint_dir: str, output_dir: str, tag: str | None = None) -> str:
    """Copy a DeepSpeed ZeRO checkpoint of a flashdist optimizer, with each rank's master partitions as fp32
    ``param + rho`` (the 24-bit master weights) and rho dropped from the optimizer state. DeepSpeed's own
    tools (ds_to_universal, zero_to_fp32) then read the full-precision masters from it: without this, the
    masters of a bf16-master run are bf16 and rho is lost. A checkpoint of the default mode (fp32 masters) has
    no rho and is copied as it is. ``checkpoint_dir``: the folder given to ``engine.save_checkpoint`` (``tag``
    defaults to its ``latest``), or a tag folder itself. Writes ``output_dir/<tag>`` (which must not exist yet,
    or be empty) and ``output_dir/latest``; returns the tag folder.

    Files are read by :mod:`flashdist.checkpoint.deepspeed_files` (``torch.load(weights_only=True)`` with
    DeepSpeed's own classes allowed): every optimizer file is checked before anything is written, and a file
    holding anything else raises :class:`~flashdist.checkpoint.CheckpointError`."""
    _require_deepspeed()
    folder = _tag_folder(checkpoint_dir, tag)
    return _fold(folder, output_dir)


def _fold(folder: Path, output_dir: str | os.PathLike) -> str:
    tag = folder.name
    out = Path(output_dir) / tag
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"flashdist: {out} already exists; fold_rho writes a new folder: pass another "
                              "output_dir")
    files, _ = deepspeed_files.optimizer_files(folder)
    for path in files.values():  # refuse a bad file before writing any (tensors are memory-mapped, not read)
        deepspeed_files.read_optimizer_file(path, deepspeed_objects=True)
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(folder.iterdir()):
        target = out / path.name
        if path in files.values():
            # DeepSpeed's own classes, not stand-ins: the copy is a checkpoint DeepSpeed loads
            file = deepspeed_files.read_optimizer_file(path, deepspeed_objects=True)
            _fold_optimizer_file(file)
            torch.save(file.contents, target)
        elif path.is_file():
            _link_or_copy(path, target)
    with output.atomic_output(Path(output_dir) / "latest", directory=False) as tmp:  # a link there is replaced,
        tmp.write_text(tag)  # never written through
    return str(out)


def to_universal(checkpoint_dir: str, output_dir: str | None = None, tag: str | None = None, *,
                 num_workers: int = 1) -> str:
    """DeepSpeed's ds_to_universal for a flashdist checkpoint, keeping 24-bit master weights.

    ``checkpoint_dir`` is the folder given to ``engine.save_checkpoint``; ``tag`` defaults to its ``latest``.
    The universal checkpoint goes to ``output_dir`` (default ``<tag>_universal`` beside the tag folder), and
    ``latest_universal`` beside it names it, as ds_to_universal does. Load it at any world size (and from ZeRO
    1 to 2 or back; DeepSpeed's loader does not cross between ZeRO 1/2 and 3) with ``"checkpoint":
    {"load_universal": true}`` and :func:`load_checkpoint`. The moments travel as floats
    (ds_to_universal's ``exp_avg``/``exp_avg_sq``); in bf16-master mode the masters travel as fp32
    ``param + rho`` (:func:`fold_rho`) and :func:`load_checkpoint` splits them again. Needs the portable state
    dict format (the default). Returns ``output_dir``."""
    _require_deepspeed()
    from deepspeed.checkpoint import ds_to_universal

    folder = _tag_folder(checkpoint_dir, tag)
    output_dir = output_dir or str(folder.parent / f"{folder.name}_universal")
    _check_portable(folder)
    with tempfile.TemporaryDirectory(prefix="flashdist-fold-", dir=os.path.dirname(os.path.abspath(output_dir))) as tmp:
        folded = _fold(folder, tmp)
        ds_to_universal.main(Namespace(input_folder=folded, output_folder=output_dir, num_extract_workers=num_workers,
                                       num_merge_workers=num_workers, keep_temp_folder=False, strict=True,
                                       inject_missing_state=True))
    return output_dir


def _check_portable(folder: Path) -> None:
    files, _ = deepspeed_files.optimizer_files(folder)
    file = deepspeed_files.read_optimizer_file(files[min(files)])
    path, base = file.path, file.state
    groups = base["param_groups"]
    if any(g.get("flashdist_format") == "compressed" for g in groups):
        raise ValueError(f"flashdist: {path} holds the compressed optimizer state (codes and scales); DeepSpeed's "
                         "universal checkpoints carry float exp_avg/exp_avg_sq only. Save with the default "
                         "state_dict_format='portable' to convert.")
    states = base.get("state", {})
    keys = {k for entry in states.values() if isinstance(entry, dict) for k in entry} - {"step", "rho"}
    if keys and not {"exp_avg", "exp_avg_sq"} <= keys:
        raise ValueError(f"flashdist: {path} holds optimizer state {sorted(keys)}, not Adam's exp_avg/exp_avg_sq: "
                         "DeepSpeed's universal checkpoints (ds_to_universal) carry Adam's moments only, so a "
                         "FlashSGD/FlashSGDW/FlashLion checkpoint cannot change world size this way. Resume it at "
                         "the world size it was saved with, or export its weights with fp32_state_dict_from_zero_checkpoint.")


def fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The model's fp32 weights from a DeepSpeed ZeRO checkpoint of a flashdist optimizer, keyed by the model's
    parameter names: DeepSpeed's zero_to_fp32 (``get_fp32_state_dict_from_zero_checkpoint``), with each bf16
    master weight plus its rho in bf16-master mode (zero_to_fp32 alone returns the bf16 masters there).
    ``checkpoint_dir``: the folder given to ``engine.save_checkpoint`` (``tag`` defaults to its ``latest``), or a
    tag folder itself. (For the weights of a live model and optimizer: :func:`flashdist.export_fp32_state_dict`;
    of a live engine: :func:`fp32_master_weights`.)"""
    _require_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = _tag_folder(checkpoint_dir, tag)
    with tempfile.TemporaryDirectory(prefix="flashdist-fold-", dir=folder.parent) as tmp:
        _fold(folder, tmp)
        state = get_fp32_state_dict_from_zero_checkpoint(tmp, folder.name)
    return {name: t.float() if t.is_floating_point() else t for name, t in state.items()}


export_fp32_state_dict = fp32_state_dict_from_zero_checkpoint
"""The former name of :func:`fp32_state_dict_from_zero_checkpoint`, kept so that existing imports work."""
