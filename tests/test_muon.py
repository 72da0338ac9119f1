"""FlashMuon against torch.optim.Muon (bit for bit where the arithmetic is the same), its AdamW groups against
FlashAdamW, its 8-bit momentum against torch's fp32 one step by step, and its param groups and refusals.
Sharded runs against one process: tests/distributed/test_muon_sharded.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import flashdist
from flashdist import FlashAdamW, FlashMuon, muon_param_groups

SHAPES = [(16, 40), (40, 16), (33, 33)]  # wide, tall (Newton-Schulz on the transpose), odd square


def _weights(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def _grads(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * 10.0 ** torch.randint(-3, 2, (s[0], 1), generator=gen) for s in SHAPES]
            for _ in range(steps)]


OPTIONS = {
    "default": {},
    "plain-momentum": dict(nesterov=False),
    "match-rms-adamw": dict(adjust_lr_fn="match_rms_adamw", weight_decay=0.01),
    "original-ns3": dict(adjust_lr_fn="original", ns_steps=3, momentum=0.9, eps=1e-5),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype, bits", [(torch.float32, None), (torch.bfloat16, 32)], ids=["fp32", "bf16-32bit"])
def test_matches_torch_muon_bitwise(options, dtype, bits):
    """fp32 momentum and a master weight that holds any fp32 value: torch.optim.Muon's bits, step by step
    (torch's run on fp32 weights that start at the bf16 values, with the bf16 gradients as fp32)."""
    params = [torch.nn.Parameter(w) for w in _weights(dtype)]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    flash = FlashMuon(params, lr=0.02, quantize_states=False, master_weight_bits=bits, **options)
    torch_muon = torch.optim.Muon(ref, lr=0.02, **options)
    for grads in _grads(4):
        for p, r, g in zip(params, ref, grads):
            p.grad = g.to(dtype)
            r.grad = p.grad.float()
        flash.step()
        torch_muon.step()
        for p, r in zip(params, ref):
            assert torch.equal(flash.master_weight(p), r.detach())
            assert torch.equal(flash.state[p]["momentum_buffer"], torch_muon.state[r]["momentum_buffer"])


@pytest.mark.parametrize("bits", [32, 24])
def test_quantized_momentum_step_by_step(bits):
    """8-bit momentum: each step from the same state (torch's buffer set to the dequantized codes, its weight to
    the master weight) gives torch.optim.Muon's weight: bit for bit with 32-bit masters (the update is computed
    from the fp32 buffer before it is stored as codes), within half a rho step (2^-8 of half a bf16 ulp) with
    24-bit ones. The stored buffer differs from torch's fp32 one by at most half a code step in the companded
    domain (1/254), times softsign's inverse slope (at most 2), plus the bf16 rounding of the scale (2^-8
    relative): (2/254 + 2^-8) of the group absmax."""
    params = [torch.nn.Parameter(w) for w in _weights(torch.bfloat16)]
    flash = FlashMuon(params, lr=0.02, master_weight_bits=bits, state_dict_format="portable")
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    torch_muon = torch.optim.Muon(ref, lr=0.02)
    for grads in _grads(4):
        portable = flash.state_dict()["state"]
        for i, (p, r, g) in enumerate(zip(params, ref, grads)):
            p.grad = g.bfloat16()
            r.grad = p.grad.float()
            with torch.no_grad():
                r.copy_(flash.master_weight(p))
            if i in portable:
                torch_muon.state[r]["momentum_buffer"] = portable[i]["momentum_buffer"].clone()
        flash.step()
        torch_muon.step()
        stored = flash.state_dict()["state"]
        for i, (p, r) in enumerate(zip(params, ref)):
            master, want = flash.master_weight(p), r.detach()
            if bits == 32:
                assert torch.equal(master, want)
            else:
                half_rho_step = want.abs().clamp(min=2.0**-126) * 2.0**-8 / 2.0**8
                assert ((master - want).abs() <= half_rho_step).all()
            buf, want_buf = stored[i]["momentum_buffer"], torch_muon.state[r]["momentum_buffer"]
            rows = want_buf.reshape(want_buf.shape[0], -1)
            cols = rows.shape[1]
            pad = (-cols) % 32
            groups = torch.nn.functional.pad(rows.abs(), (0, pad)).view(rows.shape[0], -1, 32).amax(-1)
            bound = groups.repeat_interleave(32, dim=1)[:, :cols] * (2 / 254 + 2.0**-8)
            assert ((buf - want_buf).abs().reshape(rows.shape) <= bound).all()


def test_adamw_groups_are_flash_adamw_bitwise():
    """A use_muon=False group takes FlashAdamW's update: the same bits, parameters and state."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 64), (64,), (5, 7)]
    a = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    muon = FlashMuon([{"params": a, "use_muon": False, "lr": 3e-3, "weight_decay": 0.05}],
                     adamw_betas=(0.9, 0.95), adamw_eps=1e-10)
    adamw = FlashAdamW(b, lr=3e-3, weight_decay=0.05, betas=(0.9, 0.95), eps=1e-10)
    for _ in range(3):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            q.grad = p.grad.clone()
        muon.step()
        adamw.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert muon.state[p].keys() == adamw.state[q].keys()
        assert all(torch.equal(muon.state[p][k], adamw.state[q][k]) for k in muon.state[p])


def test_flatten_true_orthogonalizes_one_matrix():
    """flatten=True: a weight of more than two dims is one matrix (shape[0], prod(shape[1:])): the bits of the
    same values given as that matrix."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(6, 3, 2, 4, generator=gen).bfloat16()
    conv, flat = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.reshape(6, 24).clone())
    a, b = FlashMuon([conv], lr=0.02, flatten=True), FlashMuon([flat], lr=0.02)
    for _ in range(2):
        g = torch.randn(6, 24, generator=gen).bfloat16()
        conv.grad, flat.grad = g.reshape(w.shape).clone(), g.clone()
        a.step()
        b.step()
    assert torch.equal(conv.detach().reshape(6, 24), flat.detach())
    assert torch.equal(a.master_weight(conv).reshape(6, 24), b.master_weight(flat))


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_flatten_false_orthogonalizes_each_matrix_of_a_stack(adjust_lr_fn):
    """flatten=False: a (experts, out, in) weight steps as its experts given as separate (out, in) matrices,
    bit for bit: each orthogonalized on its own, with the learning-rate adjustment of its own shape (tall
    matrices: Newton-Schulz on the transpose, "original" scales by sqrt(rows / cols)); a 4-D stack too. (fp32
    momentum: the 8-bit codes group 32 values along the stack's rows of in * out, the separate matrices' along
    rows of in, so their scales differ.)"""
    gen = torch.Generator().manual_seed(6)
    for shape in ((3, 40, 16), (2, 2, 8, 36)):
        w = torch.randn(shape, generator=gen).bfloat16()
        stack = torch.nn.Parameter(w.clone())
        parts = [torch.nn.Parameter(m.clone()) for m in w.reshape(-1, *shape[-2:])]
        a = FlashMuon([stack], lr=0.02, flatten=False, adjust_lr_fn=adjust_lr_fn, quantize_states=False)
        b = FlashMuon(parts, lr=0.02, adjust_lr_fn=adjust_lr_fn, quantize_states=False)
        for _ in range(3):
            g = (torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 2, shape[:-1], generator=gen)[..., None])
            stack.grad = g.bfloat16()
            for part, m in zip(parts, stack.grad.reshape(-1, *shape[-2:])):
                part.grad = m.clone()
            a.step()
            b.step()
        assert torch.equal(stack.detach().reshape(-1, *shape[-2:]), torch.stack([p.detach() for p in parts]))
        assert torch.equal(a.master_weight(stack).reshape(-1, *shape[-2:]),
                           torch.stack([b.master_weight(p) for p in parts]))
        assert not torch.equal(stack.detach(), w)


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_transposed_stack_steps_as_the_linear_weights_it_stands_for(adjust_lr_fn):
    """transposed=True: a (experts, in, out) stack (Hugging Face's is_transposed experts) steps as the
    nn.Linear (out, in) weights it stands for, each the transpose of its matrix: the orthogonalization is
    orientation-free and adjust_lr_fn reads the Linear's rows and columns (without the key, "original" reads
    the stored ones: another learning rate for a matrix that is not square)."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(3, 16, 40, generator=gen).bfloat16()  # (experts, in, out): Linear(16, 40) each
    stack = torch.nn.Parameter(w.clone())
    linears = [torch.nn.Parameter(m.t().contiguous()) for m in w]  # (out, in)
    a = FlashMuon([{"params": [stack], "flatten": False, "transposed": True}], lr=0.02, adjust_lr_fn=adjust_lr_fn,
                  quantize_states=False)
    b = FlashMuon(linears, lr=0.02, adjust_lr_fn=adjust_lr_fn, quantize_states=False)
    plain = torch.nn.Parameter(w.clone())
    c = FlashMuon([plain], lr=0.02, flatten=False, adjust_lr_fn=adjust_lr_fn, quantize_states=False)
    for _ in range(3):
        stack.grad = torch.randn(w.shape, generator=gen).bfloat16()
        plain.grad = stack.grad.clone()
        for linear, g in zip(linears, stack.grad):
            linear.grad = g.t().contiguous()
        a.step(), b.step(), c.step()
    assert torch.equal(stack.detach(), torch.stack([p.detach().t() for p in linears]))
    assert torch.equal(plain.detach(), stack.detach()) == (adjust_lr_fn == "match_rms_adamw")
    with pytest.raises(ValueError, match="transposed must be True or False, got 1"):
        FlashMuon([{"params": [stack], "flatten": False, "transposed": 1}])


def test_muon_param_groups_stack_hugging_face_fused_experts():
    """Hugging Face's MoE models hold their experts as fused (experts, out, in) weights: muon_param_groups puts
    them in a flatten=False group (each expert's matrix orthogonalized on its own), and a training step runs."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).bfloat16()
    groups = muon_param_groups(model)
    stacked = [[n for n, _ in g["params"]] for g in groups if g.get("flatten") is False]
    assert stacked == [["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]]
    opt = FlashMuon(groups, lr=0.02)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    before = experts.detach().clone()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(experts.detach(), before)
    # GPT-OSS stores its experts (experts, in, out) and says so (is_transposed): a group of their own that says
    # it too, and the stacked expert biases take AdamW
    config = transformers.GptOssConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=64,
                                       num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"])
    model = transformers.GptOssForCausalLM(config).bfloat16()
    flipped = getattr(model.model.layers[0].mlp.experts, "is_transposed", False) is True
    groups = muon_param_groups(model)
    stacked = {n: g.get("transposed", False) for g in groups if g.get("flatten") is False for n, _ in g["params"]}
    assert stacked == {"model.layers.0.mlp.experts.gate_up_proj": flipped, "model.layers.0.mlp.experts.down_proj":
                       flipped}
    assert all(not g["use_muon"] for g in groups for n, _ in g["params"] if n.endswith("_bias"))
    FlashMuon(groups, lr=0.02)


def test_a_weight_of_more_than_two_dims_needs_its_view_chosen():
    """Neither view of a 3-D weight is right for every model (a conv weight is one matrix, MoE experts are a
    stack), so a Muon group that has not chosen one refuses it in one line naming it, at construction and at
    a step whose group went back to None, before anything changes."""
    experts = torch.nn.Parameter(torch.randn(4, 8, 16).bfloat16())
    with pytest.raises(ValueError, match=r"'experts' \(shape \(4, 8, 16\).*set flatten in its param group"):
        FlashMuon([("experts", experts)])
    with pytest.raises(ValueError, match="flatten must be None, True or False, got 1"):
        FlashMuon([experts], flatten=1)
    matrix = torch.nn.Parameter(torch.randn(8, 16).bfloat16())
    opt = FlashMuon([{"params": [matrix]}, {"params": [experts], "flatten": False}], lr=0.02)
    matrix.grad, experts.grad = torch.ones_like(matrix), torch.ones_like(experts)
    opt.step()
    before = [matrix.detach().clone(), experts.detach().clone(), copy.deepcopy(opt.state_dict())]
    opt.param_groups[1]["flatten"] = None
    with pytest.raises(ValueError, match="set flatten in its param group"):
        opt.step()
    assert torch.equal(matrix, before[0]) and torch.equal(experts, before[1])
    assert json.dumps(opt.state_dict()["param_groups"][0]) == json.dumps(before[2]["param_groups"][0])
    with pytest.raises(ValueError, match="set flatten"):
        flashdist.functional.flash_muon([experts], [experts.grad], [torch.zeros(4, 8, 16)], None, None, cols=None,
                                        shapes=[(4, 8, 16)], lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True,
                                        ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7,
                                        adjust_lr_fn=None)
    assert torch.equal(experts, before[1])


def test_nonfinite_gradient_keeps_the_matrix():
    gen = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.randn(8, 64, generator=gen).bfloat16())
    opt = FlashMuon([p], lr=0.02)
    p.grad = torch.randn(8, 64, generator=gen).bfloat16()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items() if k != "step"}
    weight = p.detach().clone()
    p.grad[3, 5] = float("nan")
    opt.step()
    assert torch.equal(p.detach(), weight) and torch.equal(opt.state[p]["rho"], before["rho"])
    assert int(opt.skipped) == p.numel()
    changed = opt.state[p]["momentum_buffer_scales"] != before["momentum_buffer_scales"]
    assert not changed[3, 0]  # the group holding the NaN keeps its momentum; the others moved
    assert changed.sum() == changed.numel() - 1


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8))
        self.lm_head = torch.nn.Linear(8, 10, bias=False)


