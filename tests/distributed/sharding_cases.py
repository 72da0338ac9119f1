"""Models, gradients and checks shared by the multi-rank tests (imported by the test modules and their ranks)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from flashdist import distributed as D
from flashdist.quant.moment import MomentLayout
from tests.cases import OPTIMIZERS, Case

def single_threaded(fn):
    """Run a single-process reference with one intra-op thread, as the ranks do: tiny tensors on a busy
    two-core machine run ten times slower with a thread pool. Cached: every world size compares with it."""

    @functools.lru_cache(maxsize=None)
    @functools.wraps(fn)
    def wrapper(*args):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(threads)

    return wrapper


# ----- a model with every awkward shape -----------------------------------------------------------------


class MixedNet(nn.Module):
    """Parameters chosen for sharding edge cases; the forward pass is only for gradient-release tests."""

    def __init__(self):
        super().__init__()
        self.uneven = nn.Linear(40, 7)  # weight (7, 40): 7 rows shard unevenly on 2, 3, 4 ranks; 40 cols =
        #                                 groups of 32 + 8; bias: 1-D, fp32 moments
        self.few = nn.Parameter(torch.randn(2, 33))  # 2 rows: empty shards on 3 and 4 ranks
        self.cube = nn.Parameter(torch.randn(5, 3, 24) * 0.1)  # 3-D: rows of 72 = groups of 32, 32, 8
        self.unused = nn.Parameter(torch.randn(6, 8))  # never receives a gradient
        self.frozen = nn.Parameter(torch.randn(4, 16), requires_grad=False)
        self.gain = nn.Parameter(torch.randn(9))  # 1-D, uneven
        self.head = nn.Linear(7, 3)  # fp32 (see make_mixed_net): no rho, quantized moments only

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 40)
        h = torch.tanh(self.uneven(x))  # (batch, 7)
        h = h + (self.few.sum(1).sum() + self.cube.mean() + self.gain[:7].sum() * 0.1) * 0.01
        h = h * self.gain[:7]
        return self.head(h.float()).sum(-1)


def make_mixed_net(seed: int = 0) -> MixedNet:
    torch.manual_seed(seed)
    model = MixedNet()
    for name, p in model.named_parameters():
        if not name.startswith("head"):
            p.data = p.data.to(torch.bfloat16)
    return model


def shard_mixed_net(model: MixedNet, mesh) -> MixedNet:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.head, mesh=mesh)  # one dtype per FSDP group: the fp32 head is its own group
    fully_shard(model, mesh=mesh)
    return model


GRAD_FREE = ("unused", "frozen")  # parameters that never receive a gradient

# The optimizers of tests/cases.py under the options whose sharded step differs most: every optimizer class, both
# master weight widths, 8-bit companded and linear moments, fp32 moments. The reference step, so that these
# checks are about sharding alone (tests/test_cpu_kernel.py holds the fused CPU step to it bit for bit).
CONFIGS = {case.id: case for case in [
    Case(OPTIMIZERS["adamw"], backend="reference"),
    Case(OPTIMIZERS["adam-l2"], bits=32, moments="q-linear", backend="reference"),
    Case(OPTIMIZERS["adamw"], moments="fp32m", backend="reference"),
    Case(OPTIMIZERS["sgd-nesterov"], backend="reference"),
    Case(OPTIMIZERS["sgdw"], moments="q-linear", backend="reference"),
    Case(OPTIMIZERS["lion"], backend="reference"),
    Case(OPTIMIZERS["muon"], backend="reference"),  # its step gathers each matrix to one rank (collectives)
]}
ADAMW = Case(OPTIMIZERS["adamw"], backend="reference").id  # FlashAdamW as a user gets it: 24 bits, companded


def make_optimizer(model: nn.Module, config: str = ADAMW):
    """The optimizer of ``CONFIGS[config]`` over ``model``'s parameters."""
    case = CONFIGS[config]
    named = list(model.named_parameters())
    fast = [(n, p) for n, p in named if n.startswith(("few", "cube"))]
    rest = [(n, p) for n, p in named if not n.startswith(("few", "cube"))]
    # two groups, so that a second learning rate and per-group buckets are covered too
    return case.make([{"params": rest}, {"params": fast, "lr": case.opt.lr * 3}])


def global_grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    """The same global gradients in every process: per-row magnitudes over five decades, and non-finite
    values at steps 1 and 2 (the skipped groups must be the same ones in every layout)."""
    gen = torch.Generator().manual_seed(1000 + step)
    grads = {}
    for name, p in sorted(model.named_parameters()):
        if name.split(".")[0] in GRAD_FREE:
            continue
        g = torch.randn(tuple(p.shape), generator=gen)
        if p.ndim:
            rows = torch.randint(-3, 2, (p.shape[0],), generator=gen).float()
            g = g * (10.0 ** rows).view(-1, *([1] * (p.ndim - 1)))
        grads[name] = g
    if step == 1:
        grads["uneven.weight"][3, 35] = float("nan")  # skips the second group of row 3
    if step == 2:
        grads["gain"][4] = float("inf")
        grads["cube"][4, 1, 0] = float("-inf")
    return {n: g.to(dict(model.named_parameters())[n].dtype) for n, g in grads.items()}


