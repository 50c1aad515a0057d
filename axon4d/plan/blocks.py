"""A transformer's blocks as the planner prices them (docs/design.md §2; docs/planner.md, "Dense blocks
first"): the 3D Linear layers of one block (``block_shapes``), the width of its MLP of Linear layers
(``mlp_width``), the kinds of block a model has and how many of each (``block_kinds``: dense blocks
before MoE blocks under ``first_k_dense``) and the layer kind each of a step's linear layers is in
the runtime (``layer_kind``: one FP8 choice per kind)."""

from __future__ import annotations

import functools

from axon4d.config import ModelConfig


def mlp_width(model: ModelConfig) -> int:
    """Inner width of a block's MLP of Linear layers: the dense MLP's, or an MoE block's shared
    experts' (shared_experts·expert_ffn; 0 without them)."""
    return model.shared_experts * model.expert_width if model.moe else model.ffn


def block_shapes(m: ModelConfig) -> list[tuple[str, int, int, bool, bool]]:
    """(name, in, out, transpose, bias) of the 3D Linear layers of one block (``ModelConfig.
    linear_shapes``); in an MoE block the dense MLP gives way to the MoE layer (priced by
    ``axon4d.plan.moe_cost``) and its shared experts, one MLP of shared_experts·expert_ffn without
    bias (``axon4d.nn.moe``), named as the MLP's layers."""
    shapes = m.linear_shapes()
    if not m.moe:
        return shapes
    shapes = [s for s in shapes if not s[0].startswith("mlp")]
    width = m.shared_experts * m.expert_width
    if width:
        up = (2 if m.gated else 1) * width
        shapes += [("mlp_up", m.hidden, up, False, False), ("mlp_down", width, m.hidden, True, False)]
    return shapes


#: the names a mixed model's dense blocks give their MLP's layers (``Workload.linears``), beside the
#: MoE blocks' shared experts, which keep the MLP's own names
DENSE_MLP = {"mlp_up": "dense_mlp_up", "mlp_down": "dense_mlp_down"}
#: each layer of ``DENSE_MLP`` by the layer kind it is (the runtime's ``--bf16-layers`` kinds name both)
_KIND_OF = {dense: kind for kind, dense in DENSE_MLP.items()}


def layer_kind(name: str) -> str:
    """The layer kind a linear layer of ``Workload.linears`` is in the runtime (``axon4d.models.
    transformer.Transformer.LAYER_KINDS``): its name, or for a mixed model's dense blocks' MLP the
    MLP's (their layers and the MoE blocks' shared experts are one kind: one FP8 choice)."""
    return _KIND_OF.get(name, name)


def block_kinds(m: ModelConfig) -> tuple[tuple[ModelConfig, int], ...]:
    """The kinds of block ``m`` has, each as a model whose blocks are all of that kind, and how many
    of ``m``'s blocks are of it: one kind — ``m`` itself — for a dense model or an MoE model whose
    blocks are all MoE; for an MoE model with ``first_k_dense`` dense blocks (DeepSeek-V3), the dense
    model of its first blocks (its MLP of ``ffn``, no experts) and ``m`` with every block MoE (an
    MoE model whose blocks are all dense: the dense model alone)."""
    if not m.moe or not m.first_k_dense:
        return ((m, m.n_layers),)
    return _mixed_kinds(m)


@functools.lru_cache(maxsize=256)
def _mixed_kinds(m: ModelConfig) -> tuple[tuple[ModelConfig, int], ...]:
    """``block_kinds`` of a model with dense blocks before its MoE blocks, cached: the search asks it
    of one model hundreds of thousands of times, and each kind is a validated ``ModelConfig``."""
    dense = m.replace(n_experts=0, shared_experts=0, first_k_dense=0, n_groups=1, topk_groups=None)
    kinds = [(dense, m.first_k_dense), (m.replace(first_k_dense=0), m.moe_layers)]
    return tuple((model, n) for model, n in kinds if n)


@functools.lru_cache(maxsize=256)
def kind_shapes(m: ModelConfig) -> tuple[tuple[ModelConfig, int, tuple[tuple[str, int, int, bool, bool], ...]], ...]:
    """Each of ``block_kinds(m)`` with its block's 3D Linear layers (``block_shapes``) as a step of
    ``m`` names them: with dense blocks beside MoE blocks, the dense blocks' MLP as ``DENSE_MLP``'s.
    Cached, as ``block_kinds``."""
    kinds = block_kinds(m)
    mixed = len(kinds) > 1
    return tuple(
        (
            kind,
            n,
            tuple((DENSE_MLP.get(s[0], s[0]) if mixed and not kind.moe else s[0], *s[1:]) for s in block_shapes(kind)),
        )
        for kind, n in kinds
    )
