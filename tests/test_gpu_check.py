"""Protects ``make gpu-check`` (bench/gpu_check.py, bench/gpu_cases.py), which runs only where a GPU
is: without CUDA it refuses with a clear message and exit 1; on the host (``--on-host``) its cases run
the same code on CPU tensors and pass, its JSON and closing line are written; a case that errs on a
rank, misses its tolerance or runs no collective on several ranks is reported failed (exit 1) instead
of hanging or passing; what a machine cannot run is recorded skipped with the reason; each
tolerance's measured error is the worst the H200 run's JSON holds for its cases, and its bound
within ≈ 10× of it; the ZeRO case records the AdamW kernel each optimizer's steps ran (seen in what
they dispatched) and fails where a sharded one ran another; the sync case's watch catches a host read
planted in a copy of the step, at its line; the JSON names the code that ran, and the GPU suite's
record says why each of its tests failed. The GPU itself is
never needed."""

import collections
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
sys.path.insert(0, os.path.dirname(SCRIPT))

import gpu_cases  # noqa: E402  (bench/ is not a package)
import gpu_check  # noqa: E402


def _saved(out):
    """The JSON gpu_check wrote, its cases that ran (not the NCCL variants the host skips), and
    their status by name."""
    saved = json.loads(out.read_text())
    ran = [c for c in saved["cases"] if c["transport"] != "nccl"]
    saved["ran"] = ran
    return saved, {c["name"]: c["status"] for c in ran}


def _run(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


#: the cases the host-run tests below check, all in one ``--on-host --jobs 2`` run (one start-up,
#: two cases side by side throughout); each test judges its own cases in the one JSON
HOST_ONLY = {
    "on_the_host": "exact llama x1y1z2d1 overlap-on,checkpoint,one rank",
    "offload": "offload",
    "fp8_and_zero": "fp8,zero",
    "step": "sync,micro,hf,async,moe",
}


@pytest.fixture(scope="module")
def host_run(tmp_path_factory):
    """The host run of every case of ``HOST_ONLY``: (the process, its JSON file, this tree's source
    digest taken as the run started)."""
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    only = ",".join(HOST_ONLY.values())
    digest = gpu_check.source_digest()
    return _run("--on-host", "--only", only, "--jobs", "2", "--out", str(out), timeout=1200), out, digest


def _host_cases(host_run, test):
    """The JSON of ``host_run`` and the status by name of the cases it ran for ``test`` (a key of
    ``HOST_ONLY``); fails naming any of them that did not pass."""
    proc, out, _ = host_run
    saved, status = _saved(out)
    prefixes = tuple(HOST_ONLY[test].split(","))
    saved["ran"] = [c for c in saved["ran"] if c["name"].startswith(prefixes)]
    status = {name: s for name, s in status.items() if name.startswith(prefixes)}
    failed = {c["name"]: c["why"] for c in saved["ran"] if c["status"] != "passed"}
    assert not failed and proc.returncode == 0, (failed, proc.stdout + proc.stderr)
    return saved, status


@pytest.mark.slow
def test_without_cuda_it_says_so_and_fails():
    proc = _run()
    assert proc.returncode == 1
    assert "gpu-check: no CUDA device here" in proc.stderr and "--on-host" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the shared host run of every case below
def test_on_the_host_the_cases_run_and_the_result_is_saved(host_run):
    proc, _, digest = host_run
    saved, _ = _host_cases(host_run, "on_the_host")
    # the closing line and the JSON's counts: every case of the run, each once
    counts = collections.Counter(c["status"] for c in saved["cases"])
    assert len({(c["name"], c["transport"]) for c in saved["cases"]}) == len(saved["cases"])
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"gpu-check: host: {counts['passed']} passed, 0 failed, {counts['skipped']} skipped (")
    assert saved["counts"] == {"passed": counts["passed"], "failed": 0, "skipped": counts["skipped"]}
    status = {
        (c["name"], c["transport"]): (c["status"], c["why"])
        for c in saved["cases"]
        if c["name"].startswith(tuple(HOST_ONLY["on_the_host"].split(",")))
    }
    no_nccl = ("skipped", "NCCL needs CUDA: the host has none")
    assert status == {
        ("exact llama x1y1z2d1 overlap-on", "staged"): ("passed", None),
        ("exact llama x1y1z2d1 overlap-on", "nccl"): no_nccl,
        ("checkpoint z2 -> y2", "staged"): ("passed", None),
        ("checkpoint z2 -> y2", "nccl"): no_nccl,
        ("one rank exact llama x1y1z1d1", "gloo"): ("passed", None),  # NCCL on a GPU
    }
    exact = next(c for c in saved["cases"] if c["name"].startswith("exact") and c["status"] == "passed")
    fp32 = gpu_check.TOLERANCES["fp32"].bound
    assert len(exact["metrics"]) == 2 and all(m["grad_rel"] <= fp32 for m in exact["metrics"])
    assert all(m["collectives"] > 0 for m in exact["metrics"])  # the distributed code ran, not a short cut
    assert exact["tolerances"]["fp32"]["applied"] == fp32 and exact["tolerances"]["fp32"]["measured"] > 0
    assert saved["device"] == "host"
    # the code that ran: this tree's digest, and a commit only where no tracked file differs from it
    assert saved["source_digest"] == digest
    assert saved["commit"] in (None, saved["head"]) and (saved["commit"] is None) == bool(saved["changed_files"])


