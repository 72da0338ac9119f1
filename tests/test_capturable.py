"""The capturable step (``capturable=True``: step counts and scalars on the device) and ``GraphedStep``.

On a GPU (pytest -m gpu): the capturable step gives the same bits as the ordinary one, step after step, for
Adam(W), SGD and Lion, with a learning rate that changes every step; a step captured by the user in a CUDA
graph and replayed, with a tensor learning rate a scheduler writes, gives the same bits as eager steps;
``GraphedStep`` replays where the tensors stay put and steps eagerly where a gradient moved, with the same
bits; a capture without a warm-up step is refused before anything changes. On the CPU: the option changes
nothing, and ``GraphedStep`` refuses what it cannot capture.
"""

from __future__ import annotations

import pytest
import torch

import flashdist

CUDA = torch.cuda.is_available()


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(test))

OPTIMIZERS = {
    "adamw": lambda params, **kw: flashdist.FlashAdamW(params, lr=1e-2, weight_decay=0.1, **kw),
    "adam-fp32-moments": lambda params, **kw: flashdist.FlashAdam(params, lr=1e-2, weight_decay=0.1,
                                                                  quantize_states=False, **kw),
    "sgd": lambda params, **kw: flashdist.FlashSGD(params, lr=1e-2, momentum=0.9, dampening=0.1, **kw),
    "lion": lambda params, **kw: flashdist.FlashLion(params, lr=1e-3, weight_decay=0.1, **kw),
}
SHAPES = [(64, 96), (33,), (300, 257), (8,)]


def _muon(params, **kw):
    """FlashMuon over ``params`` as a user splits them: the matrices take Muon, the vectors AdamW."""
    return flashdist.FlashMuon([{"params": [p for p in params if p.ndim >= 2]},
                                {"params": [p for p in params if p.ndim < 2], "use_muon": False}],
                               lr=1e-2, weight_decay=0.1, momentum=0.9, **kw)


OPTIMIZERS["muon"] = _muon


def _params(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, torch.bfloat16)) for s in SHAPES]


def _grads(n, params, seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g).to(p.device, p.dtype) for p in params] for _ in range(n)]


def _snapshot(opt, params):
    """Parameters and every state tensor, on the CPU (a capturable optimizer's step counts are on the GPU)."""
    out = [p.detach().cpu() for p in params]
    for p in params:
        for k, v in sorted(opt.state[p].items()):
            if isinstance(v, torch.Tensor):
                out.append(v.detach().cpu())
    return out


def _same_bits(a, b, where):
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, where
        if x.is_floating_point():
            x, y = x.view(torch.int16 if x.element_size() == 2 else torch.int32), y.view(
                torch.int16 if y.element_size() == 2 else torch.int32)
        assert torch.equal(x, y), f"{where}: tensor {i} differs"