def test_muon_param_groups():
    model = _Tiny()
    groups = muon_param_groups(model, adamw_lr=3e-4, exclude=("block.2.weight",))
    names = [[n for n, _ in g["params"]] for g in groups]
    assert names[0] == ["block.0.weight"] and groups[0]["use_muon"]
    assert set(names[1]) == {"embed.weight", "block.0.bias", "block.1.weight", "block.1.bias", "block.2.weight",
                             "block.2.bias", "lm_head.weight"}
    assert groups[1] == {**groups[1], "use_muon": False, "lr": 3e-4}
    opt = FlashMuon(muon_param_groups(model.bfloat16()), lr=0.02)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert [g["flatten"] for g in opt.param_groups] == [None, None]


def test_muon_param_groups_leave_heads_tables_and_vectors_to_adamw():
    """A head that is a Sequential (torchvision's classifier) with everything in it, an EmbeddingBag, and a
    vector in another shape (a (1, 1, d) class token) take AdamW; exclude names a tied weight by either of its
    names, and a name that is no parameter is refused."""
    model = torch.nn.Module()
    model.features = torch.nn.Linear(8, 8)
    model.classifier = torch.nn.Sequential(torch.nn.Dropout(), torch.nn.Linear(8, 4))
    model.bag = torch.nn.EmbeddingBag(10, 8)
    model.cls_token = torch.nn.Parameter(torch.zeros(1, 1, 8))
    model.pos_embed = torch.nn.Parameter(torch.zeros(1, 5, 8))  # (1, n, d): a table, not a stack of matrices
    model.proj = torch.nn.Linear(8, 8, bias=False)
    model.twin = model.proj  # tied: named_parameters() gives proj.weight only
    model.layer = torch.nn.Module()  # BERT's layer.N.output: a "head" name deeper down, holding a dense Linear
    model.layer.output = torch.nn.Module()
    model.layer.output.dense = torch.nn.Linear(8, 8, bias=False)
    muon = [n for g in muon_param_groups(model) if g["use_muon"] for n, _ in g["params"]]
    assert muon == ["features.weight", "proj.weight", "layer.output.dense.weight"]
    excluded = muon_param_groups(model, exclude=(n for n in ["twin.weight"]))  # (a generator, a tied alias)
    assert [n for g in excluded if g["use_muon"] for n, _ in g["params"]] == ["features.weight",
                                                                              "layer.output.dense.weight"]
    with pytest.raises(ValueError, match=r"exclude names that are no parameter of the model: \['feature.weight'\]"):
        muon_param_groups(model, exclude=("feature.weight",))
    with pytest.raises(ValueError, match=r"pass \['proj.weight'\]"):
        muon_param_groups(model, exclude="proj.weight")
    # the same model inside wrappers (torch.compile's _orig_mod, a LightningModule's self.model, DDP's module):
    # its children are still the model's own, so the classifier's Linear stays with AdamW
    wrapped = torch.nn.Module()
    wrapped.module = torch.nn.Module()
    wrapped.module.model = model
    for outer, prefix in ((torch.compile(model), "_orig_mod."), (wrapped, "module.model.")):
        assert [n for g in muon_param_groups(outer) if g["use_muon"] for n, _ in g["params"]] == [
            prefix + name for name in muon]
    # not a wrapper: a model that is only its head (a probe), a container of one layer (a one-layer encoder)
    probe = torch.nn.Module()
    probe.classifier = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    encoder = torch.nn.Module()
    encoder.layer = torch.nn.ModuleList([model.layer])
    for other, want in ((probe, []), (encoder, ["layer.0.output.dense.weight"])):
        assert [n for g in muon_param_groups(other) if g["use_muon"] for n, _ in g["params"]] == want