def _raises_on_rank_one(grid):
    if grid.rank == 1:
        raise RuntimeError("broken on purpose")
    grid.comm.barrier()  # rank 0 would wait here for ever
    return {"grad_rel": 0.0, "loss_rel": 0.0}


@pytest.mark.slow
def test_a_case_that_errs_on_a_rank_fails_and_does_not_hang():
    case = gpu_check.Case("broken", 2, (1, 2, 1, 1), _raises_on_rank_one, verdict=gpu_check._exact())
    record = gpu_check.run_case(case, "staged", timeout=300)  # the spawn of two ranks on a loaded host included
    assert record["status"] == "failed" and "rank 1" in record["why"]


@pytest.mark.parametrize(
    "metrics,passes",
    [
        ({"grad_rel": 2e-6, "loss_rel": 0.0}, True),
        ({"grad_rel": 2e-5, "loss_rel": 0.0}, False),
        ({"grad_rel": 0.0, "loss_rel": 1e-3}, False),
    ],
)
def test_a_case_past_its_tolerance_fails(metrics, passes):
    metrics = {**metrics, "device": "cuda:0", "collectives": 3}
    assert (gpu_check._exact()([metrics, metrics]) is None) == passes


def test_a_multi_rank_case_that_issued_no_collective_fails():
    """A case of several ranks whose ranks issued nothing (or, for the job, moved nothing) fails
    whatever its own verdict says; a world of one is not asked to."""
    metrics = {"grad_rel": 0.0, "loss_rel": 0.0, "device": "cuda:0"}
    case = gpu_check.Case("idle", 2, (1, 2, 1, 1), gpu_cases.against_dense, verdict=gpu_check._exact())
    assert "rank 1 issued no collective" in case.judge([{**metrics, "collectives": 5}, {**metrics, "collectives": 0}])
    assert "rank 0 issued no collective" in case.judge([metrics, metrics])  # not reported counts as none
    assert case.judge([{**metrics, "collectives": 5}, {**metrics, "comm_bytes": 64}]) is None
    alone = gpu_check.Case("alone", 1, (1, 1, 1, 1), gpu_cases.against_dense, verdict=gpu_check._exact())
    assert alone.judge([{**metrics, "collectives": 0}]) is None


def test_what_a_machine_cannot_run_is_recorded_skipped_with_the_reason(tmp_path):
    """One GPU: every multi-rank case runs staged and its NCCL variant is skipped, saying why; with
    four GPUs the NCCL variants of up to four ranks run; on the host NCCL is skipped for lack of
    CUDA and the one-rank production cases run on gloo. Every case is either run or skipped."""
    every = gpu_check.cases(str(tmp_path))
    multi = [c.name for c in every if c.world >= 2 and not c.production]
    for gpus, on_host in ((1, False), (4, True), (4, False)):
        runs, skips = gpu_check.plan_runs(str(tmp_path), on_host, gpus, lambda name: True)
        nccl = sorted(c.name for c, t in runs if t == "nccl" and not c.production)
        skipped = sorted(s["name"] for s in skips)
        assert all(s["transport"] == "nccl" and s["status"] == "skipped" for s in skips)
        assert sorted(nccl + skipped) == sorted(multi)  # each multi-rank case: NCCL run or skipped
        assert sorted(c.name for c, t in runs if t == "staged") == sorted(c.name for c in every if not c.production)
        production = {t for c, t in runs if c.production}
        assert production == ({"gloo"} if on_host else {"nccl"})
        if on_host:
            assert not nccl and {s["why"] for s in skips} == {"NCCL needs CUDA: the host has none"}
        elif gpus == 1:
            assert not nccl and "NCCL needs one GPU per rank: 4 ranks, 1 GPU here" in {s["why"] for s in skips}
        else:
            assert nccl and all(c.world <= 4 for c, t in runs if t == "nccl")


