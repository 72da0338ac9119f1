"""Checkpoints: optimizer state-dict formats, DCP save/load, fp32 master-weight export and import."""

from .dcp import CheckpointError, CheckpointWriteError, load, read_metadata, save
from .fp32 import export_fp32_state_dict, load_fp32_state_dict
from .state import FORMAT_VERSION, FORMATS

__all__ = ["CheckpointError", "CheckpointWriteError", "FORMATS", "FORMAT_VERSION", "export_fp32_state_dict", "load",
           "load_fp32_state_dict", "read_metadata", "save"]
