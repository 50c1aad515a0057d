"""The training job's configuration: ``TrainConfig`` and the command line built from it.

Every field of ``TrainConfig`` is a flag (``--micro-batches`` for ``micro_batches``) whose help is
the string literal written under the field, so a field is documented once, here, and ``axon4d
train --help`` can never fall behind the dataclass; a field with a fixed set of values takes them
from where they are defined (``CHOICES``: ``--recompute`` from
``axon4d.options.recompute_mode.RECOMPUTE_MODES``, ``--comm``'s transports), and a flag that may be given
alone says what it then means (``ALONE``: ``--resume`` is ``--resume always``). ``model_config``
turns the size name and the overrides into the ``ModelConfig`` of the size table (docs/design.md
§6).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
from typing import Any

from axon4d.config import ModelConfig, get_config, moe_overrides
from axon4d.data.tokens import check_token_file
from axon4d.grid import counts
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.shape import check_sizes
from axon4d.memory.offload import offload_blocks, parse_offload
from axon4d.options.precision import FP8, NAMED, Precision
from axon4d.options.precision import resolve as resolve_precision
from axon4d.options.recompute_mode import check_recompute
from axon4d.train import hf
from axon4d.train.fields import (
    ALIASES,
    ALONE,
    CHOICES,
    DATA_NAMES,
    FP8_KINDS,
    HF_REFUSED,
    HINTS,
    MINIMUM,
    PLANNED,
    RANGES,
    ZERO_STAGES,
    flag,
)


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs; each field is a command-line flag."""

    grid: str = "1,1,1,-1"
    """Grid sizes x,y,z,data (one may be -1: the rest), or auto (the planner chooses)."""
    machine: str = ""
    """The planner's machine (a shipped name such as perlmutter, or a file from axon4d calibrate): for --grid auto, and for the overlap knobs the planner tunes (axon4d.init's overlap="auto"); default $AXON4D_MACHINE, else none (the default knobs; --grid auto then needs one)."""
    pin: str = ""
    """With --grid auto, step options the planner may not choose although they are at their defaults, comma-separated: recompute, micro_batches, zero, offload, context_parallel, context_parallel_axes, fp8_gather, expert_layout, fp8_dispatch (an MoE layout's rows to the experts in FP8; pinned by --expert-layout, which says it) (an option given another value than its default is pinned anyway; docs/planner.md)."""
    try_plans: int = 0
    """With --grid auto (also --try): build the planner's N fastest fitting plans in turn, time --try-steps steps of each in --try-rounds interleaved rounds, and train with the planner's first unless another is faster beyond the rounds' spread; a plan that fails on any rank (out of memory mid-step) is skipped with its reason within seconds; the rows go to the banner, summary.json and trials.json, and correction.json (for axon4d plan --correction) is written (docs/planner.md#trying-the-top-plans). 0: the planner's first choice."""
    try_steps: int = 3
    """With --try: timed steps per plan, after two untimed warm-up steps (the second tracked for peak memory; one in later rounds); the run trains on none of them."""
    try_rounds: int = 3
    """With --try: rounds of the plans' tries, round-robin (every plan built, stepped and torn down once a round); a plan is chosen over the planner's first only when its slowest round beats the first's fastest (docs/planner.md#trying-the-top-plans)."""
    correction: str = ""
    """With --grid auto: a correction.json an earlier --try run of this job wrote (on as many ranks); its factors scale the machine's priced compute and communication before the planner ranks the plans, as axon4d plan --correction does (the machine file is unchanged; docs/planner.md#trying-the-top-plans)."""
    retry: bool = False
    """With --try and a resumed run: try the plans again instead of taking the one the first launch chose (out_dir/trials.json)."""
    comm: str = "auto"
    """Communication transport: auto (MPI when launched by mpirun on CPUs, else torch.distributed: NCCL on GPUs, gloo on CPUs), torch, or mpi (GPU tensors go to a CUDA-aware MPI as they are, else through host memory)."""
    hf: str = ""
    """Fine-tune a saved Hugging Face causal LM: the directory save_pretrained wrote (config.json, safetensors). Built on the meta device, parallelized, each rank loading its slices; dropout off. Not with --model, --arch, the model-shape overrides or --offload (docs/training.md#fine-tuning-a-hugging-face-model)."""
    model: str = "small"
    """Model size from the table: tiny, small, tiny-moe (8 experts, top-2: docs/moe.md), 5B, 10B, 20B, 40B, 80B, 320B, 640B."""
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
    """Override the sequence length (0: the size table's; with --hf the model's max positions, at most 2048)."""
    moe: str = ""
    """Mixture-of-Experts fields of the model, field=value,… (e.g. n_experts=8,experts_per_token=2,moe_aux_coef=0.01; n_experts=0: dense). Fields: n_experts, experts_per_token, expert_ffn, shared_experts, router_scoring, moe_aux_coef, moe_z_coef (docs/moe.md)."""
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
    zero: int = 0
    """Shard the optimizer over the data axis (docs/training.md#sharding-the-optimizer): 0 off; 1 (ZeRO-1) AdamW's moments and master weights, 1/G_data per rank, the updated weights all-gathered over data; 2 (ZeRO-2) also the weights' gradients, reduce-scattered over data instead of all-reduced. Same results; with data 1 a no-op."""
    precision: str = "auto"
    """auto (bf16-fp32-reduce on GPUs, fp32 on CPUs; a resumed run keeps its checkpoint's; the banner and summary.json say which); fp32; bf16 (fp32 master weights, bf16 compute and gradient reductions); bf16-fp32-reduce (bf16 compute, fp32 reductions); bf16-fp8-gather (bf16-fp32-reduce with the weight all-gathers over z in FP8, half their bytes); bf16-fp8 (also the 3D Linear layers' GEMMs in FP8 on GPUs with FP8 tensor cores; opt-in)."""
    fp8_gradients: str = "e5m2"
    """Under --precision bf16-fp8: the float8 format of the output gradients in the dX and dW GEMMs: e5m2 (wider range; on a small Llama's layer gradients e4m3 flushed up to a share of 0.045 of them to zero, e5m2 0.0004) or e4m3 (one more mantissa bit). log.jsonl reports the flushed share per layer kind on logged steps (fp8_underflow)."""
    bf16_layers: str = ""
    """Under --precision bf16-fp8: the layer kinds whose GEMMs stay in bf16 (comma-separated, of qkv, attn_out, mlp_up, mlp_down; the LM head always is). --grid auto sets it to the planner's per-layer choice (FP8 where it is priced faster, axon4d.plan.fp8)."""
    tf32: bool = True
    """On GPUs, let fp32 matmuls use TF32 tensor cores (axon4d.device.allow_tf32; --no-tf32: full fp32). No effect on CPUs."""
    context_parallel: bool = False
    """Split the tokens of each sequence over z (head–tail chunks, causal balance; sequences split over data only) for sequences too long for one rank (docs/context.md); the sequence length must be a multiple of 2·G_z."""
    context_parallel_mode: str = "all-gather"
    """With --context-parallel: all-gather (every z rank gathers the keys and values of the whole sequence: faster where they fit) or ring (they pass around z one rank's chunks at a time: K/V memory per rank 1/G_z of the sequence's; docs/context.md "Ring mode"). Axon4d's own models only."""
    context_parallel_axes: str = "z"
    """With --context-parallel: the axes each sequence is split over: z (sequences over data), or z,data (hierarchical: over z and data together, every rank holding a part of every sequence, for sequences too long for z alone; docs/context.md "Hierarchical")."""
    packed_documents: int = -1
    """The token id that ends each document of the data (EOS; axon4d prepare-data writes the tokenizer's after every document): each sequence is cut into documents after every such token, tokens attend only within their document and positions restart at each (docs/context.md "Packed documents"; with --context-parallel the chunks are balanced by attention work). -1 (default): off, one document per sequence. Axon4d's own models only."""
    expert_layout: str = ""
    """MoE models: where the experts run, ep=<axes>,tp=<axes> over the grid's axes x, y, z, data (e.g. ep=world,tp=1: whole experts over every rank; ep=z·data,tp=x·y, the default: experts over data × z, each split over x·y; '+' may stand for '·'; add ,dispatch=fp8 to send the rows to the experts in FP8; docs/moe.md). Default: the grid's, or under --grid auto the layout the planner chose with the grid; given, it is pinned. A model without experts refuses it."""
    recompute: str = "none"
    """Activation recomputation in every block (docs/design.md §5): none keeps every activation; selective recomputes core attention; balanced re-makes the norms' and the MLP activation's outputs inside the GEMMs that read them; full keeps only each block's input."""
    offload: str = ""
    """Move what some blocks save for backward to host memory during the forward and back ahead of their backward (docs/design.md §5): a fraction of the blocks with a decimal point (0.5: the first half), block indices (0,1,2), or none (default)."""
    data: str = "synthetic"
    """synthetic, corpus (a byte-level corpus of Python's stdlib docstrings, made offline), or a token file path (.u16/.u32 memmap)."""
    seed: int = 0
    """Seed for initialisation and data: the same seed gives the same run."""
    out_dir: str = "runs/train"
    """Where log.jsonl, checkpoints/ and plots go."""
    save_every: int = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_last: int = 0
    """Keep only the newest K checkpoints (0: keep all)."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on: a save blocks only to copy the state to host memory (page-locked on GPUs; the copy is kept for the next save), at most one is written at a time, and each is published with checksums like a blocking save (docs/training.md#checkpoints); the summary gives the seconds each save blocked."""
    resume: str = "never"
    """never: start afresh (an out_dir holding checkpoints is refused unless --overwrite); always (--resume alone): continue from the newest complete checkpoint in out_dir/checkpoints, which must exist; auto: continue from it when there is one, else start afresh, so the same command serves the first launch and every relaunch (torchrun --max-restarts, sbatch --requeue; docs/reliability.md). A checkpoint resumed must match this run's model and training settings."""
    overwrite: bool = False
    """Start afresh in an out_dir that holds another run's checkpoints, deleting them (without it such a directory is refused)."""
    on_nonfinite: str = "skip"
    """A step whose loss or gradients are not finite: skip (no update; stop after --max-nonfinite in a row) or stop (end the run with an error)."""
    max_nonfinite: int = 3
    """With --on-nonfinite skip: end the run after this many non-finite steps in a row."""
    timeout: float = 60.0
    """Seconds a rank waits for a collective after the first step before the job is ended and the waiting rank named; a step's host reads (on an accelerator: the whole queued step) wait up to 3 × the median of the last 16 steps when that is longer, and torch.distributed's own timeout follows (docs/reliability.md, Deadlines)."""
    startup_timeout: float = 300.0
    """Seconds allowed for start-up and the first step (building, loading, first collectives)."""
    log_every: int = 1
    """Write a log record every N steps."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one rank for MFU (0: measure a matmul on every rank at start-up)."""
    compare_single: bool = False
    """Afterwards, train the same model in one process (rank 0) and plot both loss curves."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse flags no run can use, before anything is built, created or communicated.

        Each error names the flag, the value given and what would work: counts (--steps,
        --batch-size, --micro-batches, --log-every, --max-nonfinite) are whole numbers ≥ 1; the
        model overrides, --warmup-steps, --save-every and --keep-last are ≥ 0 (0: the default or
        off); switches (--async-save, --overwrite, …) are True or False; rates and bounds are finite,
        --lr above 0 and --min-lr within [0, --lr]; --grid is four sizes or auto; names come from
        their lists (``CHOICES``, precisions, the size table);
        the model those flags describe must be valid, and --expert-layout a layout of an MoE model; a --data file must exist and hold at least
        one sequence (its token ids are checked against the vocabulary when it is opened). With
        --hf the saved model's configuration must be readable and the sequence fit its positions,
        and the flags that describe axon4d's own models are refused (``_check_hf``)."""
        self._check_numbers()
        self._check_planned()
        if self.min_lr > self.lr:
            raise ValueError(
                f"--min-lr {self.min_lr} is above --lr {self.lr}: the schedule decays from --lr down to --min-lr; "
                f"give --min-lr at most {self.lr}"
            )
        self._check_types()
        resolve_precision(self.precision, accelerator=False)  # names the precisions that exist
        check_recompute(self.recompute)  # names the modes
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{flag(name)} {getattr(self, name)!r}: choose one of {', '.join(choices)}")
        self.grid_spec()
        if self.hf:
            self._check_hf()
        if not self.out_dir:
            raise ValueError("--out-dir '': give the directory for the log and checkpoints, e.g. runs/train")
        self._check_model_and_data()

    def _check_numbers(self) -> None:
        """Refuse a count below its minimum (``MINIMUM``), a rate or bound that is not a finite number
        in its range (``RANGES``), and AdamW betas of 1 or more."""
        for name, minimum in MINIMUM.items():
            counts.whole(getattr(self, name), flag(name), minimum=minimum, hint=HINTS[name], flag=True)
        for name, (low, high, open_low) in RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{flag(name)} {value!r} ({type(value).__name__}) must be a number")
            too_low = value <= low if open_low else value < low
            if not math.isfinite(value) or too_low or value > high:
                bounds = f"{'above' if open_low else 'at least'} {low:g}" + (
                    f" and at most {high:g}" if math.isfinite(high) else ""
                )
                raise ValueError(f"{flag(name)} {value}: must be a finite number {bounds}; {HINTS[name]}")
        if self.beta1 >= 1 or self.beta2 >= 1:
            raise ValueError(
                f"--beta1 {self.beta1} / --beta2 {self.beta2}: AdamW's betas must be below 1, e.g. 0.9 and 0.95"
            )

    def context_parallel_option(self) -> bool | str:
        """What a model is given as ``context_parallel``: False, True (all-gather) or "ring"."""
        return "ring" if self.context_parallel and self.context_parallel_mode == "ring" else self.context_parallel

    def precision_spec(self) -> Precision | str:
        """What ``axon4d.init`` is given for --precision: its name, or under ``bf16-fp8`` with
        ``--fp8-gradients e4m3`` that preset with e4m3 gradients (``Precision.grad``)."""
        if self.precision == "bf16-fp8" and self.fp8_gradients == "e4m3":
            return dataclasses.replace(NAMED["bf16-fp8"], grad=FP8)
        return self.precision

    def _check_planned(self) -> None:
        """Refuse a ZeRO stage that is not 0, 1 or 2, --pin naming what is not a planned option,
        --bf16-layers naming what is not an FP8 layer kind or without --precision bf16-fp8, and --try
        or --correction without --grid auto."""
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise ValueError(
                f"--zero {self.zero!r}: choose 0 (no sharding), 1 (optimizer state and master weights sharded over "
                "data) or 2 (also the weights' gradients)"
            )
        unknown = [n for n in (v.strip().replace("-", "_") for v in self.pin.split(",")) if n and n not in PLANNED]
        if unknown:
            raise ValueError(
                f"--pin {self.pin!r}: {', '.join(unknown)} is not a planned option; name some of {', '.join(PLANNED)}"
            )
        kinds = [k.strip() for k in self.bf16_layers.split(",") if k.strip()]
        if [k for k in kinds if k not in FP8_KINDS] or (kinds and self.precision != "bf16-fp8"):
            raise ValueError(
                f"--bf16-layers {self.bf16_layers!r}: name layer kinds of {', '.join(FP8_KINDS)} to keep in bf16, "
                "with --precision bf16-fp8 (the only precision whose GEMMs run FP8)"
            )
        if self.context_parallel_mode != "all-gather" and not self.context_parallel:
            raise ValueError(
                f"--context-parallel-mode {self.context_parallel_mode} without --context-parallel: add "
                "--context-parallel, or leave the mode out"
            )
        if self.context_parallel_axes != "z" and (
            self.context_parallel_axes not in ("z,data", "data,z") or not self.context_parallel or self.hf
        ):
            raise ValueError(
                f"--context-parallel-axes {self.context_parallel_axes}: give z or z,data, with --context-parallel "
                "and axon4d's own models (not --hf)"
            )
        if self.packed_documents < -1 or (self.packed_documents >= 0 and self.hf):
            raise ValueError(
                f"--packed-documents {self.packed_documents}: give the EOS token id that ends each document "
                "(a whole number ≥ 0; -1 for off), with axon4d's own models (not --hf)"
            )
        if self.fp8_gradients != "e5m2" and self.precision != "bf16-fp8":
            raise ValueError(
                f"--fp8-gradients {self.fp8_gradients} with --precision {self.precision}: the gradients' float8 "
                "format applies to FP8 GEMMs only; add --precision bf16-fp8 or leave --fp8-gradients out"
            )
        if (self.try_plans or self.correction) and self.grid != "auto":
            given = f"--try {self.try_plans}" if self.try_plans else f"--correction {self.correction}"
            raise ValueError(f"{given} with --grid {self.grid}: only --grid auto has plans to try or to price")

    def _check_types(self) -> None:
        """Refuse (``TypeError``) a string field holding anything but a string and a switch holding
        anything but True or False."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("str", str) and not isinstance(value, str):
                raise TypeError(
                    f"{flag(f.name)} {value!r} ({type(value).__name__}) must be a string, e.g. {f.default!r}"
                )
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(
                    f"{flag(f.name)} {value!r} ({type(value).__name__}) must be True or False (the flag "
                    f"{flag(f.name)} or --no-{flag(f.name)[2:]})"
                )

    def _check_model_and_data(self) -> None:
        """Refuse the model the flags describe where ``ModelConfig`` does, an --offload it has no
        blocks for, --data corpus with a vocabulary below 256, and a --data file that is missing or
        holds no whole sequence."""
        mcfg = self.model_config()  # the size name, the arch and the overrides, checked by ModelConfig
        hint = "give e.g. 0.5 (the first half of the blocks), 1.0 (all), 0,1,2 (blocks 0–2) or none"
        try:  # the value, the rule and what works
            offload_blocks(parse_offload(self.offload), mcfg.n_layers, hint=hint)
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith("--offload") else f"--offload {self.offload!r}: {e}") from None
        if self.data == "corpus" and mcfg.vocab_size < 256:
            raise ValueError(
                f"--data corpus holds byte ids 0…255 but --vocab-size is {mcfg.vocab_size}; "
                "give --vocab-size 256 or more, or 0 (256 for the corpus)"
            )
        if self.data not in DATA_NAMES:
            check_token_file(self.data, mcfg.seq_len)
        self._check_expert_layout(mcfg)

    def _check_expert_layout(self, mcfg: ModelConfig) -> None:
        """Refuse an --expert-layout that is not a layout (the parser's message) and one given for
        a model without experts, naming the model."""
        if not self.expert_layout:
            return
        try:
            ExpertLayout.parse(self.expert_layout)
        except ValueError as e:
            raise ValueError(f"--expert-layout {self.expert_layout!r}: {e}") from None
        if not mcfg.moe:
            model = f"--hf {self.hf!r}" if self.hf else f"--model {self.model}"
            model += f" --moe {self.moe}" if self.moe else ""
            raise ValueError(
                f"--expert-layout {self.expert_layout!r} with {model}: that model has no experts (a dense model), so "
                "there is nothing to place; drop --expert-layout, or train an MoE model (e.g. --model tiny-moe, or "
                "--moe n_experts=8)"
            )

    def _check_hf(self) -> None:
        """Refuse with --hf the flags that describe axon4d's own models or need their blocks, and
        --grid auto for a family the planner does not price."""
        given = [
            f"{flag(f.name)} {getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if f.name in HF_REFUSED and getattr(self, f.name) != f.default
        ]
        if given:
            raise ValueError(
                f"--hf {self.hf!r} with {', '.join(given)}: the saved model's configuration gives its family and "
                "shape, and --offload needs axon4d's own blocks; drop these flags (--seq-len may be given)"
            )
        if self.data == "corpus":
            raise ValueError(
                f"--hf {self.hf!r} with --data corpus: the corpus holds byte ids, not the model's tokens; give a "
                "token file made with the model's tokenizer (axon4d prepare-data --tokenizer ...) or synthetic"
            )
        if self.grid == "auto" and hf.model_type(self.hf) not in hf.PLANNED_TYPES:
            raise ValueError(
                f"--grid auto with --hf {self.hf!r} (model type {hf.model_type(self.hf)!r}): the planner prices "
                f"the parallel styles of {', '.join(hf.PLANNED_TYPES)} models only; give --grid x,y,z,data"
            )

    def grid_spec(self) -> str | tuple[int, ...]:
        """--grid as ``axon4d.init`` takes it: "auto", or the four sizes (one may be -1), checked."""
        if self.grid == "auto":
            return "auto"
        parts = [p.strip() for p in self.grid.split(",")]
        example = "give four sizes x,y,z,data such as 1,1,1,-1 or 2,2,1,-1 (one may be -1: the rest), or auto"
        if len(parts) != 4:
            raise ValueError(f"--grid {self.grid!r} has {len(parts)} sizes; {example}")
        try:
            sizes = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"--grid {self.grid!r}: every size must be a whole number; {example}") from None
        return tuple(check_sizes(sizes))

    def model_config(self) -> ModelConfig:
        """The size table's model with this run's overrides (vocabulary 256 for the byte-level corpus);
        with --hf the saved model's (``axon4d.train.hf.model_config``)."""
        if self.hf:
            return hf.model_config(self.hf, self.seq_len)
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
        return get_config(self.model, **{**overrides, **moe_overrides(self.moe)})


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
            alone: dict[str, Any] = {"nargs": "?", "const": ALONE[f.name]} if f.name in ALONE else {}
            p.add_argument(
                flag,
                *ALIASES.get(f.name, ()),
                type=kind,
                default=f.default,
                choices=CHOICES.get(f.name),
                help=f"{docs.get(f.name, '')} (default: {f.default})",
                **alone,
            )


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The config of parsed flags (attributes that are not fields are ignored)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
