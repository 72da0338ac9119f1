"""FlashMuon, and the param groups it wants (``muon_param_groups``)."""

from __future__ import annotations

import math
import numbers
import operator

import torch

from .. import distributed as D
from ..distributed.gather import OwnerOrthogonalize
from ..errors import CaptureRefused
from ..functional.adam import flash_adam
from ..functional.muon import flash_muon, unchosen_view
from .base import FlashOptimizer
from .params import check_betas, check_number, param_name
from .plan import refuse_while_capturing

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic coefficients
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
HEAD_NAMES = ("lm_head", "output", "head", "classifier", "score")  # output layers muon_param_groups leaves to AdamW


def _check_adamw(betas, eps) -> None:
    """The AdamW groups' ``adamw_betas`` and ``adamw_eps``, as FlashAdamW checks its betas and eps."""
    check_betas(betas, high_open=True, name="adamw_betas")
    check_number("adamw_eps", eps, low=0.0)
    if eps == 0:
        raise ValueError("flashdist: adamw_eps must be > 0, got 0 (as FlashAdamW's eps: 8-bit second moments can "
                         "be exactly 0)")


class FlashMuon(FlashOptimizer):
    """Muon (Keller Jordan, 2024; ``torch.optim.Muon``) with 24-bit master weights and an 8-bit companded
    momentum, for matrices; FlashAdamW's update for the other parameters of the same optimizer.

    Per matrix (a parameter of two or more dims, viewed as ``(shape[0], prod(shape[1:]))``), as
    torch.optim.Muon: ``buf = lerp(buf, g, 1 - momentum)``; ``U = lerp(g, buf, momentum)`` (Nesterov) or
    ``buf``; ``O = NewtonSchulz(U)`` (bf16, ``ns_steps`` quintic iterations with ``ns_coefficients`` after a
    Frobenius normalisation clamped at ``eps``); ``theta = theta * (1 - lr * weight_decay) - adjusted_lr * O``
    with ``adjusted_lr = lr * sqrt(max(1, rows / cols))`` (``adjust_lr_fn`` None or "original") or
    ``lr * 0.2 * sqrt(max(rows, cols))`` ("match_rms_adamw"). The momentum update and the weight update are
    elementwise and run on each rank's local shard; Newton-Schulz needs the whole matrix: under FSDP2 or
    tensor parallelism each matrix's update is gathered (bf16) to one owner rank, orthogonalized there and
    sent back (``flashdist.distributed.gather``, 4 bytes per parameter per step on each rank), so every rank
    gets the one-process bits at any world size and mesh. Param groups with ``use_muon=False`` (embeddings,
    the output head, norms, biases: ``flashdist.muon_param_groups(model)`` builds the groups) take
    FlashAdamW's update with ``lr``, ``weight_decay``, ``adamw_betas`` and ``adamw_eps`` of their group.

    Bytes per parameter held (bf16 parameters) for Muon matrices: the parameter (2) + rho (1, int8) + the
    bf16 gradient (2) + the momentum buffer (int8 code 1 + a bf16 scale per 32 values 1/16) = 6.0625, plus
    the transient update of the matrices being orthogonalized; torch.optim.Muon with fp32 master weights
    holds 12. AdamW groups: 7.125, as FlashAdamW.

    With ``quantize_states=False`` and fp32 parameters (or bf16 parameters with ``master_weight_bits=32``,
    whose master weight is any fp32 value) the Muon update is torch.optim.Muon's bit for bit on the same
    device, and the AdamW groups are FlashAdamW's bit for bit.

    Args:
        params: parameters or param groups, as for any torch optimizer (``named_parameters()`` gives error
            messages with names); a group with ``use_muon=True`` (the default) holds only parameters of two
            or more dims. bf16/fp16/fp32, plain tensors or FSDP2 / tensor-parallel DTensors.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as
            ``torch.optim.Muon`` (defaults 1e-3, 0.1, 0.95, True, (3.4445, -4.775, 2.0315), 1e-7, 5, None);
            ``lr`` and ``weight_decay`` are those of AdamW in ``use_muon=False`` groups.
        flatten: how a Muon group's parameters of more than 2 dims are orthogonalized (2-D ones are their own
            matrix): True, as one matrix ``(shape[0], prod(shape[1:]))`` (conv weights, Keller Jordan's
            reshape); False, as a stack of matrices over the last two dims, each orthogonalized on its own
            with its own learning-rate adjustment (MoE experts ``(experts, out, in)``); None (the default)
            refuses them in one line, since neither view is right for every weight and torch.optim.Muon
            takes 2-D parameters only. ``flashdist.muon_param_groups(model)`` sets it from the module.
            A group key ``transposed`` (default False) says the group's matrices are stored as ``(in, out)``,
            the transpose of ``nn.Linear``'s ``(out, in)`` (Hugging Face's fused experts marked
            ``is_transposed``: GPT-OSS, Llama 4): ``adjust_lr_fn`` then reads each matrix's rows and columns
            swapped, as for the ``nn.Linear`` weight it stands for (the orthogonalization does not depend on
            it: Newton-Schulz of a transpose is the transpose of Newton-Schulz's, bit for bit).
        adamw_betas, adamw_eps: AdamW's betas and eps in ``use_muon=False`` groups ((0.9, 0.999), 1e-8).
        master_weight_bits, quantize_states, companded, state_dict_format: as :class:`flashdist.FlashAdamW`;
            the portable state dict holds fp32 ``momentum_buffer`` (torch.optim.Muon's name) plus ``rho`` and
            ``step`` for Muon matrices, ``exp_avg`` / ``exp_avg_sq`` for AdamW groups.
        backend: "auto" (default), "triton", "cpu" or "reference", as :class:`flashdist.FlashAdamW`: the Muon
            groups' elementwise phases run as Triton kernels on CUDA and as fused C++ phases on the CPU
            (Newton-Schulz between them is torch's matmuls), the AdamW groups FlashAdamW's fused steps; the
            same bits either way.
        capturable, graphed: as :class:`flashdist.FlashAdamW`: on one GPU the whole step (both kernels,
            Newton-Schulz's matmuls, the AdamW groups) is captured in a CUDA graph and replayed, with the
            bits of eager steps; the learning rate is read on the device, and the Muon kernels read each
            gradient's address from a device cell that ``GraphedStep`` writes before a replay, so replays
            follow the gradients wherever ``zero_grad(set_to_none=True)`` and backward put them (a gradient of
            another dtype, or strided, steps eagerly). A step with sharded Muon matrices
            (FSDP2, tensor parallelism) runs eagerly, its AdamW groups included: the exchange that
            orthogonalizes them between ranks is not captured.

    Caveats: ``use_muon`` decides a group's state and is fixed once the optimizer is built. A matrix whose
    gradient holds a NaN or an Inf keeps its weight for that step (Newton-Schulz spreads the value over the
    whole matrix) and the groups of 32 momentum values holding it keep theirs; ``optimizer.skipped`` counts
    the values left unchanged. Not yet: captured steps of sharded matrices, DeepSpeed's flat partitions.
    """

    _moments = ("momentum_buffer",)
    keeps_step_count = False  # torch.optim.Muon keeps no step count
    whole_matrices = True
    newer_group_options = ("flatten", "transposed")  # a checkpoint saved before these existed keeps the live value

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None, *,
                 flatten: bool | None = None,
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 master_weight_bits: int | None = 24, quantize_states: bool = True, companded: bool = True,
                 backend: str = "auto", state_dict_format: str = "portable", capturable: bool = False,
                 graphed: bool = False):
        _check_adamw(adamw_betas, adamw_eps)  # (checked here too: the AdamW groups may come later)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, flatten=flatten, transposed=False, use_muon=True,
                        adamw_betas=tuple(adamw_betas),
                        adamw_eps=adamw_eps, master_weight_bits=master_weight_bits,
                        quantize_states=quantize_states, companded=companded, flat_layout=False)
        super().__init__(params, defaults, backend=backend, state_dict_format=state_dict_format,
                         capturable=capturable, graphed=graphed)

    def add_param_group(self, param_group: dict) -> None:
        """As the family's; a group also may not name AdamW's options as torch.optim.AdamW does: ``betas``
        (in any group) and, in a ``use_muon=False`` group, ``eps`` (a Muon group's ``eps`` is Newton-Schulz's)
        would be kept and never read, as the AdamW groups read ``adamw_betas`` and ``adamw_eps``."""
        if isinstance(param_group, dict):
            adamw = param_group.get("use_muon", self.defaults["use_muon"]) is False
            # (a FlashMuon group copied back holds adamw_eps, and eps as Newton-Schulz's default: not the user's)
            for key in ("betas", "eps") if adamw and "adamw_eps" not in param_group else ("betas",):
                if key in param_group:
                    where = "with use_muon=False" if adamw else "of Muon matrices"
                    raise ValueError(f"flashdist: a FlashMuon param group {where} sets {key!r}, which no FlashMuon "
                                     f"update reads: the AdamW groups (use_muon=False) read 'adamw_{key}' (in the "
                                     f"group, or FlashMuon(..., adamw_{key}=...) for every AdamW group)")
        super().add_param_group(param_group)

    def _check_saved_group(self, index: int, saved: dict) -> None:
        # an SGD state dict holds a momentum_buffer too: its groups have no Newton-Schulz options
        if saved.get("use_muon", self.param_groups[index]["use_muon"]) and not {"ns_coefficients", "ns_steps"} <= saved.keys():
            raise ValueError(f"flashdist: param group {index} of the state dict has no Newton-Schulz options "
                             "(ns_coefficients, ns_steps): FlashMuon and torch.optim.Muon save them, so another "
                             "optimizer saved it (SGD's momentum_buffer has Muon's name); load it into that one")

    def _reset_caches(self) -> None:
        super()._reset_caches()
        self._owner_position = 0  # the round-robin position of the next sharded matrix's owner
        self._dims_checked: dict[int, tuple] = {}  # id(group) -> (flatten, its params) when their dims last passed

    def _check_state_shapes(self, group: dict, params: list[torch.Tensor]) -> None:
        """As the family's, and first: a parameter moved into a group of the other kind (``use_muon``) after its
        state was made, whose state is the other update's (a momentum buffer, or Adam's moments and step)."""
        for p in params:
            state = self.state.get(p)
            if state and any(key.startswith("momentum_buffer") for key in state) != group["use_muon"]:
                raise ValueError(f"flashdist: {self._name(group, p)} is in a group with use_muon={group['use_muon']} "
                                 f"but its state was made by the {'Muon' if group['use_muon'] is False else 'AdamW'} "
                                 "update (moved between groups after a step?): give it back to its group, or del "
                                 "optimizer.state[p] to start its state anew")
        super()._check_state_shapes(group, params)

    def moments_of(self, group: dict) -> tuple[str, ...]:
        return self._moments if group["use_muon"] else ("exp_avg", "exp_avg_sq")

    def _check_hyperparameters(self, group: dict) -> None:
        use_muon = group["use_muon"]
        if not isinstance(use_muon, bool):
            raise ValueError(f"flashdist: use_muon must be True or False, got {use_muon!r}")
        check_number("lr", group["lr"], low=0.0)
        check_number("weight_decay", group["weight_decay"], low=0.0)
        if group.get("flat_layout", False):
            raise ValueError("flashdist: FlashMuon does not take flat_layout groups (DeepSpeed's flat "
                             "partitions hold no whole matrices to orthogonalize)")
        state = next((self.state[p] for p in group["params"] if p in self.state), None)
        if state:
            was_muon = any(key.startswith("momentum_buffer") for key in state)
            if was_muon != use_muon and not any(  # (else a parameter moved in: the step names it)
                    any(key.startswith("momentum_buffer") for key in self.state[p]) == use_muon
                    for p in group["params"] if self.state.get(p)):
                raise ValueError(f"flashdist: use_muon of a param group was {was_muon} when its state was made and "
                                 f"is now {use_muon}; it decides the state and is fixed: build a new optimizer")
        if not use_muon:
            _check_adamw(group["adamw_betas"], group["adamw_eps"])
            return
        check_number("momentum", group["momentum"], low=0.0, high=1.0)
        check_number("eps", group["eps"], low=0.0)
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"flashdist: nesterov must be True or False, got {group['nesterov']!r}")
        coefficients = group["ns_coefficients"]
        if (not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3
                or not all(isinstance(c, numbers.Real) and math.isfinite(c) for c in coefficients)):
            raise ValueError(f"flashdist: ns_coefficients must be three finite numbers (a, b, c), got {coefficients!r}")
        steps = group["ns_steps"]
        if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or not 0 <= steps < 100:
            raise ValueError(f"flashdist: ns_steps must be an int in [0, 100) (as torch.optim.Muon), got {steps!r}")
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"flashdist: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {group['adjust_lr_fn']!r}")
        flatten = group.get("flatten")  # (a group loaded from a state dict saved before the key existed: None)
        if flatten is not None and not isinstance(flatten, bool):
            raise ValueError(f"flashdist: flatten must be None, True or False, got {flatten!r}")
        if not isinstance(group.get("transposed", False), bool):
            raise ValueError(f"flashdist: transposed must be True or False, got {group['transposed']!r}")
        # before anything changes, and again whenever the group's list or flatten changed since it last passed
        # (an identity compare per parameter, as the step plans make, not a Python loop each step)
        params = group["params"]
        seen = self._dims_checked.get(id(group))
        if (seen is not None and seen[0] is flatten and len(seen[1]) == len(params)
                and all(map(operator.is_, params, seen[1]))):
            return
        for i, p in enumerate(params):
            p = p[1] if isinstance(p, tuple) else p  # (named parameters, before add_param_group unpacks them)
            if not isinstance(p, torch.Tensor) or p.ndim == 2:
                continue
            if p.ndim < 2:
                name = param_name(group, i, p, self.param_groups)
                raise ValueError(f"flashdist: {name} is in a Muon param group but has fewer than 2 dims; put it in "
                                 "a group with use_muon=False (flashdist.muon_param_groups(model) builds both groups)")
            if flatten is None:
                raise ValueError(unchosen_view(param_name(group, i, p, self.param_groups)))
        if any(g is group for g in self.param_groups):  # (a live group; not a dict a load is checking)
            self._dims_checked[id(group)] = (flatten, list(params))

    def _step_bucket(self, group, bucket, grads, step, skipped):
        if not group["use_muon"]:
            beta1, beta2 = group["adamw_betas"]
            flash_adam(bucket.params, bucket.local_grads(grads), *bucket.moments, *bucket.scales, bucket.rhos,
                       cols=bucket.cols, lr=group["lr"], beta1=float(beta1), beta2=float(beta2),
                       eps=float(group["adamw_eps"]), weight_decay=float(group["weight_decay"]), step=step,
                       decoupled=True, companded=group["companded"], skipped=skipped, backend=self.backend)
            return
        orthogonalize = None
        grads = bucket.local_grads(grads)
        if bucket.dtensor:
            refuse_while_capturing(bucket.device, "its Muon matrices are sharded (DTensors), and the exchange that "
                                   "orthogonalizes them between ranks is not captured: they step eagerly")
            # owners continue round-robin across buckets, groups and steps (the same calls in the same order on
            # every rank), so small groups do not all land on rank 0; which rank computes changes no bit
            flatten = group.get("flatten")
            orthogonalize = OwnerOrthogonalize(bucket.sources, first=self._owner_position,
                                               stacked=[p.ndim > 2 and flatten is False for p in bucket.sources])
            self._owner_position += len(bucket.sources)
        grad_cells = None
        if self._grad_cells is not None and orthogonalize is None:
            # a GraphedStep capturing: the momentum kernels read each gradient's address from a cell (allocated
            # in the graph's pool: the capture runs nothing), which GraphedStep writes before each replay; they
            # load gradients 16 bytes at a time, so one that starts off that boundary is not captured
            if any(g.data_ptr() % 16 for g in grads):
                raise CaptureRefused("flashdist: a Muon matrix's gradient does not start on a 16-byte boundary (a "
                                     "view at an odd offset into a flat buffer), which the captured kernels load "
                                     "16 bytes at a time", retry=True)
            grad_cells = torch.empty((len(grads), 2), dtype=torch.int64, device=grads[0].device)
            self._grad_cells.append((list(bucket.sources), grad_cells, [g.dtype for g in grads]))
        flash_muon(bucket.params, grads, bucket.moments[0], bucket.scales[0], bucket.rhos,
                   cols=bucket.cols, shapes=[tuple(D.global_shape(p)) for p in bucket.sources], lr=group["lr"],
                   weight_decay=float(group["weight_decay"]), momentum=float(group["momentum"]),
                   nesterov=group["nesterov"], ns_coefficients=tuple(map(float, group["ns_coefficients"])),
                   ns_steps=group["ns_steps"], eps=float(group["eps"]), adjust_lr_fn=group["adjust_lr_fn"],
                   flatten=group.get("flatten"), transposed=group.get("transposed", False),
                   companded=group["companded"], skipped=skipped, backend=self.backend,
                   orthogonalize=orthogonalize, grad_cells=grad_cells)


