"""``flashdist export CKPT OUT --hf``: a Hugging Face model folder that transformers' ``from_pretrained`` loads, with
the master weights of a FlashAdamW run (a tiny LlamaForCausalLM, built from a LlamaConfig: no downloads)."""

from __future__ import annotations

import json

import pytest
import torch

import flashdist
from flashdist import checkpoint
from _cli import run_cli as _cli  # tests/_cli.py

transformers = pytest.importorskip("transformers", reason="transformers is part of the [test] extra")




def _trained(tmp_path, tie: bool):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    opt = flashdist.FlashAdamW(model.parameters(), lr=3e-3)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(tmp_path / "ck", model, opt)
    config.save_pretrained(tmp_path / "cfg")
    return config, model, opt


def _reference(config, model, opt):
    """The model built from the master weights (fp32)."""
    ref = transformers.LlamaForCausalLM(config).float()
    ref.load_state_dict(flashdist.export_fp32_state_dict(model, opt))
    return ref.eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_from_pretrained_gives_the_master_weights_model(tmp_path, tie):
    config, model, opt = _trained(tmp_path, tie)
    saved = tmp_path / "cfg" / "config.json"  # as a model loaded with dtype=torch.bfloat16 saves its config
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "dtype": "bfloat16"}))
    out = tmp_path / "hf"
    rc, _, err = _cli("export", tmp_path / "ck", out, "--hf", "--config", tmp_path / "cfg" / "config.json",
                      "--max-shard-size", "40KB")
    assert rc == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(model.state_dict())
    assert all(p.stat().st_size <= 40_000 or len(_names(p)) == 1 for p in out.glob("model-*.safetensors"))
    # the config written says the weights' dtype: from_pretrained's default reads it (a copied "bfloat16" loaded
    # the fp32 masters rounded to bf16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert loaded.dtype == torch.float32
    ref = _reference(config, model, opt)
    for name, value in ref.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
        # and not the bf16 weights: the masters carry rho
        assert not torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.float())


def _names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def test_bf16_single_file_and_bad_input(tmp_path):
    config, model, opt = _trained(tmp_path, False)
    out = tmp_path / "hf16"
    saved = tmp_path / "cfg" / "config.json"
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "dtype": "float32"}))
    rc, _, err = _cli("export", tmp_path / "ck", out, "--hf", "--dtype", "bf16", "--config", saved)
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # one shard: no index
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    masters = flashdist.export_fp32_state_dict(model, opt)
    assert weights.keys() == masters.keys()
    assert all(torch.equal(weights[k], masters[k].bfloat16()) for k in masters)
    (tmp_path / "bad.json").write_text("[1, 2]")
    for args, needle in [(("--hf", "--config", tmp_path / "bad.json"), "not a transformers model config"),
                         (("--hf", "--max-shard-size", "lots"), "max shard size"),
                         (("--config", tmp_path / "cfg" / "config.json"), "--hf")]:
        rc, stdout, err = _cli("export", tmp_path / "ck", tmp_path / "x", *args)
        assert rc == 1 and stdout == "" and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "x").exists()