#: the metrics each tolerance bounds (the verdicts that apply it: ``_exact``, ``_fp8_close``,
#: ``_zero_exact``, ``_trains``, ``_resumes``, ``_micro_keep``)
BOUNDED_METRICS = {
    "fp32": ("grad_rel", "loss_rel"),
    "bf16": ("grad_rel", "loss_rel"),
    "fp8 loss": ("loss_rel",),
    "fp8 grad": ("grad_fro",),
    "zero fp32": ("zero1_rel", "zero2_rel"),
    "zero bf16": ("zero1_rel", "zero2_rel"),
    "train": ("max_rel_diff",),
    "resume": ("loss_rel",),
    "peak": ("peak_error",),
}


def _significant_digits(x):
    """How many significant digits ``x`` is written with (7.3e-07: 2, 0.0207: 3)."""
    return len(repr(x).split("e")[0].replace(".", "").replace("-", "").lstrip("0"))


def test_each_tolerance_is_near_ten_times_the_gpu_s_measured_error_or_tighter(tmp_path):
    """Each tolerance's ``measured`` is the worst error the H200 run (``MEASURED_IN``, read here)
    recorded for the cases that tolerance bounds, as written to its digits; a tolerance with no
    such case in that run says it was not run on a GPU. A bound below what the H200 measured would
    fail a healthy GPU; one far above it (the old training bound was 900×) would pass a broken one."""
    with open(os.path.join(ROOT, gpu_check.MEASURED_IN)) as f:
        h200 = json.load(f)
    assert h200["device"] == "NVIDIA H200" and h200["counts"]["failed"] == 0
    ran = {c["name"]: c["metrics"] for c in h200["cases"] if c["status"] == "passed"}
    assert set(BOUNDED_METRICS) == set(gpu_check.TOLERANCES)
    errors = {name: [] for name in gpu_check.TOLERANCES}
    for case in gpu_check.cases(str(tmp_path)):
        for name in case.tolerances:
            for m in ran.get(case.name, []):
                errors[name] += [abs(m[k]) for k in BOUNDED_METRICS[name] if m.get(k) is not None]
    for name, tol in gpu_check.TOLERANCES.items():
        if tol.measured is None:
            assert "not yet run on a GPU" in tol.why and not errors[name], (name, errors[name])
        else:
            worst = max(errors[name])
            assert float(f"{worst:.{_significant_digits(tol.measured)}g}") == tol.measured, (name, worst, tol)
            assert 2 * tol.measured <= tol.bound <= 12 * tol.measured, (name, tol)


def test_host_reads_finds_a_device_tensor_read_and_where(monkeypatch):
    """``HostReads`` names each read of an accelerator's tensor with the line that made it, counts
    the host's tensors' reads apart (free on the host), and ``_no_sync`` fails on either finding.
    (No accelerator here: the host's tensors stand in for one's.)"""
    t = torch.ones(3)
    with gpu_cases.HostReads() as mode:
        t.sum().item()
    assert mode.reads == [] and mode.host_reads == 1
    monkeypatch.setattr(gpu_cases.devices, "is_accelerator", lambda device: True)
    with gpu_cases.HostReads() as mode:
        total = t.sum()
        assert bool(total > 0)
        total.tolist()
        t.cpu()
        t.to("cpu")
        t.to(torch.float64)  # a cast stays on the device: not a read
    assert [r.split(" at ")[0] for r in mode.reads] == ["__bool__", "tolist", "cpu", "to"]
    assert all(os.path.basename(__file__) in r for r in mode.reads)
    ok = {"reads": [], "syncs": [], "loss": 1.0, "optimizer": "fused", "device": "cuda:0", "collectives": 4}
    assert gpu_check._no_sync([ok, ok]) is None
    assert "tolist" in gpu_check._no_sync([ok, {**ok, "reads": ["tolist at a.py:1 in f"]}])
    assert "synchroniz" in gpu_check._no_sync([{**ok, "syncs": ["called a synchronizing CUDA operation"]}])
    assert "not fused" in gpu_check._no_sync([{**ok, "optimizer": "foreach"}])


