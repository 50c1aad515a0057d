"""The cost of axon4d's machinery: on one rank, where there is nothing to communicate (issue 18,
item 4), and per collective, the host time the communication layer adds (issue 30, item 6).

On a grid of one rank (``axon4d.init(grid=(1, 1, 1, 1))`` in this one process, no launcher)
``axon4d.Linear(in, out)`` must cost no more than ``torch.nn.Linear(in, out)``: the scheduler,
the comm log and the hooks must do nothing measurable when every axis has one rank.

For every size (in, out) = (n, n), n in ``--sizes``, and every token count T in ``--tokens``,
both layers hold the same fp32 weights and bias. One step is forward + backward on T tokens: an
input (T, in) that requires its gradient, loss = (y·v).sum() for a fixed v of (out,), backward,
then every gradient set to None. Before timing, the outputs and the input, weight and bias
gradients of the two layers are compared (they must agree to fp32 rounding; whether they are
bitwise equal is recorded). Then the two layers' steps are timed interleaved (axon4d, torch,
axon4d, torch, …) after ``--warmup`` steps each, with enough repetitions for each layer to run at
least ``--min-seconds`` (and at least ``--min-reps`` steps); a point's time is the median of its
steps, and its ratio is axon4d / torch. Compute runs on ``torch.set_num_threads(--threads)``
threads (default: every core this process may run on).

    python bench/overhead.py                    # 4 sizes × 3 token counts, ~0.3 s per layer and point
    python bench/overhead.py --quick            # 2 small points, a few steps (what the test runs)
    python bench/overhead.py --sizes 1024 --tokens 4096 --min-seconds 2

**Per collective** (``--collectives``; ``--collectives-only`` skips the layers): host microseconds
per collective issued and waited, in two settings, each timed in interleaved rounds (the median
of ``--rounds`` rounds of ``--calls`` collectives):

- *layer alone*: one process, a ``Communicator`` over a transport that completes every collective
  at once (a finished ``torch.futures.Future``), so the time is the communication layer's own host
  work — the record, the clock, the handle, the completion callback, the watchdog check — for an
  all-reduce of 16 floats, an all-gather and a reduce-scatter of 16 floats per rank, issued in
  groups of ``--inflight`` and then waited (as a layer's chunks are);
- *on gloo*: a 2-rank gloo grid, the same collectives through ``grid.comm`` against the same
  calls made directly on torch.distributed's process group (the transport's own floor); their
  difference is what axon4d adds per collective on a real transport.

Saves ``bench/results/overhead.json`` (``--quick``: only with ``--out``): the result header
(bench/common.py: command, commit, host, date), the arguments, the date, the host (CPU model,
AVX-512, cores, load average), torch's version and threads, and every point's samples, medians and
ratio. Prints a table of the points; the last line is
``overhead: worst = R× at (IN×OUT, T tokens), median = M×`` (M: the median of the points' ratios),
followed with ``--collectives`` by ``collectives: layer alone U µs per collective (all_reduce A,
all_gather G, reduce_scatter S), on 2-rank gloo +D µs over torch.distributed (T µs)``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import axon4d  # noqa: E402
from axon4d import device as devices  # noqa: E402

#: --quick: two small points, five timed steps per layer and point
QUICK = {"sizes": "512,1024", "tokens": "256", "min_seconds": 0.0, "min_reps": 5, "warmup": 1}


def make_step(layer: nn.Module, x: torch.Tensor, v: torch.Tensor) -> Callable[[], None]:
    """One training step of ``layer`` on ``x``: forward, loss (y·v).sum(), backward, gradients to None."""

    def step() -> None:
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        (layer(x) * v).sum().backward()

    return step


def check_equal(ref: nn.Linear, layer: axon4d.Linear, x: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """Max abs difference of output, input gradient, weight and bias gradients (axon4d vs torch)
    relative to the torch tensor's largest entry; raises if any exceeds fp32 rounding."""
    got: dict[str, list[torch.Tensor]] = {}
    for name, mod in (("axon4d", layer), ("torch", ref)):
        xi = x.detach().clone().requires_grad_()
        y = mod(xi)
        (y * v).sum().backward()
        assert mod.bias is not None and mod.weight.grad is not None and mod.bias.grad is not None
        got[name] = [y.detach(), xi.grad, mod.weight.grad.view(ref.out_features, ref.in_features), mod.bias.grad]
        mod.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"bitwise_equal": True}
    for what, a, b in zip(("output", "input_grad", "weight_grad", "bias_grad"), got["axon4d"], got["torch"]):
        err = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
        out[what] = err
        out["bitwise_equal"] &= bool(torch.equal(a, b))
        if err > 1e-5:
            raise RuntimeError(f"axon4d.Linear differs from torch.nn.Linear in {what}: relative error {err:.2e} > 1e-5")
    return out


