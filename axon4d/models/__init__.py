"""Reference transformer models and their size table."""

from axon4d.config import SIZES, ModelConfig, get_config

__all__ = ["SIZES", "ModelConfig", "get_config"]
