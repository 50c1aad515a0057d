"""The catalogue of bad inputs (issue 16, item 4): every one is refused early, with the right
exception type and a message that names the bad value and says what would work.

Each table row is (id, call, exception, regex): ValueError for a bad value, TypeError for a wrong
type, FileNotFoundError for a missing file; the regex is searched in the message. Single-process
rows run here. Multi-rank rows (grids, layers, tensors, training runs) run on every rank of a real
4-rank gloo world (``pools``, tests/harness.py), one pool call per table, and must raise the same
way on every rank within seconds — before any collective, or a rank would be left waiting.
Training flags go through ``axon4d train``'s real parser (``axon4d.cli.run_command``) and must fail
before any process group or file exists; planner flags through ``axon4d plan``'s.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed as dist

import axon4d
from axon4d import cli
from axon4d.config import ModelConfig, get_config
from axon4d.data.tokens import MemmapTokens
from axon4d.models.transformer import Transformer
from axon4d.nn.attention import Attention
from axon4d.nn.embedding import VocabParallelEmbedding
from axon4d.nn.linear import Linear
from axon4d.nn.loss import vocab_parallel_cross_entropy
from axon4d.nn.mlp import MLP
from axon4d.nn.norm import LayerNorm, RMSNorm
from axon4d.train import TrainConfig, train

WORLD = 4
#: seconds within which every rank must have raised, per case: a refusal comes before any
#: collective, so a case this slow waited for another rank (a hang the pool's timeout would end);
#: generous, for a loaded host where building a grid alone can take seconds
PROMPT_S = 30.0


class Case(NamedTuple):
    id: str
    call: Callable[..., Any]
    exc: type[BaseException]
    regex: str


def _ids(cases: list[Case]) -> list[str]:
    return [c.id for c in cases]


# -- model configurations (plain data, one process) ------------------------------------------------

TINY = dict(n_layers=2, hidden=64, n_heads=4)
MODEL_CASES = [
    Case("n_heads=0", lambda: ModelConfig(**{**TINY, "n_heads": 0}), ValueError, r"n_heads = 0 must be at least 1"),
    Case("n_heads<0", lambda: ModelConfig(**{**TINY, "n_heads": -4}), ValueError, r"n_heads = -4 must be at least 1"),
    Case(
        "hidden%heads",
        lambda: ModelConfig(**{**TINY, "hidden": 100, "n_heads": 3}),
        ValueError,
        r"hidden = 100 is not divisible by n_heads = 3.*n_heads that divide it: 1, 2, 4, 5, 10",
    ),
    Case(
        "heads%kv_heads",
        lambda: ModelConfig(**TINY, n_kv_heads=3),
        ValueError,
        r"n_heads = 4 is not divisible by n_kv_heads = 3.*that divide it: 1, 2, 4",
    ),
    Case("kv_heads=0", lambda: ModelConfig(**TINY, n_kv_heads=0), ValueError, r"n_kv_heads = 0 must be at least 1"),
    Case("hidden<0", lambda: ModelConfig(**{**TINY, "hidden": -64}), ValueError, r"hidden = -64 must be at least 1"),
    Case(
        "hidden float", lambda: ModelConfig(**{**TINY, "hidden": 64.0}), TypeError, r"hidden = 64\.0 \(float\).*whole"
    ),
    Case("n_layers=0", lambda: ModelConfig(**{**TINY, "n_layers": 0}), ValueError, r"n_layers = 0 must be at least 1"),
    Case("vocab=0", lambda: ModelConfig(**TINY, vocab_size=0), ValueError, r"vocab_size = 0 must be at least 1"),
    Case("seq_len<0", lambda: ModelConfig(**TINY, seq_len=-5), ValueError, r"seq_len = -5 must be at least 1"),
    Case("ffn=0", lambda: ModelConfig(**TINY, ffn_hidden=0), ValueError, r"ffn_hidden = 0 must be at least 1"),
    Case(
        "norm_eps=0",
        lambda: ModelConfig(**TINY, norm_eps=0.0),
        ValueError,
        r"norm_eps = 0\.0 must be .*above 0, e\.g\.",
    ),
    Case("rope_theta nan", lambda: ModelConfig(**TINY, rope_theta=math.nan), ValueError, r"rope_theta = nan must be"),
    Case(
        "arch",
        lambda: ModelConfig(**TINY, arch="bert"),
        ValueError,
        r"arch 'bert' is not supported; use 'gpt' or 'llama'",
    ),
    Case(
        "llama odd head_dim",
        lambda: ModelConfig(n_layers=1, hidden=36, n_heads=4, arch="llama"),
        ValueError,
        r"head_dim = hidden/n_heads = 36/4 = 9 is odd.*even",
    ),
    Case("unknown size", lambda: get_config("7B"), ValueError, r"unknown model size '7B'; known sizes: 5B, 10B"),
    Case("unknown field", lambda: get_config("tiny", heads=8), TypeError, r"no field 'heads'; its fields are n_layers"),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=_ids(MODEL_CASES))
def test_model_config_is_refused(case):
    with pytest.raises(case.exc, match=case.regex):
        case.call()


# -- training flags, through `axon4d train`'s parser -------------------------------------------------

TRAIN_FLAG_CASES = [
    Case("steps<0", ["--steps", "-5"], ValueError, r"--steps -5: must be at least 1.*--steps 100"),
    Case("steps=0", ["--steps", "0"], ValueError, r"--steps 0: must be at least 1"),
    Case("batch-size=0", ["--batch-size", "0"], ValueError, r"--batch-size 0: must be at least 1.*--batch-size 16"),
    Case("micro-batches=0", ["--micro-batches", "0"], ValueError, r"--micro-batches 0: must be at least 1"),
    Case("log-every=0", ["--log-every", "0"], ValueError, r"--log-every 0: must be at least 1"),
    Case(
        "save-every<0",
        ["--save-every", "-1"],
        ValueError,
        r"--save-every -1: must be at least 0.*0 saves only at the end",
    ),
    Case("keep-last<0", ["--keep-last", "-2"], ValueError, r"--keep-last -2: must be at least 0"),
    Case("max-nonfinite=0", ["--max-nonfinite", "0"], ValueError, r"--max-nonfinite 0: must be at least 1"),
    Case("warmup<0", ["--warmup-steps", "-1"], ValueError, r"--warmup-steps -1: must be at least 0"),
    Case("seed<0", ["--seed", "-1"], ValueError, r"--seed -1: must be at least 0"),
    Case(
        "grad-clip<0",
        ["--grad-clip", "-1"],
        ValueError,
        r"--grad-clip -1\.0: must be a finite number at least 0.*0: no clip",
    ),
    Case("lr=0", ["--lr", "0"], ValueError, r"--lr 0\.0: must be a finite number above 0.*--lr 3e-3"),
    Case("lr nan", ["--lr", "nan"], ValueError, r"--lr nan: must be a finite number above 0"),
    Case(
        "min-lr>lr",
        ["--lr", "1e-3", "--min-lr", "1e-2"],
        ValueError,
        r"--min-lr 0\.01 is above --lr 0\.001.*at most 0\.001",
    ),
    Case("weight-decay<0", ["--weight-decay", "-0.1"], ValueError, r"--weight-decay -0\.1: must be .*at least 0"),
    Case("beta1=1", ["--beta1", "1.0"], ValueError, r"--beta1 1\.0 / --beta2 0\.95: .*below 1, e\.g\. 0\.9"),
    Case("beta2>1", ["--beta2", "1.5"], ValueError, r"--beta2 1\.5: must be a finite number at least 0 and at most 1"),
    Case("timeout=0", ["--timeout", "0"], ValueError, r"--timeout 0\.0: must be a finite number above 0.*--timeout 60"),
    Case("startup-timeout<0", ["--startup-timeout", "-5"], ValueError, r"--startup-timeout -5\.0: must be .*above 0"),
    Case("peak-tflops<0", ["--peak-tflops", "-1"], ValueError, r"--peak-tflops -1\.0: must be .*at least 0"),
    Case(
        "grid float",
        ["--grid", "1.5,4,1,1"],
        ValueError,
        r"--grid '1\.5,4,1,1': every size must be a whole number.*1,1,1,-1",
    ),
    Case("grid 2 sizes", ["--grid", "2,2"], ValueError, r"--grid '2,2' has 2 sizes; give four sizes"),
    Case(
        "grid zero",
        ["--grid", "0,1,1,1"],
        ValueError,
        r"grid \(0, 1, 1, 1\): size 0 is not allowed; sizes must be positive",
    ),
    Case("grid two -1", ["--grid=-1,-1,1,1"], ValueError, r"grid \(-1, -1, 1, 1\): at most one size may be -1"),
    Case("model name", ["--model", "7B"], ValueError, r"unknown model size '7B'; known sizes: .*tiny"),
    Case("heads<0", ["--heads", "-3"], ValueError, r"--heads -3: must be at least 0; 0 keeps the size table's"),
    Case(
        "hidden%heads",
        ["--model", "tiny", "--hidden", "100", "--heads", "3"],
        ValueError,
        r"hidden = 100 is not divisible by n_heads = 3",
    ),
    Case(
        "kv-heads",
        ["--model", "tiny", "--kv-heads", "3"],
        ValueError,
        r"n_heads = 4 is not divisible by n_kv_heads = 3",
    ),
    Case("vocab<0", ["--vocab-size", "-1"], ValueError, r"--vocab-size -1: must be at least 0"),
    Case("arch", ["--arch", "bert"], ValueError, r"arch 'bert' is not supported; use 'gpt' or 'llama'"),
    Case("precision", ["--precision", "fp8"], ValueError, r"precision 'fp8' is not supported; use one of fp32, bf16"),
    Case("out-dir empty", ["--out-dir", ""], ValueError, r"--out-dir '': give the directory"),
    Case(
        "expert-layout",
        ["--model", "tiny-moe", "--expert-layout", "ep=q"],
        ValueError,
        r"--expert-layout 'ep=q': expert layout ep='q': give distinct axes of .*'batch', 'world' or '1'",
    ),
    Case(
        "expert-layout dense",
        ["--model", "tiny", "--expert-layout", "ep=data"],
        ValueError,
        r"--expert-layout 'ep=data' with --model tiny: that model has no experts .*drop --expert-layout",
    ),
    Case(
        "data unknown",
        ["--data", "corpuss"],
        FileNotFoundError,
        r"'corpuss' does not exist; give --data synthetic, corpus",
    ),
    Case(
        "corpus vocab",
        ["--data", "corpus", "--vocab-size", "100"],
        ValueError,
        r"--data corpus holds byte ids 0…255 but --vocab-size is 100; give --vocab-size 256",
    ),
]


@pytest.mark.parametrize("case", TRAIN_FLAG_CASES, ids=_ids(TRAIN_FLAG_CASES))
def test_training_flag_is_refused_before_anything_starts(case, tmp_path):
    out_dir = tmp_path / "run"
    argv = ["train", *case.call] + ([] if "--out-dir" in case.call else ["--out-dir", str(out_dir)])
    world_before = dist.is_initialized()
    with pytest.raises(case.exc, match=case.regex):
        cli.run_command(argv)
    assert not out_dir.exists(), "a refused run created its output directory"
    assert dist.is_initialized() == world_before, "a refused run started a process group"
    with pytest.raises(RuntimeError):  # no grid was built
        axon4d.get_grid()


# -- planner flags, through `axon4d plan`'s parser ---------------------------------------------------

PLAN = ["plan", "--model", "5B", "--gpus", "8", "--batch", "8"]


def _plan(*flags: str, base: list[str] = PLAN) -> Callable[[str], int]:
    """`axon4d plan` with ``flags`` overriding the base command (a flag given twice: the last wins);
    "{dir}" in a flag is the test's directory of machine files."""
    return lambda d: cli.run_command([*base, *(f.replace("{dir}", d) for f in flags)])


