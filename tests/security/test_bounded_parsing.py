"""Sizes, counts and indexes taken from a file are checked against the file before memory is allocated for
them: tiny crafted files are refused with a one-line CheckpointError in bounded time and memory by every
reader, and every single-byte corruption of a real .metadata is a CheckpointError or loads."""

from __future__ import annotations

import copy
import os
import json
import pickle
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _hostile import metadata_of, plain, write_metadata
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from flashdist import checkpoint
from flashdist.checkpoint import sources

ROOT = Path(__file__).resolve().parents[2]
HUGE = 3_000_000_000
STATE = {"model": {"w": torch.arange(12.0).reshape(3, 4)},
         "optim": {"param_groups": [{"lr": 0.1, "params": ["w"]}]}}


def _tensor_key(md) -> str:
    return next(k for k, m in md.state_dict_metadata.items() if hasattr(m, "size"))


def _index(md):
    md.planner_data["optim.param_groups.0.lr"] = ("optim", "param_groups", HUGE, "lr")


def _size(md):
    meta = md.state_dict_metadata[_tensor_key(md)]
    meta.size = torch.Size([HUGE, HUGE])
    meta.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([HUGE, HUGE]))]


def _length(md):
    for info in md.storage_data.values():
        info.length = 10**15


def _chunk_outside(md):
    meta = md.state_dict_metadata[_tensor_key(md)]
    meta.chunks = [ChunkStorageMetadata(torch.Size([HUGE, 0]), torch.Size([3, 4]))]


def _negative(md):
    meta = md.state_dict_metadata[_tensor_key(md)]
    meta.size = torch.Size([-1, 4])


def _transformed(md):
    for info in md.storage_data.values():
        info.transform_descriptors = ["zstd"]


def _leaf_and_folder(md):
    md.planner_data["optim.param_groups.0.lr"] = ("model", "w", "lr")


def _name_into_list(md):
    md.planner_data["optim.param_groups.0.lr"] = ("optim", "param_groups", "lr")


def _no_table(md):
    md.state_dict_metadata = [1, 2, 3]


def _deep_route(md):
    md.planner_data["optim.param_groups.0.lr"] = tuple([0] * 1000)


MUTATIONS = {"index-3e9": _index, "size-3e9x3e9": _size, "length-1e15": _length, "chunk-outside": _chunk_outside,
             "negative-size": _negative, "transformed": _transformed, "leaf-and-folder": _leaf_and_folder,
             "name-into-list": _name_into_list, "no-table": _no_table, "deep-route": _deep_route}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, Path]:
    """One folder per mutation: a real plain DCP checkpoint whose .metadata was changed."""
    root = tmp_path_factory.mktemp("hostile")
    good = plain(root / "good", STATE)
    out = {}
    for name, mutate in MUTATIONS.items():
        md = copy.deepcopy(metadata_of(good))
        mutate(md)
        folder = root / name
        folder.mkdir()
        for shard in good.glob("*.distcp"):
            (folder / shard.name).write_bytes(shard.read_bytes())
        out[name] = write_metadata(folder, md)
        assert (folder / ".metadata").stat().st_size < 4096  # tiny files, every one
    return out


@pytest.mark.parametrize("name", MUTATIONS)
def test_crafted_metadata_is_one_line_checkpoint_error(hostile, name):
    if name in ("index-3e9", "size-3e9x3e9", "length-1e15"):  # these would allocate: run in the child below
        assert name in _CHILD_CASES
        return
    with pytest.raises(checkpoint.CheckpointError) as e:
        sources.read(hostile[name])
    assert "\n" not in str(e.value) and str(hostile[name]) in str(e.value)


_CHILD_CASES = ("index-3e9", "size-3e9x3e9", "length-1e15", "safetensors-route-3e9")
_CHILD = r"""
import json, resource, sys, time
def vm():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
from flashdist.cli import main
import contextlib, io
import flashdist.checkpoint  # imported before the limit: its libraries' address space is not the reader's
main(["inspect", sys.argv[2]])  # warm: the first run loads lazily imported modules
resource.setrlimit(resource.RLIMIT_AS, (vm() + (1 << 30),) * 2)  # a regression fails fast, not the machine
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
results = []
for path in json.loads(sys.argv[1]):
    for args in (["inspect", path], ["convert", path, path + ".out", "--to", "torch"], ["export", path, path + ".st"]):
        err = io.StringIO()
        start = time.monotonic()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(args)
        results.append([args[0], path, rc, err.getvalue(), time.monotonic() - start])
print(json.dumps({"results": results,
                  "grew": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024}))
"""


