"""The training job's configuration: ``TrainConfig`` and the command line built from it.

Every field of ``TrainConfig`` is a flag (``--micro-batches`` for ``micro_batches``) whose help is
the string literal written under the field, so a field is documented once, here, and ``axon4d
train --help`` can never fall behind the dataclass; a field with a fixed set of values takes them
from where they are defined (``CHOICES``: ``--recompute`` from ``axon4d.policy.RECOMPUTE_MODES``, ``--comm``'s transports). ``model_config`` turns the size name and the
overrides into the ``ModelConfig`` of the size table (docs/design.md §6).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from typing import Any

from axon4d.config import ModelConfig, get_config
from axon4d.policy import RECOMPUTE_MODES


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs; each field is a command-line flag."""

    grid: str = "1,1,1,-1"
    """Grid sizes x,y,z,data (one may be -1: the rest), or auto (the planner chooses)."""
    machine: str = ""
    """With --grid auto: the planner's machine (a shipped name such as perlmutter, or a file from axon4d calibrate)."""
    comm: str = "auto"
    """Communication transport: auto (MPI when launched by mpirun on CPUs, else torch.distributed: NCCL on GPUs, gloo on CPUs), torch, or mpi (GPU tensors go to a CUDA-aware MPI as they are, else through host memory)."""
    model: str = "small"
    """Model size from the table: tiny, small, 5B, 10B, 20B, 40B, 80B, 320B, 640B."""
    arch: str = "llama"
    """Model family: llama (RMSNorm, SwiGLU, RoPE, GQA) or gpt (LayerNorm, GELU, learned positions)."""
    layers: int = 0
    """Override the number of blocks (0: the size table's)."""
    hidden: int = 0
    """Override the model width (0: the size table's)."""
    heads: int = 0
    """Override the number of attention heads (0: the size table's)."""
    kv_heads: int = 0
    """Key/value heads for grouped-query attention (0: as many as heads)."""
    vocab_size: int = 0
    """Override the vocabulary size (0: the table's; 256 for the byte-level text corpus)."""
    seq_len: int = 0
    """Override the sequence length (0: the size table's)."""
    steps: int = 100
    """Optimizer steps to run (in total, counting steps done before a resume)."""
    batch_size: int = 16
    """Global sequences per micro-batch (split over data × z); a step sees batch_size × micro_batches."""
    micro_batches: int = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (applied to matrices and embeddings, not to norms and biases)."""
    beta1: float = 0.9
    """AdamW β1."""
    beta2: float = 0.95
    """AdamW β2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    precision: str = "fp32"
    """fp32; bf16 (fp32 master weights, bf16 compute and gradient reductions); bf16-fp32-reduce (fp32 reductions)."""
    recompute: str = "none"
    """Activation recomputation in every block (docs/design.md §5): none keeps every activation; selective recomputes core attention; balanced re-makes the norms' and the MLP activation's outputs inside the GEMMs that read them; full keeps only each block's input."""
    data: str = "synthetic"
    """synthetic, corpus (a byte-level corpus of Python's stdlib docstrings, made offline), or a token file path (.u16/.u32 memmap)."""
    seed: int = 0
    """Seed for initialisation and data: the same seed gives the same run."""
    out_dir: str = "runs/train"
    """Where log.jsonl, checkpoints/ and plots go."""
    save_every: int = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    resume: bool = False
    """Continue from the newest checkpoint in out_dir/checkpoints."""
    log_every: int = 1
    """Write a log record every N steps."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one rank for MFU (0: measure a matmul on every rank at start-up)."""
    compare_single: bool = False
    """Afterwards, train the same model in one process (rank 0) and plot both loss curves."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    def model_config(self) -> ModelConfig:
        """The size table's model with this run's overrides (vocabulary 256 for the byte-level corpus)."""
        overrides: dict[str, Any] = {"arch": self.arch}
        for field, key in (
            ("layers", "n_layers"),
            ("hidden", "hidden"),
            ("heads", "n_heads"),
            ("kv_heads", "n_kv_heads"),
            ("vocab_size", "vocab_size"),
            ("seq_len", "seq_len"),
        ):
            if getattr(self, field):
                overrides[key] = getattr(self, field)
        if self.data == "corpus" and not self.vocab_size:
            overrides["vocab_size"] = 256
        return get_config(self.model, **overrides)


#: fields whose flag accepts only these values.
CHOICES: dict[str, tuple[str, ...]] = {"recompute": RECOMPUTE_MODES, "comm": ("auto", "torch", "mpi")}


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal under each field)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)  # type: ignore[union-attr]
    return docs


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, documented by the field's docstring."""
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=docs.get(f.name))
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            p.add_argument(
                flag,
                type=kind,
                default=f.default,
                choices=CHOICES.get(f.name),
                help=f"{docs.get(f.name, '')} (default: {f.default})",
            )


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The config of parsed flags (attributes that are not fields are ignored)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