def test_muon_param_groups_leave_biases_and_tables_by_name_and_see_through_parameterless_siblings():
    """A parameter whose own name says bias, or whose name says embed, takes AdamW whatever its shape (GPT-OSS's
    stacked expert biases, Swin's relative position table, a (h, w, d) position table, a patch embedding, LoRA's
    factors of an embedding); a wrapper's children without
    parameters (a LightningModule's loss function beside its model) do not hide the model's head."""
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(8, 8)
    model.experts = torch.nn.Module()
    model.experts.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 16))
    model.experts.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(4, 16))
    model.relative_position_bias_table = torch.nn.Parameter(torch.zeros(49, 2))
    model.pos_embed = torch.nn.Parameter(torch.zeros(4, 4, 8))
    model.patch_embed = torch.nn.Conv2d(3, 8, 2)  # the input layer
    model.embed_tokens = torch.nn.Module()  # LoRA's factors of an embedding
    model.embed_tokens.lora_embedding_A = torch.nn.ParameterDict({"default": torch.zeros(2, 10)})
    model.classifier = torch.nn.Linear(8, 3)
    muon = [n for g in muon_param_groups(model) if g["use_muon"] for n, _ in g["params"]]
    assert muon == ["proj.weight", "experts.gate_up_proj"]
    tower = torch.nn.Module()  # layers deep inside a module named so (a retriever's encoder) are hidden layers
    tower.doc_embedder = torch.nn.Module()
    tower.doc_embedder.encoder = torch.nn.ModuleList([torch.nn.Module()])
    tower.doc_embedder.encoder[0].attention = torch.nn.Linear(8, 8)
    tower.proj = torch.nn.Linear(8, 8)
    assert [n for g in muon_param_groups(tower) if g["use_muon"] for n, _ in g["params"]] == [
        "doc_embedder.encoder.0.attention.weight", "proj.weight"]
    lit = torch.nn.Module()  # a LightningModule: self.model, self.loss_fn
    lit.model, lit.loss_fn = model, torch.nn.CrossEntropyLoss()
    assert [n for g in muon_param_groups(lit) if g["use_muon"] for n, _ in g["params"]] == [
        "model." + name for name in muon]