def test_tiny_files_naming_huge_sizes_stay_within_memory_and_time(hostile, tmp_path):
    """In a child process (its address space capped 1 GiB above its start, so a regression fails there):
    inspect, convert and export of each crafted file fail in one line, within 64 MiB more than a good
    checkpoint's inspect and 10 s."""
    from safetensors.torch import save_file

    st = tmp_path / "route.safetensors"
    save_file({"w": torch.zeros(3)}, str(st), metadata={"route:w": json.dumps(["model", "layers", HUGE, "w"])})
    paths = [str(hostile[n]) for n in _CHILD_CASES[:3]] + [str(st)]
    good = plain(tmp_path / "good", STATE)
    run = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(paths), str(good)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for command, path, rc, err, seconds in report["results"]:
        assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err, (command, path, err)
        assert "FLASHDIST_TRACEBACK" not in err and "Error:" not in err, (command, path, err)
        assert seconds < 10, (command, path, seconds)
    assert report["grew"] < 64 * 2**20, report["grew"]


def test_every_single_byte_corruption_of_a_metadata_file_is_refused_or_loads(tmp_path):
    good = plain(tmp_path / "good", STATE)
    data = (good / ".metadata").read_bytes()
    assert len(data) < 2048
    folder = tmp_path / "flipped"
    folder.mkdir()
    for shard in good.glob("*.distcp"):
        (folder / shard.name).write_bytes(shard.read_bytes())
    rng = random.Random(0)
    start, outcomes = time.monotonic(), {"refused": 0, "loaded": 0}
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= rng.randrange(1, 256)
        (folder / ".metadata").write_bytes(bytes(flipped))
        try:
            state = sources.read(folder)
        except checkpoint.CheckpointError as e:
            assert "\n" not in str(e) and str(folder) in str(e), (i, str(e))
            outcomes["refused"] += 1
        else:
            assert isinstance(state, dict), i
            outcomes["loaded"] += 1
    assert outcomes["refused"] > len(data) // 2, outcomes
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("per_byte,what", [(10, "before it is read"), (25, "after its opcodes are walked")])
def test_metadata_beyond_the_budget_is_refused_naming_the_variable(tmp_path, monkeypatch, per_byte, what):
    """A .metadata longer than a twentieth of FLASHDIST_METADATA_MIB is refused unread; a shorter one whose
    opcodes would build more than the budget, before it is unpickled; the line says how to raise it."""
    good = plain(tmp_path / "good", STATE)
    monkeypatch.setenv("FLASHDIST_METADATA_MIB", str(per_byte * (good / ".metadata").stat().st_size / 2**20))
    with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata: reading its metadata would take about .* MiB "
                       r"of memory, more than the .* MiB budget .*\(set FLASHDIST_METADATA_MIB=\d+ to read it\)$") as e:
        sources.read(good)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("FLASHDIST_METADATA_MIB", "1")
    assert sources.read(good)["model"]["w"].shape == (3, 4)
    monkeypatch.setenv("FLASHDIST_METADATA_MIB", "lots")
    with pytest.raises(checkpoint.CheckpointError, match="FLASHDIST_METADATA_MIB='lots' is not a number"):
        sources.read(good)


