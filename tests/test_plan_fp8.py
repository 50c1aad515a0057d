"""Protects the planner's FP8 GEMMs (issue 44 item 4, axon4d.plan.fp8): machines with FP8 tensor cores
(H100, H800: a published peak and speed-ups by size) price each layer's GEMMs both ways and run FP8
where the local block fits (multiples of 16) and FP8 with its casts is the cheaper; machines without
(Perlmutter's A100s, Frontier's MI250X) are never offered it, and asking is a clear error; ``axon4d
plan`` shows the per-layer choice."""

from __future__ import annotations

import math

import pytest

from axon4d.config import get_config
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Term
from axon4d.plan import fp8
from axon4d.plan.cli import add_arguments, main
from axon4d.plan.layers import layer_cost
from axon4d.plan.machine import load
from axon4d.plan.scenario import Scenario
from axon4d.plan.workload import Workload


# casts priced as the code makes them (axon4d.plan.fp8.cast_passes); (1, 2, 4, 2) keeps attn_out in bf16 and runs the rest FP8
def _sc(preset, shape=(1, 2, 4, 2), machine="h100"):
    return Scenario(Workload(get_config("20B"), 64, precision=preset), GridShape(*shape), load(machine))


def test_machines_with_and_without_fp8_tensor_cores():
    assert fp8.available(load("h100")) and fp8.available(load("h800"))
    assert not fp8.available(load("perlmutter")) and not fp8.available(load("frontier"))
    h100 = load("h100")
    assert h100.peak_flops[fp8.DTYPE] == 1979e12  # dense, the datasheet's (bf16: 989e12)
    # the GEMM's speed-up measured on an H200 (bench/fp8_gemm_speed.py), held beyond its smallest and largest
    assert (
        "measured, on an NVIDIA H200" in h100.sources["fp8_gemm_speedup"]
        and "not measured here" in h100.sources["peak_flops"]
    )
    small, large = fp8.speedup(h100, 1e6), fp8.speedup(h100, 1e15)
    assert (small, large) == (0.794, 1.92) and small < fp8.speedup(h100, 2 * 4096**3) < large
    for name in ("perlmutter", "frontier"):
        with pytest.raises(ValueError, match=rf"machine '{name}' has no FP8 tensor cores .* use bf16-fp8-gather"):
            _sc("bf16-fp8", machine=name)


def test_each_layer_is_priced_both_ways_and_runs_fp8_only_where_it_fits_and_is_cheaper():
    sc, base, plain = _sc("bf16-fp8"), _sc("bf16-fp8-gather"), _sc("bf16-fp32-reduce")
    choices = fp8.kind_choices(sc, sc.workload.linears())
    assert not choices["head"][0] and not math.isfinite(choices["head"][2])  # the LM head stays bf16
    assert any(c[0] for c in choices.values()) and any(not c[0] for n, c in choices.items() if n != "head")
    for spec in sc.workload.linears():
        if spec.embedding:
            continue
        run_fp8, bf16_s, fp8_s = choices[spec.name]
        assert run_fp8 == (fp8.fits(spec, sc) and fp8_s < bf16_s)
        a, b = layer_cost(spec, sc), layer_cost(spec, base)  # the GEMMs change, the collectives barely
        # ... an FP8 layer's E10 moves its e4m3 shards without per-shard scales (its z ranks share one,
        # gathered once per step: fp8.scale_gathers), and a layer kept in bf16 gathers bf16, as under
        # bf16-fp32-reduce (precision.layer_precision)
        if run_fp8:
            e10 = {Term.E10F, Term.E10B}
            assert {t: v for t, v in a.comm.items() if t not in e10} == {
                t: v for t, v in b.comm.items() if t not in e10
            }
            for t in e10 & set(a.term_bytes):
                assert a.term_bytes[t] == b.term_bytes[t] - 4 * sc.shape.z * a.term_calls[t], (spec.name, t)
        else:
            assert a.comm == layer_cost(spec, plain).comm, spec.name
        assert (a.fwd_mm + a.dx + a.dw < b.fwd_mm + b.dx + b.dw) == run_fp8
        assert (a.fwd_mm + a.dx + a.dw == b.fwd_mm + b.dx + b.dw) == (not run_fp8)
    # a grid whose split leaves a block that is not a multiple of 16 runs that layer in bf16
    odd = Scenario(Workload(get_config("tiny"), 8, precision="bf16-fp8"), GridShape(1, 8, 1, 1), load("h100"))
    assert not any(fp8.fits(s, odd) for s in odd.workload.linears() if s.name == "qkv")


def test_axon4d_plan_shows_which_layers_run_fp8(capsys):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args("--model 20B --gpus 16 --machine h100 --batch 64 --precision bf16-fp8 --top 1".split())
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "FP8 GEMMs on (" in out and "runs" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith(("qkv", "mlp_up", "head"))}
    assert lines["head"].endswith("bf16 (kept in bf16)") and lines["mlp_up"].endswith("fp8")