def muon_param_groups(model: torch.nn.Module, *, exclude=(), adamw_lr: float | None = None,
                      adamw_weight_decay: float | None = None) -> list[dict]:
    """Param groups for :class:`FlashMuon`: ``[{"params": matrices, "use_muon": True}, {"params": the rest,
    "use_muon": False}]``, each as ``(name, parameter)`` pairs of ``model.named_parameters()`` with
    ``requires_grad`` (a group that would be empty is left out).

    Muon takes every parameter of two or more dims except: the weights of ``nn.Embedding`` and
    ``nn.EmbeddingBag`` modules, the parameters of output layers (a module whose own name is one of
    ``HEAD_NAMES``: ``lm_head``, ``output``, ``head``, ``classifier``, ``score``; a child of the model with
    everything inside it, as torchvision's ``classifier`` Sequential, a deeper one with its own parameters
    only, as BERT's ``layer.N.output`` holding a ``dense`` Linear; the model is the one inside its wrappers,
    modules with one child that has parameters and none of their own: ``torch.compile``'s ``_orig_mod``, DDP's
    ``module``, a LightningModule holding its network beside a loss function), parameters tied to either (the
    same tensor), parameters whose own name (after the last dot) contains ``bias`` and those with ``embed`` in
    their own name, their module's or that module's parent's, whatever their shape (GPT-OSS's stacked
    ``gate_up_proj_bias``, Swin's ``relative_position_bias_table``, a ``pos_embed``, a ViT's ``patch_embed``
    convolution: the input layer, LoRA's ``lora_embedding_A/B``; not the layers deep inside a module named so,
    as a retriever's ``doc_embedder`` encoder),
    parameters with fewer than two dims larger than 1 (vectors in another shape, e.g. a ``(1, 1, d)`` class
    token) or with leading dims of 1 only (a ``(1, n, d)`` position table: one matrix, no stack), and
    ``exclude`` (full names, a tied parameter's other names included; a name that matches no parameter is
    refused; or a callable ``(name, parameter) -> bool``). Biases, norm weights and the excluded take AdamW;
    ``adamw_lr`` / ``adamw_weight_decay`` set that group's ``lr`` / ``weight_decay`` (the optimizer's defaults
    otherwise). Muon parameters of more than 2 dims get a group with their ``flatten``: True for the weights of
    convolutions (``nn.Conv1d/2d/3d`` and the transposed ones: one matrix of ``(out, in * kernel)``), False for
    the others (stacked matrices such as the ``(experts, out, in)`` weights of MoE layers: each expert's matrix
    orthogonalized on its own), in a group of their own with ``transposed``: True where the module says it
    stores them ``(experts, in, out)`` (Hugging Face's ``is_transposed`` experts: GPT-OSS, Llama 4). Edit the
    returned dicts for anything else: ``use_muon``, ``flatten`` and ``transposed`` are group keys."""
    leave, conv, flipped = set(), set(), set()
    # the model inside its wrappers (torch.compile's _orig_mod, DDP's module, a LightningModule's model: a module
    # with one child and no parameters of its own), whose children are the model's own
    chain, module = [""], model
    # (children without parameters do not count: a LightningModule's loss function or metrics beside its model)
    while (len(children := [(n, c) for n, c in module.named_children() if next(c.parameters(), None) is not None])
           == 1 and next(module.parameters(False), None) is None):
        name, child = children[0]
        if name in HEAD_NAMES or isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
            break  # (a model that is only its head; a container of one layer, as a one-layer encoder's)
        module = child
        chain.append(f"{chain[-1]}.{name}" if chain[-1] else name)
    root = chain[-1]
    for module_name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            leave.update(id(p) for p in module.parameters(recurse=False))
        if module_name.rsplit(".", 1)[-1] in HEAD_NAMES and module_name not in chain:
            # the model's own head with all inside it (torchvision's classifier Sequential); deeper, only its own
            # parameters (BERT's layer.N.output holds a dense Linear)
            own = module_name.removeprefix(root + ".") if root else module_name
            leave.update(id(p) for p in module.parameters(recurse="." not in own))
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            conv.update(id(p) for p in module.parameters(recurse=False))
        if getattr(module, "is_transposed", False) is True:  # Hugging Face's fused experts stored (E, in, out)
            flipped.update(id(p) for p in module.parameters(recurse=False))
    if isinstance(exclude, str):
        raise ValueError(f"flashdist: muon_param_groups takes exclude as names (a list or tuple) or a callable, got "
                         f"the string {exclude!r}: pass [{exclude!r}]")
    if not callable(exclude):
        exclude = list(exclude)  # (a generator: read once)
        every = dict(model.named_parameters(remove_duplicate=False))
        unknown = [name for name in exclude if name not in every]
        if unknown:
            raise ValueError(f"flashdist: muon_param_groups got exclude names that are no parameter of the model: "
                             f"{unknown[:4]} (full names, as model.named_parameters() gives them)")
        leave.update(id(every[name]) for name in exclude)
    muon, convs, stacks, flipped_stacks, other = [], [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        excluded = callable(exclude) and exclude(name, p)
        table = p.ndim > 2 and all(d == 1 for d in p.shape[:-2])  # a (1, n, d) position table: no stack
        # a bias by its own name, an embedding (or a layer of one, as LoRA's factors, or a patch embedding) by its
        # own name, its module's or that module's parent's (not deeper: an encoder inside a "doc_embedder" is
        # hidden layers), whatever its shape
        path = name.lower().split(".")
        named = "bias" in path[-1] or any("embed" in part for part in path[-3:])
        if sum(d > 1 for d in p.shape) < 2 or table or named or id(p) in leave or excluded:
            other.append((name, p))
        else:
            (muon if p.ndim == 2 else convs if id(p) in conv else flipped_stacks if id(p) in flipped
             else stacks).append((name, p))
    adamw = {"use_muon": False}
    if adamw_lr is not None:
        adamw["lr"] = adamw_lr
    if adamw_weight_decay is not None:
        adamw["weight_decay"] = adamw_weight_decay
    groups = [{"params": muon, "use_muon": True}] if muon else []
    groups += [{"params": convs, "use_muon": True, "flatten": True}] if convs else []
    groups += [{"params": stacks, "use_muon": True, "flatten": False}] if stacks else []
    groups += ([{"params": flipped_stacks, "use_muon": True, "flatten": False, "transposed": True}]
               if flipped_stacks else [])
    return groups + ([{"params": other, **adamw}] if other else [])