def test_muon_param_groups_choose_the_view_of_conv_and_stacked_weights():
    """A convolution's weight is one matrix (flatten=True); another weight of more than 2 dims (MoE experts)
    a stack of matrices (flatten=False); 2-D matrices keep the group without the key."""

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 8, 12))

    model = torch.nn.ModuleDict(dict(conv=torch.nn.Conv1d(3, 8, 5), proj=torch.nn.Linear(8, 8), experts=Experts(),
                                     embed=torch.nn.Embedding(10, 8)))
    groups = muon_param_groups(model)
    got = [([n for n, _ in g["params"]], g["use_muon"], g.get("flatten", "absent")) for g in groups]
    assert got == [(["proj.weight"], True, "absent"), (["conv.weight"], True, True),
                   (["experts.gate_up_proj"], True, False),
                   (["conv.bias", "proj.bias", "embed.weight"], False, "absent")]
    opt = FlashMuon(muon_param_groups(model.bfloat16()), lr=0.02)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()


def test_refusals(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for cls in (FlashMuon, FlashAdamW):  # (it failed inside triton with "0 active drivers")
        weight = torch.nn.Parameter(torch.ones(4, 8, dtype=torch.bfloat16))
        opt, weight.grad = cls([weight], backend="triton"), torch.ones(4, 8, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="backend='triton' runs on CUDA tensors and these are on cpu"):
            opt.step()
        assert torch.equal(weight, torch.ones_like(weight))
    vector = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="'bias'.*fewer than 2 dims.*use_muon=False"):
        FlashMuon([("bias", vector)])
    matrix = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="backend must be one of"):
        FlashMuon([matrix], backend="fused")
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        FlashMuon([matrix], adjust_lr_fn="sqrt")
    # torch.optim.AdamW's names in a group: kept and never read (the AdamW groups read adamw_betas, adamw_eps)
    for group, match in (({"params": [vector], "use_muon": False, "betas": (0.5, 0.9)}, "with use_muon=False sets "
                          "'betas'.*read 'adamw_betas'"),
                         ({"params": [vector], "use_muon": False, "eps": 1e-3}, "sets 'eps'.*read 'adamw_eps'"),
                         ({"params": [matrix], "betas": (0.5, 0.9)}, "of Muon matrices sets 'betas'")):
        with pytest.raises(ValueError, match=match):
            FlashMuon([group])
    opt = FlashMuon([matrix])
    with pytest.raises(ValueError, match="sets 'eps'"):
        opt.add_param_group({"params": [vector], "use_muon": False, "eps": 1e-3})
    assert len(opt.param_groups) == 1
    # a FlashMuon group copied back (its eps is Newton-Schulz's default, beside adamw_eps) is not the user's eps
    copied = FlashMuon([{"params": [matrix]}, {"params": [vector], "use_muon": False}])
    more = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    copied.add_param_group({**copied.param_groups[-1], "params": [more]})
    FlashMuon([{**g, "params": list(g["params"])} for g in copied.param_groups])
    matrix.grad = torch.ones_like(matrix)
    opt.step()  # (state is made at the first step; use_muon is fixed from then on)
    opt.param_groups[0]["use_muon"] = False
    with pytest.raises(ValueError, match="use_muon of a param group was True"):
        opt.step()
    opt.param_groups[0]["use_muon"] = True
    vector.grad = torch.ones_like(vector)
    opt.param_groups[0]["params"].append(vector)  # a vector put into a live Muon group: refused before any change
    opt.param_groups[0]["param_names"] = ["matrix"]  # (named: the appended one has no name, its position says)
    before = matrix.detach().clone(), copy.deepcopy(opt.state[matrix])
    with pytest.raises(ValueError, match=r"\['params'\]\[1\] \(shape \(8,\).*fewer than 2 dims"):
        opt.step()
    assert torch.equal(matrix, before[0]) and all(torch.equal(v, before[1][k]) for k, v in opt.state[matrix].items())
    # the AdamW defaults are checked at construction, by their names, though no AdamW group exists yet
    for kwargs, match in (({"adamw_betas": (1.0, 0.9)}, r"adamw_betas\[0\] must be in \[0.0, 1.0\)"),
                          ({"adamw_betas": (0.9,)}, "adamw_betas must be a pair"),
                          ({"adamw_eps": float("nan")}, "adamw_eps must be")):
        with pytest.raises(ValueError, match=match):
            FlashMuon([matrix], **kwargs)


