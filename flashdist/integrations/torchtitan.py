"""torchtitan (0.3.0): flashdist optimizers named in a torchtitan job config, checkpointed by its
CheckpointManager.

In a config registry (a function that returns ``Trainer.Config``)::

    from flashdist.integrations.torchtitan import flash_adamw

    optimizer=flash_adamw(lr=3e-4, weight_decay=0.1),

(one catch-all group; ``flash_adam``, ``flash_sgd``, ``flash_sgdw`` and ``flash_lion`` do the same for the
other classes, each with its own defaults: see :data:`HELPERS`)

or, for several groups (first matching pattern wins, as in torchtitan)::

    from flashdist.integrations.torchtitan import FlashOptimizersContainer
    from torchtitan.components.optimizer import ParamGroupConfig

    optimizer=FlashOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"\\.bias$|norm", optimizer_name="FlashAdamW",
                         optimizer_kwargs={"lr": 3e-4, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name="FlashAdamW",
                         optimizer_kwargs={"lr": 3e-4, "weight_decay": 0.1, "master_weight_bits": 24}),
    ]),

:class:`FlashOptimizersContainer` is torchtitan's ``OptimizersContainer`` that also knows the names
``FlashAdamW``, ``FlashAdam``, ``FlashSGD``, ``FlashSGDW``, ``FlashLion`` and ``FlashMuon`` (torchtitan's own
names still work, so one container may mix them; FlashMuon's non-matrix groups take ``"use_muon": False`` in
their ``optimizer_kwargs``). ``optimizer_kwargs`` are the optimizer's per-group options (``lr``,
``betas``, ``master_weight_bits``, ``quantize_states``, ``companded``, ...); the container-wide
``state_dict_format`` and ``backend`` fields reach every flashdist optimizer it builds
(``optimizer_factory_kwargs_by_name={"FlashAdamW": {...}}`` overrides them per name). torchtitan's
``implementation`` field (fused/foreach) is for torch's optimizers and does not reach flashdist's groups.

Names and options are checked when the container is built: a name neither flashdist nor torchtitan knows is
refused with the list of valid names, and a group option the chosen class does not take (Adam's ``betas`` and
``eps`` left behind when ``optimizer_name`` is switched to ``FlashSGD`` on the command line, say) is refused
naming it, instead of sitting unused in the param group.

Checkpoints. torchtitan saves the optimizer as a flat, name-keyed dict (``state.<fqn>.<state>``), and its own
loader rebuilds each parameter's state from the keys of the LIVE optimizer state, which for flashdist are
codes and scales. The container's default ``state_dict_format="compressed"`` saves exactly those (codes,
scales and rho as DTensors with global shapes: 2.125 bytes + rho per parameter, resharded exactly by
torch.distributed.checkpoint at any world size, no fp32 copy of the moments made at save or load).
``state_dict_format="portable"`` (fp32 ``exp_avg``/``exp_avg_sq`` as torch.optim.AdamW, plus rho) works too:
the container's ``load_state_dict`` rebuilds each parameter's state from the keys the checkpoint holds,
not from the live ones. A checkpoint loads only into a container of the format it was saved with (DCP
looks up the keys of the loading side).

Memory: flashdist's rho only splits bf16/fp16 parameters. By default torchtitan keeps fp32 sharded
parameters and casts them for compute (``training.mixed_precision_param``), so flashdist saves the moments
only (8 -> 2.125 bytes per parameter); ``training.dtype = "bfloat16"`` makes the parameters bf16 and gives
the full 7.125-byte budget (bf16 parameter and gradient, int8 rho, 8-bit moments).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.utils import init_optim_state, load_flat_optim_state_dict

from ..checkpoint.state import FORMATS
from ..functional.backend import BACKENDS
from ..optim import FlashAdam, FlashAdamW, FlashLion, FlashMuon, FlashOptimizer, FlashSGD, FlashSGDW
from ..optim.muon import HEAD_NAMES

FLASH_OPTIMIZERS: dict[str, type[FlashOptimizer]] = {
    "FlashAdamW": FlashAdamW, "FlashAdam": FlashAdam, "FlashSGD": FlashSGD, "FlashSGDW": FlashSGDW,
    "FlashLion": FlashLion, "FlashMuon": FlashMuon,
}
# Group keys torchtitan adds for torch's fused/foreach kernels: not options of a flashdist optimizer.
_TORCH_IMPL_KEYS = ("fused", "foreach")
# Names torchtitan's own container may know (listed in errors when it resolves them).
_TORCHTITAN_CANDIDATES = ("Adam", "AdamW", "DistMuon", "Muon", "SGD", "Lion")
# Constructor options of every flashdist optimizer that are not per group (keys a group may not set).
_OPTIMIZER_WIDE = ("backend", "state_dict_format", "capturable", "graphed")
_GROUP_OPTIONS: dict[type, frozenset[str]] = {}


class FlashOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with flashdist's optimizers available by name (see the module
    docstring for a config). Everything else (param-group patterns, model parts, step, zero_grad, lr
    schedulers, the flat FQN-keyed state dict) is torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        state_dict_format: Literal["compressed", "portable"] = "compressed"
        """Checkpoint format of the flashdist optimizers: "compressed" (codes, scales and rho; exact
        resharding at any world size, the smallest checkpoint) or "portable" (fp32 moments as
        torch.optim.AdamW, plus rho)."""

        backend: Literal["auto", "triton", "reference"] = "auto"
        """flashdist step backend: "auto" (Triton kernel for CUDA tensors, eager torch otherwise)."""

        def __post_init__(self) -> None:
            if self.state_dict_format not in FORMATS:
                raise ValueError(f"flashdist: optimizer.state_dict_format must be one of {FORMATS}, got "
                                 f"{self.state_dict_format!r}")
            if self.backend not in BACKENDS:
                raise ValueError(f"flashdist: optimizer.backend must be one of {BACKENDS}, got {self.backend!r}")

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        # torchtitan resolves names through a static method and passes per-name factory kwargs: give every
        # flashdist name the container-wide options, without overriding what the config sets per name.
        defaults = {"state_dict_format": config.state_dict_format, "backend": config.backend}
        by_name = {name: {**defaults, **config.optimizer_factory_kwargs_by_name.get(name, {})}
                   for name in FLASH_OPTIMIZERS}
        by_name.update({k: v for k, v in config.optimizer_factory_kwargs_by_name.items() if k not in by_name})
        super().__init__(dataclasses.replace(config, optimizer_factory_kwargs_by_name=by_name),
                         model_parts=model_parts)

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        if name in FLASH_OPTIMIZERS:
            return FLASH_OPTIMIZERS[name]
        try:
            return OptimizersContainer._resolve_optimizer_factory(name)
        except NotImplementedError:  # torchtitan's bare "Optimizer X not added."
            raise ValueError(unknown_name_message(name)) from None

    @staticmethod
    def _build_param_groups(model, param_group_configs, impl_kwargs):
        for pg in param_group_configs:  # every name and option is checked before anything is built
            if pg.optimizer_name in FLASH_OPTIMIZERS:
                check_group_options(pg.optimizer_name, pg.pattern, pg.optimizer_kwargs)
            else:
                FlashOptimizersContainer._resolve_optimizer_factory(pg.optimizer_name)
        groups, patterns = OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)
        if "FlashMuon" in groups:
            _vectors_to_adamw(groups["FlashMuon"], patterns["FlashMuon"])
        for name, name_groups in groups.items():
            if name in FLASH_OPTIMIZERS:
                for group in name_groups:
                    for key in _TORCH_IMPL_KEYS:
                        group.pop(key, None)
        return groups, patterns

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torchtitan's loader takes each parameter's state keys from the live optimizer (codes and scales for
        # flashdist), so a portable checkpoint's exp_avg would never be looked up: rebuild flashdist's state
        # from the keys the flat dict holds; flashdist's load_state_dict checks them.
        # Every flashdist optimizer's part is found first, so a checkpoint of another model changes nothing.
        unflattened = {id(o): unflatten_state_dict(o, state_dict) for o in self.optimizers
                       if isinstance(o, FlashOptimizer)}
        for optim in self.optimizers:
            if isinstance(optim, FlashOptimizer):
                optim.load_state_dict(unflattened[id(optim)])
            else:
                init_optim_state(optim)
                load_flat_optim_state_dict(optim, state_dict)


def _vectors_to_adamw(groups: list[dict], patterns: list[str]) -> None:
    """Move the parameters of fewer than two dims that a FlashMuon Muon group's pattern matched (which FlashMuon
    refuses there: a model's own vectors no name pattern foresaw, as gpt_oss's attention sinks) into the first
    AdamW group (``use_muon=False``) of the config; a Muon group left empty goes. Without an AdamW group they
    stay, and FlashMuon refuses them."""
    adamw = next((g for g in groups if g.get("use_muon") is False), None)
    if adamw is None:
        return
    for group in [g for g in groups if g.get("use_muon") is not False]:  # (a copy: groups loses its empty ones)
        vectors = [i for i, p in enumerate(group["params"]) if p.ndim < 2]  # ((1, d) weights: Muon's, as before)
        for i in vectors:
            adamw["params"].append(group["params"][i])
            adamw["param_names"].append(group["param_names"][i])
        group["params"] = [p for i, p in enumerate(group["params"]) if i not in vectors]
        group["param_names"] = [n for i, n in enumerate(group["param_names"]) if i not in vectors]
        if not group["params"]:
            at = next(i for i, g in enumerate(groups) if g is group)
            del groups[at], patterns[at]


def unflatten_state_dict(optim: torch.optim.Optimizer, flat: dict[str, Any]) -> dict[str, Any]:
    """The ``torch.optim.Optimizer.state_dict()``-shaped dict of ``optim`` in torchtitan's flat, FQN-keyed
    optimizer dict ``flat`` (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``), taking every key saved for
    each parameter of ``optim``. Keys of other optimizers are ignored."""
    by_prefix: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith(("state.", "param_groups.")):
            prefix, _, leaf = key.rpartition(".")
            by_prefix.setdefault(prefix, {})[leaf] = value
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for gi, group in enumerate(optim.param_groups):
        fqns = group.get("param_names")
        if not fqns:
            raise ValueError(f"flashdist: param group {gi} of {type(optim).__name__} has no param_names; torchtitan's "
                             "checkpoints are keyed by parameter name: build the optimizer from named_parameters()")
        ids = []
        for fqn in fqns:
            saved = by_prefix.get(f"state.{fqn}")
            if saved:
                state[index] = dict(saved)
            ids.append(index)
            index += 1
        saved_group = by_prefix.get(f"param_groups.{fqns[0]}")
        if saved_group is None:
            raise ValueError(f"flashdist: the checkpoint has no optimizer settings for parameter '{fqns[0]}' "
                             f"(no 'param_groups.{fqns[0]}.*' keys): was it saved from another model?")
        groups.append({**saved_group, "params": ids, "param_names": list(fqns)})
    return {"state": state, "param_groups": groups}


def torchtitan_names() -> list[str]:
    """The optimizer names torchtitan's own container resolves (of those it had in 0.3.0 and later)."""
    found = []
    for name in _TORCHTITAN_CANDIDATES:
        try:
            OptimizersContainer._resolve_optimizer_factory(name)
        except NotImplementedError:
            continue
        found.append(name)
    return found