@pytest.mark.slow
def test_the_job_runs_the_plan_s_per_layer_choice(monkeypatch):
    """``--grid auto`` with ``--precision bf16-fp8``: the layer kinds the plan prices slower in FP8
    become ``--bf16-layers`` (axon4d.train.planned), and the model runs them in bf16."""
    import dataclasses

    from axon4d.plan.job import plan_job
    from axon4d.train import planned
    from axon4d.train.config import TrainConfig

    cfg = TrainConfig(model="20B", grid="auto", precision="bf16-fp8", machine="h100", batch_size=64, steps=1)
    job = plan_job(dataclasses.replace(planned.request(cfg, True), world=16))
    best = job.best
    run = planned.apply(cfg, job)
    o = best.options  # the plan's step, one micro-batch of it as the step is priced
    wl = Workload(cfg.model_config(), 64, precision="bf16-fp8", context_parallel=best.context_parallel)
    sc = Scenario(
        wl, best.shape, load("h100"), best.overlap, best.recompute, o["micro_batches"], o["zero"], o["offload"]
    )
    priced = fp8.kind_choices(sc.micro(), sc.workload.linears())
    want = [n for n in ("qkv", "attn_out", "mlp_up", "mlp_down") if not priced[n][0]]
    assert run.bf16_layers == ",".join(want)
    assert any(priced[n][0] for n in ("qkv", "mlp_up", "mlp_down")), "nothing runs FP8: the test proves little"
    given = planned.apply(dataclasses.replace(cfg, bf16_layers="qkv"), job)
    assert given.bf16_layers == "qkv"  # the user's choice stands
    for bad, message in [
        (dict(bf16_layers="attn"), "name layer kinds of qkv, attn_out, mlp_up, mlp_down"),
        (dict(precision="bf16-fp32-reduce", bf16_layers="qkv"), "with --precision bf16-fp8"),
    ]:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(cfg, **bad).check()


def test_a_layer_kind_runs_fp8_in_the_dense_and_the_moe_blocks_alike():
    """The runtime makes one FP8 choice per layer kind (``--bf16-layers``; ``keep_in_bf16`` sets every
    block's): in a model with dense blocks first, the dense blocks' MLP and the MoE blocks' shared
    experts are the kinds mlp_up and mlp_down together. DeepSeek-V3 on (2,2,8,8): the dense blocks'
    MLP down (9216 × 3584 per rank) is cheaper in FP8, the shared experts' (1024 × 3584) in bf16 —
    the kind runs FP8 over its 61 runs, and each block kind's step, the step's scale gathers and the
    job's ``--bf16-layers`` take that one choice."""
    from axon4d.plan.blocks import layer_kind
    from axon4d.plan.sent import step_collectives_by_phase

    wl = Workload(get_config("deepseek-v3-scale"), 256, precision="bf16-fp8")
    sc = Scenario(wl, GridShape(2, 2, 8, 8), load("h100"), recompute="full", zero=2)
    specs = {s.name: s for s in wl.linears()}
    dense, shared = fp8.layer_choice(specs["dense_mlp_down"], sc), fp8.layer_choice(specs["mlp_down"], sc)
    assert dense[0] and not shared[0]  # alone they would differ
    kinds = fp8.kind_choices(sc)
    together = 3 * dense[2] + 58 * shared[2] < 3 * dense[1] + 58 * shared[1]
    assert kinds["mlp_down"][0] == together
    for kind, _ in sc.kinds():  # each block kind's step runs the kind's choice
        for spec in kind.workload.linears():
            if not spec.embedding:
                assert fp8.layer_choice(spec, kind)[0] == kinds[layer_kind(spec.name)][0], (kind.model.moe, spec.name)
    calls, _ = step_collectives_by_phase(sc)  # one scale gather per run of every FP8 layer, of every kind
    fp8_runs = sum(s.count for s in wl.linears() if not s.embedding and kinds[layer_kind(s.name)][0])
    assert calls[("z", Term.FP8_SCALE, "forward")] == fp8_runs
    chosen = fp8.kind_choices(sc, [s for s in wl.linears() if layer_kind(s.name) in ("mlp_up", "mlp_down")])
    assert set(chosen) == {"mlp_up", "mlp_down"} and chosen["mlp_down"][0] == together


def _fp8_per_layer(grid):
    from axon4d.config import ModelConfig
    from axon4d.train.loop import build_model

    cfg = ModelConfig(n_layers=2, hidden=64, n_heads=4, ffn_hidden=128, vocab_size=64, seq_len=16, arch="llama")
    model = build_model(cfg, grid, bf16="attn_out,mlp_down")
    return [[layer.fp8_gemms for layer in block.linears()] for block in model.blocks]


def test_keep_in_bf16_runs_the_named_kinds_in_bf16(pools):
    for blocks in pools(1).run((1, 1, 1, 1), _fp8_per_layer, precision="bf16-fp8"):
        assert blocks == [[True, False, True, False]] * 2, blocks
