"""``flashdist convert`` / ``export`` never lose or silently alter data: tied weights get the master weight,
destinations are checked, a failed write leaves nothing, every expected failure is one line, plain data
survives safetensors, and a conversion's memory is bounded by its largest tensor, not the checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import flashdist
from flashdist import checkpoint
from flashdist.checkpoint import convert as C
from flashdist.checkpoint import sources as S
from _cli import run_cli as _cli  # tests/_cli.py

ROOT = Path(__file__).resolve().parents[1]




def _one_line_failure(rc: int, out: str, err: str, *needles: str) -> None:
    assert rc == 1 and out == "", (rc, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class Tied(nn.Module):
    """Embedding = LM head (one parameter, two names), plus an untied layer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 48)
        self.mid = nn.Linear(48, 48)
        self.head = nn.Linear(48, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    torch.manual_seed(0)
    model = Tied().bfloat16()
    opt = flashdist.FlashAdamW(model.parameters(), lr=3e-3)
    for _ in range(4):
        x = torch.randint(0, 64, (32,))
        nn.functional.cross_entropy(model(x).float(), x).backward()
        opt.step()
        opt.zero_grad()
    path = tmp_path_factory.mktemp("tied") / "ck"
    checkpoint.save(path, model, opt, extra={"dtype": torch.bfloat16})
    return path, model, opt


# ----- 4: tied weights -------------------------------------------------------------------------------------


def test_export_fp32_state_dict_gives_every_alias_the_master(tied):
    _, model, opt = tied
    master = opt.master_weight(model.emb.weight).float()
    assert (master - model.emb.weight.float()).abs().max() > 0  # rho holds something the bf16 weight does not
    exported = flashdist.export_fp32_state_dict(model, opt)
    assert set(exported) == set(model.state_dict())
    assert torch.equal(exported["emb.weight"], master) and torch.equal(exported["head.weight"], master)


def test_export_command_gives_every_alias_the_master(tied, tmp_path):
    from safetensors.torch import load_file

    path, model, opt = tied
    rc, _, err = _cli("export", path, tmp_path / "w.safetensors")
    assert rc == 0, err
    exported = load_file(tmp_path / "w.safetensors")
    expected = flashdist.export_fp32_state_dict(model, opt)
    assert exported.keys() == expected.keys()
    for k in expected:
        assert torch.equal(exported[k], expected[k]), k
    rc, _, err = _cli("export", path, tmp_path / "w16.safetensors", "--dtype", "bf16")
    assert rc == 0, err
    half = load_file(tmp_path / "w16.safetensors")
    assert all(torch.equal(half[k], expected[k].bfloat16()) for k in expected)


CRAFTED_CODES = {
    "int32-codes": lambda e: e.update(exp_avg_codes=e["exp_avg_codes"].to(torch.int32)),
    "codes-of-another-shape": lambda e: e.update(exp_avg_codes=e["exp_avg_codes"][:4].contiguous()),
    "scales-1x1": lambda e: e.update(exp_avg_scales=e["exp_avg_scales"][:1, :1].contiguous()),
    "fp32-scales": lambda e: e.update(exp_avg_scales=e["exp_avg_scales"].float()),
    "nan-scales": lambda e: e["exp_avg_scales"].fill_(float("nan")),
    "negative-scales": lambda e: e["exp_avg_sq_scales"].neg_(),
}


@pytest.mark.parametrize("craft", CRAFTED_CODES.values(), ids=CRAFTED_CODES.keys())
def test_codes_and_scales_flashdist_does_not_write_are_refused_by_a_format_switch(tied, tmp_path, craft):
    """Compressed -> portable dequantizes the codes with their scales: codes of another dtype or shape, scales of
    another dtype or shape (broadcast), NaN or negative scales (NaN moments) are refused in one line naming the
    parameter, nothing written, where they had failed with a broadcasting error or converted without a word."""
    path, _, _ = tied
    assert _cli("convert", path, tmp_path / "ck.pt", "--to", "torch", "--format", "compressed")[0] == 0
    state = torch.load(tmp_path / "ck.pt", weights_only=True)
    craft(state["optim"]["state"]["mid.weight"])
    torch.save(state, tmp_path / "crafted.pt")
    out = tmp_path / "out.pt"
    _one_line_failure(*_cli("convert", tmp_path / "crafted.pt", out, "--to", "torch", "--format", "portable"),
                      "'mid.weight'", "damaged or crafted")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt", "crafted.pt"]


# ----- 6: destinations -------------------------------------------------------------------------------------


def test_destination_inside_equal_to_or_holding_the_source_is_refused(tied, tmp_path):
    path, _, _ = tied
    before = _listing(path)
    _one_line_failure(*_cli("export", path, path / ".metadata", "--force"), "lies inside")
    _one_line_failure(*_cli("convert", path, path, "--to", "dcp", "--force"), "is the source")
    assert _listing(path) == before
    folder = tmp_path / "dir"
    folder.mkdir()
    assert _cli("convert", path, folder / "ck.pt", "--to", "torch")[0] == 0
    (folder / "notes.txt").write_text("mine")
    before = _listing(folder)
    _one_line_failure(*_cli("convert", folder / "ck.pt", folder, "--to", "dcp", "--force"), "holds the source")
    assert _listing(folder) == before


def test_force_replaces_only_a_previous_output_of_the_same_kind(tied, tmp_path):
    path, _, _ = tied
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.bin").write_bytes(b"keep")
    _one_line_failure(*_cli("convert", path, mine, "--to", "dcp", "--force"), "--force replaces only")
    _one_line_failure(*_cli("export", path, mine, "--hf", "--force"), "--force replaces only")
    assert _listing(mine) == {"data.bin": b"keep"}
    assert _cli("convert", path, tmp_path / "out.safetensors", "--to", "safetensors")[0] == 0
    _one_line_failure(*_cli("convert", path, tmp_path / "out.safetensors", "--to", "torch", "--force"),
                      "not a torch file")
    assert _cli("convert", path, tmp_path / "out.dcp", "--to", "dcp")[0] == 0
    rc, _, err = _cli("convert", path, tmp_path / "out.dcp", "--to", "dcp", "--force", "--format", "compressed")
    assert rc == 0, err
    assert C.inspect(tmp_path / "out.dcp")["optimizer_format"] == "compressed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out.dcp", "out.safetensors"]  # no temporaries