def test_a_parameter_moved_between_muon_and_adamw_groups_is_refused_before_any_change():
    """A matrix moved from a Muon group into an AdamW one after its first step keeps a momentum buffer that the
    AdamW update would read as no state (its step count would set AdamW's bias correction): refused at the
    step, naming it, whichever of the group's parameters holds it; del optimizer.state[p] starts it anew."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(8))
    opt = FlashMuon([{"params": [a]}, {"params": [b], "use_muon": False}], lr=0.01, master_weight_bits=None)
    for p in (a, b):
        p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[0]["params"].remove(a)
    opt.param_groups[1]["params"].append(a)
    before = a.detach().clone(), b.detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\] .* use_muon=False but its state "
                       "was made by the Muon update"):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    opt.param_groups[1]["params"].insert(0, opt.param_groups[1]["params"].pop())  # first in its new group
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] .* use_muon=False but its state "
                       "was made by the Muon update"):
        opt.step()
    del opt.state[a]
    opt.step()
    assert "exp_avg_codes" in opt.state[a] and float(opt.state[a]["step"]) == 1


def test_memory():
    p = torch.nn.Parameter(torch.zeros(64, 256, dtype=torch.bfloat16))
    opt = FlashMuon([p])
    p.grad = torch.zeros_like(p)
    opt.step()  # (state is made at the first step)
    report = flashdist.memory_report(opt)
    assert report["bytes_per_param"] == pytest.approx(flashdist.bytes_per_param("flash_muon")["total"])
    assert flashdist.bytes_per_param("flash_muon")["total"] == 6.0625
    assert flashdist.bytes_per_param("muon")["total"] == 12


def test_state_dicts_move_to_and_from_torch_muon():
    """The portable format is torch.optim.Muon's (``momentum_buffer``, plus rho and step): a FlashMuon state
    loads into torch.optim.Muon and continues with its bits, and torch's state (no step) loads back."""
    params = [torch.nn.Parameter(w) for w in _weights(torch.float32)]
    flash = FlashMuon(params, lr=0.02, quantize_states=False, master_weight_bits=None)
    grads = _grads(3)
    for p, g in zip(params, grads[0]):
        p.grad = g
    flash.step()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_muon = torch.optim.Muon(ref, lr=0.02)
    torch_muon.load_state_dict(copy.deepcopy(flash.state_dict()))  # (fp32 buffers are the live tensors)
    for p, r, g in zip(params, ref, grads[1]):
        p.grad, r.grad = g, g.clone()
    flash.step()
    torch_muon.step()
    assert all(torch.equal(p, r) for p, r in zip(params, ref))
    again = FlashMuon([torch.nn.Parameter(r.detach().clone()) for r in ref], lr=0.02, quantize_states=False,
                      master_weight_bits=None)
    again.load_state_dict(copy.deepcopy(torch_muon.state_dict()))
    for p, q in zip(params, again.param_groups[0]["params"]):
        assert torch.equal(flash.state[p]["momentum_buffer"], again.state[q]["momentum_buffer"])


