"""Measure this machine for the planner and save a machine file (docs/design.md §6, §7).

    axon4d calibrate --ranks 2,4,8 --out local.json        # spawns local gloo worlds of 2, 4, 8 ranks
    torchrun --nproc-per-node 8 -m axon4d.measure.calibrate    # or: srun / mpirun, one world

Every rank measures at the same time as the others, so the numbers include the contention of a
real step (on a CPU host the ranks share cores; on a GPU node each has its own device):

- GEMM throughput of the three forms a linear layer runs (X·Wᵀ, dY·W, dYᵀ·X) on a log2 lattice of
  (m, k, n), per dtype;
- causal attention forward + backward per (sequence, head), elementwise streaming bandwidth, the
  MLP activation forward/backward per element, one Adam step per parameter, a framework op;
- every collective (all-reduce, all-gather, reduce-scatter) through ``axon4d.comm`` on every axis
  geometry (group size, rank stride) of the world, at several payloads;
- how much of an asynchronous all-reduce a concurrent GEMM hides (``overlap_efficiency``), and
  how much GEMM time each byte of a collective running beside it costs
  (``comm_interference_s_per_byte``; ``_interference``);
- with ``--step-model``, whole training steps of that model on a few grids, to which the
  planner's in-step scale is fitted (``axon4d.plan.stepfit``).

Times are the mean over ranks of each rank's median over repetitions. The results of several
worlds are merged into one file (tables keyed by the number of ranks that ran at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from axon4d import device as devices
from axon4d.launch import free_port
from axon4d.measure import steps as step_probe
from axon4d.plan import stepfit
from axon4d.plan.machine import FORMS, CommCurve, Level, Machine, MatmulTable, ring_traffic

DIMS = [16, 64, 256, 1024, 4096]
MAX_MACS = 2**29  # lattice points larger than this are not run; they take the rate of a smaller point
PAYLOADS = [4096, 65536, 1 << 20, 4 << 20, 16 << 20]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _timeit(fn: Callable[[], Any], reps: int, sync: Callable[[], None], budget_s: float | None = 1.0,
            window_s: float = 0.0) -> float:
    """Median over ``reps`` samples of the seconds per call of ``fn``, after a warm-up; with
    ``budget_s``, fewer samples once they exceed it. Collectives must pass ``budget_s=None`` and
    ``window_s=0``: every rank has to run them equally often.

    With ``window_s`` a sample is the mean over as many back-to-back calls as fill that window.
    Where ranks share cores (more ranks than cores on one host) the scheduler runs each for a
    time slice of a few milliseconds: a single short call is then either not preempted at all or
    preempted for several slices, and the median of single calls measures an unshared core. A
    window of several slices measures the share of the core a rank really gets."""
    fn()
    sync()
    times: list[float] = []
    for _ in range(reps):
        calls = 0
        t = time.perf_counter()
        while True:
            fn()
            calls += 1
            sync()
            elapsed = time.perf_counter() - t
            if elapsed >= window_s:
                break
        times.append(elapsed / calls)
        if budget_s is not None and sum(times) > budget_s and len(times) >= 2:
            break
    return statistics.median(times)


class _Ctx:
    """What the measurements need: the grid's communicator for barriers and averaging."""

    def __init__(self, grid: Any, reps: int, window_s: float = 0.0):
        self.grid, self.reps, self.window_s = grid, reps, window_s
        self.device = grid.device
        self.sync = lambda: devices.synchronize(grid.device)

    def mean(self, value: float) -> float:
        """Mean of ``value`` over all ranks (through axon4d.comm on the world axis)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        return float(self.grid.comm.all_reduce(t, "world").wait()) / self.grid.world_size

    def measure(self, fn: Callable[[], Any], budget_s: float | None = 1.0) -> float:
        """Seconds per call of local work ``fn``, mean over ranks (windowed: see ``_timeit``)."""
        self.grid.comm.barrier()
        return self.mean(_timeit(fn, self.reps, self.sync, budget_s, self.window_s))

    def measure_collective(self, fn: Callable[[], Any]) -> float:
        """Seconds of one collective ``fn`` that every rank runs the same number of times."""
        self.grid.comm.barrier()
        return self.mean(_timeit(fn, self.reps, self.sync, None))


def _matmul_table(ctx: _Ctx, dtype: torch.dtype, form: str) -> MatmulTable:
    rates = torch.zeros(len(DIMS), len(DIMS), len(DIMS), dtype=torch.float64)
    measured = {}
    for (i, m), (j, k), (l, n) in itertools.product(enumerate(DIMS), repeat=3):
        if m * k * n > MAX_MACS:
            continue
        a_shape, b_shape = {"nt": ((m, k), (n, k)), "nn": ((m, k), (k, n)), "tn": ((k, m), (k, n))}[form]
        a = torch.randn(a_shape, dtype=dtype, device=ctx.device)
        b = torch.randn(b_shape, dtype=dtype, device=ctx.device)
        op = {"nt": lambda: torch.matmul(a, b.t()), "nn": lambda: torch.matmul(a, b),
              "tn": lambda: torch.matmul(a.t(), b)}[form]
        t = ctx.measure(op, budget_s=0.5)
        measured[(i, j, l)] = 2.0 * m * k * n / t
    for (i, j, l) in itertools.product(range(len(DIMS)), repeat=3):
        if (i, j, l) in measured:
            rates[i, j, l] = measured[(i, j, l)]
            continue
        # shrink the largest dims until the point was measured: large GEMMs run at the saturated rate
        p = [i, j, l]
        while tuple(p) not in measured:
            p[max(range(3), key=lambda q: p[q])] -= 1
        rates[i, j, l] = measured[tuple(p)]
    return MatmulTable(list(DIMS), rates.numpy())


def _attention_rows(ctx: _Ctx, dtype: torch.dtype) -> list[list[float]]:
    rows = []
    for seq, hd in itertools.product([64, 128, 256, 512], [32, 64, 128]):
        units = max(1, 2**22 // (seq * seq))  # similar work per measurement
        q, k, v = (torch.randn(1, units, seq, hd, dtype=dtype, device=ctx.device, requires_grad=True) for _ in range(3))

        def fwd_bwd() -> None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))

        rows.append([seq, hd, ctx.measure(fwd_bwd) / units])
    return rows


def _elementwise(ctx: _Ctx, dtype: torch.dtype) -> tuple[float, list[float], float]:
    n = 1 << 22
    a, b = torch.randn(n, dtype=dtype, device=ctx.device), torch.randn(n, dtype=dtype, device=ctx.device)
    t_add = ctx.measure(lambda: a + b)
    bps = 3 * n * a.element_size() / t_add
    x = torch.randn(n, dtype=dtype, device=ctx.device, requires_grad=True)
    t_f = ctx.measure(lambda: F.gelu(x))
    y = F.gelu(x)
    g = torch.ones_like(y)
    t_fb = ctx.measure(lambda: torch.autograd.grad(F.gelu(x), x, g))
    p = torch.nn.Parameter(torch.randn(n, device=ctx.device))
    p.grad = torch.randn(n, device=ctx.device)
    opt = torch.optim.Adam([p], foreach=False)
    t_adam = ctx.measure(opt.step)
    return bps, [t_f / n, max(t_fb - t_f, 0.0) / n], t_adam / n


def _geometries(world: int) -> list[tuple[int, int]]:
    """(group size, stride) of every axis a grid of ``world`` ranks can have (E1)."""
    out = []
    for g in range(2, world + 1):
        for s in range(1, world // g + 1):
            if world % (g * s) == 0:
                out.append((g, s))
    return out


def _comm_curves(ctx: _Ctx, world: int, dtype: torch.dtype, passes: int = 1) -> list[CommCurve]:
    """Every collective on every axis geometry; ``passes`` sweeps over all of them, per-point median
    (a shared host's load drifts: spreading the repetitions over time makes the median robust)."""
    sweeps = [_comm_sweep(ctx, world, dtype) for _ in range(passes)]
    curves = []
    for same in zip(*sweeps):  # one (op, geometry) as measured in every pass
        points = range(len(same[0].payload))
        curves.append(dataclasses.replace(same[0], seconds=[statistics.median(c.seconds[i] for c in same) for i in points]))
    return curves


def _comm_sweep(ctx: _Ctx, world: int, dtype: torch.dtype) -> list[CommCurve]:
    from axon4d.grid import Grid
    from axon4d.shape import GridShape

    curves = []
    elem = torch.empty(0, dtype=dtype).element_size()
    for g, s in _geometries(world):
        shape = GridShape(s, g, world // (g * s), 1)  # the y axis: g ranks, stride s = G_x
        grid = Grid(shape, ctx.device, ctx.grid.comm.backend_name, launcher="existing")
        try:
            for op in ("all_reduce", "all_gather", "reduce_scatter"):
                secs = []
                for payload in PAYLOADS:
                    n = payload // elem
                    if op == "all_reduce":
                        buf = torch.zeros(n, dtype=dtype, device=ctx.device)
                        fn = lambda: grid.comm.all_reduce(buf, "y").wait()  # noqa: E731
                    elif op == "all_gather":
                        buf = torch.zeros(n // g, dtype=dtype, device=ctx.device)
                        fn = lambda: grid.comm.all_gather(buf, "y").wait()  # noqa: E731
                    else:
                        buf = torch.zeros(n - n % g, dtype=dtype, device=ctx.device)
                        fn = lambda: grid.comm.reduce_scatter(buf, "y").wait()  # noqa: E731
                    secs.append(ctx.measure_collective(fn))
                grid.comm.log.clear()
                curves.append(CommCurve(op, g, s, world, list(PAYLOADS), secs))
        finally:
            grid.comm.barrier()
            grid.destroy()
    return curves


def _beside(ctx: _Ctx, buf: torch.Tensor, length: float) -> tuple[float, float, float]:
    """Seconds of an async all-reduce of ``buf`` on the world axis alone, of GEMMs lasting about
    ``length`` times as long alone, and of the two together (issue, GEMMs, wait)."""
    a = torch.randn(512, 512, dtype=buf.dtype, device=ctx.device)
    t_one = ctx.measure(lambda: a @ a)
    t_ar = ctx.measure_collective(lambda: ctx.grid.comm.all_reduce(buf, "world").wait())
    reps = max(1, int(length * t_ar / t_one))  # t_ar and t_one are means over ranks: every rank agrees
    t_mm = ctx.measure(lambda: [a @ a for _ in range(reps)])

    def both() -> None:
        h = ctx.grid.comm.all_reduce(buf, "world")
        for _ in range(reps):
            a @ a
        h.wait()

    return t_ar, t_mm, ctx.measure_collective(both)


def _overlap_efficiency(ctx: _Ctx, dtype: torch.dtype) -> float:
    """Share of an async all-reduce (world axis) that a concurrent GEMM of similar length hides."""
    if ctx.grid.world_size == 1:
        return 1.0
    t_ar, t_mm, t_both = _beside(ctx, torch.zeros((4 << 20) // 4, dtype=dtype, device=ctx.device), 1.0)
    hidden = t_mm + t_ar - t_both
    return float(min(max(hidden / min(t_mm, t_ar), 0.0), 1.0))


#: all-reduce payloads (bytes) of the interference probe: large, so per-collective costs are small
#: beside the bytes' and cancel in the difference of the two
INTERFERENCE_PAYLOADS = (4 << 20, 16 << 20)


def _interference(ctx: _Ctx, dtype: torch.dtype) -> float:
    """Seconds of GEMM time lost per byte of ring traffic (``ring_traffic``) of an asynchronous
    all-reduce on the world axis running beside the GEMMs (every rank at once).

    For each of ``INTERFERENCE_PAYLOADS``: GEMMs lasting twice the all-reduce alone, once alone
    and once with the all-reduce issued before them and waited on after (``_beside``). With a
    core per rank the pair would take as long as the GEMMs; the excess is what moving the bytes
    took from them. The excess at the larger payload minus that at the smaller, per byte of
    traffic between them, leaves out what every collective costs regardless of its size (the
    in-step scale's per-collective term prices that)."""
    world = ctx.grid.world_size
    if world == 1:
        return 0.0
    elem = torch.empty(0, dtype=dtype).element_size()
    excess = []
    for payload in INTERFERENCE_PAYLOADS:
        _, t_mm, t_both = _beside(ctx, torch.zeros(payload // elem, dtype=dtype, device=ctx.device), 2.0)
        excess.append(t_both - t_mm)
    moved = [ring_traffic("all_reduce", world, p) for p in INTERFERENCE_PAYLOADS]
    return max((excess[1] - excess[0]) / (moved[1] - moved[0]), 0.0)


def measure_world(grid: Any, dtypes: list[str], reps: int, log: Callable[[str], None] = print,
                  passes: int = 1, window_s: float = 0.03, step_model: str | None = None,
                  step_rounds: int = 3) -> dict[str, Any]:
    """All measurements on the current world (every rank calls this); the result on every rank.
    ``window_s``: each sample of local work is a mean over this long (see ``_timeit``);
    ``step_model``: a ``stepfit.parse_model`` spec whose steps the in-step scale is fitted to
    (``step_rounds`` rounds on ``stepfit.calibration_grids``; None: no step calibration)."""
    step_wl = stepfit.parse_model(step_model) if step_model else None  # a bad spec fails before measuring
    if step_wl is not None:
        stepfit.check_grids(grid.world_size, step_wl)
    ctx = _Ctx(grid, reps, window_s)
    world = grid.world_size
    out: dict[str, Any] = {"world": world, "matmul": {}, "attention": {}}
    for name in dtypes:
        dt = DTYPES[name]
        out["matmul"][name] = {f: _matmul_table(ctx, dt, f) for f in FORMS}
        log(f"[{world} ranks] {name} GEMM tables done")
        out["attention"][name] = _attention_rows(ctx, dt)
    bps, act, adam = _elementwise(ctx, torch.float32)
    out.update(elementwise_Bps=bps, activation_s=act, adam_s=adam)
    t_op = ctx.measure(lambda: torch.add(torch.ones(1), 1))
    out["op_overhead_s"] = t_op
    log(f"[{world} ranks] attention, elementwise, optimizer done")
    out["comm"] = _comm_curves(ctx, world, torch.float32, passes) if world > 1 else []
    out["overlap_efficiency"] = statistics.median(_overlap_efficiency(ctx, torch.float32) for _ in range(max(passes, 1)))
    out["comm_interference_s_per_byte"] = statistics.median(_interference(ctx, torch.float32)
                                                            for _ in range(max(passes, 1)))
    log(f"[{world} ranks] collectives done; overlap efficiency {out['overlap_efficiency']:.2f}, "
        f"interference {out['comm_interference_s_per_byte'] * 1e9:.2f} s per GB of collective traffic")
    samples = step_probe.measure(grid, step_wl, rounds=step_rounds, log=log) if step_wl and world > 1 else []
    out["step_samples"] = [dataclasses.asdict(s) for s in samples]
    return out


def merge(machine: Machine | None, result: dict[str, Any], name: str, memory: float) -> Machine:
    """Fold one world's measurements into ``machine`` (a new one if None)."""
    world = result["world"]
    key = str(world)
    if machine is None:
        machine = Machine(name=name, devices_per_node=world, memory_per_device=memory, peak_flops={},
                          levels=[Level("host", 0, 1e-5, 1e9)], elementwise_Bps={},
                          sources={"all": "measured by `axon4d calibrate` on this host"})
    for dt, forms in result["matmul"].items():
        machine.matmul.setdefault(dt, {})[key] = forms
        best = max(float(t.rates.max()) for t in forms.values())
        machine.peak_flops[dt] = max(machine.peak_flops.get(dt, 0.0), best)  # "peak" = best measured rate
    for dt, rows in result["attention"].items():
        machine.attention.setdefault(dt, {})[key] = rows
    machine.elementwise_Bps[key] = result["elementwise_Bps"]
    if world > 1:
        machine.comm_interference_s_per_byte[key] = result["comm_interference_s_per_byte"]
    machine.activation_s[key] = result["activation_s"]
    machine.adam_s[key] = result["adam_s"]
    machine.op_overhead_s = result["op_overhead_s"] if world == 1 else machine.op_overhead_s
    machine.comm = [c for c in machine.comm if c.world != world] + result["comm"]
    if world > 1 and world >= machine.devices_per_node:  # the fullest node is what a job of the host sees
        machine.overlap_efficiency = result["overlap_efficiency"]
        curves = [c for c in machine.comm if c.op == "all_reduce"]
        if curves:  # the fallback level: the median fitted α, β over the measured all-reduces
            fits = [c.alpha_beta() for c in curves]
            machine.levels = [Level("host (measured)", 0, statistics.median(f[0] for f in fits) / 2,
                                    statistics.median(f[1] for f in fits))]
    machine.devices_per_node = max(machine.devices_per_node, world)
    stepfit.store(machine, {world}, result["step_samples"],
                  "fitted to the measured steps in step_samples (axon4d.plan.stepfit)")
    machine.sources["peak_flops"] = "best GEMM throughput measured at the lattice points (not a hardware peak)"
    return machine


def _spawned_rank(rank: int, world: int, port: int, dtypes: list[str], reps: int, passes: int,
                  step_model: str | None, queue: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import axon4d

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    grid = axon4d.init(grid=(1, 1, 1, world))
    result = measure_world(grid, dtypes, reps, log=(lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None),
                           passes=passes, step_model=step_model)
    if rank == 0:
        queue.put(result)
    axon4d.shutdown()
    dist.destroy_process_group()


def run_local(world: int, dtypes: list[str], reps: int, passes: int = 1, step_model: str | None = None) -> dict[str, Any]:
    """Spawn ``world`` gloo ranks on this host, measure, return rank 0's results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned_rank, args=(r, world, port, dtypes, reps, passes, step_model, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default="1,2,4,8",
                   help="comma-separated world sizes to spawn on this host (ignored under torchrun/srun/mpirun)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="GEMM dtypes to measure")
    p.add_argument("--reps", type=int, default=5, help="repetitions per measurement (median)")
    p.add_argument("--passes", type=int, default=3, help="sweeps over all collectives (per-point median)")
    p.add_argument("--step-model", default=None, metavar="SPEC",
                   help="also time whole steps of this model on a few grids and fit the planner's in-step scale to "
                        "them (axon4d.plan.stepfit), e.g. layers=2,hidden=512,heads=8,vocab=2048,seq=128,batch=8")
    p.add_argument("--name", default="local", help="machine name stored in the file")
    p.add_argument("--memory-gib", type=float, default=None, help="memory per device (default: host RAM / ranks)")
    p.add_argument("--out", default="local.json", help="machine file to write (merged into if it exists)")


def main(args: argparse.Namespace) -> int:
    from axon4d import launch

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if args.step_model:
        stepfit.parse_model(args.step_model)  # a bad spec fails now, not after the tables
    machine = None
    if os.path.exists(args.out):
        from axon4d.plan.machine import load

        machine = load(args.out)
    info = launch.detect()
    start = time.perf_counter()
    if info.launcher in ("torchrun", "mpi"):
        import axon4d

        grid = axon4d.init(grid=(1, 1, 1, -1))
        result = measure_world(grid, dtypes, args.reps, log=print if grid.rank == 0 else (lambda s: None),
                               passes=args.passes, step_model=args.step_model)
        rank = grid.rank
        axon4d.shutdown()
        if rank != 0:
            return 0
        mem = args.memory_gib * 2**30 if args.memory_gib else _host_memory() / max(result["world"], 1)
        machine = merge(machine, result, args.name, mem)
        machine.save(args.out)
    else:
        for w in args.ranks.split(","):
            result = run_local(int(w), dtypes, args.reps, args.passes, args.step_model)
            mem = args.memory_gib * 2**30 if args.memory_gib else _host_memory() / max(result["world"], 1)
            machine = merge(machine, result, args.name, mem)
            machine.save(args.out)  # after every world: a later failure keeps what was measured
    assert machine is not None
    print(f"calibrated {args.name} in {time.perf_counter() - start:.0f} s: {args.out}")
    for c in machine.comm:
        if c.op == "all_reduce":
            a, b = c.alpha_beta()
            print(f"  all_reduce group {c.group} stride {c.stride} ({c.world} ranks): α {a * 1e6:.0f} µs, β {b / 1e9:.2f} GB/s")
    for w, scale in sorted(machine.step_scale.items(), key=lambda kv: int(kv[0])):
        print(f"  in-step scale ({w} ranks): {stepfit.describe(scale)}")
    return 0


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 16 * 2**30


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
