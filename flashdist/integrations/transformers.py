"""Hugging Face Transformers: flashdist optimizers chosen the way Trainer users choose optimizers.

    import flashdist.integrations.transformers as fd_hf
    fd_hf.register()                                   # once, before TrainingArguments is built
    args = TrainingArguments(optim="flash_adamw", optim_args="master_weight_bits=24", bf16=True, ...)
    Trainer(model=model.to(torch.bfloat16), args=args, ...).train()

Names: ``flash_adamw``, ``flash_adam``, ``flash_sgd``, ``flash_sgdw``, ``flash_lion``, ``flash_muon`` (see
:data:`OPTIMIZERS`). ``flash_muon`` builds its param groups from the model (``flashdist.muon_param_groups``:
matrices take Muon, embeddings, the output head, norms and biases AdamW with ``adam_beta1/2`` and
``adam_epsilon``), in place of the Trainer's decay / no-decay groups, with ``weight_decay`` split as those
are (the Trainer's ``get_decay_parameter_names``: none for biases and norm weights).
The Trainer's arguments map as for its own optimizers: ``learning_rate`` -> ``lr``, ``adam_beta1/2`` ->
``betas`` (Adam and Lion), ``adam_epsilon`` -> ``eps`` (Adam), ``weight_decay`` per param group (the Trainer's
decay / no-decay groups). ``optim_args`` is the Trainer's ``"key=value,key=value"`` string; each key is a keyword
argument of the class (``master_weight_bits=24``, ``quantize_states=false``, ``momentum=0.9``,
``backend=reference``, ``master_weight_bits=none``), each value read as a bool, None, int, float or string.

Why a ``register()`` call. Transformers has no public way to add an optimizer name: ``TrainingArguments``
converts ``optim`` to the closed enum ``OptimizerNames`` in ``__post_init__``, and the Trainer looks the name up
in the table ``transformers.trainer_optimizer._OPTIMIZER_HANDLERS``. ``register()`` adds the flashdist names to
both (and routes them past the Trainer's own ``optim_args`` split, so that a malformed item gets flashdist's
error naming it), on the Transformers versions it was tested with (:data:`SUPPORTED_TRANSFORMERS`), and refuses any other
version with an error that names the public-API route: :func:`optimizer_cls_and_kwargs` gives the pair the
Trainer's public ``optimizer_cls_and_kwargs=`` argument takes, on any Transformers that has that argument.

DeepSpeed. When the arguments enable DeepSpeed (``TrainingArguments(deepspeed=...)`` or ``accelerate launch``
with DeepSpeed), the optimizer is built with ``flat_layout=True``: ZeRO hands it flat 1-d partitions, whose
moments stay 8-bit only in the flat layout (docs/deepspeed.md). FSDP and single-process runs keep the
row-aligned layout.

Memory. The saving needs the model in bf16 BEFORE the Trainer builds the optimizer (``model.to(torch.bfloat16)``
or ``from_pretrained(..., dtype=torch.bfloat16)``): a bf16 parameter gets an int8 ``rho`` (24-bit masters), an
fp32 one gets none and keeps its 4 bytes (docs/integrations.md#precision).
"""

from __future__ import annotations

import enum
import inspect
import os
from typing import Any

import torch

SUPPORTED_TRANSFORMERS = ">=5.17,<6"
"""Transformers versions :func:`register` was tested with (the enum and handler table it extends)."""

OPTIMIZERS = {"flash_adamw": "FlashAdamW", "flash_adam": "FlashAdam", "flash_sgd": "FlashSGD",
              "flash_sgdw": "FlashSGDW", "flash_lion": "FlashLion", "flash_muon": "FlashMuon"}
"""``TrainingArguments.optim`` names and the flashdist.optim class each builds."""

