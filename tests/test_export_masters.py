"""``flashdist export`` / ``master_weights`` give the live optimizer's masters (param + rho) bit for bit on every
kind of checkpoint a user saves, or refuse in one line: state keyed by index (``torch.save`` of
``optimizer.state_dict()``, with and without ``param_names``), a Trainer ``checkpoint-N`` folder, DCP; frozen
and tied parameters; an order that cannot be proved, and a rho that no weight uses, refused."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

import flashdist
from flashdist import checkpoint
from flashdist.checkpoint.convert import inspect, master_weights
from flashdist.checkpoint.errors import CheckpointError
from _cli import run_cli  # tests/_cli.py
from invariants import assert_masters_equal  # tests/invariants.py

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Tiny(torch.nn.Module):
    """An embedding, two same-shaped layers (an order that shapes alone cannot tell apart if shuffled), a norm
    and an LM head that may be tied to the embedding."""

    def __init__(self, tie: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(self.norm(x))


def _train(model, params, steps: int = 3):
    torch.manual_seed(1)
    opt = flashdist.FlashAdamW(params, lr=1e-2)
    for _ in range(steps):
        ids = torch.randint(0, 16, (4, 6))
        torch.nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _model(dtype, tie=False):
    torch.manual_seed(0)
    return Tiny(tie).to(dtype)


def _export(src, tmp_path, *args):
    out = tmp_path / "out.safetensors"
    rc, _, err = run_cli("export", src, out, *args)
    assert rc == 0, err
    return load_file(out)


def _refused(src, tmp_path, needle):
    out = tmp_path / "refused.safetensors"
    rc, stdout, err = run_cli("export", src, out)
    assert rc == 1 and stdout == "" and err.count("\n") == 1 and needle in err, err
    assert not out.exists()
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        master_weights(torch.load(src, weights_only=True) if src.is_file() else checkpoint.convert.read(src))
    assert inspect(src)["masters"].startswith("not attachable"), inspect(src)["masters"]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("named", [False, True], ids=["index", "param_names"])
def test_torch_save_of_the_state_dicts_exports_the_masters(tmp_path, dtype, named):
    model = _model(dtype)
    params = list(model.named_parameters() if named else model.parameters())
    if named:
        params.reverse()  # param_names prove any order
    opt = _train(model, params)
    sd = opt.state_dict()
    assert all(isinstance(k, int) for k in sd["state"]) and named == ("param_names" in sd["param_groups"][0])
    torch.save({"model": model.state_dict(), "optim": sd}, tmp_path / "ck.pt")
    assert_masters_equal(opt, model, _export(tmp_path / "ck.pt", tmp_path))
    assert_masters_equal(opt, model, master_weights(torch.load(tmp_path / "ck.pt", weights_only=True)))
    assert "24-bit" in inspect(tmp_path / "ck.pt")["masters"]


@pytest.mark.parametrize("cast", ["bf16", "fp32", "fp32-unrecorded", "int32", "bf16-of-32-bit"])
def test_rho_cast_by_a_torch_optimizer_exports_the_masters_or_is_refused(tmp_path, cast):
    """A state dict that went through a torch optimizer's load_state_dict (which casts rho to the parameter's
    dtype; FlashAdamW -> torch.optim.AdamW -> torch.save) exports the masters its rho holds, read back as
    whole numbers (an fp32 cast by its group's master_weight_bits), as load_state_dict takes it back; inspect
    says so. An fp32 rho whose group records no master_weight_bits, and an int32 rho, are refused in one line
    (export had failed on any of them with a bare dtype name)."""
    model = _model(torch.bfloat16)
    opt = _train(model, model.parameters())
    if cast == "bf16-of-32-bit":  # (int16 rho of small values: a bf16 cast holds them, the bits must say int16)
        opt.param_groups[0]["master_weight_bits"] = 32
    sd = opt.state_dict()
    for entry in sd["state"].values():
        if "rho" in entry:
            entry["rho"] = entry["rho"].to({"int32": torch.int32}.get(cast, torch.bfloat16 if cast.startswith("bf16")
                                                                       else torch.float32))
    if cast == "fp32-unrecorded":
        del sd["param_groups"][0]["master_weight_bits"]
    torch.save({"model": model.state_dict(), "optim": sd}, tmp_path / "ck.pt")
    if cast in ("bf16", "fp32"):
        assert_masters_equal(opt, model, _export(tmp_path / "ck.pt", tmp_path))
        held = {"bf16": "bfloat16", "fp32": "float32"}[cast]
        assert f"24-bit) for 8 of 8 weights; state named by model order; rho held as {held}" in \
            inspect(tmp_path / "ck.pt")["masters"]
    else:
        _refused(tmp_path / "ck.pt", tmp_path, {"fp32-unrecorded": "records no master_weight_bits",
                                                "int32": "is int32: not a dtype flashdist writes rho in",
                                                "bf16-of-32-bit": "does not hold every int16 value"}[cast])


def test_dcp_checkpoint_exports_the_masters(tmp_path):
    model = _model(torch.bfloat16, tie=True)
    opt = _train(model, model.parameters())
    checkpoint.save(tmp_path / "ck", model, opt)
    assert_masters_equal(opt, model, _export(tmp_path / "ck", tmp_path))
    assert "state named by names" in inspect(tmp_path / "ck")["masters"]


FROZEN = {
    # the optimizer holds the frozen norm without state: the count proves the order
    "frozen-listed": ("norm.weight", lambda m: m.parameters()),
    # the optimizer leaves the frozen (tied) embedding out: proved by shapes, no other reading fits
    "frozen-left-out": ("embed.weight", lambda m: [p for p in m.parameters() if p.requires_grad]),
}


@pytest.mark.parametrize("frozen, params", FROZEN.values(), ids=FROZEN.keys())
def test_frozen_and_tied_parameters_keep_the_mapping(tmp_path, frozen, params):
    model = _model(torch.bfloat16, tie=True)
    model.get_parameter(frozen).requires_grad_(False)
    opt = _train(model, params(model))
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck.pt")
    assert_masters_equal(opt, model, _export(tmp_path / "ck.pt", tmp_path))


@pytest.mark.parametrize("saved", ["dcp", "dcp-to-torch", "compiled"])
def test_a_frozen_copy_of_a_weight_is_exported_as_itself(tmp_path, saved):
    """A frozen bf16 copy of a trained weight (a reference model, a teacher) with the same bits, early in
    training (steps small enough that rho moves and the bf16 values do not): no optimizer state and the same
    values are what a tied weight looks like too. Where the checkpoint says which weights are one tensor (the
    ties checkpoint.save records, kept by convert, under the names the checkpoint keeps: a compiled model's
    too), the copy is exported as itself and the tied head still gets the embedding's master (the copy got the
    trained weight's master)."""
    model = _model(torch.bfloat16, tie=True)
    model.ref = torch.nn.Linear(8, 8).bfloat16().requires_grad_(False)
    model.ref.load_state_dict(model.layers[0].state_dict())
    # (named: a state keyed by index alone could not tell the copy's place, and is refused)
    opt = flashdist.FlashAdamW([(n, p) for n, p in model.named_parameters() if p.requires_grad], lr=1e-6)
    for _ in range(2):
        ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
        torch.nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(model.ref.weight, model.layers[0].weight)  # the bits a tie would have
    assert bool(opt.state[model.layers[0].weight]["rho"].any())
    # (compiled: named_parameters() says _orig_mod.head.weight, the checkpoint head.weight)
    checkpoint.save(tmp_path / "ck", torch.compile(model) if saved == "compiled" else model, opt)
    src = tmp_path / "ck"
    if saved == "dcp-to-torch":  # (each name its own tensor in the file: the record tells)
        assert run_cli("convert", src, tmp_path / "ck.pt", "--to", "torch")[0] == 0
        src = tmp_path / "ck.pt"
    exported = _export(src, tmp_path)
    assert_masters_equal(opt, model, exported)
    assert torch.equal(exported["ref.weight"], model.ref.weight.float())
    assert not torch.equal(exported["ref.weight"], opt.master_weight(model.layers[0].weight))


@pytest.mark.parametrize("saved", ["torch", "torch-copied", "memory-copied"])
def test_tied_weights_saved_without_a_record_get_the_master(tmp_path, saved):
    """A torch file or an in-memory state dict of a tied model: one storage under both names, or each name its
    own copy (a state moved to the CPU, cloned): both names get the master, where nothing records the tie."""
    model = _model(torch.bfloat16, tie=True)
    opt = _train(model, model.named_parameters())
    weights = model.state_dict()
    if saved.endswith("copied"):
        weights = {k: v.clone() for k, v in weights.items()}
    state = {"model": weights, "optim": opt.state_dict()}
    if saved == "memory-copied":
        exported = master_weights(state)
    else:
        torch.save(state, tmp_path / "ck.pt")
        exported = _export(tmp_path / "ck.pt", tmp_path)
    assert_masters_equal(opt, model, exported)


def test_unprovable_orders_are_refused(tmp_path):
    model = _model(torch.bfloat16)
    # a norm weight frozen and left out: which of the same-shaped vectors the optimizer holds, shapes cannot tell
    model.norm.weight.requires_grad_(False)
    opt = _train(model, [p for p in model.parameters() if p.requires_grad])
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck.pt")
    _refused(tmp_path / "ck.pt", tmp_path, "more than one way")
    # shuffled against the model's order: no match
    model = _model(torch.bfloat16)
    opt = _train(model, list(model.parameters())[::-1])
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck.pt")
    _refused(tmp_path / "ck.pt", tmp_path, "no model weights of these shapes")


def test_rho_that_no_weight_uses_is_refused(tmp_path):
    model = _model(torch.bfloat16)
    opt = _train(model, model.named_parameters())
    sd = opt.state_dict()
    weights = model.state_dict()
    del weights["head.weight"]  # its state and rho stay
    torch.save({"model": weights, "optim": sd}, tmp_path / "ck.pt")
    _refused(tmp_path / "ck.pt", tmp_path, "param_names ['head.weight'] are not among the model weights")
    # keyed by name: a state of a weight the model does not have
    named = {"model": weights, "optim": {
        "state": {"head.weight": sd["state"][len(sd["state"]) - 1]}, "param_groups": [{"params": ["head.weight"]}]}}
    with pytest.raises(CheckpointError, match=r"rho of optimizer state \['head.weight'\] belongs to no"):
        master_weights(named)
    # rho beside an fp32 weight of that name
    weights = dict(model.state_dict(), **{"head.weight": model.head.weight.detach().float()})
    torch.save({"model": weights, "optim": sd}, tmp_path / "ck.pt")
    _refused(tmp_path / "ck.pt", tmp_path, "belongs to no bf16/fp16 model weight")


def test_trainer_checkpoint_folder_exports_the_masters(tmp_path):
    """A Trainer ``checkpoint-N`` folder (model.safetensors, optimizer.pt keyed by index in the Trainer's decay /
    no-decay groups, no param_names), and the same weights as pytorch_model.bin and as sharded safetensors: fp32
    export, --hf and a convert output, against the Trainer's live optimizer."""
    transformers = pytest.importorskip("transformers")
    from flashdist.integrations import transformers as fd_hf
    from integrations._tiny_llama import tiny_llama

    fd_hf.register()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids.clone()}
            for ids in ((torch.randint(0, 128, (1,), generator=g) + torch.arange(16)) % 128 for _ in range(8))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), optim="flash_adamw", learning_rate=1e-2, max_steps=2, save_steps=2,
        per_device_train_batch_size=4, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, weight_decay=0.1)
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=data)
    trainer.train()
    model, opt = trainer.model, getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    folder = tmp_path / "run" / "checkpoint-2"
    assert len(torch.load(folder / "optimizer.pt", weights_only=True)["param_groups"]) == 2  # decay, no decay
    info = inspect(folder)
    assert info["kind"] == "trainer" and info["step"] == 2 and "model order" in info["masters"], info
    assert_masters_equal(opt, model, _export(folder, tmp_path))
    rc, _, err = run_cli("export", folder, tmp_path / "hf", "--hf", "--config", folder / "config.json")
    assert rc == 0, err
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert_masters_equal(opt, model, loaded.state_dict())
    # the other ways the Trainer writes the weights: pytorch_model.bin, and sharded safetensors with an index
    import shutil

    from huggingface_hub import save_torch_state_dict

    weights = load_file(folder / "model.safetensors")
    for variant in ("bin", "sharded"):
        other = tmp_path / variant / "checkpoint-2"
        shutil.copytree(folder, other, ignore=shutil.ignore_patterns("model.safetensors"))
        if variant == "bin":
            torch.save(weights, other / "pytorch_model.bin")
        else:
            save_torch_state_dict(weights, other, max_shard_size="40KB")
            assert len(list(other.glob("model-*.safetensors"))) > 1
        out = tmp_path / variant / "out.safetensors"
        rc, _, err = run_cli("export", other, out)
        assert rc == 0, err
        assert_masters_equal(opt, model, load_file(out))
    # a convert output keeps the model's order: its masters are still exact
    rc, _, err = run_cli("convert", folder, tmp_path / "ck.pt", "--to", "torch")
    assert rc == 0, err
    assert_masters_equal(opt, model, master_weights(torch.load(tmp_path / "ck.pt", weights_only=True)))