def time_point(n_in: int, n_out: int, tokens: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Interleaved step times of axon4d.Linear and torch.nn.Linear on one (in, out, tokens) point."""
    gen = torch.Generator().manual_seed(n_in * 7 + tokens)
    ref = nn.Linear(n_in, n_out, device=device)
    layer = axon4d.Linear.from_dense(ref)
    x = devices.to_device(torch.randn(tokens, n_in, generator=gen), device).requires_grad_()
    v = devices.to_device(torch.randn(n_out, generator=gen), device)
    agreement = check_equal(ref, layer, x, v)
    steps = {"axon4d": make_step(layer, x, v), "torch": make_step(ref, x, v)}

    def timed(step: Callable[[], None]) -> float:
        devices.synchronize(device)
        start = time.perf_counter()
        step()
        devices.synchronize(device)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        for step in steps.values():
            step()
    probe = timed(steps["torch"])  # how many steps make --min-seconds
    reps = max(args.min_reps, math.ceil(args.min_seconds / probe))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            samples[name].append(timed(step))
    medians = {name: common.median(s) for name, s in samples.items()}
    return {
        "in": n_in,
        "out": n_out,
        "tokens": tokens,
        "reps": reps,
        "agreement": agreement,
        "samples_s": samples,
        "median_s": medians,
        "ratio": medians["axon4d"] / medians["torch"],
    }


#: the collectives timed per collective: (name, Communicator method, elements per rank)
COLLECTIVES = (
    ("all_reduce", "all_reduce", 16),
    ("all_gather", "all_gather", 16),
    ("reduce_scatter", "reduce_scatter", 32),
)


class _Done:
    """A collective a transport finished at once (the layer-alone setting): ``wait`` returns at
    once and its future is complete. One instance serves every collective, so the transport's
    own cost is a method call."""

    def __init__(self) -> None:
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(None)

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


_DONE = _Done()


class _DoneTransport:
    """A transport whose collectives move nothing and are done when issued."""

    name = "done"
    stages_reduce_scatter = False

    def all_reduce(self, tensor: torch.Tensor, axis: str) -> _Done:
        return _DONE

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, axis: str) -> _Done:
        return _DONE

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, axis: str) -> _Done:
        return _DONE

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


def _issue_and_wait(issue: Callable[[], Any], calls: int, inflight: int) -> float:
    """Seconds per collective: ``calls`` collectives issued ``inflight`` at a time, then waited."""
    start = time.perf_counter()
    for _ in range(calls // inflight):
        handles = [issue() for _ in range(inflight)]
        for h in handles:
            h.wait()
    return (time.perf_counter() - start) / (calls // inflight * inflight)


def _layer_alone(args: argparse.Namespace) -> dict[str, Any]:
    """Host µs per collective of the communication layer over ``_DoneTransport`` (2 ranks on data)."""
    from axon4d.comm.communicator import Communicator
    from axon4d.grid.shape import GridShape

    comm = Communicator(GridShape(1, 1, 1, 2), _DoneTransport())  # type: ignore[arg-type]
    steps = {}
    for name, method, n in COLLECTIVES:
        t = torch.zeros(n)
        call = getattr(comm, method)
        steps[name] = lambda call=call, t=t: _issue_and_wait(
            lambda: call(t, "data", tag="bench"), args.calls, args.inflight
        )
    for step in steps.values():  # warm-up
        step()
    samples = common.paired(steps, args.rounds)
    comm.log.clear()
    us = {k: common.median(v) * 1e6 for k, v in samples.items()}
    return {"samples_s": samples, "median_us": us, "mean_us": sum(us.values()) / len(us)}


def _on_gloo(grid: Any, args: argparse.Namespace) -> dict[str, Any]:
    """On each rank of a 2-rank gloo grid: µs per collective through ``grid.comm`` and directly on
    torch.distributed's process group of the data axis (the same calls, async then waited)."""
    import torch.distributed as dist

    group = grid.comm.transport.groups["data"]
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed after torch 2.11
    steps = {}
    for name, method, n in COLLECTIVES:
        t = torch.zeros(n)
        out = torch.empty(2 * n if name == "all_gather" else n // 2 if name == "reduce_scatter" else n)
        call = getattr(grid.comm, method)
        if name == "all_reduce":
            raw = lambda t=t: dist.all_reduce(t, group=group, async_op=True)  # noqa: E731
        elif name == "all_gather":
            raw = lambda t=t, out=out: gather(out, t, group=group, async_op=True)  # noqa: E731
        else:
            raw = lambda t=t, out=out: grid.comm.transport.reduce_scatter(out, t, "data")  # noqa: E731
        steps[f"axon4d.{name}"] = lambda call=call, t=t: _issue_and_wait(
            lambda: call(t, "data", tag="bench"), args.calls, args.inflight
        )
        steps[f"torch.{name}"] = lambda raw=raw: _issue_and_wait(raw, args.calls, args.inflight)
    for step in steps.values():
        step()
    grid.comm.barrier()
    samples = {k: [] for k in steps}
    for r in range(args.rounds):  # the same order on both ranks: every collective meets its peer
        for name in common.rotated(list(steps), r):
            samples[name].append(steps[name]())
        grid.comm.log.clear()
    us = {k: common.median(v) * 1e6 for k, v in samples.items()}
    return {"samples_s": samples, "median_us": us}


def collectives(args: argparse.Namespace) -> dict[str, Any]:
    """Both settings of the per-collective bench (see the module docstring)."""
    from axon4d.measure.spawn import run_local

    alone = _layer_alone(args)
    gloo = run_local(2, _on_gloo, args, grid=(1, 1, 1, 2), timeout=1800)
    names = [name for name, _, _ in COLLECTIVES]
    added = {n: gloo["median_us"][f"axon4d.{n}"] - gloo["median_us"][f"torch.{n}"] for n in names}
    return {
        "layer_alone": alone,
        "gloo_2_ranks": gloo,
        "gloo_added_us": added,
        "gloo_added_mean_us": sum(added.values()) / len(added),
        "gloo_torch_mean_us": sum(gloo["median_us"][f"torch.{n}"] for n in names) / len(names),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="512,1024,2048,4096", help="n of the square layers n×n, comma-separated")
    p.add_argument("--tokens", default="256,1024,4096", help="token counts, comma-separated")
    p.add_argument("--min-seconds", type=float, default=0.3, help="time each layer at least this long per point")
    p.add_argument("--min-reps", type=int, default=5, help="at least this many timed steps per layer and point")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per layer and point")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch.set_num_threads")
    p.add_argument("--quick", action="store_true", help="2 small points, 5 steps each (for the test)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/overhead.json; --quick: none)")
    p.add_argument("--collectives", action="store_true", help="also time the host work per collective")
    p.add_argument("--collectives-only", action="store_true", help="only the per-collective bench")
    p.add_argument("--calls", type=int, default=2000, help="collectives per timed round (per collective kind)")
    p.add_argument("--inflight", type=int, default=4, help="collectives issued before they are waited")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per setting")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    out = args.out or (None if args.quick else os.path.join(ROOT, "bench", "results", "overhead.json"))
    torch.set_num_threads(args.threads)

    head = common.header()
    host = dict(head["host"])  # CPU model, AVX-512, cores, load average, torch and Python versions
    host["loadavg_start"] = host.pop("loadavg")
    print(
        f"host: {host['cpu_model']}, AVX-512 {'yes' if host['has_avx512'] else 'no'}, "
        f"{host['cores_available']} cores available, load {host['loadavg_start'][0]:.2f}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    result: dict[str, Any] = {"args": vars(args), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": host}
    lines = []
    if not args.collectives_only:
        result.update(layers(args))
        worst, median = result["summary"]["worst_ratio"], result["summary"]["median_ratio"]
        at = result["summary"]["worst_at"]
        lines.append(f"overhead: worst = {worst:.3f}× at ({at}), median = {median:.3f}×")
    if args.collectives or args.collectives_only:
        per = result["collectives"] = collectives(args)
        alone = per["layer_alone"]["median_us"]
        print(f"{'collective':>15} {'layer alone µs':>15} {'gloo axon4d µs':>15} {'gloo torch µs':>14}", flush=True)
        for name, _, _ in COLLECTIVES:
            gloo = per["gloo_2_ranks"]["median_us"]
            print(f"{name:>15} {alone[name]:15.2f} {gloo[f'axon4d.{name}']:15.2f} {gloo[f'torch.{name}']:14.2f}")
        lines.append(
            f"collectives: layer alone {per['layer_alone']['mean_us']:.1f} µs per collective "
            f"(all_reduce {alone['all_reduce']:.1f}, all_gather {alone['all_gather']:.1f}, "
            f"reduce_scatter {alone['reduce_scatter']:.1f}), on 2-rank gloo +{per['gloo_added_mean_us']:.1f} µs "
            f"over torch.distributed ({per['gloo_torch_mean_us']:.1f} µs)"
        )
    host["loadavg_end"] = os.getloadavg()
    if out is not None:
        print(f"saved {common.save(out, result, head)}")
    for line in lines:
        print(line)
    return 0


def layers(args: argparse.Namespace) -> dict[str, Any]:
    """The one-rank layer points: axon4d.Linear against torch.nn.Linear at every size and token count."""
    grid = axon4d.init(grid=(1, 1, 1, 1), seed=0)
    print(f"{'in×out':>11} {'tokens':>6} {'torch ms':>9} {'axon4d ms':>9} {'ratio':>6} {'reps':>5}", flush=True)
    points = []
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            for tokens in (int(t) for t in args.tokens.split(",")):
                pt = time_point(n, n, tokens, args, grid.device)
                points.append(pt)
                med = pt["median_s"]
                print(
                    f"{f'{n}×{n}':>11} {tokens:>6} {med['torch'] * 1e3:9.3f} {med['axon4d'] * 1e3:9.3f} "
                    f"{pt['ratio']:6.3f} {pt['reps']:5d}",
                    flush=True,
                )
    finally:
        axon4d.shutdown()
    worst = max(points, key=lambda pt: pt["ratio"])
    summary = {
        "worst_ratio": worst["ratio"],
        "worst_at": f"{worst['in']}×{worst['out']}, {worst['tokens']} tokens",
        "median_ratio": common.median(pt["ratio"] for pt in points),
    }
    return {"threads": torch.get_num_threads(), "device": str(grid.device), "points": points, "summary": summary}


if __name__ == "__main__":
    raise SystemExit(main())
