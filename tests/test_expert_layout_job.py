"""Protects the expert layout's flags and arguments (issue 51, item 2): ``axon4d plan
--expert-layout`` pins the layout the search prices (or searches them, ``auto``) and refuses a bad
one and a dense model's before anything is priced; ``axon4d train --expert-layout`` is refused, the
same on every rank before any collective, when it is not a layout, names a dense model, or does not
fit the grid, and otherwise trains on the loss curve of the default layout; under ``--grid auto``
the run builds the layout the planner priced with its grid, and ``--try`` builds each tried plan
with its own; ``auto_parallelize(expert_layout=...)`` places a Hugging Face Mixtral's experts so,
equal to transformers' model, and loads its checkpoint by the layout's slices. Start here when a
flag or a job step forgets the layout."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import time

import pytest
import torch
from hf_models import mixtral_config, save_moe

from axon4d.grid.expert_layout import ExpertLayout
from axon4d.plan import cli
from axon4d.plan.job import plan_job
from axon4d.train import TrainConfig, planned, train, trial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: a machine file measured on a CPU host: the planner's choice there is a host's
HOST_MACHINE = os.path.join(ROOT, "bench", "results", "planner_machine_local.json")
WHOLE = str(ExpertLayout.parse("ep=world,tp=1"))
#: a short tiny-moe job (2 MoE layers of 8 experts, top-2, one shared expert)
JOB = dict(model="tiny-moe", steps=3, batch_size=4, warmup_steps=0, peak_tflops=1.0, progress=False, comm="torch")


def _plan(*argv: str) -> tuple[int, str, dict]:
    """``axon4d plan`` for tiny-moe on 8 host ranks with ``argv``: its exit code, what it printed
    and its --json."""
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    base = [
        "--model",
        "tiny-moe",
        "--gpus",
        "8",
        "--batch",
        "8",
        "--machine",
        HOST_MACHINE,
        "--top",
        "50",
        "--dtype",
        "float32",
    ]
    args = p.parse_args([*base, *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(args)
    args.json = "-"
    with contextlib.redirect_stdout(io.StringIO()) as js:
        cli.main(args)
    return code, out.getvalue(), json.loads(js.getvalue())


def test_the_plan_command_pins_a_layout_or_searches_them():
    code, out, js = _plan("--expert-layout", "ep=world,tp=1")
    assert code == 0
    layouts = {c["expert_layout"] for c in js["candidates"]}
    assert layouts == {WHOLE}, layouts  # every grid priced in the pinned layout
    best = next(line for line in out.splitlines() if line.startswith("best: "))
    assert f"experts {WHOLE}" in best and f"expert layout {WHOLE}" in out
    assert f"fp8_gather searched, expert layout {WHOLE}" in out.splitlines()[0]
    code, out, js = _plan()  # auto: every layout each grid admits
    assert code == 0 and len({c["expert_layout"] for c in js["candidates"]}) > 1
    assert "expert layout searched" in out.splitlines()[0]


def test_the_plan_command_pins_fp8_dispatch_and_refuses_it_beside_a_pinned_layout():
    code, out, _ = _plan("--fp8-dispatch", "off")
    assert code == 0 and "expert layout searched (FP8 dispatch off)" in out.splitlines()[0]
    with pytest.raises(ValueError, match="ep=world,tp=1: a pinned layout says how its rows travel"):
        _plan("--expert-layout", "ep=world,tp=1", "--fp8-dispatch", "on")


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--expert-layout", "ep=q"), r"--expert-layout 'ep=q': expert layout ep='q': give distinct axes of .*auto"),
        (("--expert-layout", "ep=x,tp=x"), r"axis x cannot both hold different experts and split each expert"),
        (
            ("--expert-layout", "ep=world,tp=1", "--gpus", "16"),
            r"--expert-layout ep=world,tp=1: no grid of 16 ranks places tiny-moe's experts so \(n_experts = 8 is "
            r"not divisible by .*layouts some grid admits: ep=1,tp=1",
        ),
        (
            ("--model", "tiny", "--expert-layout", "ep=world,tp=1"),
            r"--expert-layout 'ep=world,tp=1' with --model tiny: a dense model has no experts to place; drop "
            r"--expert-layout, or plan an MoE model \(tiny-moe",
        ),
    ],
    ids=["not-a-layout", "axis-twice", "fits-no-grid", "dense-model"],
)
def test_the_plan_command_refuses_a_bad_layout_before_pricing_anything(monkeypatch, argv, message):
    def priced(*args, **kwargs):
        raise AssertionError("the search ran")

    monkeypatch.setattr(cli, "plan", priced)
    with pytest.raises(ValueError, match=message):
        _plan(*argv)


def test_the_training_config_refuses_a_bad_layout_and_a_dense_model_s():
    assert TrainConfig(model="tiny-moe", expert_layout="ep=world,tp=1").expert_layout == "ep=world,tp=1"
    with pytest.raises(ValueError, match=r"--expert-layout 'ep=world,tp=q': expert layout tp='q': give distinct"):
        TrainConfig(model="tiny-moe", expert_layout="ep=world,tp=q")
    with pytest.raises(ValueError, match=r"--expert-layout 'ep=data' with --model tiny: that model has no experts"):
        TrainConfig(model="tiny", expert_layout="ep=data")
    with pytest.raises(ValueError, match=r"with --model tiny-moe --moe n_experts=0: that model has no experts"):
        TrainConfig(model="tiny-moe", moe="n_experts=0", expert_layout="ep=data")


def _refusals(root: str) -> dict[str, tuple[str, str, float]]:
    """On one rank: the runs the job refuses, each (exception type, message, seconds to refuse)."""
    import axon4d

    cases = {
        "not a layout": dict(expert_layout="tp=z"),
        "dense model": dict(model="tiny", expert_layout="ep=data"),
        "does not fit": dict(moe="n_experts=6", expert_layout="ep=data,tp=1"),
    }
    out = {}
    for name, flags in cases.items():
        start = time.perf_counter()
        try:
            train(TrainConfig(**{**JOB, "grid": "1,1,1,4", "out_dir": os.path.join(root, name), **flags}))
            out[name] = ("", "", 0.0)
        except ValueError as e:
            out[name] = (type(e).__name__, str(e), time.perf_counter() - start)
        with pytest.raises(RuntimeError):  # no grid was built
            axon4d.get_grid()
    return out


def test_the_job_refuses_a_bad_layout_on_every_rank_before_any_collective(pools, tmp_path):
    per_rank = pools(4).run(None, _refusals, str(tmp_path), timeout=120)
    got = {name: msg for name, (_, msg, _) in per_rank[0].items()}
    for rank in per_rank:  # the same refusal on every rank
        assert {name: (kind, msg) for name, (kind, msg, _) in rank.items()} == {
            n: ("ValueError", m) for n, m in got.items()
        }
    assert "experts split only over x (hidden) and y (FFN width)" in got["not a layout"]
    assert got["dense model"].startswith("--expert-layout 'ep=data' with --model tiny: that model has no experts")
    assert (
        got["does not fit"].startswith(
            "--expert-layout ep=data,tp=1 on grid (1, 1, 1, 4) (x, y, z, data): n_experts = 6 is not divisible by G_data"
        )
        and "expert layouts that fit this grid: ep=1,tp=1" in got["does not fit"]
    )
    assert all(seconds < 30 for rank in per_rank for _, _, seconds in rank.values())  # nobody waited for another


def _moe_layouts(model) -> list[str]:
    from axon4d.nn.moe import MoE

    return [str(m.layout) for m in model.modules() if isinstance(m, MoE)]


def _spied_train(cfg: TrainConfig) -> tuple[dict, list[str]]:
    """``train(cfg)`` (what it printed in the summary's ``printed``), and the expert layout of every
    MoE layer of the model it built."""
    from axon4d.train import loop

    build, seen = loop._model, []

    def spy(*args):
        model = build(*args)
        seen.extend(_moe_layouts(model))
        return model

    loop._model = spy
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            summary = train(cfg)
    finally:
        loop._model = build
    return {**summary, "printed": out.getvalue()}, seen


def _two_layouts(root: str) -> list[tuple[dict, list[str]]]:
    base = {**JOB, "grid": "2,1,1,2"}  # default: experts over data, each split over x; pinned: whole over x·data
    return [
        _spied_train(TrainConfig(**{**base, "out_dir": os.path.join(root, "default")})),
        _spied_train(TrainConfig(**{**base, "out_dir": os.path.join(root, "whole"), "expert_layout": "ep=world,tp=1"})),
    ]


def test_a_pinned_layout_trains_on_the_default_layout_s_loss_curve(pools, tmp_path):
    results = pools(4).run(None, _two_layouts, str(tmp_path))
    assert results[0][1][0]["printed"]  # rank 0 printed its banner and summary
    for (default, default_layers), (whole, whole_layers) in results:
        assert default_layers == [str(ExpertLayout())] * 2 and whole_layers == [WHOLE] * 2
        assert (default["expert_layout"], whole["expert_layout"]) == (str(ExpertLayout()), WHOLE)
        assert len(whole["losses"]) == 3
        if whole["printed"]:  # rank 0's banner and summary table say which layout ran
            assert f"expert layout {WHOLE}: 8 experts over world (4 ranks), 2 per rank, each whole" in whole["printed"]
            assert any(line.split() == ["expert", "layout", WHOLE] for line in whole["printed"].splitlines())
        for a, b in zip(whole["losses"], default["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (whole["losses"], default["losses"])


def _auto_run(cfg_dict: dict) -> tuple[list[str], str]:
    """A --grid auto run: the layouts of the MoE layers it built, and its grid."""
    summary, layers = _spied_train(TrainConfig(**cfg_dict))
    return layers, summary["grid"]


def test_grid_auto_builds_the_layout_the_planner_priced(pools, tmp_path):
    cfg = {**JOB, "grid": "auto", "machine": HOST_MACHINE, "steps": 1, "out_dir": str(tmp_path / "auto")}
    asked = dataclasses.replace(planned.request(TrainConfig(**cfg), False), world=4, rank=1)  # as every rank asks
    best = plan_job(asked).best
    assert best.expert_layout and best.expert_layout != str(ExpertLayout())  # the host's choice: not the default
    for layers, grid in pools(4).run(None, _auto_run, cfg, timeout=120):
        assert grid == str(best.shape) and layers == [best.expert_layout] * 2


def test_a_pinned_layout_is_the_planner_s_and_try_builds_each_plan_with_its_own(monkeypatch):
    """The request carries the pinned layout (else AUTO: searched), ``apply`` sets the candidate's,
    and each trial's ``axon4d.init`` gets its own plan's layout (``trials.run`` stands in)."""
    from axon4d import trials
    from axon4d.plan.options import AUTO_OPTION

    cfg = TrainConfig(**{**JOB, "grid": "auto", "machine": HOST_MACHINE, "try_plans": 3})
    assert planned.request(cfg, False).expert_layout == AUTO_OPTION
    assert planned.request(dataclasses.replace(cfg, pin="expert_layout"), False).expert_layout == str(ExpertLayout())
    pinned = dataclasses.replace(cfg, expert_layout="ep=world,tp=1")
    request = dataclasses.replace(planned.request(pinned, False, 3), world=4, rank=1)
    assert request.expert_layout == "ep=world,tp=1"
    assert {c.expert_layout for c in plan_job(request).fitting} == {WHOLE}
    job = plan_job(dataclasses.replace(planned.request(cfg, False, 3), world=4, rank=1))
    assert len({c.expert_layout for c in job.fitting}) > 1  # the plans tried differ in layout
    for c in job.fitting:
        assert planned.apply(cfg, job, c).expert_layout == c.expert_layout
    inits = []

    def run(plans, build, *, init, **kwargs):
        inits.extend((c.expert_layout, init(c)["expert_layout"]) for c in plans)
        return []

    monkeypatch.setattr(trials, "run", run)
    trial._try_all(cfg, job, job.fitting, lambda c: "fp32", None, None)
    assert inits and all(want == got for want, got in inits)


# -- auto_parallelize: a Hugging Face Mixtral under a layout of its own -----------------------------

VOCAB, BATCH, SEQ = 128, 8, 8


def rel_err(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _mixtral_under(grid, layout: str):
    """On one rank of ``grid`` (its own layout the default): a tiny Mixtral parallelized with its
    experts in ``layout`` against transformers' (``test_hf_moe._compare``: logits, loss, every
    parameter and gradient), and the refusal of a layout the grid cannot place."""
    from test_hf_moe import _compare
    from transformers import MixtralForCausalLM

    from axon4d.parallelize import auto_parallelize
    from axon4d.parallelize.moe import HFMoEBlock

    built: list = []
    errs = _compare(grid, "mixtral", layout, built)
    try:  # 3 experts cannot be split over data = 2
        auto_parallelize(MixtralForCausalLM(mixtral_config(VOCAB, experts=3)), expert_layout="ep=data,tp=1")
        refused = ""
    except ValueError as e:
        refused = str(e)
    return errs, [str(b.moe.layout) for b in built[0].modules() if isinstance(b, HFMoEBlock)], refused


#: the grid's own layout: experts over data, each split over x; the one given: whole experts over x·data
MIXTRAL_GRID = (2, 1, 1, 2)


def test_auto_parallelize_places_a_mixtral_s_experts_in_the_layout_given(pools):
    for rank, (errs, layouts, refused) in enumerate(pools(4).run(MIXTRAL_GRID, _mixtral_under, "ep=world,tp=1")):
        worst = max(errs, key=errs.get)
        assert errs[worst] <= 1e-5, f"rank {rank}: {worst} error {errs[worst]:.2e}"
        assert layouts == [WHOLE] * 2
        assert refused.startswith("MixtralForCausalLM under expert layout ep=data,tp=1: n_experts = 3 is not")
        assert "expert layouts that fit this grid: ep=1,tp=1" in refused


def _loaded_under(grid, layout: str, directory: str):
    """A tiny Mixtral built on the meta device, parallelized with its experts in ``layout`` and
    loaded by slices from ``directory``: its logits and this rank's expert blocks' shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import axon4d
    from axon4d.parallelize import auto_parallelize, load_pretrained_
    from axon4d.parallelize.moe import HFMoEBlock

    config = AutoConfig.from_pretrained(directory)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = auto_parallelize(empty, expert_layout=layout)
    load_pretrained_(model, directory)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = axon4d.gather_batch(model(input_ids=axon4d.shard_batch(ids)).logits)
    return logits, [tuple(b.moe.experts.up.shape) for b in model.modules() if isinstance(b, HFMoEBlock)]


