"""Protects ``axon4d.auto_parallelize`` and ``axon4d.to_dense`` (the package axon4d/parallelize/).

Hugging Face models built from tiny configs with random weights (no downloads) — Llama with
grouped-query attention and GPT-2 with its packed Conv1D attention — are parallelized on grids of
2, 4 and 8 ranks (data > 1 and z > 1 included) and must equal the unparallelized model: logits,
loss, and the gradient of every parameter (gathered back with ``to_dense``), in each style
(sharded residual stream, chained blocks, general). Also checked: the warning that lists layers left as they are, layers
that cannot split staying correct, gradient accumulation and an optimizer step, clear errors.

Loss convention: each rank's loss is the mean over its local batch (``shard_batch``); the
reference is the mean over the full batch, and every ``.grad`` must equal the reference's.
"""

import copy
import warnings

import pytest
import torch
from hf_models import llama_config
from torch import nn

import axon4d
from axon4d import checkpoint
from axon4d.parallelize import auto_parallelize, to_dense
from axon4d.parallelize.layers import ShardedLinear

TOL = 2e-5  # fp32: max abs error relative to the reference tensor's scale
VOCAB, BATCH, SEQ = 128, 8, 8


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _llama(attn: str = "eager", tied: bool = False):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(VOCAB, tied=tied, attn=attn))


def _gpt2(attn: str = "eager"):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    cfg._attn_implementation = attn
    return GPT2LMHeadModel(cfg)


def _qwen2(attn: str = "eager"):
    """A family with no style (q/k/v biases, GQA): the default style falls back to the general path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = attn
    return Qwen2ForCausalLM(cfg)


class _Toy(nn.Module):
    """A model no family style knows: an odd-sized head that cannot split, and a tied pair."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.up = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.down = nn.Linear(64, 32, bias=False)
        self.odd = nn.Linear(32, 3)
        self.out = nn.Linear(32, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, input_ids, labels=None):
        h = self.emb(input_ids)
        h = h + self.down(torch.relu(self.norm(self.up(h))))
        logits = self.out(h) * (1 + self.odd(h).tanh().mean(-1, keepdim=True))  # odd matters
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return type("Out", (), {"logits": logits, "loss": loss})()


BUILDERS = {
    "llama": _llama,
    "gpt2": _gpt2,
    "qwen2": _qwen2,
    "toy": _Toy,
    "llama_tied": lambda attn: _llama(attn, tied=True),
}


def _compare(grid, family, attn, style, steps=1):
    """Run reference and parallel model on the same batch; return {what: relative error}, warnings."""
    torch.manual_seed(0)
    model = BUILDERS[family](attn) if family != "toy" else _Toy()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        par = auto_parallelize(model, style=style)
    local = axon4d.shard_batch(ids)
    for _ in range(steps):  # steps > 1: gradients accumulate over backward calls
        out = par(input_ids=local, labels=local)
        out.loss.backward()
        rout = ref(input_ids=ids, labels=ids)
        rout.loss.backward()
    errs = {"logits": rel_err(axon4d.gather_batch(out.logits), rout.logits)}
    losses = axon4d.gather_batch(out.loss.detach().reshape(1))
    errs["loss"] = rel_err(losses.mean(), rout.loss)
    dense = to_dense(par, grads=True)
    got = dict(dense.named_parameters())
    for name, p in ref.named_parameters():
        errs[f"{name}"] = rel_err(got[name], p)
        errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
    assert set(got) == set(dict(ref.named_parameters())), "to_dense must give the original parameter names"
    with torch.no_grad():  # the copy is a working unparallelized model (hooks gone, attributes restored)
        errs["dense_copy_logits"] = rel_err(dense(input_ids=ids, labels=ids).logits, rout.logits)
    assert not any(isinstance(m, ShardedLinear) for m in dense.modules())
    assert all(not m._forward_pre_hooks for m in dense.modules())
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return errs, messages, type(dense).__name__, type(model).__name__


def _assert_close(results, what):
    for rank, (errs, *_rest) in enumerate(results):
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, f"{what} rank {rank}: {worst} error {errs[worst]:.2e} > {TOL:.0e}"


