"""Transformer shapes (docs/design.md §6): ``ModelConfig`` (``model``) and the size table by name
(``sizes``: ``SIZES``, ``get_config``, ``moe_overrides``)."""

from axon4d.config.model import ModelConfig
from axon4d.config.sizes import MOE_FIELDS, SIZES, get_config, moe_overrides

__all__ = ["MOE_FIELDS", "SIZES", "ModelConfig", "get_config", "moe_overrides"]
