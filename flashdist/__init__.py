"""flashdist: FlashOptim (arXiv:2602.23349) optimizers for sharded training with FSDP2 and DeepSpeed.

Per parameter, FlashAdamW holds a bf16 parameter, an int8 correction ``rho`` (24-bit master weights), the
bf16 gradient and both Adam moments as 8-bit codes with a bf16 scale per 32 values: 7.125 bytes, against
16 for AdamW with fp32 master weights. FlashSGD, FlashSGDW and FlashLion keep one such moment; FlashMuon
keeps one for its matrices and orthogonalizes each matrix's update whole, on one owner rank when sharded.
"""

from .checkpoint.fp32 import export_fp32_state_dict, load_fp32_state_dict
from .gradient_release import GradientRelease, enable_gradient_release
from .memory import bytes_per_param, memory_report
from .optim import (FlashAdam, FlashAdamW, FlashLion, FlashMuon, FlashOptimizer, FlashSGD, FlashSGDW, PrecisionWarning,
                    muon_param_groups)
from .optim.graph import GraphedStep

__version__ = "0.1.0"

__all__ = ["FlashAdam", "FlashAdamW", "FlashLion", "FlashMuon", "FlashOptimizer", "FlashSGD", "FlashSGDW", "GradientRelease", "GraphedStep",
           "bytes_per_param",
           "PrecisionWarning", "enable_gradient_release", "export_fp32_state_dict", "load_fp32_state_dict", "memory_report", "muon_param_groups",
           "__version__"]
