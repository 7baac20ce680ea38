"""A differentiable PyTorch port of DeepSeek-V4.1 (model-spec.md), for training small models.

    from v41 import V41, load_config, load_weights, engram_token_map
"""
from .checkpoint import load_config, load_weights, save_float_checkpoint
from .engram import engram_token_map
from .model import V41

__all__ = ["V41", "load_config", "load_weights", "save_float_checkpoint", "engram_token_map"]
