"""``axon4d train --hf PATH``: a saved Hugging Face causal LM as the training job's model.

PATH is a directory ``save_pretrained`` wrote: ``config.json`` and the safetensors weights (one file
or shards with their index), maybe the tokenizer's files. Three pieces:

- ``model_config(path, seq_len)``: the ``ModelConfig`` of the saved model, which the job uses for
  FLOPs and MFU, the banner, the data (vocabulary, sequence length), a resume's checks and the
  planner of ``--grid auto``. Llama-family and GPT-2 configurations are read field by field
  (``PLANNED_TYPES``); other families through the common names, as an approximation the planner
  does not price. Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE and DeepSeek-V3 (``MOE_TYPES``) add their experts' fields (one sparse
  block's: ``axon4d.parallelize.moe.moe_config``), so the job logs its tokens per expert. The sequence length defaults to the model's positions, at most ``DEFAULT_SEQ_LEN``.
- ``build(path, cfg, grid, ...)``: the model built on the meta device from its configuration
  (``AutoModelForCausalLM.from_config``, fp32 master weights), parallelized there
  (``axon4d.auto_parallelize``: Llama and GPT-2 keep the residual stream split over x, other families
  take the general path; docs/parallelize.md) and given this rank's slices of the saved weights
  (``axon4d.parallelize.load_pretrained_``): no rank ever holds the whole model.
- ``HFCausalLM``: the interface of axon4d's ``Transformer`` that the loop, the checkpoints and the
  reference run use — ``cfg``, ``loss(ids, targets)`` (the mean cross-entropy over this rank's
  tokens, ``axon4d.nn.loss.vocab_parallel_cross_entropy``: over the head's vocabulary slices where
  the head is split, never a full fp32 copy of the logits), ``context_parallel`` and ``to_dense()`` (the
  unparallelized model, for ``--compare-single``). The Hugging Face model is its ``module``, so a
  checkpoint's tensors are named ``module.<the parallelized model's names>``.

Dropout is off (every ``*dropout*`` and ``*pdrop*`` probability of the configuration is set to 0):
the ranks of an x·y plane would draw their masks unlike one process does (docs/parallelize.md,
Limits), and the run must be reproducible, resumable and equal to its single-process reference.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import torch
from torch import nn

from axon4d.config import ModelConfig
from axon4d.grid.mesh import Grid
from axon4d.nn.loss import vocab_parallel_cross_entropy
from axon4d.nn.moe import aux_loss
from axon4d.parallelize import auto_parallelize, load_pretrained_, moe, to_dense
from axon4d.parallelize.context import position_ids
from axon4d.parallelize.layers import ShardedLinear

#: the model types whose configuration is read exactly and whose parallel style the planner prices
PLANNED_TYPES = ("llama", "gpt2")
#: the Mixture-of-Experts model types whose configuration carries its experts into the run's ModelConfig
MOE_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3")
#: the sequence length of a run that gives none: the model's positions, but at most this
DEFAULT_SEQ_LEN = 2048
#: the file ``save_pretrained`` writes the configuration to
CONFIG_FILE = "config.json"


def read_config(path: str) -> Any:
    """The Hugging Face configuration saved in directory ``path``, dropout off (module docstring);
    ``FileNotFoundError``/``ValueError`` naming what is missing."""
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        what = "holds no" if os.path.isdir(path) else "is not a directory with a"
        raise FileNotFoundError(
            f"--hf {path!r} {what} {CONFIG_FILE}; give the directory a Hugging Face causal LM was saved to "
            "with save_pretrained (config.json and model.safetensors)"
        )
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig  # optional: only --hf runs need it

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"--hf {path!r}: transformers cannot read its {CONFIG_FILE} ({first})") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"--hf {path!r}: a {config.model_type!r} model has no causal LM class in transformers "
            "(AutoModelForCausalLM); give a causal LM such as a Llama or a GPT-2"
        )
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def model_type(path: str) -> str:
    """The ``model_type`` of the configuration saved in ``path`` ("llama", "gpt2", ...)."""
    return str(read_config(path).model_type)


def model_config(path: str, seq_len: int = 0) -> ModelConfig:
    """The ``ModelConfig`` of the model saved in ``path`` trained on sequences of ``seq_len`` tokens
    (0: the model's positions, at most ``DEFAULT_SEQ_LEN``); ``ValueError`` for a longer sequence
    than the model has positions."""
    config = read_config(path)
    positions = int(getattr(config, "max_position_embeddings", None) or 0)  # 0: not given
    if not seq_len and not positions:
        raise ValueError(f"--hf {path!r}: its configuration gives no max_position_embeddings; give --seq-len")
    seq = seq_len or min(positions, DEFAULT_SEQ_LEN)
    if positions and seq > positions:
        raise ValueError(
            f"--seq-len {seq}: the model in {path!r} has {positions} positions (max_position_embeddings); "
            f"give --seq-len {positions} or less (0: {min(positions, DEFAULT_SEQ_LEN)})"
        )
    heads = int(config.num_attention_heads)
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    eps = getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_epsilon", None)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or getattr(config, "rope_theta", None)
    architectures = getattr(config, "architectures", None) or [config.model_type]
    try:
        return _with_experts(
            config,
            ModelConfig(
                n_layers=int(config.num_hidden_layers),
                hidden=int(config.hidden_size),
                n_heads=heads,
                n_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                ffn_hidden=int(ffn) if ffn else None,
                vocab_size=int(config.vocab_size),
                seq_len=seq,
                arch="gpt" if config.model_type == "gpt2" else "llama",
                rope_theta=float(theta or 10000.0),
                norm_eps=float(eps or 1e-5),
                name=str(architectures[0]),
            ),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"--hf {path!r}: its configuration does not describe a decoder-only transformer ({e})") from e


def _with_experts(config: Any, cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with the Mixture-of-Experts fields of a Mixtral or Qwen3-MoE ``config`` (what one of
    its sparse blocks is on the grid: ``axon4d.parallelize.moe.moe_config``), so the job counts and
    logs its experts; ``cfg`` as it is for another family."""
    if config.model_type not in MOE_TYPES:
        return cfg
    sparse = sum(1 for i in range(config.num_hidden_layers) if moe.is_sparse_layer(config, i))
    block = moe.moe_config(config, sparse)
    fields: tuple[str, ...] = ("n_experts", "experts_per_token", "expert_ffn", "router_topk_norm", "moe_aux_coef")
    fields += ("moe_z_coef",)
    fields += ("router_scoring", "n_groups", "topk_groups", "routed_scaling_factor")  # DeepSeek-V3's, else off
    values: dict[str, Any] = {f: getattr(block, f) for f in fields}
    if config.model_type == "deepseek_v3":  # its dense first blocks and its shared experts
        values.update(first_k_dense=int(config.first_k_dense_replace or 0), shared_experts=int(config.n_shared_experts))
    return dataclasses.replace(cfg, **values)


class HFCausalLM(nn.Module):
    """A (parallelized) Hugging Face causal LM with the interface of axon4d's ``Transformer`` that
    the training job uses (module docstring). ``grid`` None: the unparallelized model of one process."""

    def __init__(
        self, module: nn.Module, cfg: ModelConfig, grid: Grid | None = None, context_parallel: bool | str = False
    ):
        super().__init__()
        self.module = module
        self.cfg = cfg
        self.grid = grid
        self.context_parallel = bool(context_parallel and grid is not None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(b, s) ids → (b, s, vocab) logits: this rank's rows (``axon4d.shard_batch``) or, with
        ``context_parallel``, this rank's head–tail tokens of each sequence (``shard_sequence``),
        rotated at their global positions."""
        return self.module(input_ids=ids, use_cache=False, **self._positions(ids)).logits

    def _positions(self, ids: torch.Tensor) -> dict[str, Any]:
        """The keyword arguments that place this rank's tokens of ``ids`` (b, s) in their sequences:
        none, or with ``context_parallel`` their global positions."""
        if not self.context_parallel:
            return {}
        assert self.grid is not None
        seq = ids.shape[1] * self.grid.size("z")  # the whole sequence's length
        return {"position_ids": position_ids(ids.shape[0], seq, self.grid, ids.device)}

    def split_head(self) -> ShardedLinear | None:
        """The output head when its logits are this rank's slice of the vocabulary before they are
        gathered (a ``ShardedLinear`` of unpermuted rows in a family, ``PLANNED_TYPES`` or ``MOE_TYPES``, whose logits
        are the head's output of the body's last hidden state); None otherwise (a tied head: whole)."""
        module: Any = self.module  # a transformers PreTrainedModel
        head = module.get_output_embeddings()
        if self.grid is None or module.config.model_type not in PLANNED_TYPES + MOE_TYPES:
            return None
        if not isinstance(head, ShardedLinear) or head.fused is not None or head.output_sharded:
            return None
        return head

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the logits of ``ids`` (b, s) against ``targets`` (b, s) over this
        rank's tokens, in fp32 row chunks (``vocab_parallel_cross_entropy``): with a split head
        (``split_head``) over this rank's slice of the vocabulary, the logits never gathered; else over
        the whole logits, without communication. After ``backward()`` every gradient is the
        DDP-averaged one of the global mean (the parallelized model averages over batch = data × z)."""
        head = self.split_head()
        config: Any = getattr(self.module, "config", None)
        if self.grid is None and getattr(config, "output_router_logits", False):
            # one process: transformers' own model, its load-balancing loss (``aux_loss``) weighted as it weights it
            out = self.module(input_ids=ids, use_cache=False)
            coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
            return vocab_parallel_cross_entropy(out.logits, targets, None) + coef * out.aux_loss
        if head is None:
            loss = vocab_parallel_cross_entropy(self(ids), targets, None)  # (b, s, vocab) logits
        else:
            body: Any = self.module.base_model  # the model below the head: (b, s, ·) hidden states
            hidden = body(input_ids=ids, use_cache=False, **self._positions(ids)).last_hidden_state
            logits = head.local(hidden)  # (b, s, vocab/G_out): this rank's slice of the vocabulary
            loss = vocab_parallel_cross_entropy(logits, targets, self.grid, axis=head.inner.out_axis)
        aux = aux_loss(self.module)  # transformers' balance loss (this rank's share) when asked: moe.RouterAux
        return loss if aux is None else loss + aux

    def to_dense(self, grads: bool = False) -> HFCausalLM:
        """The unparallelized model (full weights, and ``.grad`` with ``grads``) on every rank:
        ``axon4d.to_dense`` of the module; every rank must call it (it communicates)."""
        return HFCausalLM(to_dense(self.module, grads=grads), self.cfg)


def build(
    path: str, cfg: ModelConfig, grid: Grid, recompute: str = "none", context_parallel: bool | str = False
) -> HFCausalLM:
    """The model saved in ``path`` on ``grid``: built on meta, parallelized with activation
    recomputation ``recompute`` and, with ``context_parallel``, each sequence's tokens split over z
    (docs/context.md), then filled with this rank's slices (module docstring). Only rank 0 shows
    ``auto_parallelize``'s warning of the layers it leaves whole."""
    from transformers import AutoModelForCausalLM  # an optional dependency: only --hf runs need it

    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(read_config(path), dtype=torch.float32)
    with warnings.catch_warnings():
        if grid.rank != 0:
            warnings.simplefilter("ignore")
        module = auto_parallelize(module, grid=grid, recompute=recompute, context_parallel=context_parallel)
    load_pretrained_(module, path, grid=grid)
    module.train()
    return HFCausalLM(module, cfg, grid, context_parallel)