def set_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Give each parameter its gradient: the whole tensor, or this rank's shard of it for a DTensor."""
    from torch.distributed.tensor import distribute_tensor

    for name, p in model.named_parameters():
        g = grads.get(name)
        if g is not None and D.is_dtensor(p):
            g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)  # local split, no comm
        p.grad = g


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor)."""
    if not D.is_dtensor(t):
        return t.detach().clone()
    if t.dtype == torch.int16:  # gloo cannot gather int16 (rho of 32-bit master weights): widen, gather, narrow
        wide = D.state_like(t, D.local(t).to(torch.int32), tuple(t.shape))
        return wide.full_tensor().to(t.dtype)
    return t.full_tensor()


@torch.no_grad()
def snapshot(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """Every tensor the promise covers, as whole tensors: parameters, master weights and all state."""
    out = {}
    for name, p in model.named_parameters():
        out[f"{name}"] = full(p)
        out[f"{name}/master"] = full(optimizer.master_weight(p))
        for key, value in stepped_state(optimizer, p).items():
            out[f"{name}/{key}"] = full(value)
    return out


def stepped_state(optimizer, p) -> dict:
    """``p``'s state, or {} when it was never stepped: a state dict makes the (all-zero) state of every
    trainable parameter, so one run may hold it where the other, equal, run holds none."""
    state = optimizer.state.get(p, {})
    if state and float(state["step"]) == 0:
        assert all(not D.local(v).any() for k, v in state.items() if k != "step"), "unstepped state is not zero"
        return {}
    return state


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ: {sorted(got.keys() ^ want.keys())}"
    bad = []
    for key in want:
        a, b = got[key], want[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            bad.append(f"{key}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
        elif not torch.equal(_bits(a), _bits(b)):
            diff = (_bits(a) != _bits(b)).sum().item()
            bad.append(f"{key}: {diff} of {a.numel()} values differ")
    assert not bad, f"{what}: not bit-identical:\n  " + "\n  ".join(bad)


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.reshape(-1).view(ints[t.element_size()]) if t.is_floating_point() else t.reshape(-1)


# ----- checks inside a rank ------------------------------------------------------------------------------


class NoCollectives(TorchDispatchMode):
    """Records every collective (eager c10d ops and DTensor's functional collectives) and every op applied
    to a DTensor while active: a step that runs on local shards records neither."""

    def __init__(self):
        super().__init__()
        self.collectives: list[str] = []
        self.dtensor_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            self.collectives.append(str(func))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(D.is_dtensor(x) for x in leaves):
            self.dtensor_ops.append(str(func))
        return func(*args, **kwargs)


def check_state_layout(model: nn.Module, optimizer) -> None:
    """Every state tensor of a DTensor parameter is a DTensor with the parameter's mesh and placements and
    its true global shape and stride; scales are (rows, groups) and hold exactly the local rows. Frozen
    parameters hold no state, nor does any parameter before its first step."""
    from flashdist.quant.codes import quantized_layout

    for name, p in model.named_parameters():
        state = optimizer.state.get(p)
        if not p.requires_grad:  # frozen parameters hold no optimizer state
            assert not state, f"{name}: a frozen parameter holds state {sorted(state)}"
            continue
        if not state:  # (made at the first step, as torch.optim makes it)
            continue
        for key, value in state.items():
            if key == "step":
                assert not D.is_dtensor(value)
                continue
            assert D.is_dtensor(value), f"{name}/{key} is not a DTensor"
            assert value.device_mesh == p.device_mesh, f"{name}/{key}"
            assert value.placements == D.state_placements(p, tuple(value.shape)), f"{name}/{key}"
            want = tuple(p.shape)
            if key.endswith("_scales"):
                rows, _, groups = quantized_layout(p.shape)
                want = (rows, groups)
                local = MomentLayout.of(p.shape).local(D.local(p).shape)
                assert D.local(value).shape == (local.rows, local.groups_per_row), f"{name}/{key} local shape"
            else:
                assert D.local(value).shape == D.local(p).shape, f"{name}/{key} local shape"
            assert tuple(value.shape) == want, f"{name}/{key}: global shape {tuple(value.shape)} != {want}"
            assert value.stride() == torch.empty(want, device="meta").stride(), f"{name}/{key} stride"
            assert D.local(value).is_contiguous()


# ----- a small transformer --------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 37, dim: int = 32, heads: int = 4, layers: int = 2, context: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)  # 37 rows: uneven on 2 and 3 ranks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_tiny_lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().to(torch.bfloat16)


def shard_tiny_lm(model: TinyLM, mesh) -> TinyLM:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def lm_batch(step: int, batch: int, context: int = 16, vocab: int = 37) -> torch.Tensor:
    """Sequences of an affine recurrence t' = (5 t + 3) mod vocab from random starts: learnable in a few
    dozen steps."""
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(0, vocab, (batch, 1), generator=gen)
    seq = [starts]
    for _ in range(context):
        seq.append((seq[-1] * 5 + 3) % vocab)
    return torch.cat(seq, dim=1)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
