"""Reference transformer models and their size table (docs/design.md §6)."""

from axon4d.config import SIZES, ModelConfig, get_config

__all__ = ["SIZES", "ModelConfig", "get_config"]