# Which TrainingArguments each class takes: (betas from adam_beta1/2, eps from adam_epsilon)
_ADAM_ARGS = {"FlashAdamW": (True, True), "FlashAdam": (True, True), "FlashLion": (True, False),
              "FlashSGD": (False, False), "FlashSGDW": (False, False), "FlashMuon": (True, True)}
_ARG_PREFIX = {"FlashMuon": "adamw_"}  # FlashMuon's AdamW groups take adamw_betas, adamw_eps


def _optimizer_class(name: str) -> type:
    from .. import optim

    key = str(getattr(name, "value", name)).strip().lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"flashdist: unknown optimizer name {name!r}; flashdist names: {', '.join(OPTIMIZERS)}")
    return getattr(optim, OPTIMIZERS[key])


# optim_args a class takes for the param groups the handler builds, not as constructor arguments
_GROUP_ARGS = {"FlashMuon": ("adamw_lr",)}  # the AdamW groups' learning rate (muon_param_groups' adamw_lr)


def _accepted(cls: type) -> list[str]:
    """Keyword arguments of ``cls``, following ``**kwargs`` up the class hierarchy (FlashAdam -> FlashAdamW)."""
    names: list[str] = list(_GROUP_ARGS.get(cls.__name__, ()))
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in params if p.name not in ("self", "params", *names)
                  and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def _value(text: str) -> Any:
    """One optim_args value: bool, None, int, float, else the string itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text.strip()


def parse_optim_args(optim_args: str | dict | None, cls: type = None) -> dict[str, Any]:
    """``TrainingArguments.optim_args`` (``"key=value,key=value"``, or a dict of strings as the Trainer parses
    it) as typed keyword arguments of ``cls``. Raises ``ValueError`` naming a malformed item or a key ``cls``
    does not take."""
    if not optim_args:
        return {}
    if isinstance(optim_args, str):
        items = {}
        for item in optim_args.replace(" ", "").split(","):
            if not item:
                continue
            if item.count("=") != 1:
                raise ValueError(f"flashdist: optim_args item {item!r} is not key=value (optim_args={optim_args!r}; "
                                 "separate items with commas, e.g. 'master_weight_bits=24,quantize_states=true')")
            key, value = item.split("=")
            items[key] = value
    elif isinstance(optim_args, dict):
        items = dict(optim_args)
    else:
        raise TypeError(f"flashdist: optim_args must be a 'key=value,...' string, got {type(optim_args).__name__}")
    kwargs = {key: _value(v) if isinstance(v, str) else v for key, v in items.items()}
    if cls is not None:
        accepted = _accepted(cls)
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise ValueError(f"flashdist: optim_args has {unknown}, which {cls.__name__} does not take. It takes: "
                             f"{', '.join(a for a in accepted if a != 'params')}")
    return kwargs


def uses_deepspeed(args) -> bool:
    """Whether these TrainingArguments train under DeepSpeed (``deepspeed=`` or an Accelerate DeepSpeed launch)."""
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None:
        return True
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").strip().lower() in ("1", "true", "yes")


def optimizer_cls_and_kwargs(name: str, args=None, optim_args: str | dict | None = None,
                             model: torch.nn.Module | None = None) -> tuple[type, dict]:
    """``(class, kwargs)`` for the Trainer's public ``optimizer_cls_and_kwargs=`` argument, from a flashdist
    name (:data:`OPTIMIZERS`) and the TrainingArguments, mapped as ``optim=`` maps them (module docstring).
    ``optim_args`` defaults to ``args.optim_args``. Works on any Transformers whose Trainer takes
    ``optimizer_cls_and_kwargs``; ``register()`` is not needed for it. ``flash_muon`` needs ``model``: its
    param groups (``kwargs["params"]``, which the Trainer takes out of the dict and uses in place of its own)
    come from it, so a pair serves one Trainer: call this again for the next.

        Trainer(model, args, optimizer_cls_and_kwargs=fd_hf.optimizer_cls_and_kwargs("flash_adamw", args))"""
    name = str(getattr(name, "value", name))  # TrainingArguments hold an OptimizerNames member
    cls = _optimizer_class(name)
    kwargs: dict[str, Any] = {}
    if args is not None:
        kwargs["lr"] = args.learning_rate
        betas, eps = _ADAM_ARGS[cls.__name__]
        prefix = _ARG_PREFIX.get(cls.__name__, "")
        if betas:
            kwargs[prefix + "betas"] = (args.adam_beta1, args.adam_beta2)
        if eps:
            kwargs[prefix + "eps"] = args.adam_epsilon
        if optim_args is None:
            optim_args = args.optim_args
    kwargs.update(parse_optim_args(optim_args, cls))
    group_args = {k: kwargs.pop(k) for k in _GROUP_ARGS.get(cls.__name__, ()) if k in kwargs}
    deepspeed = args is not None and uses_deepspeed(args)
    if "flat_layout" in kwargs and bool(kwargs["flat_layout"]) != deepspeed:
        raise ValueError(f"flashdist: optim_args sets flat_layout={kwargs['flat_layout']!r}; it follows the launcher "
                         "(True under DeepSpeed ZeRO, False otherwise): remove it")
    if deepspeed and cls.__name__ == "FlashMuon":
        raise ValueError("flashdist: optim='flash_muon' cannot run under DeepSpeed ZeRO (its flat partitions hold no "
                         "whole matrices for Newton-Schulz); train it with FSDP2 or in one process")
    if deepspeed:
        kwargs["flat_layout"] = True  # ZeRO's flat partitions keep 8-bit moments only in the flat layout
    probe = [torch.zeros(1, 1, dtype=torch.bfloat16, requires_grad=True)]
    if "adamw_lr" in group_args:  # (checked as the AdamW group's lr it becomes)
        probe = [{"params": probe, "use_muon": False, "lr": group_args["adamw_lr"]}]
    try:  # every check the class makes, now rather than at the Trainer's first step
        cls(probe, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"flashdist: {cls.__name__} from optim={name!r}, optim_args={optim_args!r}: {e}") from e
    if cls.__name__ == "FlashMuon":
        if model is None:
            raise ValueError("flashdist: optim='flash_muon' builds its param groups from the model: pass model= to "
                             "optimizer_cls_and_kwargs (the Trainer's handler does, after register())")
        from ..optim.muon import muon_param_groups

        groups = muon_param_groups(model, adamw_lr=group_args.get("adamw_lr"))
        # the Trainer's decay / no-decay split, by its own rule (optim_args win; without args, FlashMuon's default)
        decay = kwargs.get("weight_decay", getattr(args, "weight_decay",
                                                   inspect.signature(cls).parameters["weight_decay"].default))
        decayed = _trainer_decay_names(model)
        groups = [{**group, "params": params, "weight_decay": decay if on else 0.0}
                  for group in groups for on in (True, False)
                  if (params := [(n, p) for n, p in group["params"] if (n in decayed) == on])]
        kwargs["params"] = groups  # the Trainer takes kwargs["params"] as the groups
    return cls, kwargs


def _trainer_decay_names(model: torch.nn.Module) -> set[str]:
    """The parameter names the Trainer gives weight decay: its ``get_decay_parameter_names`` (not biases, not
    norm layers by type or name), a method that reads nothing of the Trainer it is bound to."""
    from transformers import Trainer

    return set(Trainer.get_decay_parameter_names(None, model))


# ----- registration ------------------------------------------------------------------------------------


def _check_version():
    import transformers
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = Version(transformers.__version__)
    if Version(version.base_version) not in SpecifierSet(SUPPORTED_TRANSFORMERS):  # 5.25.0.dev0 counts as 5.25.0
        raise ImportError(
            f"flashdist: register() supports transformers{SUPPORTED_TRANSFORMERS}, this is {transformers.__version__}"
            ". Use the public route instead: Trainer(..., optimizer_cls_and_kwargs=flashdist.integrations."
            "transformers.optimizer_cls_and_kwargs('flash_adamw', args)) with a supported optim name in args, or "
            "Trainer(..., optimizers=(FlashAdamW(model.parameters(), ...), None))")
    try:
        from transformers import trainer_optimizer
        from transformers.training_args import OptimizerNames
    except ImportError as e:
        raise ImportError(f"flashdist: transformers {transformers.__version__} lacks the optimizer table register() "
                          f"extends ({e}); use flashdist.integrations.transformers.optimizer_cls_and_kwargs") from e
    handlers = getattr(trainer_optimizer, "_OPTIMIZER_HANDLERS", None)
    if not isinstance(handlers, dict) or not issubclass(OptimizerNames, enum.Enum):
        raise ImportError(f"flashdist: transformers {transformers.__version__} has no optimizer handler table; use "
                          "flashdist.integrations.transformers.optimizer_cls_and_kwargs")
    return OptimizerNames, handlers


def _handler(ctx) -> tuple[type, dict]:
    """The Trainer's handler for a flashdist name: ``ctx`` is transformers' OptimizerContext."""
    return optimizer_cls_and_kwargs(ctx.args.optim, ctx.args, ctx.optim_args, ctx.model)


def _add_member(enum_cls: type, value: str) -> None:
    """Add ``value`` to a str Enum as the member NAME=value: lookup by value (what TrainingArguments does),
    by name, iteration and listing all see it."""
    if value in enum_cls._value2member_map_:
        return
    name = value.upper()
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    setattr(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._member_names_.append(name)
    enum_cls._value2member_map_[value] = member


def register(*, deepspeed: bool = True) -> None:
    """Make ``TrainingArguments(optim="flash_adamw")`` (and every name of :data:`OPTIMIZERS`) build flashdist
    optimizers in the Trainer. Idempotent; call it before building TrainingArguments (or parsing them with
    HfArgumentParser). On an untested Transformers version it raises ``ImportError`` naming the public route,
    and changes nothing.

    With ``deepspeed=True`` (the default) and DeepSpeed installed, it also runs
    ``flashdist.integrations.deepspeed.register()``, so that a DeepSpeed config given to the Trainer may name
    ``"type": "FlashAdamW"``, and a flashdist optimizer passed as ``optimizers=(...)`` without
    ``flat_layout=True`` is refused under ZeRO instead of keeping fp32 moments."""
    names, handlers = _check_version()
    if deepspeed:
        from .._compat import HAS_DEEPSPEED

        if HAS_DEEPSPEED:
            from . import deepspeed as fd_deepspeed

            fd_deepspeed.register()
    for value in OPTIMIZERS:
        _add_member(names, value)
        handlers[names(value)] = _handler
    _route_flashdist_names()


def _route_flashdist_names() -> None:
    """Make the Trainer's public ``get_optimizer_cls_and_kwargs`` send a flashdist name straight to
    :func:`optimizer_cls_and_kwargs`: Transformers splits ``optim_args`` before it looks the handler up, so a
    malformed item would fail in its unpacking (``not enough values to unpack``) before flashdist's parser
    could name the item. Other names go to Transformers' own method, unchanged."""
    from transformers import Trainer

    original = Trainer.get_optimizer_cls_and_kwargs
    if getattr(original, "_flashdist_route", False):
        return

    def get_optimizer_cls_and_kwargs(args, model=None):
        if str(getattr(args.optim, "value", args.optim)) in OPTIMIZERS:
            return optimizer_cls_and_kwargs(args.optim, args, model=model)
        return original(args, model)

    get_optimizer_cls_and_kwargs._flashdist_route = True
    get_optimizer_cls_and_kwargs.__doc__ = original.__doc__
    Trainer.get_optimizer_cls_and_kwargs = staticmethod(get_optimizer_cls_and_kwargs)
