"""Protects the weight cast of axon4d.Linear on a grid of one rank (axon4d/nn/local_linear.py) under
mixed precision: each weight is cast to the compute dtype once per forward and the backward reuses
that copy, as torch.autocast does — counted with a dispatch mode, in every recomputation mode; the
output and input gradient are autocast's bit for bit, before and after the optimizer or a load
writes the weight; the copy is held only from the forward to the backward and never shipped by
activation offload; with matching dtypes (fp32, pure bf16) nothing is cast at all.

Start here when a change touches what a one-rank Linear keeps for backward.
"""

import gc
import weakref
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import axon4d
from axon4d.config import ModelConfig
from axon4d.memory import offload
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.nn.block import TransformerBlock
from axon4d.options.recompute_mode import RECOMPUTE_MODES
from tests.test_recompute import GPT, LLAMA, _compare_modes

BLOCK = ModelConfig(n_layers=1, hidden=32, n_heads=4, ffn_hidden=64, vocab_size=64, seq_len=8, arch="gpt")
MIXED = "bf16-fp32-reduce"


class _Casts(TorchDispatchMode):
    """Counts ``aten._to_copy`` calls whose input lies in a parameter's storage, by parameter name."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): n for n, p in module.named_parameters()}
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._to_copy and isinstance(args[0], torch.Tensor):
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _block_casts(grid, mode, dtype):
    """Per step of two (an SGD step between), the casts of each Linear parameter of a block."""
    torch.manual_seed(0)
    block = TransformerBlock(BLOCK, recompute=mode, dtype=dtype)
    linears = {f"{n}.{p}" for n in ("attn.qkv", "attn.out", "mlp.up", "mlp.down") for p in ("weight", "bias")}
    opt = torch.optim.SGD(block.parameters(), lr=1e-2)
    x = torch.randn(2, BLOCK.seq_len, BLOCK.hidden, dtype=torch.bfloat16, requires_grad=True)
    steps = []
    for _ in range(2):
        opt.zero_grad()
        with _Casts(block) as casts:
            block(x).float().sum().backward()
        opt.step()
        steps.append({n: c for n, c in casts.counts.items() if n in linears})
    return steps, sorted(linears)


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_each_weight_is_cast_once_per_forward_that_runs(pools, mode):
    # fp32 masters under bf16 compute: one cast per weight and bias per step, the backward's dX
    # reusing it; under full recomputation the re-run forward casts once more (as autocast's would)
    steps, linears = pools(1).run((1, 1, 1, 1), _block_casts, mode, torch.float32, precision=MIXED)[0]
    forwards = 2 if mode == "full" else 1
    for step in steps:
        assert step == dict.fromkeys(linears, forwards), (mode, step)


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_nothing_is_cast_where_the_dtypes_match(pools, precision, dtype):
    steps, _ = pools(1).run((1, 1, 1, 1), _block_casts, "none", dtype, precision=precision)[0]
    assert steps == [{}, {}]


def _autocast_agreement(grid):
    """Whether output and input gradient equal nn.Linear's under torch.autocast bit for bit: as
    built, after an optimizer step, after a load; and the copy held between forward and backward."""
    torch.manual_seed(0)
    ref = nn.Linear(48, 40)
    layer = axon4d.Linear.from_dense(ref)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    v = torch.randn(40)
    equal, held = [], []
    for when in ("built", "stepped", "loaded"):
        x = torch.randn(3, 8, 48)
        xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = layer(xa)
        copy = y.grad_fn.w_copy  # the bf16 (out, in) copy the backward will reuse
        held.append((when, copy.dtype, tuple(copy.shape)))
        gone = weakref.ref(copy)
        del copy
        (y.float() * v).sum().backward()
        gc.collect()
        held.append((when, "freed", gone() is None and y.grad_fn.w_copy is None))  # the graph is still alive
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yr = ref(xr)
        (yr.float() * v).sum().backward()
        equal.append((when, torch.equal(y, yr), torch.equal(xa.grad, xr.grad)))
        opt.step()  # in place: the next forward must cast the new weight
        opt.zero_grad()
        if when == "built":
            with torch.no_grad():
                ref.weight.copy_(layer.weight.view(40, 48))
                ref.bias.copy_(layer.bias)
        else:  # a checkpoint's load writes the weight in place too
            with torch.no_grad():
                ref.weight.normal_()
            layer.load_dense_(ref.weight, ref.bias)
    return equal, held


def test_output_and_input_gradient_are_autocasts_as_the_weight_changes(pools):
    equal, held = pools(1).run((1, 1, 1, 1), _autocast_agreement, precision=MIXED)[0]
    for when, output, input_grad in equal:
        assert output and input_grad, f"{when}: output {output}, input gradient {input_grad}"
    for when, *what in held:
        assert what in ([torch.bfloat16, (40, 48)], ["freed", True]), (when, what)


def _copies_alive(grid, mode):
    """How many bf16 weight-block-shaped tensors are alive after a block's forward, and after its backward."""
    torch.manual_seed(0)
    block = TransformerBlock(BLOCK, recompute=mode)
    shapes = {layer.block_shape for layer in block.linears()}

    def alive():
        gc.collect()
        return sum(
            isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and tuple(o.shape) in shapes
            for o in gc.get_objects()
        )

    y = block(torch.randn(2, BLOCK.seq_len, BLOCK.hidden, dtype=torch.bfloat16, requires_grad=True))
    forward = alive()
    y.float().sum().backward()
    return forward, alive()


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_a_copy_lives_from_forward_to_backward_and_not_under_full_recomputation(pools, mode):
    # one bf16 copy per Linear from its forward to its backward (autocast's cost); under full
    # recomputation none: the block keeps only its input, and the re-run makes the copies again
    forward, backward = pools(1).run((1, 1, 1, 1), _copies_alive, mode, precision=MIXED)[0]
    assert (forward, backward) == (0 if mode == "full" else 4, 0)