@pytest.mark.slow
def test_loading_a_mixtral_by_slices_follows_the_layout(pools, tmp_path):
    from transformers import AutoModelForCausalLM

    directory = save_moe(str(tmp_path / "mixtral"), "mixtral", VOCAB)
    saved = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = saved(input_ids=ids).logits
    for logits, shapes in pools(4).run(MIXTRAL_GRID, _loaded_under, "ep=world,tp=1", directory):
        assert rel_err(logits, want) <= 1e-5
        assert shapes == [(1, 2 * 32, 64)] * 2  # 1 whole expert of the 4 per rank: [gate | up] of FFN 32, hidden 64


def _tried_run(cfg_dict: dict) -> tuple[list[str], list[dict]]:
    """A --try run: the layout of every MoE model it built (each trial's, then the run's), and its rows."""
    summary, layers = _spied_train(TrainConfig(**cfg_dict))
    return layers, summary["trials"]


@pytest.mark.slow
def test_try_builds_each_plan_in_its_own_layout_and_trains_the_chosen_one_s(pools, tmp_path):
    cfg = {**JOB, "grid": "auto", "machine": HOST_MACHINE, "steps": 1, "try_plans": 2, "try_steps": 1, "try_rounds": 1}
    cfg["out_dir"] = str(tmp_path / "try")
    asked = dataclasses.replace(planned.request(TrainConfig(**cfg), False, 2), world=4, rank=1)
    fitting = plan_job(asked).fitting
    for layers, rows in pools(4).run(None, _tried_run, cfg, timeout=300):
        chosen = next(i for i, r in enumerate(rows) if r["chosen"])
        want = [c.expert_layout for c in fitting] + [fitting[chosen].expert_layout]
        assert layers == [layout for layout in want for _ in range(2)]  # two MoE layers per model