def _cpu_pair(steps: int, seed: int, **kw):
    """An ordinary optimizer and one built with ``kw``, on identical CPU parameters, after ``steps`` steps on
    the same gradients; their bits compared."""
    plain, capt = _params("cpu"), _params("cpu")
    a, b = OPTIMIZERS["adamw"](plain), OPTIMIZERS["adamw"](capt, **kw)
    for grads in _grads(steps, plain, seed):
        for p, q, g in zip(plain, capt, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    _same_bits(_snapshot(a, plain), _snapshot(b, capt), f"cpu, {kw}")
    return a, b, capt


def test_capturable_changes_nothing_on_the_cpu():
    """On the CPU there is no graph to capture: the step counts stay there and every bit is the same."""
    a, b, capt = _cpu_pair(3, 1, capturable=True)
    assert b.capturable is True and a.capturable is False
    assert "capturable" not in b.param_groups[0]  # the optimizer's setting, as backend: not a param-group key
    assert b.state[capt[0]]["step"].device.type == "cpu"


def test_capturable_flash_muon_on_the_cpu_is_the_ordinary_one():
    """FlashMuon takes capturable=True (and graphed=True, which implies it) as the family does; on the CPU it
    changes no bit."""
    plain, capt = _params("cpu"), _params("cpu")
    a, b = _muon(plain), _muon(capt, capturable=True)
    for grads in _grads(3, plain, 16):
        _set_grads(plain, capt, grads)
        a.step()
        b.step()
    _same_bits(_snapshot(a, plain), _snapshot(b, capt), "FlashMuon, capturable on the cpu")
    assert b.capturable and _muon(_params("cpu"), graphed=True).capturable


def test_graphed_step_refuses_what_it_cannot_capture():
    with pytest.raises(ValueError, match="capturable=True"):
        flashdist.GraphedStep(OPTIMIZERS["adamw"](_params("cpu")))
    with pytest.raises(ValueError, match="one CUDA device"):
        flashdist.GraphedStep(OPTIMIZERS["adamw"](_params("cpu"), capturable=True))
    with pytest.raises(TypeError, match="flashdist optimizer"):
        flashdist.GraphedStep(torch.optim.SGD(_params("cpu"), lr=0.1))


@gpu
@pytest.mark.parametrize("algo", OPTIMIZERS)
@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
def test_capturable_step_is_the_ordinary_step(algo, tensor_lr):
    plain, capt = _params("cuda"), _params("cuda")
    a, b = OPTIMIZERS[algo](plain), OPTIMIZERS[algo](capt, capturable=True)
    if tensor_lr:
        b.param_groups[0]["lr"] = torch.tensor(b.param_groups[0]["lr"], device="cuda")
    for k, grads in enumerate(_grads(4, plain, 2)):
        lr = 1e-2 / (k + 1)
        if tensor_lr:  # an fp32 tensor, as torch's schedulers write: the ordinary step gets the fp32 value too
            b.param_groups[0]["lr"].fill_(lr)
            lr = b.param_groups[0]["lr"].item()
        else:
            b.param_groups[0]["lr"] = lr
        a.param_groups[0]["lr"] = lr
        for p, q, g in zip(plain, capt, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
        _same_bits(_snapshot(a, plain), _snapshot(b, capt), f"{algo} step {k + 1}")
    assert b.state[capt[0]]["step"].device.type == "cuda" and float(b.state[capt[0]]["step"]) == 4.0


@gpu
@pytest.mark.parametrize("algo", ["adamw", "sgd", "lion", "muon"])
def test_user_captured_step_replays_the_eager_steps(algo):
    """torch.cuda.graph around optimizer.step() after one warm-up step, the learning rate a device tensor
    written between replays (as a scheduler would), gradients copied into the captured ones."""
    plain, capt = _params("cuda"), _params("cuda")
    a = OPTIMIZERS[algo](plain)
    b = OPTIMIZERS[algo](capt, capturable=True)
    lr = torch.tensor(1e-2, device="cuda")
    b.param_groups[0]["lr"] = lr
    steps = _grads(5, plain, 3)
    for p, q, g in zip(plain, capt, steps[0]):
        p.grad, q.grad = g.clone(), g.clone()
    a.param_groups[0]["lr"] = lr.item()
    a.step()
    b.step()  # warm-up: plans, state, compiled kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b.step()
    for k, grads in enumerate(steps[1:], start=2):
        for p, q, g in zip(plain, capt, grads):
            p.grad.copy_(g)
            q.grad.copy_(g)
        lr.fill_(1e-2 / k)
        a.param_groups[0]["lr"] = lr.item()  # (the fp32 value the graph reads)
        a.step()
        graph.replay()
        torch.cuda.synchronize()
        _same_bits(_snapshot(a, plain), _snapshot(b, capt), f"{algo} replay {k}")


@gpu
def test_capture_without_warm_up_is_refused_and_changes_nothing():
    params = _params("cuda")
    opt = OPTIMIZERS["adamw"](params, capturable=True)
    for p, g in zip(params, _grads(1, params, 4)[0]):
        p.grad = g
    before = [p.detach().clone() for p in params]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warm-up"):
        with torch.cuda.graph(graph):
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    assert not opt.state[params[0]] or float(opt.state[params[0]].get("step", 0)) == 0
    opt.step()  # and the optimizer still steps
    assert float(opt.state[params[0]]["step"]) == 1.0


@gpu
def test_graphed_step_replays_and_falls_back_with_the_same_bits():
    """GraphedStep against eager steps of a copy: a float learning rate that changes every step (no
    recapture), gradients copied in place (replays), then gradients replaced by new tensors (a replay, its
    tables pointed at them first), then a changed weight decay (an eager step, and a new capture after)."""
    plain, capt = _params("cuda"), _params("cuda")
    a = OPTIMIZERS["adamw"](plain, capturable=True)
    b = OPTIMIZERS["adamw"](capt, capturable=True)
    graphed = flashdist.GraphedStep(b)
    steps = _grads(9, plain, 5)
    for p, q, g in zip(plain, capt, steps[0]):
        p.grad, q.grad = g.clone(), g.clone()
    for k, grads in enumerate(steps, start=1):
        if k == 5:  # new gradient tensors (what zero_grad(set_to_none=True) and a backward pass may give)
            for q in capt:
                q.grad = torch.empty_like(q.grad)
        if k == 8:
            a.param_groups[0]["weight_decay"] = b.param_groups[0]["weight_decay"] = 0.05
        for p, q, g in zip(plain, capt, grads):
            p.grad.copy_(g)
            q.grad.copy_(g)
        a.param_groups[0]["lr"] = b.param_groups[0]["lr"] = 1e-2 / k
        a.step()
        graphed()
        torch.cuda.synchronize()
        _same_bits(_snapshot(a, plain), _snapshot(b, capt), f"graphed step {k}")
    # 1: eager (warm-up); 2: capture + replay; 3-7: replays (5: new gradient tensors); 8: eager (weight
    # decay); 9: capture + replay
    assert (graphed.eager_steps, graphed.captures, graphed.replays) == (2, 2, 7)
    assert isinstance(b.param_groups[0]["lr"], float)




@gpu
def test_graphed_flash_muon_replays_wherever_its_gradients_are():
    """FlashMuon's Muon kernels read each gradient's address from a device cell that GraphedStep writes before a
    replay: new gradient tensors at new addresses replay too, with the bits of eager steps throughout; a float
    learning rate changing every step needs no capture; a gradient of another dtype steps eagerly."""
    plain, capt = _params("cuda"), _params("cuda")
    a, b = _muon(plain, capturable=True), _muon(capt, capturable=True)
    graphed = flashdist.GraphedStep(b)
    for k, grads in enumerate(_grads(8, plain, 15), start=1):
        if k == 5:  # every gradient a new tensor
            for q in capt:
                q.grad = torch.empty_like(q.grad)
        _set_grads(plain, capt, grads)
        for group in a.param_groups + b.param_groups:
            group["lr"] = 1e-2 / k
        a.step()
        graphed()
        torch.cuda.synchronize()
        _same_bits(_snapshot(a, plain), _snapshot(b, capt), f"graphed FlashMuon step {k}")
    # 1: eager (warm-up); 2: capture + replay; 3-8: replays (5: every gradient a new tensor elsewhere)
    assert (graphed.eager_steps, graphed.captures, graphed.replays) == (1, 1, 7), graphed.__dict__
    q = next(q for q in capt if q.ndim >= 2)
    q.grad = q.grad.t().contiguous().t()  # strided: the captured kernel would read it in the wrong order
    before = q.detach().clone()
    with pytest.raises(ValueError, match="not contiguous"):  # no replay: the eager step's one-line refusal
        graphed()
    assert "not contiguous" in graphed._why and torch.equal(q.detach(), before)


@gpu
def test_graphed_flash_muon_steps_eagerly_on_gradients_off_16_byte_boundaries():
    """The captured momentum kernels load gradients 16 bytes at a time: Muon gradients that are views at an odd
    offset into one flat buffer (a user's flat gradient buffer, DDP's bucket views) make the call eager, at the
    capture and at a replay, with the bits of eager steps (such a gradient crashed the replay with a misaligned
    address, and the CUDA context with it)."""
    plain, capt = _params("cuda"), _params("cuda")
    a, b = _muon(plain, capturable=True), _muon(capt, capturable=True)
    graphed = flashdist.GraphedStep(b)

    def offset_views(grads, offset):  # the gradients laid one after the other in a flat buffer, from `offset`
        flat = torch.empty(offset + sum(g.numel() for g in grads), dtype=grads[0].dtype, device="cuda")
        views, at = [], offset
        for g in grads:
            views.append(flat[at:at + g.numel()].view(g.shape).copy_(g))
            at += g.numel()
        return views

    history = []
    for k, grads in enumerate(_grads(7, plain, 16), start=1):
        offset = 1 if k in (2, 5) else 0  # 2: the capture; 5: a replay
        # (offset 0: the gradients as they come, each its own allocation; laid end to end, a tensor whose size is
        # not a multiple of 8 values would put the next one off the boundary too)
        given = offset_views(grads, offset) if offset else [g.clone() for g in grads]
        for p, q, g, v in zip(plain, capt, grads, given):
            p.grad, q.grad = g, v
        a.step()
        graphed()
        torch.cuda.synchronize()
        _same_bits(_snapshot(a, plain), _snapshot(b, capt), f"graphed FlashMuon step {k}, offset {offset}")
        history.append((graphed.eager_steps, graphed.captures, graphed.replays))
        if offset:
            assert "16-byte" in graphed._why, graphed._why
    # (eager steps, captures, replays) after each call. 1: the warm-up; 2: the capture refused, eager; 3: the
    # capture tried again at the next call, replayed; 4: a replay; 5: eager; 6-7: replays (after a new capture)
    assert history[1] == (2, 0, 0) and history[2] == (2, 1, 1) and history[3] == (2, 1, 2), history
    assert history[4][0] == 3 and history[4][2] == 2 and history[6][2] == 4, history


@gpu
def test_graphed_step_resets_rho_of_weights_written_between_replays():
    """A weight written outside the optimizer (``copy_``, as ``model.load_state_dict`` and SWA's copy-back
    write) between two replays is its own master from then on, as with eager steps: the replay after it
    starts from the new weight with rho reset, with the same bits as an eager optimizer given the same writes
    (also a write just before the call that captures)."""
    plain, capt = _params("cuda"), _params("cuda")
    a = OPTIMIZERS["adamw"](plain, capturable=True)
    b = OPTIMIZERS["adamw"](capt, capturable=True)
    graphed = flashdist.GraphedStep(b)
    new = [torch.randn(p.shape, generator=torch.Generator().manual_seed(9)).to("cuda", p.dtype) for p in plain]
    for k, grads in enumerate(_grads(8, plain, 3), start=1):
        if k in (2, 5):  # 2: before the capture; 5: between replays
            with torch.no_grad():
                for p, q, w in zip(plain, capt, new):
                    p.copy_(w)
                    q.copy_(w)
        for p, q, g in zip(plain, capt, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        graphed()
        torch.cuda.synchronize()
        _same_bits(_snapshot(a, plain), _snapshot(b, capt), f"graphed step {k}")
    assert graphed.captures == 1 and graphed.replays == 7, (graphed.captures, graphed.replays)


@gpu
def test_graphed_step_under_fsdp2_is_the_eager_step(tmp_path):
    """FSDP2 (one NCCL rank, DTensor parameters and gradients): GraphedStep's steps against eager steps of an
    identical model, bit for bit, with ``zero_grad(set_to_none=True)`` between steps (FSDP2 then makes new
    gradient tensors); at steps 4 and 5 every gradient is moved to a new tensor (a clone), which the replay
    must follow through the DTensors' local shards."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        def model():
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
            m = m.to("cuda", torch.bfloat16)
            for layer in (m[0], m[2]):
                fully_shard(layer)
            return fully_shard(m)

        ref, mod = model(), model()
        a = flashdist.FlashAdamW(ref.parameters(), lr=1e-2, capturable=True)
        graphed = flashdist.GraphedStep(flashdist.FlashAdamW(mod.parameters(), lr=1e-2, capturable=True))
        gen = torch.Generator(device="cuda").manual_seed(1)
        for k in range(1, 7):
            x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            for m, step in ((ref, a.step), (mod, graphed)):
                m(x).float().square().mean().backward()
                if k in (4, 5) and m is mod:
                    for p in m.parameters():
                        p.grad = p.grad.clone()
                step()
                for p in m.parameters():
                    p.grad = None
            torch.cuda.synchronize()
            for p, q in zip(ref.parameters(), mod.parameters()):
                assert torch.equal(p.to_local().view(torch.int16), q.to_local().view(torch.int16)), f"step {k}"
        assert (graphed.eager_steps, graphed.captures, graphed.replays) == (1, 1, 5)
        print(f"FSDP2: {graphed.eager_steps} eager steps, {graphed.captures} captures, {graphed.replays} replays")
    finally:
        dist.destroy_process_group()


def test_address_check_sees_every_move():
    """The compiled check GraphedStep runs at every call: a parameter or gradient at a new address, a gradient
    set or removed, and nothing else, counts as a change; each call records what it found."""
    from flashdist.kernels import host

    m = host.load()
    if m is None:
        pytest.skip("no C++ compiler here: GraphedStep checks in Python")
    params = [torch.nn.Parameter(torch.randn(4, 8)) for _ in range(5)]
    for p in params[:4]:
        p.grad = torch.randn_like(p)
    seen = torch.zeros((2, 5), dtype=torch.int64)

    def changed():
        return m.addresses_changed(params, False, seen[0]) | m.addresses_changed(params, True, seen[1])

    assert changed() and not changed()
    assert seen[0].tolist() == [p.data_ptr() for p in params] and seen[1, 4] == 0
    params[2].grad.copy_(torch.ones(4, 8))  # in place: same address
    assert not changed()
    params[4].grad = torch.zeros(4, 8)
    assert changed() and not changed()
    params[1].grad = None
    assert changed() and seen[1, 1] == 0
    params[3].data = torch.zeros(4, 8)
    assert changed() and seen[0, 3] == params[3].data_ptr()
    with pytest.raises(RuntimeError, match="not a tensor"):
        m.addresses_changed([params[0], 3], False, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="int64"):
        m.addresses_changed(params, False, torch.zeros(4, dtype=torch.int64))


def test_checkpoints_without_the_option_load_and_the_loader_keeps_its_own(tmp_path):
    """``capturable`` says how a step runs, not what it computes: a setting of the optimizer, not of its param
    groups, so checkpoints have the keys of earlier versions and load through flashdist.checkpoint, and neither
    that nor a state dict of a non-capturable run turns the loading optimizer's option off."""
    import flashdist.checkpoint as C

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    opt = flashdist.FlashAdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64, dtype=torch.bfloat16)).square().mean().backward()
    opt.step()
    sd = opt.state_dict()
    assert "capturable" not in sd["param_groups"][0]  # so a checkpoint has the keys of earlier versions
    C.save(tmp_path / "old", model, opt, extra={"step": 1})
    other = torch.nn.Linear(64, 64).to(torch.bfloat16)
    loaded = flashdist.FlashAdamW(other.parameters(), lr=1e-3, capturable=True)
    C.load(tmp_path / "old", other, loaded)
    assert torch.equal(other.weight, model.weight) and loaded.param_groups[0]["lr"] == 1e-2
    assert loaded.capturable is True
    again = flashdist.FlashAdamW(other.parameters(), lr=1e-3, capturable=True)
    again.load_state_dict(sd)
    assert again.capturable is True and again.param_groups[0]["lr"] == 1e-2


def _pair(n_steps, seed, **kw):
    """Two identical capturable optimizers (the reference steps eagerly) and their gradients."""
    plain, capt = _params("cuda"), _params("cuda")
    a, b = OPTIMIZERS["adamw"](plain, capturable=True, **kw), OPTIMIZERS["adamw"](capt, capturable=True, **kw)
    return plain, capt, a, b, _grads(n_steps, plain, seed)


def _set_grads(plain, capt, grads):
    for p, q, g in zip(plain, capt, grads):
        if p.grad is None:
            p.grad, q.grad = g.clone(), g.clone()
        else:
            p.grad.copy_(g)
            q.grad.copy_(g)


@gpu
def test_graphed_step_survives_a_direct_step_with_other_gradients():
    """Replays, then a direct optimizer.step() with gradients elsewhere (which gets a launch plan of its own:
    the captured one is never changed), then the first gradients back: the replay reads the tables it captured."""
    plain, capt, a, b, steps = _pair(6, 7)
    graphed = flashdist.GraphedStep(b)
    originals = None
    for k, grads in enumerate(steps, start=1):
        _set_grads(plain, capt, grads)
        a.step()
        if k == 4:
            originals = [q.grad for q in capt]
            for q in capt:
                q.grad = q.grad.clone()
            b.step()
            for q, g in zip(capt, originals):
                q.grad = g
        else:
            graphed()
        torch.cuda.synchronize()
        _same_bits(_snapshot(a, plain), _snapshot(b, capt), f"step {k}")
    assert graphed.replays >= 3


@gpu
def test_graphed_step_with_a_cpu_lr_tensor_an_added_group_and_uneven_step_counts():
    """A learning rate in a CPU tensor written between calls (copied to the device like a float); a param group
    added midway (no error, its own learning rate); a parameter without a gradient at the first step, so the
    group's step counts differ (the capture is refused: eager steps, no error); all bit for bit."""
    plain, capt, a, b, steps = _pair(7, 8)
    late_a = torch.nn.Parameter(torch.randn(32, 64, device="cuda", dtype=torch.bfloat16))
    late_b = torch.nn.Parameter(late_a.detach().clone())
    lr = torch.tensor(1e-2)
    b.param_groups[0]["lr"] = lr
    graphed = flashdist.GraphedStep(b)
    for k, grads in enumerate(steps, start=1):
        lr.fill_(1e-2 / k)
        a.param_groups[0]["lr"] = lr.item()
        if k == 3:
            a.add_param_group({"params": [late_a], "lr": 3e-3})
            b.add_param_group({"params": [late_b], "lr": 3e-3})
        _set_grads(plain, capt, grads)
        if k >= 3:
            g = torch.randn_like(late_a)
            late_a.grad, late_b.grad = g.clone(), g.clone()
        if k == 5:  # the first parameter skips a step: its count falls behind the others'
            plain[0].grad = capt[0].grad = None
        a.step()
        graphed()
        torch.cuda.synchronize()
        _same_bits(_snapshot(a, plain + [late_a] * (k >= 3)), _snapshot(b, capt + [late_b] * (k >= 3)), f"step {k}")
    assert graphed.replays >= 1 and graphed.eager_steps >= 4


@gpu
def test_capturing_a_group_that_is_not_capturable_is_refused():
    """torch.optim refuses to capture a step whose counts live on the host; so does flashdist, before the step
    changes anything (its counts would move once, at the capture)."""
    from flashdist.errors import CaptureRefused

    params = _params("cuda")
    opt = OPTIMIZERS["adamw"](params)
    for p, g in zip(params, _grads(1, params, 9)[0]):
        p.grad = g
    opt.step()
    before = _snapshot(opt, params)
    with pytest.raises(CaptureRefused, match="capturable=True"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            opt.step()
    _same_bits(before, _snapshot(opt, params), "after the refusal")


@gpu
def test_device_scalars_are_the_host_scalars_on_the_gpu():
    """The device's float64 arithmetic (division, square root, the squaring powers) gives the host's bits."""
    from flashdist.kernels.triton import device_scalars as DS
    from flashdist.kernels.scalars import AdamScalars, SGDScalars

    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        step = int(torch.randint(1, 2**24, (), generator=gen)) if torch.rand((), generator=gen) < 0.5 else \
            int(torch.randint(1, 50, (), generator=gen))
        lr, b1, b2, wd = (float(torch.rand((), generator=gen)) * s for s in (0.1, 0.999, 1.0, 0.2))
        b2 = min(b2, 0.99999)
        count = torch.tensor([float(step)], device="cuda")
        got = DS.adam(count, lr, beta1=b1, beta2=b2, eps=1e-8, weight_decay=wd, decoupled=True)
        want = AdamScalars.make(lr=lr, beta1=b1, beta2=b2, eps=1e-8, weight_decay=wd, step=step, decoupled=True)
        assert _f32_bits(got.values.tolist()) == _f32_bits(want.kernel_args()), (step, lr, b1, b2, wd)
        got = DS.sgd(count, lr, momentum=b1, dampening=wd, weight_decay=wd, nesterov=False, decoupled=False)
        want = SGDScalars.make(lr=lr, momentum=b1, dampening=wd, weight_decay=wd, nesterov=False, step=step,
                               decoupled=False)
        assert _f32_bits(got.values.tolist()) == _f32_bits(want.kernel_args()), (step, lr, b1, wd)


def _f32_bits(values) -> list[int]:
    return torch.tensor(list(values), dtype=torch.float32).view(torch.int32).tolist()


def test_address_check_reads_dtensors_local_shards(tmp_path):
    """DTensors have no data of their own: the compiled check refuses them and GraphedStep's check reads their
    local shards instead, so a gradient moved to a new tensor is seen (one gloo rank, on the CPU)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    from flashdist.optim.graph import GraphedStep
    from flashdist.kernels import host

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(8, 32), mesh, [Shard(0)])) for _ in range(3)]
        for p in params:
            p.grad = distribute_tensor(torch.randn(8, 32), mesh, [Shard(0)])
        m = host.load()
        if m is not None:
            with pytest.raises(RuntimeError, match="without data of its own"):
                m.addresses_changed(params, True, torch.zeros(3, dtype=torch.int64))
        check = object.__new__(GraphedStep)
        check._host = m
        seen = torch.zeros((2, 3), dtype=torch.int64)
        for dtensors in (False, True):  # found by the compiled check's refusal, or told
            seen.zero_()
            assert check._addresses_changed(params, seen[0], seen[1], dtensors)
            assert not check._addresses_changed(params, seen[0], seen[1], dtensors)
            assert seen[1].tolist() == [p.grad.to_local().data_ptr() for p in params]
            params[1].grad = params[1].grad.clone()
            assert check._addresses_changed(params, seen[0], seen[1], dtensors)
            params[2].grad = None
            assert check._addresses_changed(params, seen[0], seen[1], dtensors) and seen[1, 2] == 0
            params[2].grad = distribute_tensor(torch.randn(8, 32), mesh, [Shard(0)])
    finally:
        dist.destroy_process_group()


def test_graphed_optimizer_on_the_cpu_steps_eagerly_and_keeps_the_option():
    """``graphed=True`` implies capturable; on the CPU there is nothing to capture: step() steps eagerly, with the
    bits of an ordinary optimizer; copies keep the option; a capturable that is not a bool is refused."""
    import pickle

    with pytest.warns(UserWarning, match="graphed=True has no effect.*one CUDA device") as caught:
        _, b, _ = _cpu_pair(3, 11, graphed=True)
    assert b.graphed and b.capturable is True
    assert sum("graphed=True" in str(w.message) for w in caught) == 1  # said once, not at every step
    copy = pickle.loads(pickle.dumps(b))
    assert b._graph is None and copy.graphed and copy.capturable
    with pytest.raises(ValueError, match="capturable must be True or False"):
        OPTIMIZERS["adamw"](_params("cpu"), capturable="yes")
    with pytest.raises(ValueError, match="graphed must be True or False"):
        OPTIMIZERS["adamw"](_params("cpu"), graphed=1)


@gpu
def test_graphed_optimizer_replays_inside_step_and_runs_its_hooks():
    """``graphed=True``: opt.step() (as a client calls it) replays the captured step, bit for bit against eager
    steps, with a float learning rate changing every step, and the step hooks run at every call."""
    plain, capt, a, _, steps = _pair(6, 12)
    b = OPTIMIZERS["adamw"](capt, graphed=True)
    calls = []
    b.register_step_post_hook(lambda opt, args, kwargs: calls.append(1))
    for k, grads in enumerate(steps, start=1):
        _set_grads(plain, capt, grads)
        a.param_groups[0]["lr"] = b.param_groups[0]["lr"] = 1e-2 / k
        a.step()
        b.step()
        torch.cuda.synchronize()
        _same_bits(_snapshot(a, plain), _snapshot(b, capt), f"step {k}")
    assert len(calls) == 6 and b._graph is not None and b._graph.replays == 5 and b._graph.captures == 1


def test_graphed_optimizer_says_once_why_a_step_is_not_graphed():
    """Where ``graphed=True`` cannot take effect it says so once per optimizer: the reference backend, and a
    step with a closure (Lightning's), which runs eagerly."""
    params = _params("cpu")
    opt = OPTIMIZERS["adamw"](params, graphed=True, backend="reference")
    for p, g in zip(params, _grads(1, params, 13)[0]):
        p.grad = g
    with pytest.warns(UserWarning, match="graphed=True has no effect.*Triton kernel") as caught:
        opt.step()
        opt.step()
    assert sum("graphed=True" in str(w.message) for w in caught) == 1
    other = OPTIMIZERS["adamw"](_params("cpu"), graphed=True)
    with pytest.warns(UserWarning, match="graphed=True has no effect.*closure") as caught:
        for _ in range(2):
            other.step(lambda: torch.tensor(0.0))
    assert sum("graphed=True" in str(w.message) for w in caught) == 1


class _TinyLlama(torch.nn.Module):
    """A Llama-shaped model in plain torch (embedding, RMSNorm, attention and SwiGLU blocks, untied head), big
    enough to have a tensor of the large-tensor launch under a lowered ``large_numel``."""

    def __init__(self, vocab=512, dim=64, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict(dict(
                norm1=torch.nn.RMSNorm(dim), qkv=torch.nn.Linear(dim, 3 * dim, bias=False),
                out=torch.nn.Linear(dim, dim, bias=False), norm2=torch.nn.RMSNorm(dim),
                up=torch.nn.Linear(dim, 4 * dim, bias=False), gate=torch.nn.Linear(dim, 4 * dim, bias=False),
                down=torch.nn.Linear(4 * dim, dim, bias=False))))
        self.norm = torch.nn.RMSNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        b, t, d = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).view(b, t, 3, 4, d // 4).unbind(2)
            a = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                 v.transpose(1, 2), is_causal=True)
            x = x + blk["out"](a.transpose(1, 2).reshape(b, t, d))
            h = blk["norm2"](x)
            x = x + blk["down"](torch.nn.functional.silu(blk["gate"](h)) * blk["up"](h))
        return self.head(self.norm(x))


@gpu
@pytest.mark.parametrize("kind", ["FlashAdamW", "FlashMuon"])
@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
def test_graphed_optimizer_replays_with_gradients_set_to_none(clip, kind):
    """The loop every client runs (``loss.backward(); [clip_grad_norm_]; opt.step(); opt.zero_grad()``, with
    torch's default ``set_to_none=True``, so that the gradients are new tensors at every step, wherever the
    allocator puts them): a ``graphed=True`` optimizer captures once and replays every later step, bit for bit
    against an eager optimizer on an identical model, with a float learning rate a scheduler changes at every
    step, and the large-tensor launch (``large_numel`` lowered so that the embedding and head take it)."""
    from flashdist.kernels.triton import DEFAULT, using

    steps = 40
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(_TinyLlama().to("cuda", torch.bfloat16))
    ref, mod = models
    if kind == "FlashMuon":
        a = flashdist.FlashMuon(flashdist.muon_param_groups(ref), lr=1e-3, weight_decay=0.1, capturable=True)
        b = flashdist.FlashMuon(flashdist.muon_param_groups(mod), lr=1e-3, weight_decay=0.1, graphed=True)
    else:
        a = flashdist.FlashAdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, capturable=True)
        b = flashdist.FlashAdamW(mod.parameters(), lr=1e-3, weight_decay=0.1, graphed=True)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (1 + k)) for o in (a, b)]
    gen = torch.Generator(device="cuda").manual_seed(2)
    moved, seen = 0, None
    fixed_moved, fixed_seen = 0, None  # FlashMuon: its Muon matrices' gradients (reported)
    with using(DEFAULT.replace(large_numel=16384)):
        for k in range(steps):
            tokens = torch.randint(0, 512, (4, 32), device="cuda", generator=gen)
            for model, opt, sched in ((ref, a, scheds[0]), (mod, b, scheds[1])):
                logits = model(tokens[:, :-1])
                torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                if model is mod:  # (the allocator may or may not reuse addresses: the replays must not care)
                    now = [p.grad.data_ptr() for p in mod.parameters()]
                    moved += seen is not None and now != seen
                    seen = now
                    fixed = [p.grad.data_ptr() for g in b.param_groups if g.get("use_muon") for p in g["params"]]
                    fixed_moved += k > 0 and fixed != fixed_seen
                    fixed_seen = fixed
                opt.step()
                opt.zero_grad()  # set_to_none=True
                sched.step()
            torch.cuda.synchronize()
            for p, q in zip(ref.parameters(), mod.parameters()):
                assert torch.equal(p.view(torch.int16), q.view(torch.int16)), f"step {k + 1}"
                assert torch.equal(a.state[p]["rho"], b.state[q]["rho"]), f"step {k + 1}"
    graph = b._graph
    print(f"graphed {kind}, clip={clip}: {graph.captures} captures, {graph.replays} replays, {graph.eager_steps} eager "
          f"steps, gradients at new addresses at {moved} of {steps - 1} steps (Muon matrices' at {fixed_moved})")
    # wherever the allocator put the gradients (the Muon kernels read theirs from cells): one capture, then replays
    assert graph.captures == 1 and graph.replays >= steps - 2, graph.__dict__