GRIDS = [
    (2, 1, 1, 1),
    (1, 2, 1, 1),
    (1, 1, 2, 1),
    (1, 1, 1, 2),
    (2, 2, 1, 1),
    (1, 2, 2, 1),
    (2, 1, 1, 2),
    (2, 2, 2, 1),
    (1, 2, 2, 2),
    (2, 2, 1, 2),
]


def _world(grid):
    return grid[0] * grid[1] * grid[2] * grid[3]


@pytest.mark.parametrize("grid", [*GRIDS[:2], *(pytest.param(g, marks=pytest.mark.slow) for g in GRIDS[2:])])
@pytest.mark.parametrize(
    "family,attn,style",
    [
        ("llama", "eager", "sharded"),
        ("llama", "sdpa", "chained"),
        ("gpt2", "sdpa", "sharded"),
        ("gpt2", "eager", "chained"),
    ],
)
def test_family_styles_match_the_unparallelized_model(pools, family, attn, style, grid):
    results = pools(_world(grid)).run(grid, _compare, family, attn, style)
    _assert_close(results, f"{family} {style} {grid}")
    for _errs, _msgs, dense_cls, par_cls in results:
        assert dense_cls == par_cls


@pytest.mark.parametrize("grid", [(2, 1, 1, 1), (2, 2, 1, 1), pytest.param((2, 2, 1, 2), marks=pytest.mark.slow)])
def test_tied_llama_keeps_its_embedding_whole_and_matches(pools, grid):
    # tie_word_embeddings: the embedding's output is sliced over x and lm_head gathers its input
    results = pools(_world(grid)).run(grid, _compare, "llama_tied", "eager", "sharded")
    _assert_close(results, f"tied llama {grid}")
    assert "lm_head (Linear: weight shared with model.embed_tokens (tied))" in results[0][1][0]


