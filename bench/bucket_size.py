"""The data axis's gradient all-reduce (E12, E13, the replicated gradients) by bucket size.

One collective per tensor pays the link's latency once per tensor; a bucket pays it once per
bucket plus a copy of its tensors into one flat buffer (``axon4d.scheduler``'s buckets:
``OverlapPolicy.bucket_mb``). On a data axis of ``--ranks`` ranks over loopback gloo, the gradients of
a transformer-shaped model (``--layers`` blocks of width ``--hidden``: per block the QKV, output,
up and down weights and their biases, two norms) are all-reduced once per step with each bucket
size, the sizes interleaved round by round; the median wall time per step of each, the number of
collectives, and the median time of one 4-byte all-reduce (the latency a call pays).

    python bench/bucket_size.py                 # 2 ranks, 8 blocks of width 256 (24 MiB of gradients)
    python bench/bucket_size.py --model         # nothing timed: the planner's NCCL model (below)

Saves bench/results/bucket_size_loopback.json (with the result header of bench/common.py); the last
line is ``bucket_size: best B MiB (T ms/step), per tensor T0 ms/step over N calls, latency L us``.
Nothing here is overlapped with compute: it prices the calls, not what ODP hides behind backward.

``--model`` instead prices, on every shipped accelerator machine file, one all-reduce over a data
axis of 8 ranks in a node, 8 nodes and 64 nodes (one rank per node; ``Machine.comm_time``, NCCL's
tuner as ``axon4d.plan.collective_model`` reproduces it) for each bucket size: the share of the
call's time its latency (the price of a 1-byte call) takes. Saves bench/results/bucket_size_model.json;
the last line is ``bucket_size model: latency share at 25 MiB across nodes at most P%``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES_MB = (0.0, 0.25, 1.0, 4.0, 25.0)


def _tensor_sizes(layers: int, hidden: int) -> list[int]:
    """Elements of each gradient tensor, in backward order: per block the down, up, output and QKV
    weights with their biases, and two norm weights."""
    h = hidden
    block = [4 * h * h, h, 4 * h * h, 4 * h, h * h, h, 3 * h * h, 3 * h, h, h]
    return block * layers


def _buckets(sizes: list[int], bucket_mb: float) -> list[list[int]]:
    """Indices of ``sizes`` grouped as the scheduler groups them: a bucket closes once it holds
    ``bucket_mb`` of fp32 bytes (0: every tensor alone)."""
    out: list[list[int]] = [[]]
    held = 0
    for i, n in enumerate(sizes):
        out[-1].append(i)
        held += 4 * n
        if held >= bucket_mb * 2**20:
            out.append([])
            held = 0
    return [b for b in out if b]


def worker(args: argparse.Namespace) -> None:
    import torch

    import axon4d
    from axon4d.layout.geometry import Term

    torch.set_num_threads(1)
    grid = axon4d.init(grid=(1, 1, 1, args.ranks), seed=0)
    sizes = _tensor_sizes(args.layers, args.hidden)
    grads = [torch.randn(n) for n in sizes]
    plans = {mb: _buckets(sizes, mb) for mb in SIZES_MB}

    def step(mb: float) -> float:
        grid.comm.barrier()
        t0 = time.perf_counter()
        handles = []
        for bucket in plans[mb]:
            flat = grads[bucket[0]] if len(bucket) == 1 else torch.cat([grads[i] for i in bucket])
            handles.append(grid.comm.all_reduce(flat, "data", tag=Term.E12))
        for h in handles:
            h.wait()
        return time.perf_counter() - t0

    tiny = torch.zeros(1)
    latency = []
    for mb in SIZES_MB:
        step(mb)  # warm up
    times: dict[float, list[float]] = {mb: [] for mb in SIZES_MB}
    for r in range(args.rounds):
        for mb in common.rotated([str(m) for m in SIZES_MB], r):
            times[float(mb)].append(step(float(mb)))
        grid.comm.barrier()
        t0 = time.perf_counter()
        grid.comm.all_reduce(tiny, "data").wait()
        latency.append(time.perf_counter() - t0)
    if grid.rank == 0:
        out = {
            "tensors": len(sizes),
            "gradient_mib": sum(sizes) * 4 / 2**20,
            "latency_s": common.median(latency),
            "by_bucket_mb": {
                str(mb): {"calls": len(plans[mb]), "step_s": common.median(times[mb]), "steps_s": times[mb]}
                for mb in SIZES_MB
            },
        }
        with open(args.out, "w") as f:
            json.dump(out, f)
    axon4d.shutdown()


def model() -> dict[str, dict[str, dict[str, float]]]:
    """{machine: {placement: {bucket MiB: latency share of one all-reduce of that size}}}."""
    from axon4d.plan import machine

    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in machine.available():
        m = machine.load(name)
        if not m.accelerator:
            continue
        per_node = m.devices_per_node
        for label, group, stride in (("8 in a node", 8, 1), ("8 nodes", 8, per_node), ("64 nodes", 64, per_node)):
            latency = m.comm_time("all_reduce", group, stride, 1, group * stride)
            out.setdefault(name, {})[label] = {
                str(mb): latency / m.comm_time("all_reduce", group, stride, mb * 2**20, group * stride)
                for mb in (1, 4, 16, 25, 64, 128)
            }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="ranks on the data axis")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--model", action="store_true", help="the planner's NCCL model instead; nothing timed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ranks < 2 or args.layers < 1 or args.hidden < 1 or args.rounds < 1:
        p.error("--ranks >= 2, --layers, --hidden and --rounds >= 1")
    if args.worker:
        worker(args)
        return 0
    if args.model:
        sys.path.insert(0, ROOT)
        shares = model()
        common.save(os.path.join(HERE, "results", "bucket_size_model.json"), {"latency_share": shares})
        print(json.dumps(shares, indent=1))
        worst = max(s["25"] for rows in shares.values() for label, s in rows.items() if "nodes" in label)
        print(f"bucket_size model: latency share at 25 MiB across nodes at most {worst:.1%}")
        return 0
    head = common.header()
    out = f"/tmp/axon4d_bucket_size_{os.getpid()}.json"
    cmd = [os.path.abspath(__file__), "--worker", "--out", out, "--ranks", str(args.ranks)]
    cmd += ["--layers", str(args.layers), "--hidden", str(args.hidden), "--rounds", str(args.rounds)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    code = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), *cmd], env=env
    ).returncode
    if code != 0:
        raise SystemExit(f"a rank failed (exit {code}); see the output above")
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    setting = {"where": "loopback", "ranks": args.ranks, "layers": args.layers, "hidden": args.hidden}
    path = os.path.join(HERE, "results", "bucket_size_loopback.json")
    common.save(path, {"setting": {**setting, "rounds": args.rounds}, "results": result}, head)
    rows = result["by_bucket_mb"]
    best = min(rows, key=lambda mb: rows[mb]["step_s"])
    print(json.dumps(rows, indent=1))
    print(
        f"bucket_size: best {best} MiB ({rows[best]['step_s'] * 1e3:.2f} ms/step), per tensor "
        f"{rows['0.0']['step_s'] * 1e3:.2f} ms/step over {rows['0.0']['calls']} calls, "
        f"latency {result['latency_s'] * 1e6:.0f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