@gpu
def test_graphed_step_says_once_when_parameters_move_at_every_step():
    """Parameters at new addresses at every step (a parameter swap): every step eager, bit for bit, and one
    warning that says why, after ``MISS_LIMIT`` misses."""
    from flashdist.optim import graph as G

    plain, capt, a, b, steps = _pair(G.MISS_LIMIT + 4, 14)
    graphed = flashdist.GraphedStep(b)
    with pytest.warns(UserWarning, match="not replaying.*parameter is at a new address") as caught:
        for k, grads in enumerate(steps, start=1):
            _set_grads(plain, capt, grads)
            for p in capt:
                p.data = p.data.clone()
            a.step()
            graphed()
            torch.cuda.synchronize()
            _same_bits(_snapshot(a, plain), _snapshot(b, capt), f"step {k}")
    assert sum("not replaying" in str(w.message) for w in caught) == 1
    assert graphed.replays == 0 and graphed.eager_steps == len(steps)


def test_compiled_gradient_check_reads_what_a_replay_needs():
    """``grad_info``, what GraphedStep checks before pointing a captured step at the gradients: each gradient's
    address, dtype and numel; False where one is missing or not contiguous (the Python check then says which)."""
    from flashdist.kernels import host

    m = host.load()
    if m is None:
        pytest.skip("no C++ compiler here: GraphedStep checks in Python")
    params = [torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(3).to(torch.bfloat16))]
    for p in params:
        p.grad = torch.randn_like(p)
    info = torch.zeros((3, 2), dtype=torch.int64)
    assert m.grad_info(params, *info)
    assert info[0].tolist() == [p.grad.data_ptr() for p in params] and info[2].tolist() == [32, 3]
    assert info[1, 0] != info[1, 1]  # fp32 and bf16
    params[0].grad = torch.randn(8, 4).t()
    assert not m.grad_info(params, *info)
    params[0].grad = None
    assert not m.grad_info(params, *info)
    with pytest.raises(RuntimeError, match="int64 CPU"):
        m.grad_info(params, *torch.zeros((3, 3), dtype=torch.int64))
