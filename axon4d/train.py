"""The training job: a GPT or Llama model trained on the 4D grid.

    torchrun --nproc-per-node 8 -m axon4d.train --grid 2,2,2,1 --model small --steps 200
    axon4d train --help                       # every TrainConfig field is a flag

Every field of ``TrainConfig`` is a command-line flag. The loop: deterministic global batches
(``axon4d.data``) → this rank's rows (``shard_batch``) → micro-batches with gradient accumulation →
gradient clipping whose norm counts each element once (``axon4d.params``) → AdamW with warmup
and cosine decay. Rank 0 shows a progress bar (loss, tokens/s, MFU, hidden communication) and
writes ``log.jsonl``; checkpoints (``axon4d.checkpoint``) are saved every ``save_every`` steps and
at the end, and ``--resume`` continues from the newest one on the same loss curve. With
``--compare-single`` rank 0 afterwards trains the same model in one process with plain PyTorch
from the same initial weights and plots both loss curves.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import os
import time
from typing import Any

import torch

import axon4d
from axon4d import checkpoint, params
from axon4d.data import MemmapTokens, SyntheticTokens, demo_corpus
from axon4d.config import ModelConfig, get_config
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.precision import Precision


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs; each field is a command-line flag."""

    grid: str = "1,1,1,-1"
    """Grid sizes x,y,z,data (one may be -1: the rest), or auto (the planner chooses)."""
    machine: str = ""
    """With --grid auto: the planner's machine (a shipped name such as perlmutter, or a file from axon4d calibrate)."""
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
        overrides: dict[str, Any] = {"arch": self.arch}
        for field, key in (("layers", "n_layers"), ("hidden", "hidden"), ("heads", "n_heads"),
                           ("kv_heads", "n_kv_heads"), ("vocab_size", "vocab_size"), ("seq_len", "seq_len")):
            if getattr(self, field):
                overrides[key] = getattr(self, field)
        if self.data == "corpus" and not self.vocab_size:
            overrides["vocab_size"] = 256
        return get_config(self.model, **overrides)