@pytest.mark.parametrize("dtype, bits", [(torch.bfloat16, 24), (torch.float16, 24), (torch.bfloat16, 32)],
                         ids=["bf16-24", "fp16-24", "bf16-32"])
def test_a_state_dict_that_went_through_torch_muon_loads_back_with_its_rho(dtype, bits):
    """torch.optim.Muon's load_state_dict casts every state tensor but ``step`` to the parameter's dtype, rho
    included: where that cast holds every rho value (int8 in bf16 or fp16), FlashMuon takes rho back as it
    was, and continues with the bits of the optimizer it came from; an int16 rho (32-bit masters of a bf16
    parameter) is refused in one line naming it, changing nothing."""
    params = [torch.nn.Parameter(w) for w in _weights(dtype)]
    flash = FlashMuon(params, lr=0.02, master_weight_bits=bits)
    grads = _grads(3)
    for p, g in zip(params, grads[0]):
        p.grad = g.to(dtype)
    flash.step()
    torch_muon = torch.optim.Muon([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.02)
    torch_muon.load_state_dict(copy.deepcopy(flash.state_dict()))
    through_torch = torch_muon.state_dict()
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = FlashMuon(copies, lr=0.02, master_weight_bits=bits)
    if bits == 32:
        assert next(iter(flash.state.values()))["rho"].dtype == torch.int16
        with pytest.raises(ValueError, match=r"state 'rho' of .* is torch.bfloat16, which does not hold every "
                                             r"torch.int16 value"):
            again.load_state_dict(through_torch)
        assert len(again.state) == 0
        return
    again.load_state_dict(through_torch)
    for p, q, g in zip(params, copies, grads[1]):
        assert torch.equal(flash.master_weight(p), again.master_weight(q))
        p.grad, q.grad = g.to(dtype), g.to(dtype)
    flash.step()
    again.step()
    assert all(torch.equal(p, q) and torch.equal(flash.master_weight(p), again.master_weight(q))
               for p, q in zip(params, copies))


def test_an_sgd_state_dict_is_refused():
    """torch.optim.SGD's and FlashSGD's state (momentum_buffer, FlashMuon's name) and groups (no Newton-Schulz
    options) are refused in one line, changing nothing (they loaded, and SGD's lr, momentum and nesterov replaced
    FlashMuon's)."""
    for sgd in (torch.optim.SGD, flashdist.FlashSGD):
        params = [torch.nn.Parameter(w) for w in _weights(torch.float32)]
        other = sgd(params, lr=1e-3, momentum=0.9, **({} if sgd is torch.optim.SGD else {"master_weight_bits": None}))
        for p, g in zip(params, _grads(1)[0]):
            p.grad = g
        other.step()
        muon = FlashMuon([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.02, master_weight_bits=None)
        before = {k: v for k, v in muon.param_groups[0].items() if k != "params"}
        with pytest.raises(ValueError, match=r"param group 0 of the state dict has no Newton-Schulz options"):
            muon.load_state_dict(copy.deepcopy(other.state_dict()))
        assert len(muon.state) == 0 and {k: v for k, v in muon.param_groups[0].items() if k != "params"} == before
    # a group saved without use_muon (torch.optim.Muon's and AdamW's, merged) is read as the live group is
    weights = [torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(8))]
    flash = FlashMuon([{"params": weights[:1]}, {"params": weights[1:], "use_muon": False}], master_weight_bits=None)
    for p in weights:
        p.grad = torch.ones_like(p)
    flash.step()
    saved = flash.state_dict()
    saved["param_groups"] = [{k: v for k, v in g.items() if k != "use_muon"} for g in saved["param_groups"]]
    saved["param_groups"][1] = {k: v for k, v in saved["param_groups"][1].items() if not k.startswith("ns_")}
    flash.load_state_dict(saved)


@pytest.mark.parametrize("fmt", ["portable", "compressed"])
def test_state_dict_round_trip_mid_run(fmt):
    """Saved after 2 steps and loaded into a fresh optimizer, the third step is the same bits."""
    params = [torch.nn.Parameter(w) for w in _weights(torch.bfloat16)]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a = FlashMuon(params, lr=0.02, state_dict_format=fmt)
    grads = _grads(3)
    for step in range(2):
        for p, g in zip(params, grads[step]):
            p.grad = g.bfloat16()
        a.step()
    with torch.no_grad():
        for p, q in zip(params, copies):
            q.copy_(p)
    b = FlashMuon(copies, lr=0.02, state_dict_format=fmt)
    b.load_state_dict(a.state_dict())
    for p, q, g in zip(params, copies, grads[2]):
        p.grad, q.grad = g.bfloat16(), g.bfloat16()
    a.step()
    b.step()
    for p, q in zip(params, copies):
        assert torch.equal(p, q) and all(torch.equal(a.state[p][k], b.state[q][k]) for k in a.state[p])


@pytest.mark.parametrize("fmt", ["portable", "compressed"])
def test_checkpoint_inspect_export_and_convert(tmp_path, fmt):
    """A FlashMuon DCP checkpoint of a tiny Llama in either state format: `flashdist inspect` reads it, `flashdist
    export` (safetensors and `--hf` folder) writes the master weights (parameter + rho) bit for bit, and
    `flashdist convert` to the other format gives a checkpoint that loads back to the same state."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from _cli import run_cli
    from flashdist import checkpoint

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)

    def build():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).bfloat16()
        return model, FlashMuon(muon_param_groups(model, adamw_lr=3e-3), lr=0.02, state_dict_format=fmt)

    model, opt = build()
    for step in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(str(tmp_path / "ck"), model, opt)
    config.save_pretrained(tmp_path / "cfg")
    rc, out, err = run_cli("inspect", tmp_path / "ck", "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["optimizer_format"] == fmt and info["master_weight_bits"] == [24], info
    masters = {name: opt.master_weight(p) for name, p in model.named_parameters()}
    rc, _, err = run_cli("export", tmp_path / "ck", tmp_path / "w.safetensors")
    assert rc == 0, err
    rc, _, err = run_cli("export", tmp_path / "ck", tmp_path / "hf", "--hf", "--config",
                         tmp_path / "cfg" / "config.json")
    assert rc == 0, err
    for exported in (load_file(str(tmp_path / "w.safetensors")),
                     load_file(str(tmp_path / "hf" / "model.safetensors"))):
        for name, master in masters.items():
            assert torch.equal(exported[name], master), name
    other = {"portable": "compressed", "compressed": "portable"}[fmt]
    rc, _, err = run_cli("convert", tmp_path / "ck", tmp_path / other, "--to", "dcp", "--format", other)
    assert rc == 0, err
    fresh, loaded = build()
    checkpoint.load(str(tmp_path / other), fresh, loaded)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
        assert opt.state[p].keys() == loaded.state[q].keys(), name
        assert all(torch.equal(opt.state[p][k], loaded.state[q][k]) for k in opt.state[p]), name


def test_a_checkpoint_saved_before_flatten_existed_loads(tmp_path):
    """A DCP checkpoint whose param groups lack an option added since (flatten) loads, the groups keeping
    this optimizer's value, and training goes on with the bits of the run it was saved from."""
    from flashdist import checkpoint

    def build():
        torch.manual_seed(0)
        model = torch.nn.ModuleDict(dict(proj=torch.nn.Linear(8, 16, bias=False), norm=torch.nn.LayerNorm(16)))
        model.register_parameter("experts", torch.nn.Parameter(torch.randn(3, 16, 8)))
        model = model.bfloat16()
        return model, FlashMuon(muon_param_groups(model, adamw_lr=1e-3), lr=0.02)

    def step(model, opt, seed):
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()

    model, opt = build()
    step(model, opt, 0)
    options = [g.pop("flatten") for g in opt.param_groups]  # as a checkpoint of an earlier flashdist
    flipped = [g.pop("transposed") for g in opt.param_groups]  # (added later still)
    checkpoint.save(str(tmp_path / "ck"), model, opt)
    for g, value, t in zip(opt.param_groups, options, flipped):
        g["flatten"], g["transposed"] = value, t
    again, resumed = build()
    groups = resumed.param_groups
    groups[:] = groups[1:] + groups[:1]  # listed in another order than saved: the options follow the parameters
    with pytest.warns(UserWarning, match="saved before FlashMuon's flatten option"):  # (it trained them flattened)
        checkpoint.load(str(tmp_path / "ck"), again, resumed)
    groups[:] = groups[-1:] + groups[:-1]
    assert [g["flatten"] for g in resumed.param_groups] == options == [None, False, None]
    assert [g["transposed"] for g in resumed.param_groups] == flipped == [False, False, False]
    step(model, opt, 1)
    step(again, resumed, 1)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    momenta = [g.pop("momentum") for g in opt.param_groups]  # any other option missing still refuses it
    checkpoint.save(str(tmp_path / "other"), model, opt)
    for g, value in zip(opt.param_groups, momenta):
        g["momentum"] = value
    with pytest.raises(checkpoint.CheckpointError, match="missing from the checkpoint.*momentum"):
        checkpoint.load(str(tmp_path / "other"), *build())


def test_names_and_defaults_are_torch_muons():
    """Every option of torch.optim.Muon is an option of FlashMuon, with the same name and default (the
    learning-rate adjustment included: adjust_lr_fn None, "original" or "match_rms_adamw")."""
    import inspect

    ours = inspect.signature(FlashMuon.__init__).parameters
    theirs = {n: p.default for n, p in inspect.signature(torch.optim.Muon.__init__).parameters.items()
              if n not in ("self", "params")}
    assert {n: ours[n].default for n in theirs if n in ours} == theirs
    assert flashdist.optim.muon.ADJUST_LR_FNS == (None, "original", "match_rms_adamw")


def test_empty_matrices_step_and_save():
    """Matrices with a zero dim (torch.optim.Muon divides by zero on (3, 0)) step as no-ops beside a real one,
    whose bits are those of a run without them, and their state saves and loads in both formats."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(8, 40, generator=gen).bfloat16()
    empties = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in ((3, 0), (0, 5), (2, 0, 3))]
    params = [torch.nn.Parameter(w.clone()), *empties]
    alone = torch.nn.Parameter(w.clone())
    a, b = FlashMuon(params, lr=0.02, flatten=False), FlashMuon([alone], lr=0.02)
    for _ in range(2):
        g = torch.randn(8, 40, generator=gen).bfloat16()
        params[0].grad, alone.grad = g.clone(), g
        for p in empties:
            p.grad = torch.zeros_like(p)
        a.step()
        b.step()
    assert torch.equal(params[0], alone) and torch.equal(a.master_weight(params[0]), b.master_weight(alone))
    for fmt in ("portable", "compressed"):
        again = FlashMuon([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.02, flatten=False)
        again.load_state_dict(a.state_dict(format=fmt))
        for p, q in zip(params, again.param_groups[0]["params"]):
            assert a.state[p].keys() == again.state[q].keys()
            assert all(torch.equal(a.state[p][k], again.state[q][k]) for k in a.state[p])


def test_gradient_release_in_one_process_matches_the_ordinary_step():
    """enable_gradient_release steps each matrix (whole in one process) during backward: the ordinary
    step's bits, and memory_report measures the analytic 4.0625 bytes per parameter (no gradient) between
    steps. (FSDP2: tests/distributed/test_muon_sharded.py.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(64, 32, bias=False)).bfloat16()
    ref = copy.deepcopy(model)
    released = FlashMuon(muon_param_groups(model), lr=0.02)
    ordinary = FlashMuon(muon_param_groups(ref), lr=0.02)
    handle = flashdist.enable_gradient_release(model, released)
    for step in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step)).bfloat16()
        for net, opt in ((model, released), (ref, ordinary)):
            net(x).float().square().mean().backward()
            if opt is released:
                assert flashdist.memory_report(opt)["bytes_per_param"] == \
                    flashdist.bytes_per_param("flash_muon", gradient_release=True)["total"]
            opt.step()
            opt.zero_grad()
    handle.remove()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(released.state[p][k], ordinary.state[q][k]) for k in released.state[p])


