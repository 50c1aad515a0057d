"""The training job's flags as data: each checked field's bounds and hint, the fields with fixed
choices, flags given alone or under other names, and the option groups ``TrainConfig.check`` uses
(axon4d.train.config). Plain tables, no behaviour.
"""

from __future__ import annotations

import math

from axon4d.options.recompute_mode import RECOMPUTE_MODES


def flag(name: str) -> str:
    """The flag of a field: ``micro_batches`` is ``--micro-batches``."""
    return "--" + name.replace("_", "-")


#: whole-number fields and their least value
MINIMUM: dict[str, int] = {
    "steps": 1,
    "try_plans": 0,
    "try_steps": 1,
    "try_rounds": 1,
    "batch_size": 1,
    "micro_batches": 1,
    "log_every": 1,
    "max_nonfinite": 1,
    "layers": 0,
    "hidden": 0,
    "heads": 0,
    "kv_heads": 0,
    "vocab_size": 0,
    "seq_len": 0,
    "warmup_steps": 0,
    "save_every": 0,
    "keep_last": 0,
    "seed": 0,
}
#: number fields: (bound, largest value, whether the bound itself is excluded)
RANGES: dict[str, tuple[float, float, bool]] = {
    "lr": (0.0, math.inf, True),
    "min_lr": (0.0, math.inf, False),
    "weight_decay": (0.0, math.inf, False),
    "beta1": (0.0, 1.0, False),
    "beta2": (0.0, 1.0, False),
    "grad_clip": (0.0, math.inf, False),
    "timeout": (0.0, math.inf, True),
    "startup_timeout": (0.0, math.inf, True),
    "peak_tflops": (0.0, math.inf, False),
}
#: what each checked field means, for its error message
HINTS: dict[str, str] = {
    "steps": "the optimizer steps of the whole run, e.g. --steps 100",
    "try_plans": "plans to try with --grid auto, e.g. --try 3 (0: none)",
    "try_steps": "timed steps per tried plan, e.g. --try-steps 3",
    "try_rounds": "rounds of the tried plans, round-robin, e.g. --try-rounds 3",
    "batch_size": "global sequences per micro-batch, e.g. --batch-size 16",
    "micro_batches": "micro-batches accumulated per step, e.g. --micro-batches 1",
    "log_every": "a log record every N steps, e.g. --log-every 1",
    "max_nonfinite": "non-finite steps in a row before the run stops, e.g. --max-nonfinite 3",
    "layers": "0 keeps the size table's",
    "hidden": "0 keeps the size table's",
    "heads": "0 keeps the size table's",
    "kv_heads": "0 means as many as the attention heads",
    "vocab_size": "0 keeps the size table's",
    "seq_len": "0 keeps the size table's",
    "warmup_steps": "0 means no warmup",
    "save_every": "0 saves only at the end, N every N steps",
    "keep_last": "0 keeps every checkpoint, K the newest K",
    "seed": "e.g. --seed 0",
    "lr": "e.g. --lr 3e-3",
    "min_lr": "e.g. --min-lr 3e-4 (0: decay to zero)",
    "weight_decay": "e.g. --weight-decay 0.1 (0: none)",
    "beta1": "e.g. --beta1 0.9",
    "beta2": "e.g. --beta2 0.95",
    "grad_clip": "e.g. --grad-clip 1.0 (0: no clipping)",
    "timeout": "seconds, e.g. --timeout 60",
    "startup_timeout": "seconds, e.g. --startup-timeout 300",
    "peak_tflops": "e.g. --peak-tflops 0 (0: measure it)",
}
#: the flags --hf refuses at other values than their defaults
HF_REFUSED = ("model", "arch", "layers", "hidden", "heads", "kv_heads", "vocab_size", "offload", "moe")
#: --zero's stages: 0 (off) and axon4d.zero's
ZERO_STAGES = (0, 1, 2)
#: --data names that are not files
DATA_NAMES = ("synthetic", "corpus")
#: the layer kinds of a block whose GEMMs may run FP8 (``--bf16-layers``; the planner's names, axon4d.plan.fp8)
FP8_KINDS = ("qkv", "attn_out", "mlp_up", "mlp_down")
#: the step options ``--grid auto`` lets the planner choose (axon4d.train.planned), as --pin names them
PLANNED = (
    "recompute",
    "micro_batches",
    "zero",
    "offload",
    "context_parallel",
    "context_parallel_axes",
    "fp8_gather",
    "expert_layout",
    "fp8_dispatch",
)
#: fields whose flag accepts only these values.
CHOICES: dict[str, tuple[str, ...]] = {
    "recompute": RECOMPUTE_MODES,
    "comm": ("auto", "torch", "mpi"),
    "on_nonfinite": ("skip", "stop"),
    "resume": ("never", "always", "auto"),
    "fp8_gradients": ("e5m2", "e4m3"),
    "context_parallel_mode": ("all-gather", "ring"),
}
#: fields whose flag may be given alone, meaning this value (``--resume`` is ``--resume always``)
ALONE: dict[str, str] = {"resume": "always"}
#: other names of a field's flag
ALIASES: dict[str, tuple[str, ...]] = {"try_plans": ("--try",)}