def _kept(grid):
    """The copy a forward keeps: with an input that needs a gradient, with one that does not, in fp32."""
    torch.manual_seed(0)
    layer = axon4d.Linear(16, 8)
    needs = layer(torch.randn(4, 16, requires_grad=True)).grad_fn.w_copy
    leaf = layer(torch.randn(4, 16)).grad_fn.w_copy  # only dW: the copy is not needed
    return None if needs is None else (needs.dtype, tuple(needs.shape)), leaf


def test_a_copy_is_kept_only_for_an_input_gradient(pools):
    needs, leaf = pools(1).run((1, 1, 1, 1), _kept, precision=MIXED)[0]
    assert needs == (torch.bfloat16, (8, 16)) and leaf is None
    assert pools(1).run((1, 1, 1, 1), _kept, precision="fp32")[0] == (None, None)


def _written_between(grid):
    layer = axon4d.Linear(16, 8)
    y = layer(torch.randn(4, 16, requires_grad=True))
    with torch.no_grad():
        layer.weight.add_(1.0)
    try:
        y.float().sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_a_weight_written_between_forward_and_backward_is_refused(pools):
    # the copy would be stale: autograd's check of the saved weight's version refuses the backward
    message = pools(1).run((1, 1, 1, 1), _written_between, precision=MIXED)[0]
    assert message is not None and "modified by an inplace operation" in message


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_every_recompute_mode_gives_the_gradients_of_none_in_mixed_precision(pools, cfg):
    # bf16 compute: the modes run the same GEMMs on the same copies; balanced re-makes the norms'
    # output from their statistics (another order of fp32 ops), which bf16 rounding may change
    errs = pools(1).run((1, 1, 1, 1), _compare_modes, cfg, None, precision=MIXED)[0]
    bad = {k: v for k, v in errs.items() if v > (1e-2 if k.startswith("balanced") else 0.0)}
    assert not bad, bad


def _offloaded(grid, cfg, mode):
    """Losses and gradients of two SGD steps with every block offloaded (threshold 0) and without;
    the (shape, dtype) of every tensor the offloader packed; the block weights' (out, in) shapes."""
    packed = []
    pack = offload._Group.pack

    def recording(self, t):
        packed.append((tuple(t.shape), t.dtype))
        return pack(self, t)

    results = []
    for blocks in (None, 1.0):
        torch.manual_seed(7)
        model = Transformer.from_dense(DenseTransformer(cfg), grid=grid, recompute=mode, offload=blocks)
        if model.offloader is not None:
            model.offloader.min_bytes = 0
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        losses, grads = [], []
        offload._Group.pack = recording
        try:
            for _ in range(2):
                ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen)
                opt.zero_grad()
                loss = model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:]))
                loss.backward()
                losses.append(loss.detach())
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                opt.step()
        finally:
            offload._Group.pack = pack
        results.append((losses, grads, model.offloader.stats().copies_out if model.offloader else 0))
    (ref_losses, ref_grads, _), (losses, grads, copies) = results
    same = all(torch.equal(a, b) for a, b in zip(losses, ref_losses)) and all(
        torch.equal(g[n], r[n]) for g, r in zip(grads, ref_grads) for n in r
    )
    shapes = {m.block_shape for m in model.modules() if isinstance(m, axon4d.Linear)}
    return same, copies, packed, shapes


@pytest.mark.parametrize("mode", ["none", "balanced"])
def test_offload_never_ships_a_weights_copy(pools, mode):
    same, copies, packed, shapes = pools(1).run((1, 1, 1, 1), _offloaded, LLAMA, mode, precision=MIXED)[0]
    assert same and copies > 0, (same, copies)
    shipped = [(s, d) for s, d in packed if s in shapes and d == torch.bfloat16]
    assert not shipped, f"bf16 weight-shaped tensors reached the offloader: {shipped}"