def test_training_tracks_torch_muon_and_rho_matters():
    """A tiny transformer, 25 steps: FlashMuon (bf16 + 24-bit masters, 8-bit momentum) ends within 1% of the loss
    of torch.optim.Muon + torch.optim.AdamW on fp32 weights; without rho (pure bf16 weights) it ends visibly
    higher: Muon's lr-sized steps are below half a bf16 spacing for many weights."""
    from sharding_cases import lm_batch, lm_loss, make_tiny_lm

    def run(kind: str) -> float:
        model = make_tiny_lm()
        if kind == "torch":
            model = model.float()
            muon, adamw = muon_param_groups(model)
            optimizers = [torch.optim.Muon([p for _, p in muon["params"]], lr=0.02),
                          torch.optim.AdamW([p for _, p in adamw["params"]], lr=3e-3, weight_decay=0.1)]
        else:
            optimizers = [FlashMuon(muon_param_groups(model, adamw_lr=3e-3), lr=0.02,
                                    master_weight_bits=24 if kind == "flash" else None)]
        losses = []
        for step in range(25):
            loss = lm_loss(model, lm_batch(step, 16))
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0] / 3, losses
        return sum(losses[-5:]) / 5

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool on a busy machine only slows them
    try:
        reference, flash, no_rho = run("torch"), run("flash"), run("no-rho")
    finally:
        torch.set_num_threads(threads)
    assert abs(flash - reference) < 0.01 * reference, (flash, reference)
    assert no_rho > 1.05 * flash, (no_rho, flash)