def _init_auto_layouts(plan_args: dict) -> tuple[tuple[int, ...], list[str]]:
    """``axon4d.init(grid="auto", plan=...)`` then an MoE model built on it: its grid and layers' layouts."""
    import axon4d
    from axon4d.config import get_config
    from axon4d.models.transformer import Transformer
    from axon4d.nn.moe import MoE

    grid = axon4d.init(grid="auto", plan=plan_args)
    try:
        model = Transformer(get_config("tiny-moe"))
        return grid.shape.as_tuple(), [str(m.layout) for m in model.modules() if isinstance(m, MoE)]
    finally:
        axon4d.shutdown()


def test_init_auto_builds_the_layout_the_planner_chose(pools):
    """``axon4d.init(grid="auto")`` of an MoE model builds the grid and the expert layout of the
    candidate the planner chose (which is not the default layout here), and ``Tried.init_args``
    names the chosen plan's layout."""
    from axon4d.plan.auto import choose
    from axon4d.trials import Tried

    plan_args = {"model": "tiny-moe", "batch": 8, "machine": HOST_MACHINE, "dtype": "float32"}
    best = choose(4, overlap="auto", **plan_args)
    assert best.expert_layout and best.expert_layout != str(ExpertLayout())
    assert pools(4).run(None, _init_auto_layouts, plan_args) == [(best.shape.as_tuple(), [best.expert_layout] * 2)] * 4
    assert Tried(best, []).init_args()["expert_layout"] == best.expert_layout