PLAN_CASES = [
    Case("gpus=0", _plan("--gpus", "0"), ValueError, r"--gpus\) = 0 must be at least 1.*for example 8"),
    Case("gpus<0", _plan("--gpus", "-4"), ValueError, r"--gpus\) = -4 must be at least 1"),
    Case("seq-len<0", _plan("--seq-len", "-5"), ValueError, r"seq_len = -5 must be at least 1"),
    Case("seq-len=0", _plan("--seq-len", "0"), ValueError, r"seq_len = 0 must be at least 1"),
    Case("memory<0", _plan("--memory-gib", "-1"), ValueError, r"--memory-gib -1\.0: .*above 0, e\.g\. --memory-gib 80"),
    Case("memory=0", _plan("--memory-gib", "0"), ValueError, r"--memory-gib 0\.0: .*above 0"),
    Case("memory inf", _plan("--memory-gib", "inf"), ValueError, r"--memory-gib inf: .*finite"),
    Case(
        "batch=0",
        _plan("--batch", "0"),
        ValueError,
        r"batch = 0: need at least one sequence per step, e\.g\. --batch 8",
    ),
    Case("top=0", _plan("--top", "0"), ValueError, r"--top \(rows to print\) = 0 must be at least 1.*for example 10"),
    Case("model", _plan("--model", "7B"), ValueError, r"unknown model size '7B'; known sizes"),
    Case("machine name", _plan("--machine", "perlmutterr"), ValueError, r"unknown machine 'perlmutterr'.*perlmutter"),
    Case(
        "machine not JSON",
        _plan("--machine", "{dir}/broken.json"),
        ValueError,
        r"machine file '.*broken\.json' is not a machine description \(JSONDecodeError.*axon4d calibrate",
    ),
    Case(
        "machine lacks fields",
        _plan("--machine", "{dir}/empty.json"),
        ValueError,
        r"machine file '.*empty\.json' is not a machine description \(ValueError: machine file 'without a name' "
        r"gives no memory_per_device",
    ),
    Case(
        "machine is a list",
        _plan("--machine", "{dir}/list.json"),
        ValueError,
        r"machine file '.*list\.json' is not a machine description",
    ),
    Case(
        "expert-layout",
        _plan("--model", "tiny-moe", "--expert-layout", "ep=x,tp=x"),
        ValueError,
        r"--expert-layout 'ep=x,tp=x': .*axis x cannot both hold different experts and split each expert",
    ),
    Case(
        "expert-layout dense",
        _plan("--expert-layout", "ep=data"),
        ValueError,
        r"--expert-layout 'ep=data' with --model 5B: a dense model has no experts to place",
    ),
    Case(
        "overlap",
        _plan("--overlap", "fast"),
        ValueError,
        r"unknown overlap mechanisms \['fast'\] in 'fast'; choose from",
    ),
]


