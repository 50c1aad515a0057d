"""Fold one world's calibration into a machine file (docs/design.md §6).

A machine file written by ``axon4d calibrate`` holds the results of several world sizes: the
tables are keyed by the number of ranks that ran at once (``Machine``'s "concurrency"), the
collective curves carry their world, and the in-step scale is refitted per world size
(``axon4d.plan.stepfit.store``). ``merge`` adds one world's ``measure_world`` result to a
``Machine`` (a new one for the first world), replacing what that world had measured before.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from axon4d.measure import memory_figures
from axon4d.plan import stepfit
from axon4d.plan.machine import Level, Machine


def merge(machine: Machine | None, result: dict[str, Any], name: str, memory: float) -> Machine:
    """Fold one world's measurements into ``machine`` (a new one named ``name`` with ``memory``
    bytes per device if None; a result of the network alone renames it ``name``)."""
    world = result["world"]
    key = str(world)
    if machine is None:
        machine = Machine(
            name=name,
            devices_per_node=world,
            memory_per_device=memory,
            peak_flops={},
            levels=[Level("host", 0, 1e-5, 1e9)],
            elementwise_Bps={},
            sources={
                "all": "measured by `axon4d calibrate` on this host",
                "memory_per_device": "given to `axon4d calibrate` (--memory-gib; by default the host's memory shared "
                "evenly by the ranks): a stated figure, replaced by the device's measured memory on an accelerator",
            },
        )
    for dt, forms in result.get("matmul", {}).items():
        machine.matmul.setdefault(dt, {})[key] = forms
        best = max(float(t.rates.max()) for t in forms.values())
        machine.peak_flops[dt] = max(machine.peak_flops.get(dt, 0.0), best)  # "peak" = best measured rate
    for dt, rows in result.get("attention", {}).items():
        machine.attention.setdefault(dt, {})[key] = rows
    for dt, rows in result.get("attention_prefix", {}).items():
        machine.attention_prefix.setdefault(dt, {})[key] = rows
    if "elementwise_Bps" in result:  # the compute part (calibrate --parts)
        machine.accelerator = bool(result.get("accelerator", machine.accelerator))  # what the compute ran on
        if "host_link_Bps" in result:  # an accelerator's link to host memory, each rank copying at once
            machine.host_link_Bps = float(result["host_link_Bps"])
            machine.sources["host_link_Bps"] = (
                "measured by `axon4d calibrate`: pinned copies of 256 MiB, the slower way"
            )
        if machine.accelerator:  # the node's host memory, and what others held of it as it calibrated
            total = host_memory()
            machine.host_memory_per_node = total
            machine.host_reserve_per_node = min(max(total - host_available(total), 0.0), 0.9 * total)
            machine.sources["host_memory_per_node"] = "this host's memory (sysconf)"
            machine.sources["host_reserve_per_node"] = (
                "this host's memory less /proc/meminfo's MemAvailable while `axon4d calibrate` ran (the OS, "
                "other processes and the calibrating ranks themselves), at most 90% of it"
            )
        if "device_memory" in result:  # the fit test's figures, each measured or stated with its source
            _device_memory(machine, result["device_memory"])
        machine.elementwise_Bps[key] = result["elementwise_Bps"]
        machine.activation_s[key] = result["activation_s"]
        machine.adam_s[key] = result["adam_s"]
        if "elementwise_curve" in result:
            machine.elementwise_curve[key] = result["elementwise_curve"]
        machine.op_overhead_s = result["op_overhead_s"] if world == 1 else machine.op_overhead_s
        if "host_sync_s" in result and (machine.host_sync_s is None or world >= machine.devices_per_node):
            machine.host_sync_s = float(result["host_sync_s"])  # the fullest node's, as a job sees it
            machine.sources["host_sync_s"] = (
                f"measured by `axon4d calibrate` on {world} ranks at once: a loop of small queued ops that reads "
                "a small int64 tensor to the host each time, less the loop without the read "
                "(axon4d.measure.kernels.host_sync); the planner charges it per MoE layer on an accelerator only"
            )
    if "comm" not in result:  # no network part
        machine.devices_per_node = max(machine.devices_per_node, world)
        return _with_steps(machine, world, result)
    if "matmul" not in result and "elementwise_Bps" not in result:  # the network alone: the name is this one's
        machine.name = name
        machine.sources["network"] = f"re-measured on {world} ranks by `axon4d calibrate --parts network`"
    if world > 1:
        machine.comm_interference_s_per_byte[key] = result["comm_interference_s_per_byte"]
        machine.staged_reduce_scatter = result["staged_reduce_scatter"]  # the backend the curves are of
    machine.comm = [c for c in machine.comm if c.world != world] + result["comm"]
    if world > 1 and world >= machine.devices_per_node:  # the fullest node is what a job of the host sees
        machine.overlap_efficiency = result["overlap_efficiency"]
        curves = [c for c in machine.comm if c.op == "all_reduce"]
        if curves:  # the fallback level: the median fitted α, β over the measured all-reduces
            fits = [c.alpha_beta() for c in curves]
            machine.levels = [
                Level(
                    "host (measured)",
                    0,
                    statistics.median(f[0] for f in fits) / 2,
                    statistics.median(f[1] for f in fits),
                )
            ]
    machine.devices_per_node = max(machine.devices_per_node, world)
    return _with_steps(machine, world, result)


def _device_memory(machine: Machine, measured: dict[str, Any]) -> None:
    """Set ``machine``'s device-memory figures and their sources from a calibration's
    (``axon4d.measure.memory_figures``); on an accelerator NCCL's buffers at its defaults over the
    machine's channels (a stated assumption, said so)."""
    for field, value in measured["figures"].items():
        setattr(machine, field, value)
    machine.sources.update(measured["sources"])
    if machine.accelerator:
        machine.nccl_buffer_bytes, machine.sources["nccl_buffer_bytes"] = memory_figures.nccl_buffers(
            machine.nccl_channels
        )


def _with_steps(machine: Machine, world: int, result: dict[str, Any]) -> Machine:
    """``machine`` with the in-step scale fitted to ``result``'s step samples (if any)."""
    stepfit.store(
        machine, {world}, result["step_samples"], "fitted to the measured steps in step_samples (axon4d.plan.stepfit)"
    )
    machine.sources["peak_flops"] = "best GEMM throughput measured at the lattice points (not a hardware peak)"
    return machine


def host_memory() -> float:
    """Bytes of this host's memory (16 GiB where the system does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 16 * 2**30


def host_available(total: float, meminfo: str = "/proc/meminfo") -> float:
    """Bytes of this host's memory the kernel says a new process could take (MemAvailable); 90% of
    ``total`` where the system does not say."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.9 * total