def test_unknown_pickle_opcodes_and_truncations_are_checkpoint_errors(tmp_path):
    good = plain(tmp_path / "good", STATE)
    data = (good / ".metadata").read_bytes()
    for bad in (data[:-1], data[: len(data) // 2], b"", b"\x80\x05\x95" + b"\xff" * 8, pickle.dumps([[]] * 10),
                b"\x80\x04" + b"(" * 100_000, b"\x80\x04B\xff\xff\xff\x7f"):
        (good / ".metadata").write_bytes(bad)
        with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata"):
            sources.read(good)


@pytest.mark.parametrize("kind", ["dcp", "safetensors", "torch"])
def test_damaged_files_are_one_line_through_every_command(tmp_path, kind):
    """Seeded random byte changes in a flashdist checkpoint's .metadata, a safetensors file's header and a
    torch file: inspect, convert and export succeed or exit 1 with one line that is a refusal, not an error
    nobody foresaw, and leave no output behind."""
    from _hostile import copy_checkpoint, saved

    from flashdist.checkpoint import convert as C
    from tests._cli import run_cli

    ck = saved(tmp_path / "ck")
    source = {"dcp": ck, "safetensors": tmp_path / "a.safetensors", "torch": tmp_path / "a.pt"}[kind]
    if kind != "dcp":
        C.convert(ck, source, to=kind)
    target = source / ".metadata" if kind == "dcp" else source
    data = target.read_bytes()
    end = 8 + int.from_bytes(data[:8], "little") if kind == "safetensors" else len(data)
    rng = random.Random(kind)
    for trial in range(40):
        work = tmp_path / f"w{trial}"
        work.mkdir()
        damaged = copy_checkpoint(source, work / "ck") if kind == "dcp" else work / source.name
        changed = bytearray(data)
        changed[rng.randrange(end)] ^= rng.randrange(1, 256)
        (damaged / ".metadata" if kind == "dcp" else damaged).write_bytes(bytes(changed))
        for command in (("inspect", damaged), ("convert", damaged, work / "o.pt", "--to", "torch"),
                        ("export", damaged, work / "o.safetensors")):
            rc, _, err = run_cli(*command)
            assert rc in (0, 1) and (rc == 0 or err.count("\n") == 1), (trial, command[0], err)
            assert "FLASHDIST_TRACEBACK" not in err, (trial, command[0], err)
            assert rc == 0 or not (work / "o.pt").exists() or command[0] != "convert"


@pytest.mark.parametrize("param_groups", [[{"params": 5}], [7], "groups", [{"params": [0, 1]}] * 3])
def test_deepspeed_files_of_unexpected_structure_are_checkpoint_errors(tmp_path, param_groups):
    from _hostile import attempt

    folder = tmp_path / "ds" / "step1"
    folder.mkdir(parents=True)
    (folder.parent / "latest").write_text("step1")
    torch.save({"module": {}, "param_shapes": [{"w": torch.Size([2])}], "dp_world_size": 1, "ds_version": "0.19"},
               folder / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "partition_count": 1,
                                         "base_optimizer_state": {"state": {}, "param_groups": param_groups},
                                         "single_partition_of_fp32_groups": [torch.zeros(2)]}},
               folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    for reader in ("inspect", "convert", "export"):
        error = attempt(reader, folder.parent, tmp_path / "out")
        assert error is not None and "ds" in str(error), (reader, error)


@pytest.mark.parametrize("plain_data", [{"optim": {"param_groups": [5]}}, {"optim": {"param_groups": [{"params": 5}]}},
                                        {"optim": {"param_groups": "x", "state": 4}}, [1, 2]],
                         ids=["group-int", "params-int", "groups-str", "list"])
def test_safetensors_plain_data_of_unexpected_types_is_one_line(tmp_path, plain_data):
    from safetensors.torch import save_file

    from tests._cli import run_cli

    path = tmp_path / "c.safetensors"
    save_file({"model.w": torch.zeros(3, dtype=torch.bfloat16), "optim.state.w.rho": torch.zeros(3, dtype=torch.int8)},
              str(path), metadata={"flashdist": json.dumps(plain_data)})
    for command in (("inspect", path), ("convert", path, tmp_path / "o.pt", "--to", "dcp", "--format", "compressed"),
                    ("export", path, tmp_path / "o.safetensors")):
        rc, _, err = run_cli(*command)
        assert rc in (0, 1) and "FLASHDIST_TRACEBACK" not in err and err.count("\n") == rc, (command[0], err)


# ----- the metadata budget ----------------------------------------------------------------------------------
# Pickles that build the most memory per byte the C unpickler reads (fresh containers left on the stack or in
# the memo, long runs of small items, wide characters): each is sized to just under the budget, and must cost
# no more than it.


def _int(i: int) -> bytes:
    return b"J" + i.to_bytes(4, "little", signed=True)


_DENSE = {
    "lists-on-stack": lambda n: b"]" * n,
    "dicts-on-stack": lambda n: b"}" * n,
    "dicts-of-one-item": lambda n: b"](" + b"}K\x01Ns" * n + b"e",
    "memoized-dicts": lambda n: b"}\x94" * n,
    "tuple-of-lists": lambda n: b"(" + b"]" * n + b"t",
    "dict-items": lambda n: b"}(" + b"".join(_int(i) + b"N" for i in range(n)) + b"u",
    "wide-strings": lambda n: b"](" + (b"\x8c\x20" + ("\U0001F600" * 8).encode()) * n + b"e",
    "ints": lambda n: b"](" + b"".join(_int(1000 + i) for i in range(n)) + b"e",
    "marks": lambda n: b"(" * n + b"N",
}
_BUDGET_MIB = 32