@pytest.fixture(scope="module")
def machine_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("machines")
    (d / "broken.json").write_text('{"name": "half a file",')
    (d / "empty.json").write_text("{}")
    (d / "list.json").write_text(json.dumps([1, 2]))
    return str(d)


@pytest.mark.parametrize("case", PLAN_CASES, ids=_ids(PLAN_CASES))
def test_planner_flag_is_refused(case, machine_files):
    with pytest.raises(case.exc, match=case.regex):
        case.call(machine_files)


# -- token files -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    np.arange(100, dtype=np.uint16).tofile(d / "ok.u16")
    (d / "odd.u16").write_bytes(b"\x01\x00\x02")  # one and a half uint16 tokens
    np.arange(5, dtype=np.uint16).tofile(d / "short.u16")
    (d / "empty.u16").write_bytes(b"")
    np.full(64, 300, dtype=np.uint16).tofile(d / "big.u16")
    os.mkdir(d / "folder.u16")
    return str(d)


DATA_CASES = [
    Case(
        "missing",
        lambda d: MemmapTokens(f"{d}/nope.u16", 8, 256),
        FileNotFoundError,
        r"nope\.u16' does not exist; give",
    ),
    Case(
        "directory",
        lambda d: MemmapTokens(f"{d}/folder.u16", 8, 256),
        FileNotFoundError,
        r"folder\.u16' is a directory",
    ),
    Case(
        "not whole elements",
        lambda d: MemmapTokens(f"{d}/odd.u16", 8, 256),
        ValueError,
        r"odd\.u16' has 3 bytes, not a multiple of 2 \(uint16\).*rewrite it whole",
    ),
    Case(
        "shorter than a sequence",
        lambda d: MemmapTokens(f"{d}/short.u16", 8, 256),
        ValueError,
        r"short\.u16' holds 5 tokens, fewer than one sequence of 9.*at least 10 tokens",
    ),
    Case("empty", lambda d: MemmapTokens(f"{d}/empty.u16", 8, 256), ValueError, r"empty\.u16' holds 0 tokens"),
    Case(
        "ids >= vocab",
        lambda d: MemmapTokens(f"{d}/big.u16", 8, 256),
        ValueError,
        r"big\.u16' contains token id 300, but the model's vocab_size is 256; give --vocab-size 301",
    ),
    Case(
        "dtype",
        lambda d: MemmapTokens(f"{d}/ok.u16", 8, 256, dtype="int8"),
        ValueError,
        r"'int8' is not supported; use one of uint16",
    ),
    Case(
        "--data missing file",
        lambda d: TrainConfig(data=f"{d}/nope.u16", model="tiny"),
        FileNotFoundError,
        r"nope\.u16' does not exist; give --data synthetic, corpus, or the path",
    ),
    Case(
        "--data shorter than seq_len",
        lambda d: TrainConfig(data=f"{d}/ok.u16", model="tiny", seq_len=200),
        ValueError,
        r"ok\.u16' holds 100 tokens, fewer than one sequence of 201",
    ),
]