def test_accelerate_save_state_folder_exports_the_masters_or_refuses(tmp_path):
    """An Accelerate ``save_state`` folder (model.safetensors + optimizer.bin, no config.json): named by
    param_names; an optimizer built from ``model.parameters()`` leaves the order unknown: refused in one line;
    a folder of two optimizers refused."""
    accelerate = pytest.importorskip("accelerate")
    for named in (True, False):
        model = _model(torch.bfloat16)
        opt = _train(model, model.named_parameters() if named else model.parameters())
        accelerator = accelerate.Accelerator(cpu=True)
        _, prepared = accelerator.prepare(model, opt)
        folder = tmp_path / f"state-{named}"
        accelerator.save_state(str(folder))
        if named:
            assert_masters_equal(opt, model, _export(folder, tmp_path))
            info = inspect(folder)
            assert info["layout"] == "Accelerate save_state" and "param_names" in info["masters"], info
        else:
            _refused(folder, tmp_path, "has no config.json to build the model's parameter order from")
    (folder / "optimizer_1.bin").write_bytes((folder / "optimizer.bin").read_bytes())
    rc, _, err = run_cli("inspect", folder)
    assert rc == 1 and err.count("\n") == 1 and "several models or optimizers (optimizer_1.bin)" in err, err


def test_inspect_refuses_a_checkpoint_with_nothing_it_reads(tmp_path):
    """No model weights and no optimizer state under 'model' / 'optim' (a Lightning-style file): inspect exits
    1 with one line naming the file and its keys, never "0 parameters"."""
    path = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "optimizer_states": [{}]}, path)
    rc, out, err = run_cli("inspect", path)
    assert rc == 1 and out == "" and err.count("\n") == 1, (rc, out, err)
    assert str(path) in err and "'optimizer_states', 'state_dict'" in err, err


def test_fsdp_sharded_folder_exports_the_masters(tmp_path):
    """The folder the Trainer (checkpoint-N) and Accelerate's save_state write under FSDP with a sharded state
    dict: the model and the optimizer as two DCP checkpoints, the state keyed by name (the layout of
    accelerate.utils.save_fsdp_model / save_fsdp_optimizer). The conformance matrix checks the folders the
    real clients write on 2 ranks; a folder of two optimizers is refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _model(torch.bfloat16)
    opt = _train(model, model.parameters())
    folder = tmp_path / "checkpoint-3"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"), no_dist=True)
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(folder / "optimizer_0"),
             no_dist=True)
    assert_masters_equal(opt, model, _export(folder, tmp_path))
    info = inspect(folder)
    assert info["kind"] == "fsdp-folder" and info["master_weight_bits"] == [24], info
    (folder / "optimizer_1").mkdir()
    rc, _, err = run_cli("inspect", folder)
    assert rc == 1 and err.count("\n") == 1 and "several models or optimizers (optimizer_1)" in err, err