def _dense_metadata(kind: str, budget: int) -> bytes:
    from flashdist.checkpoint.dcp_files import check_pickle

    def make(n):
        return b"\x80\x04" + _DENSE[kind](n) + b"."

    per, size = check_pickle(make(1000), Path("x")) / 1000, len(make(1000)) / 1000
    data = make(int(min(0.97 * budget / (per + 2 * size), 0.97 * budget / 20 / size)))  # the cost, the length
    assert 0.9 * budget < 2 * len(data) + check_pickle(data, Path("x")) <= budget or 0.9 * budget < 20 * len(data)
    return data


_BUDGET_CHILD = r"""
import contextlib, io, json, sys, time
from flashdist.cli import main
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
main(["inspect", sys.argv[2]])  # warm: modules imported lazily
out = []
for path in json.loads(sys.argv[1]):
    err = io.StringIO()
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here
    start = time.monotonic()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["inspect", path])
    out.append([path, rc, err.getvalue(), time.monotonic() - start, status("VmHWM:") - before])
print(json.dumps(out))
"""


def test_inspect_of_metadata_built_to_the_budget_stays_within_it(tmp_path):
    """With FLASHDIST_METADATA_MIB=32: .metadata files that pack the most objects per byte, each just under the
    budget by check_pickle's count, are unpickled (then refused: they are not DCP metadata) with a peak
    growth within the budget, each in under 10 s; one over it is refused before unpickling; so is a torch file
    whose tensor record would inflate to 256 MiB."""
    budget = _BUDGET_MIB << 20
    paths = []
    for kind in _DENSE:
        folder = tmp_path / kind
        folder.mkdir()
        (folder / ".metadata").write_bytes(_dense_metadata(kind, budget))
        paths.append(str(folder))
    paths.append(str(_torch_file_with(tmp_path / "bomb.pt", inflate_to=256 << 20)))  # and a zip bomb
    over = tmp_path / "over"
    over.mkdir()
    (over / ".metadata").write_bytes(b"\x80\x04" + b"]" * (budget // 100) + b".")
    good = plain(tmp_path / "good", STATE)
    env = {**os.environ, "FLASHDIST_METADATA_MIB": str(_BUDGET_MIB), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _BUDGET_CHILD, json.dumps(paths + [str(over)]), str(good)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for path, rc, err, seconds, grew in results:
        assert rc == 1 and err.count("\n") == 1 and "FLASHDIST_TRACEBACK" not in err, (path, err)
        assert seconds < 10 and grew <= budget, (path, seconds, grew / 2**20)
    assert f"FLASHDIST_METADATA_MIB={2 * _BUDGET_MIB} to read it" in results[-1][2]


def test_default_budget_holds_a_llama_8b_state_on_8_ranks_with_margin():
    """The .metadata of a Llama-3-8B-shaped FlashAdamW state (compressed: six state tensors per parameter) on 8
    FSDP2 ranks, built without its tensors: its cost by check_pickle is under a quarter of the default budget."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (Metadata, MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    from flashdist.checkpoint.dcp_files import check_pickle
    from flashdist.checkpoint.files import metadata_budget

    shapes = {"model.embed_tokens.weight": (128256, 4096), "model.norm.weight": (4096,),
              "lm_head.weight": (128256, 4096)}
    for i in range(32):
        for name, shape in (("self_attn.q_proj", (4096, 4096)), ("self_attn.k_proj", (1024, 4096)),
                            ("self_attn.v_proj", (1024, 4096)), ("self_attn.o_proj", (4096, 4096)),
                            ("mlp.gate_proj", (14336, 4096)), ("mlp.up_proj", (14336, 4096)),
                            ("mlp.down_proj", (4096, 14336)), ("input_layernorm", (4096,)),
                            ("post_attention_layernorm", (4096,))):
            shapes[f"model.layers.{i}.{name}.weight"] = shape
    entries, storage, routes, offsets = {}, {}, {}, [0] * 8

    def add(key, route, shape, ranks):
        chunks = []
        for r in range(ranks):
            rows = -(-shape[0] // ranks) if shape else 0
            start = torch.Size([min(r * rows, shape[0])] + [0] * (len(shape) - 1)) if shape else torch.Size([])
            size = torch.Size([min(rows, shape[0] - start[0])] + list(shape[1:])) if shape else torch.Size([])
            chunks.append(ChunkStorageMetadata(start, size))
            storage[MetadataIndex(key, start, None)] = _StorageInfo(f"__{r}_0.distcp", offsets[r], size.numel())
            offsets[r] += size.numel()
        entries[key] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size(shape), chunks)
        routes[key] = route

    for name, shape in shapes.items():
        add(f"model.{name}", ("model", name), shape, 8)
        for state in ("rho", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales"):
            add(f"optim.state.{name}.{state}", ("optim", "state", name, state), shape, 8)
        add(f"optim.state.{name}.step", ("optim", "state", name, "step"), (), 1)
    data = pickle.dumps(Metadata(entries, planner_data=routes, storage_data=storage,
                                 storage_meta=StorageMeta(checkpoint_id=Path("/ck"), save_id="flashdist-1-" + "0" * 32)))
    assert 1 << 20 < len(data) < 4 << 20
    assert 2 * len(data) + check_pickle(data, Path("x")) < metadata_budget() // 4


def _torch_file_with(path: Path, *, inflate_to: int = 0, deflate_pickle: bool = False, numel: int = 0) -> Path:
    """A torch.save file of {"w": zeros(4)} rewritten: its tensor's record deflated to ``inflate_to`` zero bytes
    (a zip bomb: the numel in its pickle raised to match), its pickle deflated, or its numel and shape raised
    to ``numel`` over the same 16-byte record."""
    import zipfile

    torch.save({"w": torch.zeros(4)}, path)
    with zipfile.ZipFile(path) as z:
        records = {name: z.read(name) for name in z.namelist()}
    pkl = next(n for n in records if n.endswith("data.pkl"))
    data = next(n for n in records if n.endswith("/data/0"))
    if inflate_to or numel:
        records[pkl] = records[pkl].replace(b"K\x04t", b"J" + (numel or inflate_to // 4).to_bytes(4, "little") + b"t")
    if numel:  # the tensor's shape too
        records[pkl] = records[pkl].replace(b"K\x04\x85", b"J" + numel.to_bytes(4, "little") + b"\x85")
    with zipfile.ZipFile(path, "w") as z:
        for name, payload in records.items():
            deflated = (name == data and inflate_to) or (name == pkl and deflate_pickle)
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED if deflated else zipfile.ZIP_STORED
            with z.open(info, "w") as out:
                if name == data and inflate_to:
                    for _ in range(inflate_to >> 20):
                        out.write(bytes(1 << 20))
                else:
                    out.write(payload)
    return path


def _safetensors_with_header_length(path: Path, length: int) -> Path:
    from safetensors.torch import save_file

    save_file({"model.w": torch.zeros(3)}, str(path))
    data = path.read_bytes()
    path.write_bytes(length.to_bytes(8, "little") + data[8:])
    return path


@pytest.mark.parametrize("kind", ["zip-bomb", "deflated-pickle", "numel-2^31", "safetensors-2^63",
                                  "safetensors-past-end"])
def test_torch_and_safetensors_files_that_would_inflate_are_refused_in_one_line(tmp_path, kind):
    """A torch file whose 1 KB tensor record inflates to 256 MiB (torch.load without mmap would take it), a
    compressed pickle, a tensor of 2^31 floats over a 16-byte record, a safetensors header length of 2^63 or
    past the file's end: every command refuses in one line naming the file, and so does the library reader."""
    from _hostile import attempt

    path = {"zip-bomb": lambda p: _torch_file_with(p / "bomb.pt", inflate_to=256 << 20),
            "deflated-pickle": lambda p: _torch_file_with(p / "pkl.pt", deflate_pickle=True),
            "numel-2^31": lambda p: _torch_file_with(p / "numel.pt", numel=2**31 - 1),  # torch.load checks it
            "safetensors-2^63": lambda p: _safetensors_with_header_length(p / "a.safetensors", 1 << 63),
            "safetensors-past-end": lambda p: _safetensors_with_header_length(p / "b.safetensors", 1 << 20)}[kind](tmp_path)
    assert path.stat().st_size < 1 << 20
    for reader in ("inspect", "convert", "export"):
        error = attempt(reader, path, tmp_path / "out")
        assert error is not None and path.name in str(error), (reader, error)
    with pytest.raises(checkpoint.CheckpointError, match=path.name):
        sources.read(path)


def test_torch_and_safetensors_metadata_beyond_the_budget_is_refused(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    st = tmp_path / "a.safetensors"
    save_file({f"model.w{i}": torch.zeros(1) for i in range(200)}, str(st))
    pt = tmp_path / "a.pt"
    torch.save({"model": {"w": torch.zeros(1)}, "extra": {"notes": list(range(3000))}}, pt)
    monkeypatch.setenv("FLASHDIST_METADATA_MIB", "0.1")
    for path, what in ((st, "its header"), (pt, "its pickled structure")):
        with pytest.raises(checkpoint.CheckpointError, match=f"reading {what} would take .*FLASHDIST_METADATA_MIB"):
            sources.read(path)
    monkeypatch.setenv("FLASHDIST_METADATA_MIB", "8")
    assert len(sources.read(st)["model"]) == 200 and len(sources.read(pt)["extra"]["notes"]) == 3000


def test_plain_data_nested_beyond_the_limit_is_refused_in_one_line(tmp_path):
    """Lists nested 100,000 deep (a few hundred KB of pickle, which the unpickler builds without recursion) in a
    DCP entry and in a torch file: convert and export refuse in one line naming the entry or the file, where
    copying the data would have raised RecursionError."""
    import io
    import zipfile

    from _hostile import attempt

    deep = b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b"."

    def with_pickle(blob: bytes, pickled: bytes) -> bytes:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            records = {n: z.read(n) for n in z.namelist()}
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            for name, payload in records.items():
                z.writestr(zipfile.ZipInfo(name), pickled if name.endswith("data.pkl") else payload)
        return out.getvalue()

    ck = plain(tmp_path / "ck", {**STATE, "extra": {"x": [1]}})
    md = metadata_of(ck)
    buffer = io.BytesIO()
    torch.save([1], buffer)
    blob = with_pickle(buffer.getvalue(), deep)
    for index, info in md.storage_data.items():
        if index.fqn == "extra.x":
            shard = ck / info.relative_path
            info.offset, info.length = shard.stat().st_size, len(blob)
            with open(shard, "ab") as f:
                f.write(blob)
    write_metadata(ck, md)
    pt = tmp_path / "deep.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "extra": {"x": [1]}}, pt)
    with zipfile.ZipFile(pt) as z:
        pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    pt.write_bytes(with_pickle(pt.read_bytes(), pickled.replace(b"]q", b"]" * 100_000 + b"a" * 99_999 + b"q", 1)))
    for path, named in ((ck, "checkpoint entry 'extra.x'"), (pt, str(pt))):
        for reader in ("convert", "export"):
            error = attempt(reader, path, tmp_path / f"out-{reader}")
            assert error is not None and f"{named} nests lists or dicts more than 100 deep" in str(error), error


def test_check_pickle_bounds_what_the_unpickler_allocates(tmp_path):
    """check_pickle's count is at least what unpickling allocates (tracemalloc's peak), for the densest pickles
    and for real DCP metadata written with every pickle protocol; and it is within 6 times that allocation for
    the real metadata (so the default budget is not spent on the bound's slack)."""
    import io
    import tracemalloc

    from flashdist.checkpoint.dcp_files import _MetadataUnpickler, check_pickle

    md = metadata_of(plain(tmp_path / "ck", STATE))
    cases = {f"metadata-protocol-{p}": pickle.dumps(md, protocol=p) for p in range(2, pickle.HIGHEST_PROTOCOL + 1)}
    cases.update({kind: b"\x80\x04" + make(20_000) + b"." for kind, make in _DENSE.items()})
    for name, data in cases.items():
        cost = check_pickle(data, Path(name))
        tracemalloc.start()
        try:
            _MetadataUnpickler(io.BytesIO(data)).load()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= cost, (name, peak, cost)
        if name.startswith("metadata"):
            assert cost <= 6 * peak, (name, peak, cost)


@pytest.mark.parametrize("index", ["beyond-the-budget", "nested-100000-deep"])
def test_trainer_folder_json_is_read_within_the_budget(tmp_path, monkeypatch, index):
    """A Trainer / Accelerate folder's shard index whose parsing would cost more than FLASHDIST_METADATA_MIB (32
    bytes per byte of JSON), or nests 100,000 deep: inspect and export refuse in one line naming it."""
    from safetensors.torch import save_file

    from tests._cli import run_cli

    folder = tmp_path / "state"
    folder.mkdir()
    save_file({"w": torch.zeros(2, dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    torch.save({"state": {}, "param_groups": [{"params": [], "param_names": []}]}, folder / "optimizer.bin")
    text = ('{"weight_map": {"w": "model.safetensors"}, "notes": [' + ",".join(["{}"] * 20_000) + "]}"
            if index == "beyond-the-budget" else "[" * 100_000 + "]" * 100_000)
    (folder / "model.safetensors.index.json").write_text(text)
    monkeypatch.setenv("FLASHDIST_METADATA_MIB", "0.5" if index == "beyond-the-budget" else "8")
    for command in (("inspect", folder), ("export", folder, tmp_path / "out.safetensors")):
        rc, _, err = run_cli(*command)
        assert rc == 1 and err.count("\n") == 1 and "model.safetensors.index.json" in err, err
        assert ("FLASHDIST_METADATA_MIB=" in err) == (index == "beyond-the-budget"), err
    monkeypatch.setenv("FLASHDIST_METADATA_MIB", "8")
    if index == "beyond-the-budget":
        assert run_cli("inspect", folder)[0] in (0, 1) and "index.json" not in run_cli("inspect", folder)[2]


@pytest.mark.parametrize("where", ["num_hidden_layers", "decoder_layers", "vision_config"])
def test_trainer_folder_config_of_a_million_layers_is_not_built(tmp_path, where):
    """A Trainer folder's config.json of a few hundred bytes naming a million layers (building its model on the
    meta device would take minutes and gigabytes), under Llama's key, BART's decoder key or in a sub-config: not
    built, the order left unknown with the reason, in the time and memory of the checkpoint itself."""
    import json
    import time

    from safetensors.torch import save_file

    from tests._cli import run_cli

    folder = tmp_path / "state"
    folder.mkdir()
    save_file({"w": torch.zeros(2, dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    torch.save({"state": {}, "param_groups": [{"params": [0]}]}, folder / "optimizer.bin")
    layers = {"num_hidden_layers": {"num_hidden_layers": 1_000_000}, "decoder_layers": {"decoder_layers": 1_000_000},
              "vision_config": {"vision_config": {"num_hidden_layers": 1_000_000}}}[where]
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 8,
        "num_attention_heads": 1, "vocab_size": 8, **layers}))
    start = time.monotonic()
    rc, out, err = run_cli("inspect", folder)
    assert time.monotonic() - start < 60, "the model of the config was built"
    assert "1,000,000 layers, more than the checkpoint's 1 weights" in out + err, (rc, out, err)


# ----- inspect of a DeepSpeed folder: the structure only ---------------------------------------------------


def _zero2_folder(folder: Path, rows: int, world: int = 2, cols: int = 1024) -> Path:
    """A ZeRO-2 checkpoint of a flashdist optimizer in DeepSpeed's layout: four bf16 (rows, cols) parameters in
    one param group, fp32 master partitions and fp32 moments on ``world`` ranks (12 bytes per value)."""
    folder.mkdir()
    shapes = {f"w{i}": torch.Size([rows, cols]) for i in range(4)}
    total = 4 * rows * cols
    torch.save({"dp_world_size": world, "param_shapes": [shapes], "global_steps": 7,
                "module": {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()},
                "ds_config": {"zero_optimization": {"stage": 2}}}, folder / "mp_rank_00_model_states.pt")
    for rank in range(world):
        part = torch.full((total // world,), 0.5 + rank)
        entry = {"step": torch.tensor(7.0), "exp_avg": part.clone(), "exp_avg_sq": part.clone()}
        zsd = {"zero_stage": 2, "partition_count": [world], "param_alignment_paddings": [[0] * 4],
               "single_partition_of_fp32_groups": [part],
               "base_optimizer_state": {"state": {0: entry}, "param_groups": [
                   {"params": [0], "lr": 1e-3, "flashdist_format": "portable", "master_weight_bits": 24}]}}
        torch.save({"optimizer_state_dict": zsd}, folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return folder


_DEEPSPEED_CHILD = r"""
import contextlib, io, json, sys
from flashdist.checkpoint import sources
from flashdist.cli import main
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
def peak(fn):
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here
    fn()
    return status("VmHWM:") - before
main(["inspect", sys.argv[2]])  # warm: modules imported lazily
out = io.StringIO()
with contextlib.redirect_stdout(out):
    grew = peak(lambda: main(["inspect", "--json", sys.argv[1]]))
whole = peak(lambda: sources.read(sys.argv[1]))  # the control: every partition read and reassembled
print(json.dumps([grew, whole, json.loads(out.getvalue())]))
"""


def _fsdp_folder(folder: Path, rows: int, cols: int = 1024) -> Path:
    """The folder the Trainer and Accelerate write under FSDP with a sharded state dict (two DCP checkpoints,
    the optimizer state keyed by name): four bf16 (rows, cols) weights of a 24-bit flashdist optimizer with
    fp32 moments (11 bytes per value)."""
    import torch.distributed.checkpoint as dcp

    names = [f"w{i}" for i in range(4)]
    model = {n: torch.zeros(rows, cols, dtype=torch.bfloat16) for n in names}
    state = {n: {"step": torch.tensor(7.0), "exp_avg": torch.full((rows, cols), 0.5),
                 "exp_avg_sq": torch.full((rows, cols), 0.25), "rho": torch.ones(rows, cols, dtype=torch.int8)}
             for n in names}
    groups = [{"params": names, "lr": 1e-3, "flashdist_format": "portable", "master_weight_bits": 24}]
    dcp.save({"model": model}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"), no_dist=True)
    dcp.save({"optimizer": {"state": state, "param_groups": groups}}, checkpoint_id=str(folder / "optimizer_0"),
             no_dist=True)
    return folder


@pytest.mark.parametrize("layout", ["deepspeed", "fsdp-folder"])
def test_inspect_of_a_folder_of_partitions_reads_none_of_them(tmp_path, layout):
    """With FLASHDIST_METADATA_MIB=8, `flashdist inspect` of a 2-rank ZeRO-2 folder of 56 MiB (partitions and
    model states), or of a 66 MiB folder of Accelerate's FSDP layout (two DCP checkpoints), grows the
    process's peak memory by less than the budget, while reading it whole (the control) grows it by more
    than the checkpoint's size; inspect still gives the step and the parameters."""
    build = _zero2_folder if layout == "deepspeed" else _fsdp_folder
    big = build(tmp_path / "big", rows=1024 if layout == "deepspeed" else 1536)
    small = build(tmp_path / "small", rows=4)
    size = sum(f.stat().st_size for f in big.rglob("*") if f.is_file())
    budget = 8 << 20
    assert size > 7 * budget
    env = {**os.environ, "FLASHDIST_METADATA_MIB": "8", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _DEEPSPEED_CHILD, str(big), str(small)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    grew, whole, info = json.loads(run.stdout.strip().splitlines()[-1])
    assert info["kind"] == layout and info["step"] == 7, info
    assert info["parameters"] == 4 * 1024 * (1024 if layout == "deepspeed" else 1536), info
    assert layout == "deepspeed" or info["master_weight_bits"] == [24], info
    assert grew < budget, (grew / 2**20, size / 2**20)
    assert whole > size, (whole / 2**20, size / 2**20)


# ----- tensor records: no longer than their tensor, and stored as torch.save writes them ---------------------


def _record_swapped(folder: Path, record: bytes) -> Path:
    """A plain DCP checkpoint whose 0-d tensor ``step`` (what inspect reads) points at ``record``, in a shard file
    of its own."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    plain(folder, {"model": {"w": torch.zeros(4, 4)}, "optim": {"state": {"w": {"step": torch.tensor(7.0)}}}})
    (folder / "__1_0.distcp").write_bytes(record)
    metadata = metadata_of(folder)
    index = next(i for i in metadata.storage_data if i.fqn.endswith("step"))
    metadata.storage_data[index] = _StorageInfo(relative_path="__1_0.distcp", offset=0, length=len(record))
    return write_metadata(folder, metadata)


def _deflated(record: bytes) -> bytes:
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(record)) as zi, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            zo.writestr(info.filename, zi.read(info.filename))
    return out.getvalue()


@pytest.mark.parametrize("record", ["oversized", "deflated"])
def test_a_tensor_record_that_would_inflate_is_refused_before_it_is_read(tmp_path, record):
    """A 0-d tensor whose record is a whole 32 MiB tensor (a record far longer than its tensor: refused with the
    metadata), or that tensor deflated into 32 KB (a record torch.save never writes, which torch.load would
    inflate: refused before torch.load sees it): one line naming the checkpoint, and nothing inflated."""
    import io

    from flashdist.checkpoint.convert import inspect

    raw = io.BytesIO()
    torch.save(torch.zeros(8 << 20), raw)
    data = raw.getvalue() if record == "oversized" else _deflated(raw.getvalue())
    assert len(data) < 64 << 10 or record == "oversized"
    folder = _record_swapped(tmp_path / "ck", data)
    expected = "far more than torch.save writes" if record == "oversized" else "compressed or beyond its end"
    for read in (sources.read, inspect):
        with pytest.raises(checkpoint.CheckpointError, match=expected) as refused:
            read(folder)
        assert "\n" not in str(refused.value) and str(folder) in str(refused.value)