@pytest.mark.parametrize("case", DATA_CASES, ids=_ids(DATA_CASES))
def test_token_file_is_refused(case, token_files):
    with pytest.raises(case.exc, match=case.regex):
        case.call(token_files)


# -- multi-rank tables: each row runs on every rank of a 4-rank world -------------------------------


def _grid(grid: Any) -> Callable[[], Any]:
    return lambda: axon4d.init(grid=grid)


GRID_CASES = [
    Case(
        "1.5 truncated", _grid((1.5, 4, 1, 1)), TypeError, r"size 1\.5 \(float\) is not a whole number.*-1 for the rest"
    ),
    Case("string size", _grid(("2", 2, 1, 1)), TypeError, r"size '2' \(str\) is not a whole number"),
    Case("bool size", _grid((True, 4, 1, 1)), TypeError, r"size True \(bool\) is not a whole number"),
    Case("dict float", _grid({"x": 2.5, "data": -1}), TypeError, r"size 2\.5 \(float\) is not a whole number"),
    Case("not a grid", _grid(4), TypeError, r"grid 4 \(int\) is not a grid: give \(x, y, z, data\) sizes"),
    Case("string", _grid("2,2,1,1"), ValueError, r"grid='2,2,1,1': give \(x, y, z, data\) sizes or 'auto'"),
    Case(
        "product",
        _grid((2, 2, 2, 2)),
        ValueError,
        r"has 16 ranks .* world size is 4; grids \(x, y, z, data\) that work",
    ),
    Case(
        "-1 does not divide", _grid((3, 1, 1, -1)), ValueError, r"multiply to 3, which does not divide the world size 4"
    ),
    Case("two -1", _grid((-1, -1, 2, 1)), ValueError, r"at most one size may be -1"),
    Case("zero", _grid((0, 2, 2, 1)), ValueError, r"size 0 is not allowed; sizes must be positive"),
    Case("three sizes", _grid((2, 2, 1)), ValueError, r"has 3 sizes; give 4 as \(x, y, z, data\), for example"),
    Case("unknown axis", _grid({"w": 4}), ValueError, r"unknown grid axes \['w'\]; axes are"),
]