def unknown_name_message(name: str) -> str:
    valid = [*FLASH_OPTIMIZERS, *torchtitan_names()]
    close = difflib.get_close_matches(name.lower(), [v.lower() for v in valid], n=1)
    hint = f" (did you mean {next(v for v in valid if v.lower() == close[0])!r}?)" if close else ""
    return (f"flashdist: optimizer_name {name!r} is neither a flashdist nor a torchtitan optimizer{hint}; "
            f"valid names: {', '.join(valid)}")


def group_options(cls: type[FlashOptimizer]) -> frozenset[str]:
    """The per-group options of ``cls`` (the keys of its ``defaults``): what a param group may set."""
    if cls not in _GROUP_OPTIONS:
        # (1, 1): a matrix, which every class takes (FlashMuon's Muon groups hold matrices only)
        probe = cls([torch.zeros(1, 1, dtype=torch.bfloat16, requires_grad=True)])
        _GROUP_OPTIONS[cls] = frozenset(probe.defaults)
    return _GROUP_OPTIONS[cls]


def check_group_options(name: str, pattern: str, options: dict[str, Any]) -> None:
    """Refuse, in one line, the keys of a param group's ``optimizer_kwargs`` that ``FLASH_OPTIMIZERS[name]``
    does not take per group: torch keeps unknown group keys without a word, so Adam's ``betas`` and ``eps``
    left in a group switched to FlashSGD would silently do nothing."""
    cls = FLASH_OPTIMIZERS[name]
    unknown = sorted(set(options) - group_options(cls))
    if not unknown:
        return
    wide = [k for k in unknown if k in _OPTIMIZER_WIDE]
    where = (f"; {', '.join(wide)} apply to the whole optimizer: set them as the container's state_dict_format / "
             f"backend or in optimizer_factory_kwargs_by_name[{name!r}]") if wide else ""
    raise ValueError(f"flashdist: param group {pattern!r} ({name}) sets {', '.join(unknown)}, which {name} does "
                     f"not take per group (left from another optimizer's config?){where}; {name} takes: "
                     f"{', '.join(sorted(group_options(cls)))}")