def test_the_source_digest_names_the_code_and_nothing_else(tmp_path, monkeypatch):
    """The digest changes with any Python file of the library, benches or tests and the build
    files, not with results, caches or other files; ``commit`` is the head only where no tracked
    file differs from it."""
    for rel, text in {
        "axon4d/a.py": "x = 1\n",
        "bench/b.py": "",
        "tests/c.py": "",
        "Makefile": "all:\n",
        "bench/results/r.json": "{}",
        "axon4d/__pycache__/a.cpython-312.pyc": "",
        "docs/d.md": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    before = gpu_check.source_digest(str(tmp_path))
    for rel in ("bench/results/r.json", "axon4d/__pycache__/a.cpython-312.pyc", "docs/d.md"):
        (tmp_path / rel).write_text("changed")
    assert gpu_check.source_digest(str(tmp_path)) == before
    for rel in ("axon4d/a.py", "tests/c.py", "Makefile"):
        (tmp_path / rel).write_text("changed")
        after = gpu_check.source_digest(str(tmp_path))
        assert after != before, rel
        before = after
    head = "0123456789abcdef0123456789abcdef01234567"
    for status, commit in (("", head), (" M axon4d/a.py\n", None)):
        monkeypatch.setattr(gpu_check, "_git", lambda *a, status=status: head + "\n" if a[0] == "rev-parse" else status)
        code = gpu_check.code_that_ran()
        assert code["head"] == head and code["commit"] == commit
        assert code["changed_files"] == ([] if commit else ["axon4d/a.py"])


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the shared host run
def test_the_offload_cases_run_on_the_host_and_record_time_and_memory(host_run):
    """The offload cases (exactness against no offload on (1,2,2,1) with and without context
    parallelism; step time and peak memory with and without on one rank) pass on the host and
    write what a GPU run reports: bitwise equality there, bytes moved, both step times and peaks."""
    saved, status = _host_cases(host_run, "offload")
    assert status == {
        "offload exact x1y2z2d1": "passed",
        "offload exact x1y2z2d1 context": "passed",
        "offload speed x1y1z1d1": "passed",
        "offload speed wide x1y1z1d1": "passed",
    }
    for case in saved["ran"][:2]:
        assert len(case["metrics"]) == 4
        assert all(m["bitwise"] and m["copies_out"] > 0 and m["late_fetches"] == 0 for m in case["metrics"])
    speed = saved["ran"][2]["metrics"][0]
    assert speed["plain"]["step_s"] > 0 and speed["offloaded"]["step_s"] > 0 and speed["step_ratio"] > 0
    assert speed["plain"]["peak_bytes"] is None  # the host keeps no allocator peak; a GPU's is compared
    assert speed["offloaded"]["offloaded_bytes"] > 0 and sorted(speed["offloaded"]["block_bytes"]) == ["0", "1"]
    link = speed["host_link"]
    assert link["device_to_host_Bps"] > 0 and link["host_to_device_Bps"] > 0
    assert link["bytes"] == max(speed["offloaded"]["block_bytes"].values())  # a block's copy


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the shared host run
def test_the_fp8_and_zero_cases_run_side_by_side_on_the_host(host_run):
    """--jobs 2: the FP8-gather and ZeRO cases pass on the host, each recording what it compared,
    and the JSON holds every case once (rewritten after each)."""
    saved, status = _host_cases(host_run, "fp8_and_zero")
    zero = ["zero 1 and 2 x1y1z1d2", "zero 1 and 2 x1y2z1d2", "zero bf16 job AdamW x1y1z1d2"]
    assert status == dict.fromkeys(["fp8 gather x1y1z2d1", "fp8 gather x1y2z2d1", *zero], "passed")
    for case in saved["ran"]:
        for m in case["metrics"]:
            if case["name"].startswith("fp8"):
                assert 0 < m["grad_fro"] < 2.0**-4 and 0 < m["e10_bytes"] < m["e10_bytes_bf16"]
            else:
                assert 0 <= m["zero1_rel"] <= 1e-5 and 0 <= m["zero2_rel"] <= 1e-5
                # in bf16 ZeRO stores the Linear weights in bf16 (sharded fp32 masters), in fp32 not
                stored = ["torch.bfloat16" if "bf16" in case["name"] else "torch.float32"]
                assert m["zero1_linear_dtypes"] == m["zero2_linear_dtypes"] == stored
                # what the sharded optimizers' steps ran, seen in what they dispatched: the job's
                # AdamW on the host is foreach, torch's default there one parameter at a time
                ran = "foreach" if "job AdamW" in case["name"] else "for-loop"
                assert m["unsharded_optimizer"] == m["zero1_optimizer"] == m["zero2_optimizer"] == ran
                assert m["collectives"] > 0
    assert saved["source_digest"] == host_run[2]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the shared host run
def test_the_step_cases_run_on_the_host(host_run):
    """The cases of a step as the job runs it pass on the host and record what a GPU run judges:
    the watched step on (1,2,2,1) (no read of a device tensor — none can be on the host — the
    host's own reads counted, the job's optimizer); two micro-batches with keep-for-backward
    (blocks carried between them, none after, the peak within the planner's host bound); train
    --hf then export-hf (every weight transformers loads is the trained one, the export's peak
    resident memory); background saves on one rank resumed on the same losses, bit for bit."""
    saved, status = _host_cases(host_run, "step")
    names = ["sync training step x1y2z2d1", "micro keep x1y2z2d1", "hf train then export x1y2z2d1"]
    moe = ["moe exact one read x1y1z2d1", "moe exact one read x1y2z2d1", "moe exact one read ep=z x1y1z2d2"]
    assert status == dict.fromkeys([*names, "async save resume x1y1z1d1", *moe], "passed")
    got = {c["name"]: c["metrics"] for c in saved["ran"]}
    sync = got[names[0]]
    assert len(sync) == 4 and all(m["reads"] == [] == m["syncs"] and m["collectives"] > 0 for m in sync)
    assert all(m["host_tensor_reads"] > 0 and m["optimizer"] == "foreach" for m in sync)  # the host's AdamW
    micro = got[names[1]]
    assert all(m["carried_between"] == [micro[0]["carried_between"][0]] and m["carried_after"] == 0 for m in micro)
    assert micro[0]["carried_between"][0] > 0 and abs(micro[0]["peak_error"]) <= 0.08
    hf = got[names[2]][0]
    assert hf["export_exit"] == 0 and hf["weights"] > 0 and hf["differ"] == [] == hf["unloaded"]
    assert hf["export_peak_rss_bytes"] > 0 and hf["train_peak_device_bytes"] is None  # the host keeps no peak
    resume = got["async save resume x1y1z1d1"][0]
    assert resume["async_save"] and resume["written"] == ["step_2", "step_4"] and resume["bitwise"]
    for m in (m for name in moe for m in got[name]):  # exact, its host's reads seen (the counts exchange), none flagged
        assert m["loss_rel"] <= 8e-6 and m["grad_rel"] <= 8e-6 and m["host_tensor_reads"] > 0
        assert m["forward_reads"] == [] == m["backward"] and m["collectives"] > 0


def _watched_step(grid, plant):
    """``gpu_cases.no_host_sync`` on this rank, the host's tensors standing in for an accelerator's
    (the watch reports every read of them); with ``plant``, in a copy of the step whose clipping
    reads the norm on the host (``.item()``) and whose update first copies the loss sum to the host
    (``.cpu()``)."""
    import types

    from axon4d.train import optim

    clip, step, real = optim.clip, optim.step, gpu_cases.devices

    def planted_clip(model, job, grid):
        norm = clip(model, job, grid)
        norm.item()  # planted: a host read
        return norm

    def planted_step(opt, loss_sum, norm, read):
        loss_sum.cpu()  # planted: a copy to the host
        return step(opt, loss_sum, norm, read)

    gpu_cases.devices = types.SimpleNamespace(**{**vars(real), "is_accelerator": lambda device: True})
    if plant:
        optim.clip, optim.step = planted_clip, planted_step
    try:
        return gpu_cases.no_host_sync(grid)
    finally:
        gpu_cases.devices, optim.clip, optim.step = real, clip, step


@pytest.mark.slow
def test_a_host_read_planted_in_the_step_is_caught_where_it_is(pools):
    """The sync case's watch on a copy of the step with an ``.item()`` planted in its clipping and a
    ``.cpu()`` in its update: it reports both, each at the planted line, besides what the step read
    without them (on the host, whose tensors stand in for a device's: the host-only paths' reads),
    and ``_no_sync`` fails naming them."""
    plain, planted = (pools(1).run((1, 1, 1, 1), _watched_step, plant)[0] for plant in (False, True))
    lines, start = inspect.getsourcelines(_watched_step)
    at = {word: start + i for i, line in enumerate(lines) for word in ("item", "cpu") if f".{word}()  #" in line}
    here = os.path.relpath(__file__, ROOT)
    added = collections.Counter(planted["reads"]) - collections.Counter(plain["reads"])
    assert sorted(added.elements()) == [
        f"cpu at {here}:{at['cpu']} in planted_step",
        f"item at {here}:{at['item']} in planted_clip",
    ]
    assert not collections.Counter(plain["reads"]) - collections.Counter(planted["reads"])
    assert plain["syncs"] == [] == planted["syncs"] and planted["collectives"] == plain["collectives"]
    why = gpu_check._no_sync([{**planted, "reads": list(added.elements())}])
    assert why is not None and "in planted_clip" in why and "in planted_step" in why


@pytest.mark.parametrize(
    "asked,ran", [({"fused": True}, "fused"), ({"foreach": True}, "foreach"), ({"foreach": False}, "for-loop")]
)
def test_the_adamw_kernel_is_seen_in_what_its_step_dispatched(asked, ran):
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = torch.optim.AdamW([p], **asked)
    with gpu_cases._Dispatched() as mode:
        opt.step()
    assert gpu_cases.adamw_kernel_ran(mode.ops) == ran
    assert gpu_cases.adamw_kernel_ran(set()) == "none"


def test_the_zero_case_fails_where_a_sharded_step_ran_another_kernel():
    good = {"device": "cuda:0", "precision": "torch.float32", "zero1_rel": 0.0, "zero2_rel": 0.0}
    good.update(zero1_linear_dtypes=["torch.float32"], zero2_linear_dtypes=["torch.float32"])
    good.update(optimizer_asked="fused", unsharded_optimizer="fused", zero1_optimizer="fused", zero2_optimizer="fused")
    assert gpu_check._zero_exact([good]) is None
    assert "ZeRO's AdamW ran ['for-loop', 'fused']" in gpu_check._zero_exact([{**good, "zero2_optimizer": "for-loop"}])
    foreach = dict.fromkeys(["unsharded_optimizer", "zero1_optimizer", "zero2_optimizer"], "foreach")
    assert "not the fused kernel" in gpu_check._zero_exact([{**good, **foreach}])
    assert gpu_check._zero_exact([{**good, **foreach, "device": "cpu", "optimizer_asked": "foreach"}]) is None


def test_the_moe_case_fails_on_a_second_read_or_a_read_in_backward():
    good = {"device": "cuda:0", "forward_reads": ["tolist at moe_routes.py:61"], "forward_syncs": []}
    good.update(backward=[], host_tensor_reads=0, loss_rel=1e-7, grad_rel=1e-7)
    assert gpu_check._moe([good]) is None
    assert gpu_check._moe([{**good, "forward_reads": good["forward_reads"] * 2}]) is not None
    assert gpu_check._moe([{**good, "backward": ["item at moe.py:1"]}]) is not None
    assert gpu_check._moe([{**good, "grad_rel": 1e-3}]) is not None
    assert gpu_check._moe([{**good, "device": "cpu"}]) is not None  # on the host the watch must see the read


@pytest.mark.parametrize(
    "plain_peak,offload_peak,moved,late,passes",
    [(100, 60, 40, 0, True), (100, 100, 40, 0, False), (100, 60, 0, 0, False), (100, 60, 40, 2, False)],
)
def test_the_offload_speed_case_fails_when_nothing_moved_or_the_peak_did_not_fall(
    plain_peak, offload_peak, moved, late, passes
):
    metrics = {
        "plain": {"step_s": 1.0, "peak_bytes": plain_peak},
        "offloaded": {"step_s": 1.2, "peak_bytes": offload_peak, "offloaded_bytes": moved, "late_fetches": late},
    }
    assert (gpu_check._offload_saves([metrics]) is None) == passes


@pytest.mark.slow
def test_the_suite_s_record_says_why_each_test_failed(tmp_path):
    """A failing GPU test's record keeps its one-line traceback (file, line, the assertion's message)
    and its summary line, not only the counts: the H200 run that failed the fused row cast said
    which test, not why."""
    (tmp_path / "test_two.py").write_text(
        "def test_fine():\n    pass\n\n\ndef test_off():\n    assert 1 + 1 == 3, 'scales differ in 7 of 229376 blocks'\n"
    )
    record = gpu_check.run_suite(120, str(tmp_path))
    assert record["status"] == "failed" and record["metrics"]["counts"] == {"failed": 1, "passed": 1}
    failures = record["metrics"]["failures"]
    assert any(line.startswith(f"{tmp_path / 'test_two.py'}:6: ") and "7 of 229376" in line for line in failures)
    assert any(line.startswith("FAILED ") and "test_off" in line for line in failures)
    assert not any("test_fine" in line for line in failures)