LLAMA = ModelConfig(n_layers=1, hidden=32, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=8, arch="llama")


def _ids_of(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def _normal_output(g: Any) -> torch.Tensor:
    layer = Linear(8, 12, grid=g)
    return layer(axon4d.shard_input(torch.randn(2, 8), grid=g))


def _transposed_output(g: Any) -> torch.Tensor:
    layer = Linear(8, 12, transpose=True, grid=g)
    return layer(axon4d.shard_input(torch.randn(2, 8), transpose=True, grid=g))


LAYER_CASES = [  # grid (2, 2, 1, 1): G_x = G_y = 2
    Case(
        "Linear(0, 8)", lambda g: Linear(0, 8, grid=g), ValueError, r"in_features = 0 must be at least 1.*for example"
    ),
    Case("Linear(8, -4)", lambda g: Linear(8, -4, grid=g), ValueError, r"out_features = -4 must be at least 1"),
    Case(
        "Linear(8.0, 8)",
        lambda g: Linear(8.0, 8, grid=g),
        TypeError,
        r"in_features = 8\.0 \(float\) must be a whole number",
    ),
    Case(
        "Linear in % G_x",
        lambda g: Linear(7, 8, grid=g),
        ValueError,
        r"in_features = 7 is not divisible by G_x = 2 .*that work: .*\(1, 4, 1, 1\)",
    ),
    Case(
        "Linear out % G_y", lambda g: Linear(8, 7, grid=g), ValueError, r"out_features = 7 is not divisible by G_y = 2"
    ),
    Case(
        "Linear dtype",
        lambda g: Linear(8, 8, grid=g, dtype=torch.float64),
        ValueError,
        r"dtype torch\.float64 .*use one of",
    ),
    Case("Attention heads=0", lambda g: Attention(32, 0, grid=g), ValueError, r"n_heads = 0 must be at least 1"),
    Case(
        "Attention hidden%heads",
        lambda g: Attention(32, 3, grid=g),
        ValueError,
        r"hidden = 32, n_heads = 3.*need hidden % n_heads",
    ),
    Case(
        "Attention heads%G_y",
        lambda g: Attention(32, 1, grid=g),
        ValueError,
        r"n_heads = 1 is not divisible by G_y = 2",
    ),
    Case("Attention kv=0", lambda g: Attention(32, 4, 0, grid=g), ValueError, r"n_kv_heads = 0 must be at least 1"),
    Case(
        "Attention odd rotary",
        lambda g: Attention(36, 4, rope_theta=1e4, grid=g),
        ValueError,
        r"head_dim = hidden/n_heads = 36/4 = 9 is odd.*rope_theta=None",
    ),
    Case("MLP ffn=0", lambda g: MLP(32, 0, grid=g), ValueError, r"ffn = 0 must be at least 1"),
    Case("MLP ffn%G_y", lambda g: MLP(32, 7, grid=g), ValueError, r"ffn_hidden = 7 is not divisible by G_y = 2"),
    Case(
        "Embedding vocab=0",
        lambda g: VocabParallelEmbedding(0, 32, grid=g),
        ValueError,
        r"vocab_size = 0 must be at least 1",
    ),
    Case(
        "Embedding vocab%G_y",
        lambda g: VocabParallelEmbedding(33, 32, grid=g),
        ValueError,
        r"vocab_size = 33 is not divisible by G_y",
    ),
    Case(
        "LayerNorm hidden=0",
        lambda g: LayerNorm(0, grid=g),
        ValueError,
        r"hidden \(the normalised features\) = 0 must be",
    ),
    Case("RMSNorm eps=0", lambda g: RMSNorm(32, eps=0.0, grid=g), ValueError, r"eps = 0\.0 must be above 0.*1e-5"),
    Case(
        "Transformer(dict)",
        lambda g: Transformer({"hidden": 32}, grid=g),
        TypeError,
        r"takes a ModelConfig, got dict; use",
    ),
    Case(
        "Transformer recompute",
        lambda g: Transformer(LLAMA, grid=g, recompute="most"),
        ValueError,
        r"recompute='most'.*none",
    ),
    Case(
        "auto_parallelize(list)",
        lambda g: axon4d.auto_parallelize([1], grid=g),
        TypeError,
        r"takes a torch\.nn\.Module.*got list",
    ),
]

TENSOR_CASES = [  # the same grid; every rank passes the same bad tensor
    Case(
        "float64 input",
        lambda g: Linear(8, 8, grid=g)(torch.randn(2, 4, dtype=torch.float64)),
        TypeError,
        r"input of dtype torch\.float64; it computes in one of torch\.float32.*x\.to\(torch\.float32\)",
    ),
    Case(
        "int input",
        lambda g: Linear(8, 8, grid=g)(torch.ones(2, 4, dtype=torch.long)),
        TypeError,
        r"dtype torch\.int64",
    ),
    Case("list input", lambda g: Linear(8, 8, grid=g)([1.0] * 4), TypeError, r"takes a torch\.Tensor, got list"),
    Case(
        "full width input",
        lambda g: Linear(8, 8, grid=g)(torch.randn(2, 8)),
        ValueError,
        r"last dim in_features/G_x = 8/2 = 4, got shape \(2, 8\); .*shard_input\(x, transpose=False\)",
    ),
    Case("scalar input", lambda g: Linear(8, 8, grid=g)(torch.tensor(1.0)), ValueError, r"got shape \(\)"),
    Case(
        "meta input",
        lambda g: Linear(8, 8, grid=g)(torch.empty(2, 4, device="meta")),
        ValueError,
        r"input on meta but its parameters are on cpu; move the input with x\.to\('cpu'\)",
    ),
    Case(
        "gather_output transpose of normal",
        lambda g: axon4d.gather_output(_normal_output(g), transpose=True, grid=g),
        ValueError,
        r"output of a normal layer \(features split over y\); call gather_output\(y, transpose=False\)",
    ),
    Case(
        "gather_output normal of transposed",
        lambda g: axon4d.gather_output(_transposed_output(g), grid=g),
        ValueError,
        r"output of a transposed layer \(features split over x\); call gather_output\(y, transpose=True\)",
    ),
    Case(
        "norm wrong width",
        lambda g: RMSNorm(32, grid=g)(torch.randn(2, 32)),
        ValueError,
        r"RMSNorm\(32\) expects .*hidden/G_x = 32/2 = 16, got shape \(2, 32\)",
    ),
    Case(
        "norm int input",
        lambda g: LayerNorm(32, grid=g)(torch.ones(2, 16, dtype=torch.long)),
        TypeError,
        r"got torch\.int64",
    ),
    Case(
        "attention 2-D",
        lambda g: Attention(32, 4, grid=g)(torch.randn(3, 16)),
        ValueError,
        r"shape \(batch, seq, hidden/G_x\), got \(3, 16\); add a batch dim",
    ),
    Case(
        "ids >= vocab",
        lambda g: Transformer(LLAMA, grid=g)(_ids_of([1, 2, 64])),
        ValueError,
        r"token ids hold 64, outside the vocabulary \[0, 64\): ids must lie in 0 … 63",
    ),
    Case(
        "ids < 0", lambda g: Transformer(LLAMA, grid=g)(_ids_of([1, -1, 3])), ValueError, r"token ids hold -1, outside"
    ),
    Case(
        "float ids",
        lambda g: Transformer(LLAMA, grid=g)(torch.zeros(1, 3)),
        TypeError,
        r"token ids must be an integer tensor \(torch\.long\), got torch\.float32; convert with ids\.long\(\)",
    ),
    Case(
        "1-D ids",
        lambda g: Transformer(LLAMA, grid=g)(torch.arange(3)),
        ValueError,
        r"\(batch, seq\), got \(3,\).*unsqueeze",
    ),
    Case(
        "ids too long",
        lambda g: Transformer(LLAMA, grid=g)(torch.zeros(1, 9, dtype=torch.long)),
        ValueError,
        r"sequence length 9 exceeds cfg\.seq_len = 8; give at most 8",
    ),
    Case(
        "targets >= vocab",
        lambda g: Transformer(LLAMA, grid=g).loss(_ids_of([1, 2, 3]), _ids_of([2, 3, 70])),
        ValueError,
        r"targets hold 70, outside the vocabulary \[0, 64\).*\(or -100, ignored\)",
    ),
    Case(
        "targets negative",
        lambda g: Transformer(LLAMA, grid=g).loss(_ids_of([1, 2, 3]), _ids_of([2, -5, 4])),
        ValueError,
        r"targets hold -5, outside the vocabulary",
    ),
    Case(
        "logits/targets shapes",
        lambda g: vocab_parallel_cross_entropy(torch.randn(2, 3, 32), torch.zeros(2, 4, dtype=torch.long), g),
        ValueError,
        r"logits \(2, 3, 32\) and targets \(2, 4\) disagree.*targets\.shape == logits\.shape\[:-1\]",
    ),
]

BATCH_CASES = [  # grid (1, 1, 2, 2): tokens split over batch = data × z = 4
    Case(
        "batch % G_batch",
        lambda g: axon4d.shard_batch(torch.zeros(3, 5), grid=g),
        ValueError,
        r"the batch \(dim 0 of the input\) = 3 is not divisible by G_data·G_z = 4",
    ),
    Case(
        "scalar batch",
        lambda g: axon4d.shard_batch(torch.tensor(1.0), grid=g),
        ValueError,
        r"needs a tensor with a batch dim",
    ),
]

MULTI_RANK = {"grid": GRID_CASES, "layer": LAYER_CASES + TENSOR_CASES, "batch": BATCH_CASES}


def _outcome(call: Callable[..., Any], *args: Any) -> tuple[type[BaseException] | None, str, float]:
    """(exception type, message, seconds) of ``call(*args)``; (None, repr of the result, seconds) if it
    returned. A grid a case built by mistake is shut down, so the next case starts clean."""
    start = time.monotonic()
    try:
        result = call(*args)
    except Exception as e:  # the catalogue records whatever was raised
        return type(e), str(e), time.monotonic() - start
    if isinstance(result, axon4d.Grid):
        axon4d.shutdown()
    return None, repr(result)[:200], time.monotonic() - start


def _run_table(*args: Any) -> dict[str, tuple[Any, str, float]]:
    """On one rank: the outcome of every case of a multi-rank table (last argument: its name)."""
    *grid, name = args
    torch.manual_seed(0)  # the same bad tensors on every rank
    return {c.id: _outcome(c.call, *grid) for c in MULTI_RANK[name]}


@pytest.fixture(scope="module")
def multi_rank(pools):
    """Every multi-rank table's outcomes, per rank: {table: [rank 0's {id: outcome}, ...]}."""
    pool = pools(WORLD)
    return {
        "grid": pool.run(None, _run_table, "grid"),
        "layer": pool.run((2, 2, 1, 1), _run_table, "layer"),
        "batch": pool.run((1, 1, 2, 2), _run_table, "batch"),
    }


def _check_every_rank(per_rank: list[dict[str, tuple[Any, str, float]]], case: Case) -> None:
    for rank, outcomes in enumerate(per_rank):
        kind, message, seconds = outcomes[case.id]
        assert kind is not None, f"rank {rank}: {case.id} was accepted (returned {message})"
        assert issubclass(kind, case.exc), f"rank {rank}: {case.id} raised {kind.__name__}: {message}"
        assert re.search(case.regex, message, re.S), (
            f"rank {rank}: {case.id}: {message!r} does not match {case.regex!r}"
        )
        assert seconds < PROMPT_S, f"rank {rank}: {case.id} took {seconds:.1f} s to raise"


@pytest.mark.parametrize("case", GRID_CASES, ids=_ids(GRID_CASES))
def test_bad_grid_is_refused_on_every_rank(case, multi_rank):
    _check_every_rank(multi_rank["grid"], case)


@pytest.mark.parametrize("case", LAYER_CASES, ids=_ids(LAYER_CASES))
def test_bad_layer_is_refused_on_every_rank(case, multi_rank):
    _check_every_rank(multi_rank["layer"], case)


@pytest.mark.parametrize("case", TENSOR_CASES, ids=_ids(TENSOR_CASES))
def test_bad_tensor_is_refused_on_every_rank(case, multi_rank):
    _check_every_rank(multi_rank["layer"], case)


@pytest.mark.parametrize("case", BATCH_CASES, ids=_ids(BATCH_CASES))
def test_bad_batch_is_refused_on_every_rank(case, multi_rank):
    _check_every_rank(multi_rank["batch"], case)


def _vocab_edges(g: Any) -> tuple[float, float]:
    """Loss of ids at both ends of the global vocabulary, whose halves live on different y ranks."""
    model = Transformer(LLAMA, grid=g)
    ids = _ids_of([0, 63, 32], [31, 1, 62])
    targets = _ids_of([63, 0, -100], [32, 31, 1])
    return float(model.loss(ids, targets)), float(model.loss(ids, torch.full_like(targets, -100)))


def test_token_check_uses_the_global_vocabulary(pools):
    """The id checks accept every id of the global vocabulary on a vocab-split grid (G_y = 2: each
    rank's shard holds 32 of the 64 rows) and the ignored target -100."""
    for loss, ignored in pools(WORLD).run((2, 2, 1, 1), _vocab_edges):
        assert math.isfinite(loss) and loss > 0 and ignored == 0.0


# -- training runs on 4 ranks: what the job refuses before its first collective --------------------

RUN = dict(model="tiny", grid="1,1,1,-1", steps=1, batch_size=4, warmup_steps=0, peak_tflops=1.0, progress=False)


def _run_case(out_dir: str, **flags: Any) -> Callable[[], Any]:
    return lambda: train(TrainConfig(**{**RUN, "out_dir": out_dir, **flags}))


def _run_cases(root: str) -> dict[str, tuple[Any, str, float]]:
    """On one rank: one real 1-step run that saves a checkpoint, then the runs the job must refuse."""
    done = os.path.join(root, "done")
    with open(os.path.join(root, "a-file"), "w") as f:  # every rank alike: only its existence matters
        f.write("not a directory")
    train(TrainConfig(**{**RUN, "out_dir": done}))
    return {c.id: _outcome(c.call(root, done)) for c in RUN_CASES}


RUN_CASES = [
    Case(
        "out-dir is a file",
        lambda root, done: _run_case(os.path.join(root, "a-file", "run")),
        ValueError,
        r"--out-dir '.*a-file/run' cannot be written by this rank.*give a directory every rank can create",
    ),
    Case(
        "another run's checkpoints",
        lambda root, done: _run_case(done),
        ValueError,
        r"holds checkpoints of another run .*step 1\); pass --resume to continue it, --overwrite",
    ),
    Case(
        "resume at --steps",
        lambda root, done: _run_case(done, resume="always"),
        ValueError,
        r"--resume from .* at step 1 with --steps 1: the run is already at its last step; give --steps above 1",
    ),
    Case(
        "resume another model",
        lambda root, done: _run_case(done, resume="always", steps=3, hidden=128),
        ValueError,
        r"configuration differs in 'hidden': saved 64, this run 128; resume with the same hidden",
    ),
    Case(
        "resume auto another model",
        lambda root, done: _run_case(done, resume="auto", steps=3, hidden=128),
        ValueError,
        r"--resume auto found another run's checkpoint, .*step_1: .*differs in 'hidden'.*or pass --overwrite",
    ),
    Case(
        "resume always without a checkpoint",
        lambda root, done: _run_case(os.path.join(root, "empty"), resume="always"),
        ValueError,
        r"--resume always: '.*empty/checkpoints' holds no complete checkpoint.*or --resume auto to start afresh",
    ),
]


@pytest.fixture(scope="module")
def run_outcomes(pools, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("runs"))
    return pools(WORLD).run(None, _run_cases, root, timeout=120)


@pytest.mark.parametrize("case", RUN_CASES, ids=_ids(RUN_CASES))
def test_bad_training_run_is_refused_on_every_rank(case, run_outcomes):
    _check_every_rank(run_outcomes, case)


def test_the_catalogue_is_complete():
    """At least 60 cases, over every kind of input the issue lists."""
    tables = [MODEL_CASES, TRAIN_FLAG_CASES, PLAN_CASES, DATA_CASES, GRID_CASES, LAYER_CASES, TENSOR_CASES]
    tables += [BATCH_CASES, RUN_CASES]
    assert sum(len(t) for t in tables) >= 60
    for t in tables:
        assert len(set(_ids(t))) == len(t), "case ids must be unique within a table"