def _catch_all(name: str, state_dict_format: str, backend: str,
               options: dict[str, Any]) -> FlashOptimizersContainer.Config:
    return FlashOptimizersContainer.Config(
        state_dict_format=state_dict_format, backend=backend,
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs=options)])


def flash_adamw(lr: float = 8e-4, *, state_dict_format: Literal["compressed", "portable"] = "compressed",
                backend: Literal["auto", "triton", "reference"] = "auto",
                **kwargs: Any) -> FlashOptimizersContainer.Config:
    """torchtitan's ``default_adamw`` with FlashAdamW: one catch-all group, betas (0.9, 0.95), eps 1e-8,
    weight decay 0.1 (torchtitan's defaults); ``kwargs`` are further FlashAdamW options
    (``master_weight_bits``, ``quantize_states``, ``companded``, or to replace the defaults)."""
    return _catch_all("FlashAdamW", state_dict_format, backend,
                      {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, **kwargs})


def flash_adam(lr: float = 8e-4, *, state_dict_format: Literal["compressed", "portable"] = "compressed",
               backend: Literal["auto", "triton", "reference"] = "auto",
               **kwargs: Any) -> FlashOptimizersContainer.Config:
    """FlashAdam (L2 weight decay, as torch.optim.Adam) in one catch-all group: betas (0.9, 0.95), eps 1e-8,
    no weight decay; ``kwargs`` as for :func:`flash_adamw`."""
    return _catch_all("FlashAdam", state_dict_format, backend,
                      {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, **kwargs})


