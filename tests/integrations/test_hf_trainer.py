"""TrainingArguments(optim="flash_adamw") with the real Transformers Trainer on CPU: names, optim_args, version
check, and a tiny bf16 Llama that trains (its checkpoint and resume: tests/conformance/test_matrix.py)."""

from __future__ import annotations

import re
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from flashdist import FlashAdam, FlashAdamW, FlashLion, FlashSGD, FlashSGDW  # noqa: E402
from flashdist.integrations import transformers as fd_hf  # noqa: E402
from _tiny_llama import tiny_llama  # noqa: E402 (tests/integrations/_tiny_llama.py)

fd_hf.register()

CLASSES = {"flash_adamw": FlashAdamW, "flash_adam": FlashAdam, "flash_sgd": FlashSGD, "flash_sgdw": FlashSGDW,
           "flash_lion": FlashLion}


def _args(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path), optim="flash_adamw", learning_rate=1e-2, max_steps=4, save_steps=2,
                  per_device_train_batch_size=4, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                  dataloader_num_workers=0, disable_tqdm=True, adam_beta2=0.95, weight_decay=0.1)
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


@pytest.mark.parametrize("name", CLASSES)
def test_optim_names_build_the_flashdist_class(tmp_path, name):
    args = _args(tmp_path, optim=name, optim_args="master_weight_bits=32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checking the arguments warns about nothing (no fp32 stand-in)
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is CLASSES[name]
    assert kwargs["lr"] == 1e-2 and kwargs["master_weight_bits"] == 32 and "flat_layout" not in kwargs
    if name in ("flash_adamw", "flash_adam", "flash_lion"):
        assert kwargs["betas"] == (0.9, 0.95)
    assert ("eps" in kwargs) == name.startswith("flash_adam")


def test_optim_args_are_typed_as_the_class_takes_them(tmp_path):
    args = _args(tmp_path, optim="flash_sgd",
                 optim_args="momentum=0.9, nesterov=true,master_weight_bits=none,backend=reference,companded=False")
    _, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    assert kwargs == {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "master_weight_bits": None,
                      "backend": "reference", "companded": False}


BAD_OPTIM_ARGS = {
    "unknown-key": ("flash_adamw", "momentum=0.9", r"\['momentum'\], which FlashAdamW does not take"),
    "bad-value": ("flash_adamw", "master_weight_bits=16", "master_weight_bits"),
    "not-key-value": ("flash_lion", "master_weight_bits", "not key=value"),
    "flat-layout": ("flash_adamw", "flat_layout=true", "follows the launcher"),
}


@pytest.mark.parametrize("name, optim_args, match", BAD_OPTIM_ARGS.values(), ids=BAD_OPTIM_ARGS.keys())
def test_bad_optim_args_are_refused_with_the_key(tmp_path, name, optim_args, match):
    with pytest.raises(ValueError, match=match):
        fd_hf.optimizer_cls_and_kwargs(name, _args(tmp_path, optim=name), optim_args)


@pytest.mark.parametrize("optim_args", ["master_weight_bits", "master_weight_bits=24,,companded=true=1",
                                        "quantize_states=false,"], ids=["no-equals", "two-equals", "trailing-comma"])
def test_malformed_optim_args_through_the_trainer_get_the_documented_error(tmp_path, optim_args):
    """The Trainer's own path (TrainingArguments -> get_optimizer_cls_and_kwargs), not only the helper: a
    malformed item is named by flashdist's parser, not failed in Transformers' unpacking."""
    args = _args(tmp_path, optim="flash_lion", optim_args=optim_args)
    if optim_args.endswith(","):  # an empty item is skipped, as the documented parser does
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
        assert cls is FlashLion and kwargs["quantize_states"] is False
        return
    with pytest.raises(ValueError, match="optim_args item .* is not key=value") as info:
        transformers.Trainer(model=torch.nn.Linear(4, 4), args=args).create_optimizer()
    assert "\n" not in str(info.value)


def test_other_optimizer_names_keep_transformers_own_route(tmp_path):
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(_args(tmp_path, optim="adamw_torch"))
    assert cls is torch.optim.AdamW and kwargs["lr"] == 1e-2


def test_unsupported_transformers_version_is_refused_and_changes_nothing(monkeypatch):
    from transformers import trainer_optimizer

    before = dict(trainer_optimizer._OPTIMIZER_HANDLERS)
    # the module register() imports: Transformers' lazy init may have replaced the one imported above
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.0")
    supported = re.escape(fd_hf.SUPPORTED_TRANSFORMERS)
    with pytest.raises(ImportError, match=rf"supports transformers{supported}, this is 4.46.0.*optimizer_cls_and_kwargs"):
        fd_hf.register()
    assert trainer_optimizer._OPTIMIZER_HANDLERS == before


def test_register_is_idempotent():
    from transformers.training_args import OptimizerNames

    count = len(OptimizerNames)
    fd_hf.register()
    assert len(OptimizerNames) == count and OptimizerNames("flash_adamw") is OptimizerNames.FLASH_ADAMW


def test_hf_argument_parser_accepts_the_names():
    (args,) = transformers.HfArgumentParser(transformers.TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "/nonexistent-out", "--optim", "flash_lion", "--optim_args", "weight_decay=0.3",
         "--report_to", "none"])
    assert args.optim == "flash_lion"
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is FlashLion and kwargs["weight_decay"] == 0.3


def test_deepspeed_arguments_select_the_flat_layout(tmp_path, monkeypatch):
    """Under DeepSpeed ZeRO the optimizer sees flat 1-d partitions: flat_layout keeps their moments 8-bit."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), optim="flash_adamw", report_to=[])
    cls, kwargs = fd_hf.optimizer_cls_and_kwargs("flash_adamw", args)
    assert fd_hf.uses_deepspeed(args) and kwargs["flat_layout"] is True


# ----- a tiny Llama in bf16 through Trainer.train ---------------------------------------------------------


def _data(n: int = 32, length: int = 16):
    """Counting sequences from random starts: the next token is learnable within a few steps."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = (torch.randint(0, 128, (1,), generator=g) + torch.arange(length)) % 128
        rows.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    return rows


def _state(trainer):
    model = trainer.model
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # Accelerate's AcceleratedOptimizer wraps it
    names = {p: n for n, p in model.named_parameters()}
    state = {names[p]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()}
    return weights, state, opt


def test_trainer_trains_a_bf16_model_with_24_bit_masters(tmp_path):
    """The checkpoint, the bit-exact resume and the export are cells of tests/conformance/test_matrix.py."""
    data = _data()
    args = _args(tmp_path / "run", optim_args="master_weight_bits=24")
    full = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=data)
    full.train()
    weights, state, opt = _state(full)
    assert isinstance(opt, FlashAdamW)
    losses = [log["loss"] for log in full.state.log_history if "loss" in log]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2, losses
    w = "model.layers.0.mlp.up_proj.weight"
    assert weights[w].dtype == torch.bfloat16
    assert state[w]["rho"].dtype == torch.int8 and state[w]["exp_avg_codes"].dtype == torch.int8

