"""The training job: a GPT or Llama model trained on the 4D grid.

    torchrun --nproc-per-node 8 -m axon4d.train --grid 2,2,2,1 --model small --steps 200
    axon4d train --help                       # every TrainConfig field is a flag

Every field of ``TrainConfig`` is a command-line flag. The loop: deterministic global batches
(``axon4d.data.tokens``) → this rank's rows (``shard_batch``) → micro-batches with gradient accumulation →
gradient clipping whose norm counts each element once (``axon4d.grads``) → AdamW with warmup
and cosine decay. Rank 0 shows a progress bar (loss, tokens/s, MFU, hidden communication) and
writes ``log.jsonl``; checkpoints (``axon4d.checkpoint``) are saved every ``save_every`` steps and
at the end, and ``--resume`` continues from the newest one on the same loss curve (``--resume
auto``: when there is one, else afresh — one command for every relaunch under ``torchrun
--max-restarts`` or ``sbatch --requeue``). With
``--grid auto`` the planner chooses the grid and the step options (recomputation, micro-batches,
ZeRO, offload, FP8 gathers, split sequences) and the run takes them. With
``--compare-single`` rank 0 afterwards trains the same model in one process with plain PyTorch
from the same initial weights and plots both loss curves. With ``--hf PATH`` the model is a saved
Hugging Face causal LM (``save_pretrained``'s directory), fine-tuned by the same loop:

    torchrun --nproc-per-node 8 -m axon4d.train --hf llama-dir --grid 2,2,2,1 --data tokens.u32 --lr 3e-5
"""

# This docstring is the help text of `axon4d train` and `python -m axon4d.train`. The package sits
# in layer L9 (docs/design.md §9), one idea per module:
#   config     TrainConfig and the flags built from its field docstrings
#   batches    the token stream --data names, a step's micro-batches, gradient accumulation
#   optim      learning-rate schedule, AdamW, clipping by the global gradient norm
#   peak       the peak TFLOP/s that MFU is measured against
#   loop       train(cfg) on the grid, and main(args)
#   hf         --hf: a saved Hugging Face causal LM, parallelized and loaded by slices, as the model
#   planned    --grid auto: the planner's grid and step options applied to the run
#   reference  the single-process run of --compare-single
#   moe_log    MoE blocks: tokens per expert, imbalance and balance loss in the step record
#   report     step records, progress line, log.jsonl, summary.json, loss.png

from axon4d.train.config import TrainConfig, add_arguments
from axon4d.train.loop import main, train

__all__ = ["TrainConfig", "add_arguments", "main", "train"]