def flash_lion(lr: float = 1e-4, *, state_dict_format: Literal["compressed", "portable"] = "compressed",
               backend: Literal["auto", "triton", "reference"] = "auto",
               **kwargs: Any) -> FlashOptimizersContainer.Config:
    """FlashLion in one catch-all group: betas (0.9, 0.99), weight decay 0.1 (Lion's usual lr is 3-10x below
    AdamW's, its weight decay as many times higher); no eps (Lion has none)."""
    return _catch_all("FlashLion", state_dict_format, backend,
                      {"lr": lr, "betas": (0.9, 0.99), "weight_decay": 0.1, **kwargs})


def flash_sgd(lr: float = 1e-2, *, state_dict_format: Literal["compressed", "portable"] = "compressed",
              backend: Literal["auto", "triton", "reference"] = "auto",
              **kwargs: Any) -> FlashOptimizersContainer.Config:
    """FlashSGD in one catch-all group: momentum 0.9, no weight decay; ``kwargs``: ``nesterov``,
    ``dampening``, ``weight_decay`` (L2, as torch.optim.SGD) and the flashdist options."""
    return _catch_all("FlashSGD", state_dict_format, backend,
                      {"lr": lr, "momentum": 0.9, "weight_decay": 0.0, **kwargs})


def flash_sgdw(lr: float = 1e-2, *, state_dict_format: Literal["compressed", "portable"] = "compressed",
               backend: Literal["auto", "triton", "reference"] = "auto",
               **kwargs: Any) -> FlashOptimizersContainer.Config:
    """FlashSGDW (decoupled weight decay) in one catch-all group: momentum 0.9, weight decay 0.1."""
    return _catch_all("FlashSGDW", state_dict_format, backend,
                      {"lr": lr, "momentum": 0.9, "weight_decay": 0.1, **kwargs})


