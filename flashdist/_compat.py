"""Optional dependencies, detected in one place. ``import flashdist`` needs torch alone."""

from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