@pytest.mark.parametrize(
    "grid",
    [
        (2, 1, 1, 1),
        pytest.param((1, 4, 1, 1), marks=pytest.mark.slow),
        pytest.param((2, 2, 2, 1), marks=pytest.mark.slow),
        pytest.param((1, 2, 1, 4), marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "family,attn,style", [("llama", "sdpa", "general"), ("gpt2", "eager", "general"), ("qwen2", "sdpa", "sharded")]
)
def test_general_style_matches_the_unparallelized_model(pools, family, attn, style, grid):
    # (1, 4, 1, 1) splits features over y = 4 although the 2 KV heads could not be; Qwen2 has no
    # family style, so even the default style runs it on the general path
    _assert_close(pools(_world(grid)).run(grid, _compare, family, attn, style), f"{family} {grid}")


def _toy(grid):
    errs, messages, *_ = _compare(grid, "toy", None, "chained", steps=2)
    return errs, messages


@pytest.mark.parametrize("grid", [(1, 2, 1, 2), pytest.param((2, 2, 2, 1), marks=pytest.mark.slow)])
def test_layers_that_cannot_split_are_left_whole_listed_and_still_exact(pools, grid):
    # a model no family style knows, with gradient accumulation over two backward calls: `odd` (3 outputs)
    # cannot split over G_y = 2, `out` is tied to the embedding; both stay whole and correct
    results = pools(_world(grid)).run(grid, _toy)
    _assert_close([(e,) for e, _ in results], f"toy {grid}")
    for _errs, messages in results:
        assert len(messages) == 1, messages
        msg = messages[0]
        assert "left 3 layer(s) as they are" in msg
        assert "emb (Embedding" in msg
        assert "odd (Linear: (3, 32) does not split over G_y = 2" in msg
        assert "out (Linear: weight shared with emb (tied))" in msg


def _sgd_steps(grid, family):
    """Two SGD steps on the parallel and the reference model; the third forward must agree."""
    torch.manual_seed(0)
    model = BUILDERS[family]("eager")
    ref = copy.deepcopy(model)
    par = auto_parallelize(model)
    opt, ref_opt = torch.optim.SGD(par.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(3)
    errs = {}
    for step in range(3):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        local = axon4d.shard_batch(ids)
        out, rout = par(input_ids=local, labels=local), ref(input_ids=ids, labels=ids)
        errs[f"logits{step}"] = rel_err(axon4d.gather_batch(out.logits), rout.logits)
        for o, m, _ref in ((opt, out, ref_opt), (ref_opt, rout, None)):
            o.zero_grad()
            m.loss.backward()
            o.step()
    return errs


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.slow
def test_optimizer_steps_need_no_extra_call(pools, family):
    grid = (2, 1, 2, 2)
    _assert_close([(r,) for r in pools(8).run(grid, _sgd_steps, family)], f"{family} sgd {grid}")


def _lead_model_to_dense(grid):
    """axon4d's own models implement to_dense; axon4d.to_dense must hand over to it, also when nested."""
    from axon4d.models import get_config
    from axon4d.models.transformer import llama

    torch.manual_seed(0)
    model = llama(get_config("tiny", n_kv_heads=2))
    direct, nested = to_dense(model), to_dense(nn.ModuleList([model]))[0]
    ref = model.to_dense()
    return max(rel_err(a, b) for x in (direct, nested) for a, b in zip(x.parameters(), ref.parameters()))


def test_to_dense_hands_over_to_the_library_models_own_to_dense(pools):
    assert max(pools(4).run((2, 2, 1, 1), _lead_model_to_dense)) == 0.0


def _value_error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def _errors(grid):
    msgs = {
        "kv_heads": _value_error(lambda: auto_parallelize(_llama())),
        "style": _value_error(lambda: auto_parallelize(_llama(), style="fast")),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        general = auto_parallelize(_llama(), style="general")  # the general path still splits every layer
    msgs["general_layers"] = sum(isinstance(m, ShardedLinear) for m in general.modules())
    return msgs


def test_heads_that_do_not_divide_raise_a_clear_error_on_every_rank(pools):
    for msgs in pools(4).run((1, 4, 1, 1), _errors):
        assert "the model: num_key_value_heads = 2 is not divisible by G_y = 4" in msgs["kv_heads"]
        assert "style='general'" in msgs["kv_heads"] and "(4, 1, 1, 1)" in msgs["kv_heads"]
        assert "style 'fast' is not known" in msgs["style"]
        assert msgs["general_layers"] == 2 * 7 + 1


def _gathers(grid, family, style):
    """Feature all-gathers one forward and backward issue, by tag."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        par = auto_parallelize(BUILDERS[family]("eager"), style=style)
    ids = axon4d.shard_batch(torch.randint(0, VOCAB, (BATCH, SEQ)))
    grid.comm.log.clear()
    par(input_ids=ids, labels=ids).loss.backward()
    counts, elements = {}, {}
    for r in grid.comm.log.records:
        if r.tag.startswith(("gather_replicated.", "split_replicated.")):
            counts[r.tag] = counts.get(r.tag, 0) + 1
            elements[r.tag] = elements.get(r.tag, 0) + r.payload_bytes // 4  # fp32
    return counts, elements


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.slow
def test_chained_blocks_gather_once_per_block_and_sharded_ones_never(pools, family):
    per_layer = {"llama": 7, "gpt2": 4}[family]  # linear layers in one transformer block
    (general, general_el), (chained, chained_el), (sharded, _) = (
        pools(4).run((2, 2, 1, 1), _gathers, family, lay)[0] for lay in ("general", "chained", "sharded")
    )
    head = 1 if family == "llama" else 0  # Llama's lm_head is split; GPT-2's is tied to wte, whole
    # general: every layer gathers its output (forward) and its input gradient (backward)
    assert general["gather_replicated.y"] == 2 * per_layer + head
    assert general["split_replicated.grad.x"] == 2 * per_layer + head
    # chained: attention and MLP gather once each, over x, forward and backward; the head over y
    assert chained["gather_replicated.x"] == 2 * 2
    assert chained["split_replicated.grad.x"] == 2 * 2 + head
    assert chained.get("gather_replicated.y", 0) == head
    if family == "llama":  # the payloads of docs/parallelize.md's cost table, in elements
        b, h, kv_d, f, v, layers = BATCH * SEQ, 64, 2 * 16, 128, VOCAB, 2  # b: tokens per rank (G_batch = 1)
        assert general_el["gather_replicated.y"] == layers * b * (3 * h + 2 * kv_d + 2 * f) + b * v
        assert general_el["split_replicated.grad.x"] == layers * b * (6 * h + f) + b * h
        assert chained_el["gather_replicated.x"] == layers * 2 * b * h
        assert chained_el["split_replicated.grad.x"] == layers * 2 * b * h + b * h
    # sharded: the residual stream stays split over x between blocks; Llama gathers only the logits
    # (over y); GPT-2's tied head gathers its input over x, and the backward of its two whole
    # embeddings (tokens, positions) gathers their output gradient over x
    expected = {"llama": {"gather_replicated.y": 1}, "gpt2": {"gather_replicated.x": 1, "split_replicated.grad.x": 2}}[
        family
    ]
    assert sharded == expected


def _hf_recompute(grid, family):
    """Every recompute mode's loss and gradients against "none", on the parallel HF model."""
    torch.manual_seed(0)
    base = BUILDERS[family]("sdpa")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    local = axon4d.shard_batch(ids)
    results = {}
    for mode in ("none", "selective", "balanced", "full"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            par = auto_parallelize(copy.deepcopy(base), recompute=mode)
        par.train()
        out = par(input_ids=local, labels=local)
        out.loss.backward()
        results[mode] = (
            out.loss.detach(),
            {n: p.grad.clone() for n, p in par.named_parameters() if p.grad is not None},
        )
        if mode != "none":  # the unparallelized copy is the plain model again
            dense = to_dense(par)
            assert not any(getattr(m, "gradient_checkpointing", False) for m in dense.modules())
            assert not any("Recomputed" in type(m).__name__ for m in dense.modules())
    loss0, grads0 = results["none"]
    errs = {}
    for mode, (loss, grads) in results.items():
        errs[f"{mode}.loss"] = float((loss - loss0).abs() / loss0.abs())
        errs[f"{mode}.grads"] = max(
            float((grads[n].double() - g.double()).norm() / g.double().norm().clamp_min(1e-30))
            for n, g in grads0.items()
        )
    return errs


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("grid", [(1, 2, 2, 1), pytest.param((2, 2, 1, 1), marks=pytest.mark.slow)])
def test_recompute_modes_match_none_on_hugging_face_models(pools, family, grid):
    for rank, errs in enumerate(pools(4).run(grid, _hf_recompute, family)):
        bad = {k: v for k, v in errs.items() if v > 1e-6}
        assert not bad, f"rank {rank}, {family} on {grid}: {bad}"


def _save_gpt2(grid, path):
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = _gpt2()
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    auto_parallelize(model)
    checkpoint.save(path, model, grid, overwrite=True)
    return dense


def _load_gpt2(grid, path):
    warnings.simplefilter("ignore")
    torch.manual_seed(1)  # other weights: everything must come from the file
    model = _gpt2()
    auto_parallelize(model)
    checkpoint.load(path, model, grid, check_model=False)
    return to_dense(model).state_dict()


def test_a_parallelized_gpt2_checkpoint_loads_on_another_grid(pools, tmp_path):
    """GPT-2's c_attn fuses q|k|v in one tensor and is permuted so that each y-rank holds its heads'
    q, k and v: saved as that permuted order, a checkpoint of one G_y would scramble q|k|v on a grid of
    another. Its rows are saved as q, k and v of their own, so a save on (1,2,1,1) loads on (1,1,1,2)."""
    path = str(tmp_path / "ckpt")
    saved = pools(2).run((1, 2, 1, 1), _save_gpt2, path)[0]
    for loaded in pools(2).run((1, 1, 1, 2), _load_gpt2, path):
        for name, tensor in saved.items():
            assert torch.equal(loaded[name], tensor), name