def flash_muon(lr: float = 0.02, *, adamw_lr: float = 8e-4,
               state_dict_format: Literal["compressed", "portable"] = "compressed",
               backend: Literal["auto", "triton", "reference"] = "auto",
               **kwargs: Any) -> FlashOptimizersContainer.Config:
    """FlashMuon in two groups, as :func:`flashdist.muon_param_groups` splits a model: embeddings, norms,
    biases and the output head (names matching ``NON_MUON_PATTERN``) take FlashAdamW's update
    (``use_muon=False``, ``adamw_lr``, betas (0.9, 0.95), weight decay 0.1); every other parameter, the
    matrices, takes Muon's (momentum 0.95, Nesterov, weight decay 0.1), with ``flatten=False``: a weight of
    more than 2 dims there (the ``(experts, out, in)`` weights of torchtitan's ``GroupedExperts``) is a stack of
    matrices, each orthogonalized on its own; a parameter the Muon group's pattern matches that has fewer than
    two dims (gpt_oss's attention sinks) takes the AdamW group's update. ``kwargs``
    are further options of the Muon group."""
    return FlashOptimizersContainer.Config(
        state_dict_format=state_dict_format, backend=backend, param_groups=[
            ParamGroupConfig(pattern=NON_MUON_PATTERN, optimizer_name="FlashMuon", optimizer_kwargs={
                "lr": adamw_lr, "adamw_betas": (0.9, 0.95), "weight_decay": 0.1, "use_muon": False}),
            ParamGroupConfig(pattern=r".*", optimizer_name="FlashMuon",
                             optimizer_kwargs={"lr": lr, "weight_decay": 0.1, "flatten": False, **kwargs})])


NON_MUON_PATTERN = r"embed|norm|bias|(^|\.)(" + "|".join(HEAD_NAMES) + r")\."
"""Parameter names :func:`flash_muon` gives FlashAdamW's update: embeddings (torchtitan's ``tok_embeddings``,
Hugging Face's ``embed_tokens``), norms, biases, and the output layers :func:`flashdist.muon_param_groups`
leaves to AdamW (a module named one of ``HEAD_NAMES``: torchtitan's ``output``, ``lm_head``, ...)."""


HELPERS: dict[str, Callable[..., FlashOptimizersContainer.Config]] = {
    "FlashAdamW": flash_adamw, "FlashAdam": flash_adam, "FlashLion": flash_lion, "FlashSGD": flash_sgd,
    "FlashSGDW": flash_sgdw, "FlashMuon": flash_muon,
}
"""The config helper (one group; two for FlashMuon) of each name of :data:`FLASH_OPTIMIZERS`."""