def test_unwritable_destination_is_one_line(tied, tmp_path):
    path, _, _ = tied
    (tmp_path / "file").write_text("x")
    for to in ("torch", "dcp", "safetensors"):
        _one_line_failure(*_cli("convert", path, tmp_path / "file" / "out", "--to", to), "cannot write")
    _one_line_failure(*_cli("export", path, tmp_path / "file" / "out", "--hf"), "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# ----- 5: failed writes ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """Writes past ``nbytes`` fail with EFBIG (Python ignores SIGXFSZ), as on a full or capped disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.parametrize("args", [("convert", "--to", "torch"), ("convert", "--to", "dcp"),
                                  ("convert", "--to", "safetensors"), ("export",), ("export", "--hf")],
                         ids=["torch", "dcp", "safetensors", "export", "export-hf"])
def test_failed_write_exits_1_and_leaves_nothing(tied, tmp_path, args):
    path, _, _ = tied
    out = tmp_path / "out"
    with _file_size_limit(16 * 1024):  # the checkpoint's tensors are larger
        rc, stdout, err = _cli(args[0], path, out, *args[1:])
    _one_line_failure(rc, stdout, err, "could not write", str(out))
    assert list(tmp_path.iterdir()) == []


# ----- 9/10: plain data and shared storage through safetensors ----------------------------------------------


def test_safetensors_keeps_dtypes_in_extra_and_exports_shared_storage(tmp_path):
    shared = torch.randn(8, 4)
    state = {"model": {"a.weight": shared, "b.weight": shared, "c": torch.arange(3)},
             "extra": {"dtype": torch.bfloat16, "nested": {"dtypes": [torch.float32, torch.int8], "n": 3}}}
    torch.save(state, tmp_path / "ck.pt")
    rc, _, err = _cli("convert", tmp_path / "ck.pt", tmp_path / "ck.safetensors", "--to", "safetensors")
    assert rc == 0, err
    rc, _, err = _cli("convert", tmp_path / "ck.safetensors", tmp_path / "back.pt", "--to", "torch")
    assert rc == 0, err
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["extra"] == state["extra"]
    for k, v in state["model"].items():
        assert torch.equal(back["model"][k], v), k
    rc, _, err = _cli("export", tmp_path / "ck.pt", tmp_path / "w.safetensors")
    assert rc == 0, err
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "w.safetensors")
    assert torch.equal(weights["a.weight"], shared) and torch.equal(weights["b.weight"], shared)


def test_plain_data_json_cannot_hold_is_one_line(tmp_path):
    torch.save({"model": {"w": torch.ones(2)}, "extra": {"blob": b"\x00\x01"}}, tmp_path / "ck.pt")
    _one_line_failure(*_cli("convert", tmp_path / "ck.pt", tmp_path / "x.safetensors", "--to", "safetensors"),
                      "not JSON", "--to torch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]


# ----- smaller: inspect's world size, DeepSpeed tags ------------------------------------------------------


def test_inspect_counts_the_ranks_the_metadata_names(tied, tmp_path):
    path, _, _ = tied
    copy = tmp_path / "ck"
    copy.mkdir()
    for name, data in _listing(path).items():
        (copy / name).write_bytes(data)
    (copy / "__7_0.distcp").write_bytes(next(path.glob("*.distcp")).read_bytes())  # a stray file
    assert C.inspect(copy)["saved_world_size"] == 1


def test_deepspeed_tag_outside_the_folder_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "link").symlink_to(elsewhere)
    for tag in ("../elsewhere", str(elsewhere), "link"):
        (ds / "latest").write_text(tag)
        _one_line_failure(*_cli("convert", ds, tmp_path / "out", "--to", "dcp"), "leads outside")
        _one_line_failure(*_cli("convert", ds, tmp_path / "out", "--to", "dcp", "--tag", tag), "leads outside")