def _field_docs(cls: type) -> dict[str, str]:
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
    docs = _field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=docs.get(f.name))
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            p.add_argument(flag, type=kind, default=f.default, help=f"{docs.get(f.name, '')} (default: {f.default})")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at cfg.steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only (norm weights and biases excluded).

    Decided by the parameter's *global* shape, so flat Linear shards count as matrices; for a
    plain single-process model the global shape is the parameter's own."""
    layouts = params.param_layouts(model)
    decay = [p for n, p in model.named_parameters() if len(layouts[n].global_shape) >= 2]
    other = [p for n, p in model.named_parameters() if len(layouts[n].global_shape) < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


CORPUS_PATH = os.path.join("build", "corpus.u16")


def make_data(cfg: TrainConfig, mcfg: ModelConfig, grid: axon4d.Grid | None = None) -> SyntheticTokens | MemmapTokens:
    """The token stream ``cfg.data`` names; the demo corpus is written once, by rank 0."""
    if cfg.data == "synthetic":
        return SyntheticTokens(mcfg.vocab_size, mcfg.seq_len, seed=cfg.seed)
    path = cfg.data
    if cfg.data == "corpus":
        path = CORPUS_PATH
        if grid is None or grid.rank == 0:
            demo_corpus(path)
        if grid is not None:
            grid.comm.barrier()
    if not os.path.exists(path):
        raise ValueError(f"data {cfg.data!r}: no such token file; use synthetic, corpus, or a path to a .u16/.u32 file")
    return MemmapTokens(path, mcfg.seq_len, mcfg.vocab_size, seed=cfg.seed)


def measure_peak_tflops(grid: axon4d.Grid, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """Matmul TFLOP/s of this rank while every rank measures at once (the machine's shared peak)."""
    n = 512
    a = torch.randn(n, n, dtype=dtype, device=grid.device)
    b = torch.randn(n, n, dtype=dtype, device=grid.device)
    torch.matmul(a, b)
    grid.comm.barrier()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.matmul(a, b)
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start) / 1e12


def _global_mean(value: torch.Tensor, grid: axon4d.Grid) -> float:
    """Mean over the batch axis of a per-rank scalar (each rank's loss is over its own tokens)."""
    total = grid.comm.all_reduce(value.detach().float().reshape(1).clone(), "batch", tag="log").wait()
    return float(total) / grid.size("batch")


def _fit_step(model: torch.nn.Module, batches: tuple[torch.Tensor, ...], grid: axon4d.Grid | None) -> torch.Tensor:
    """Forward and backward of every micro-batch; returns the mean loss (this rank's tokens)."""
    total = torch.zeros(())
    for full in batches:
        rows = axon4d.shard_batch(full, grid) if grid is not None else full
        loss = model.loss(rows[:, :-1], rows[:, 1:]) / len(batches)
        loss.backward()
        total += loss.detach()
    return total


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the training job described by ``cfg`` on the grid; return the run summary (all ranks)."""
    Precision.parse(cfg.precision)  # a bad name fails here, on every rank, before any communication
    mcfg = cfg.model_config()
    grid_spec = "auto" if cfg.grid == "auto" else tuple(int(s) for s in cfg.grid.split(","))
    grid = axon4d.init(grid=grid_spec, seed=cfg.seed, precision=cfg.precision,
                       plan={"model": mcfg, "batch": cfg.batch_size, "machine": cfg.machine or None,
                             "dtype": "float32" if cfg.precision == "fp32" else "bfloat16"})
    try:
        return _train_on(grid, cfg, mcfg)
    finally:
        axon4d.shutdown()


def _train_on(grid: axon4d.Grid, cfg: TrainConfig, mcfg: ModelConfig) -> dict[str, Any]:
    from tqdm import tqdm

    rank0 = grid.rank == 0
    model = Transformer(mcfg, grid=grid)
    initial_dense = model.to_dense() if cfg.compare_single else None
    opt = make_optimizer(model, cfg)
    data = make_data(cfg, mcfg, grid)
    ckpt_dir = os.path.join(cfg.out_dir, "checkpoints")
    start = 0
    if cfg.resume:
        found = checkpoint.latest(ckpt_dir)
        if found is not None:
            start = int(checkpoint.load(found, model, grid, opt)["step"])
    peak_rank = cfg.peak_tflops or measure_peak_tflops(grid, grid.precision.compute)
    peak_total = grid.comm.all_reduce(torch.tensor([peak_rank]), "world", tag="peak").wait().item()
    if rank0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"{grid}\nmodel {mcfg.name or cfg.model} ({mcfg.arch}): {mcfg.n_params() / 1e6:.2f} M parameters, "
              f"{mcfg.n_layers} layers, hidden {mcfg.hidden}, seq {mcfg.seq_len}; "
              f"peak {peak_total:.3f} TFLOP/s over {grid.world_size} ranks" + (f"; resumed at step {start}" if start else ""))
    log = open(os.path.join(cfg.out_dir, "log.jsonl"), "a") if rank0 else None
    tokens_per_step = cfg.batch_size * cfg.micro_batches * mcfg.seq_len
    bar = tqdm(total=cfg.steps, initial=start, disable=not (rank0 and cfg.progress), ncols=110, desc="train")
    records, losses = [], []
    for step in range(start, cfg.steps):
        grid.comm.log.clear()
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batches = data.batch(step, cfg.batch_size * cfg.micro_batches).chunk(cfg.micro_batches)
        loss = _fit_step(model, batches, grid)
        norm = params.clip_grad_norm_(model, cfg.grad_clip, grid) if cfg.grad_clip > 0 else params.grad_norm(model, grid).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        comm = grid.comm.log.summary()
        mean_loss = _global_mean(loss, grid)
        losses.append(mean_loss)
        tps = tokens_per_step / dt
        mfu = mcfg.flops_per_token() * tps / (peak_total * 1e12)
        rec = {"step": step + 1, "loss": mean_loss, "lr": lr_at(step, cfg), "grad_norm": norm, "step_s": dt,
               "tokens_per_s": tps, "mfu": mfu, "comm_bytes": {a: v["bytes"] for a, v in comm["axes"].items()},
               "comm_s": comm["comm_s"], "blocked_s": comm["blocked_s"], "hidden_pct": comm["hidden_pct"]}
        records.append(rec)
        if log is not None and (step + 1) % cfg.log_every == 0:
            log.write(json.dumps(rec) + "\n")
            log.flush()
        bar.set_postfix_str(f"loss {mean_loss:.4f} | {tps:,.0f} tok/s | MFU {100 * mfu:.1f}% | hidden {comm['hidden_pct']:.0f}%")
        bar.update()
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            checkpoint.save(os.path.join(ckpt_dir, f"step_{step + 1}"), model, grid, opt, step=step + 1,
                            extra={"train_config": dataclasses.asdict(cfg)})
    bar.close()
    final = os.path.join(ckpt_dir, f"step_{cfg.steps}")
    checkpoint.save(final, model, grid, opt, step=cfg.steps, extra={"train_config": dataclasses.asdict(cfg)})
    summary = _summarize(records, cfg, grid, final)
    if log is not None:
        log.close()
    if rank0:
        print(format_summary(summary))
        with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    if initial_dense is not None and rank0 and start == 0:
        ref = train_single(initial_dense, cfg, mcfg)
        summary["single_process_losses"] = ref
        summary["max_rel_diff"] = max(abs(a - b) / b for a, b in zip(losses, ref))
        print(f"single process vs 4D grid: max relative loss difference over {len(ref)} steps = {summary['max_rel_diff']:.1e}")
        png = plot_curves(os.path.join(cfg.out_dir, "loss.png"), losses, ref, cfg.grid)
        print(f"loss curves: {png}")
        with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    summary["losses"] = losses
    return summary


def _summarize(records: list[dict[str, Any]], cfg: TrainConfig, grid: axon4d.Grid, ckpt: str) -> dict[str, Any]:
    steady = records[1:] or records  # the first step pays for warm-up allocations
    med = lambda key: sorted(r[key] for r in steady)[len(steady) // 2] if steady else float("nan")  # noqa: E731
    axes: dict[str, float] = {}
    for r in steady:
        for a, b in r["comm_bytes"].items():
            axes[a] = axes.get(a, 0) + b / len(steady)
    comm_s = sum(r["comm_s"] for r in steady)
    blocked = sum(r["blocked_s"] for r in steady)
    return {"grid": str(grid.shape), "steps": cfg.steps, "final_loss": records[-1]["loss"] if records else None,
            "median_step_s": med("step_s"), "median_tokens_per_s": med("tokens_per_s"), "median_mfu": med("mfu"),
            "comm_bytes_per_step": axes, "hidden_pct": 100.0 * (1 - blocked / comm_s) if comm_s else 0.0,
            "checkpoint": ckpt}


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-run table."""
    rows = [("grid", s["grid"]), ("steps", s["steps"]), ("final loss", f"{s['final_loss']:.4f}" if s["final_loss"] is not None else "-"),
            ("step time (median)", f"{1e3 * s['median_step_s']:.1f} ms"), ("tokens/s (median)", f"{s['median_tokens_per_s']:,.0f}"),
            ("MFU (median)", f"{100 * s['median_mfu']:.2f}%"), ("communication hidden", f"{s['hidden_pct']:.0f}%")]
    rows += [(f"bytes/step on {a}", f"{b / 2**20:.2f} MiB") for a, b in sorted(s["comm_bytes_per_step"].items())]
    rows.append(("checkpoint", s["checkpoint"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(["", "run summary", "-" * (width + 30)] + [f"{k:<{width}}  {v}" for k, v in rows])


def train_single(dense: DenseTransformer, cfg: TrainConfig, mcfg: ModelConfig) -> list[float]:
    """The same run in one process with plain PyTorch (the reference curve)."""
    from tqdm import tqdm

    opt = make_optimizer(dense, cfg)
    data = make_data(cfg, mcfg)
    precision, p0 = Precision.parse(cfg.precision), next(dense.parameters())  # mixed: autocast, the usual way
    losses = []
    for step in tqdm(range(cfg.steps), desc="1 process", ncols=110, disable=not cfg.progress):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batches = data.batch(step, cfg.batch_size * cfg.micro_batches).chunk(cfg.micro_batches)
        with torch.autocast(p0.device.type, dtype=precision.compute, enabled=precision.mixed):
            loss = _fit_step(dense, batches, None)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(dense.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def plot_curves(path: str, ours: list[float], ref: list[float], grid: str) -> str:
    """Both loss curves in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.plot(range(1, len(ref) + 1), ref, label="1 process, plain PyTorch", linewidth=3.5, alpha=0.45)
    ax.plot(range(1, len(ours) + 1), ours, label=f"axon4d, grid {grid}", linewidth=1.2, linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title("4D-parallel training follows the single-process loss curve")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(args: argparse.Namespace) -> int:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    train(cfg)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
