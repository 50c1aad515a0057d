"""No hidden inputs (issue 29, item 7): importing axon4d changes no environment variable, and the
planner reads a machine file only when one is named (``plan={"machine": ...}``, ``--machine`` or
``$AXON4D_MACHINE``), never a stray ``./local.json`` in the working directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import axon4d.plan.machine

THP = "THP_MEM_ALLOC_ENABLE"
#: a shipped machine on which the planner tunes the small model on (1, 2, 1, 1) away from the
#: default knobs (one forward chunk instead of 4), so a machine file that is read shows
MACHINE = os.path.join(os.path.dirname(axon4d.plan.machine.__file__), "machines", "perlmutter.json")
SHAPE, PLAN = (1, 1, 2, 1), {"model": "small", "batch": 8}  # a grid whose tuned knobs are not the default


def _python(code: str, thp: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != THP}
    if thp is not None:
        env[THP] = thp
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


_ENTRY = """
import os, runpy, sys
sys.argv = ["axon4d.train", "--help"]
try:
    runpy.run_module("axon4d.train", run_name="__main__")  # the job's entry, as torchrun runs it
except SystemExit:
    pass
"""


@pytest.mark.slow
def test_a_bare_import_changes_no_environment_variable_and_the_training_entry_asks_for_huge_pages():
    code = "import os\nbefore = dict(os.environ)\nimport axon4d, axon4d.train\nprint(os.environ == before)\n"
    out = _python(code + _ENTRY + "print(os.environ.get('THP_MEM_ALLOC_ENABLE'))").split()
    assert out[0] == "True" and out[-1] == "1"  # after `import axon4d` the same environment; the entry sets it


def test_the_axon4d_train_command_asks_for_huge_pages_as_the_module_entry_does(monkeypatch):
    from axon4d import cli

    for preset, expected in ((None, "1"), ("0", "0")):  # unset: the command sets it; the user's 0 is kept
        monkeypatch.setenv(THP, preset or "")  # recorded, so restored after the test
        if preset is None:
            monkeypatch.delenv(THP)
        with pytest.raises(SystemExit):
            cli.main(["train", "--help"])
        assert os.environ.get(THP) == expected


_ENTRY_FAULTS = (
    _ENTRY
    + """
import resource, torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    x = torch.empty(64 << 20, dtype=torch.uint8); x.fill_(1); del x  # 64 MiB made and freed, as a step does
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
)


def _entry_faults(thp: str | None) -> tuple[str, int]:
    setting, faults = _python(_ENTRY_FAULTS, thp).split()[-2:]
    return setting, int(faults)


@pytest.mark.slow
def test_the_training_entry_puts_host_tensors_in_huge_pages_unless_told_not_to():
    """Host memory freed by one step and made again by the next is touched afresh every step
    (axon4d.device.environment.use_huge_pages, called by ``python -m axon4d.train``): in 4 KiB pages 512 MiB is
    131072 page faults."""
    default, faults = _entry_faults(None)
    off, faults_off = _entry_faults("0")
    assert (default, off) == ("1", "0")  # the entry sets it; the user's own setting is kept
    assert faults_off > 100_000
    policy = "/sys/kernel/mm/transparent_hugepage/enabled"
    if os.path.exists(policy) and "[never]" not in open(policy).read():  # where the kernel gives huge pages
        assert faults < faults_off / 10


def _init_overlap(cwd: str, plan: dict, machine_env: str | None):
    """On every rank: ``axon4d.init`` with a model to plan for, run from ``cwd``; its overlap policy."""
    import axon4d

    old_cwd, old_env = os.getcwd(), os.environ.pop("AXON4D_MACHINE", None)
    if machine_env is not None:
        os.environ["AXON4D_MACHINE"] = machine_env
    os.chdir(cwd)
    try:
        grid = axon4d.init(grid=SHAPE, plan=plan)
        try:
            return grid.scheduler.policy
        finally:
            axon4d.shutdown()
    finally:
        os.chdir(old_cwd)
        os.environ.pop("AXON4D_MACHINE", None)
        if old_env is not None:
            os.environ["AXON4D_MACHINE"] = old_env


def test_a_stray_local_json_does_not_change_inits_overlap_choice(pools, tmp_path, monkeypatch):
    from axon4d.grid.shape import GridShape
    from axon4d.options.overlap_policy import OverlapPolicy
    from axon4d.plan.auto import choose_overlap

    shutil.copy(MACHINE, tmp_path / "local.json")  # what `axon4d calibrate --out local.json` leaves behind
    monkeypatch.delenv("AXON4D_MACHINE", raising=False)
    monkeypatch.chdir(tmp_path)
    tuned = choose_overlap(GridShape(*SHAPE), machine=MACHINE, **PLAN)
    assert tuned != OverlapPolicy()  # the file, when read, changes the knobs
    pool = pools(2)
    stray = pool.run(None, _init_overlap, str(tmp_path), PLAN, None)
    named = pool.run(None, _init_overlap, str(tmp_path), {**PLAN, "machine": "local.json"}, None)
    by_env = pool.run(None, _init_overlap, str(tmp_path), PLAN, "local.json")
    assert stray == [OverlapPolicy()] * 2  # not read: the default knobs
    assert named == by_env == [tuned] * 2  # read when named, by plan["machine"] or $AXON4D_MACHINE
    assert choose_overlap(GridShape(*SHAPE), **PLAN) == OverlapPolicy()