# ----- streaming ------------------------------------------------------------------------------------------


def test_convert_and_export_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """The benchmark's peak RSS of a conversion, less the same conversion of a tiny checkpoint, on a checkpoint of
    many tensors none of them large: a whole-checkpoint read would need its full size."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = tmp_path / "mem.json"
    subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "bench_convert_memory.py"), "--shape", "test",
                    "--ops", "dcp->torch", "export safetensors", "--work", str(tmp_path),
                    "--out", str(out)], env=env, check=True, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    assert result["checkpoint_bytes"] > 40 * result["largest_tensor_bytes"]
    for row in result["rows"]:
        assert row["growth_bytes"] < 0.25 * result["checkpoint_bytes"], row


def test_torch_round_trip_keeps_plain_data_as_it_was(tied, tmp_path):
    path, _, _ = tied
    assert _cli("convert", path, tmp_path / "a.pt", "--to", "torch")[0] == 0
    assert _cli("convert", tmp_path / "a.pt", tmp_path / "b.pt", "--to", "torch")[0] == 0
    a, b = (torch.load(tmp_path / n, weights_only=True) for n in ("a.pt", "b.pt"))
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    assert isinstance(b["optim"]["param_groups"][0]["betas"], tuple)
    # the user's extra, and the ties checkpoint.save recorded (export reads them)
    assert b["extra"] == {"dtype": torch.bfloat16, "flashdist_tied": [["emb.weight", "head.weight"]]}, b["extra"]
    flat_a, _ = S.flat_tensors(a)
    flat_b, _ = S.flat_tensors(b)
    assert flat_a.keys() == flat_b.keys() and all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a)


def test_inspect_of_files_reads_the_structure_only(tied, tmp_path):
    path, model, _ = tied
    want = C.inspect(path)
    for to in ("torch", "safetensors"):
        assert _cli("convert", path, tmp_path / f"ck.{to}", "--to", to)[0] == 0
        info = C.inspect(tmp_path / f"ck.{to}")
        assert info["kind"] == to and info["step"] == want["step"] == 4
        for key in ("parameters", "parameter_tensors", "model_dtypes", "optimizer_format", "master_weight_bits",
                    "optimizer_state_keys"):
            assert info[key] == want[key], (to, key)


def test_converted_dcp_shards_are_tied_to_their_metadata(tied, tmp_path):
    """`convert --to dcp` writes shards as `flashdist.checkpoint.save` does: a shard of another conversion
    put in its place is refused on load, naming the file."""
    import shutil

    from flashdist.checkpoint.dcp import read_metadata

    path, model, opt = tied
    for name in ("a", "b"):
        assert _cli("convert", path, tmp_path / name, "--to", "dcp")[0] == 0
    ids = {read_metadata(tmp_path / n).storage_meta.save_id for n in ("a", "b")}
    assert len(ids) == 2 and all(i.startswith("flashdist-") for i in ids)
    checkpoint.load(tmp_path / "a", model, opt)  # intact: loads
    shard = next((tmp_path / "b").glob("*.distcp"))
    shutil.copyfile(shard, tmp_path / "a" / shard.name)
    with pytest.raises(checkpoint.CheckpointError, match=shard.name):
        checkpoint.load(tmp_path / "a", model, opt)


# ----- DeepSpeed ZeRO files: one reader, one safety policy --------------------------------------------------


class Payload:
    """A class DeepSpeed never pickles into a checkpoint."""

    def __init__(self):
        self.note = "not DeepSpeed's"


def _zero_folder(root: Path, extra: dict[int, dict] | None = None, *, zero_stage=2, loss_scaler=None) -> Path:
    """A 2-rank ZeRO-2 checkpoint of a flashdist optimizer in DeepSpeed's layout (one bf16 parameter of 4 values,
    bf16 masters + rho), with ``extra[rank]`` added to that rank's ZeRO state. Returns the folder holding
    ``latest``."""
    folder = root / "step1"
    folder.mkdir(parents=True)
    (root / "latest").write_text("step1")
    torch.save({"dp_world_size": 2, "param_shapes": [{"w": torch.Size([4])}], "global_steps": 1,
                "module": {"w": torch.zeros(4, dtype=torch.bfloat16)}, "ds_config": {"zero_optimization": {"stage": 2}}},
               folder / "mp_rank_00_model_states.pt")
    for rank in range(2):
        master = torch.tensor([1.0, -2.0], dtype=torch.bfloat16) * (rank + 1)
        entry = {"step": torch.tensor(1.0), "exp_avg": torch.full((2,), 0.5), "exp_avg_sq": torch.full((2,), 0.25),
                 "rho": torch.tensor([3, -7], dtype=torch.int8)}
        zsd = {"zero_stage": zero_stage, "loss_scaler": loss_scaler, "partition_count": [2],
               "param_alignment_paddings": [[0]], "single_partition_of_fp32_groups": [master],
               "base_optimizer_state": {"state": {0: entry}, "param_groups": [
                   {"params": [0], "lr": 1e-3, "flashdist_format": "portable", "master_weight_bits": 24}]}}
        zsd.update((extra or {}).get(rank, {}))
        torch.save({"optimizer_state_dict": zsd}, folder / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return root


def test_deepspeed_file_with_an_unexpected_class_is_refused_and_nothing_written(tmp_path):
    """Rank 1's optimizer file holds an object DeepSpeed never writes: convert reads it with weights_only=True,
    refuses it in one line naming the file and the class, and writes nothing. The same folder without the object
    converts (the refusal is the object's, not the folder's)."""
    good = _zero_folder(tmp_path / "good")
    rc, _, err = _cli("convert", good, tmp_path / "good.pt", "--to", "torch")
    assert rc == 0 and (tmp_path / "good.pt").is_file(), err
    bad = _zero_folder(tmp_path / "bad", {1: {"loss_scaler": Payload()}})
    before = _listing(bad)
    for command in (("convert", bad, tmp_path / "out.pt", "--to", "torch"), ("export", bad, tmp_path / "out.pt")):
        _one_line_failure(*_cli(*command), "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "Payload", "refused")
    assert not (tmp_path / "out.pt").exists() and not list(tmp_path.glob("out.pt*"))
    assert _listing(bad) == before


@pytest.mark.skipif(not flashdist._compat.HAS_DEEPSPEED, reason="fold_rho is part of the DeepSpeed integration; "
                                                                "DeepSpeed is the [deepspeed] extra")
def test_fold_rho_reads_through_the_same_reader(tmp_path, monkeypatch):
    """fold_rho refuses the file with the unexpected class before writing anything, and refuses to write into
    an existing tag folder; on a good folder its copy holds DeepSpeed's own classes (DeepSpeed's loaders take
    it), fp32 masters equal to param + rho and no rho."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from flashdist.checkpoint import CheckpointError
    from flashdist.integrations import deepspeed as fds
    from flashdist.quant import rho as R

    bad = _zero_folder(tmp_path / "bad", {1: {"clip_grad": Payload()}})
    with pytest.raises(CheckpointError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt holds a pickled "
                                              r"\S*Payload"):
        fds.fold_rho(str(bad), str(tmp_path / "bad-out"))
    assert not (tmp_path / "bad-out").exists()

    good = _zero_folder(tmp_path / "good", zero_stage=ZeroStageEnum.gradients, loss_scaler=LossScaler(scale=1.0))
    (tmp_path / "out").mkdir()
    (tmp_path / "victim").write_text("not yours")
    (tmp_path / "out" / "latest").symlink_to(tmp_path / "victim")  # planted: replaced, never written through
    out = Path(fds.fold_rho(str(good), str(tmp_path / "out")))
    assert out == tmp_path / "out" / "step1" and (tmp_path / "out" / "latest").read_text() == "step1"
    assert not (tmp_path / "out" / "latest").is_symlink() and (tmp_path / "victim").read_text() == "not yours"
    for rank in range(2):
        name = f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        saved = torch.load(good / "step1" / name, weights_only=False)["optimizer_state_dict"]
        folded = torch.load(out / name, weights_only=False)["optimizer_state_dict"]
        assert type(folded["zero_stage"]) is ZeroStageEnum and type(folded["loss_scaler"]) is LossScaler
        rho = saved["base_optimizer_state"]["state"][0]["rho"]
        expected = R.merge(saved["single_partition_of_fp32_groups"][0], rho)
        assert folded["single_partition_of_fp32_groups"][0].dtype == torch.float32
        assert torch.equal(folded["single_partition_of_fp32_groups"][0], expected)
        assert "rho" not in folded["base_optimizer_state"]["state"][0]
    before = _listing(tmp_path / "out")
    with pytest.raises(FileExistsError, match="already exists"):
        fds.fold_rho(str(good), str(tmp_path / "out"))
    assert _listing(tmp_path / "out") == before
