"""Protects the communication layer: collectives return the right data along any dim, every call
is logged with its payload, and a Linear's forward + backward moves exactly the bytes of docs/design.md
E8–E13 as computed by axon4d.layout.geometry (the planner's source of truth)."""

import importlib.util
import types
from collections import Counter

import pytest
import torch

import axon4d
from axon4d.layout.geometry import Op, Term, linear_collectives


def _primitives(grid):
    comm = grid.comm
    comm.log.clear()
    r = grid.rank
    out = {}
    out["all_reduce"] = comm.all_reduce(torch.full((3,), float(r)), "x").wait()
    base = torch.arange(6.0).view(2, 3) + 10 * grid.coord("y")
    out["gather0"] = comm.all_gather(base, "y").wait()
    out["gather1"] = comm.all_gather(base, "y", dim=1).wait()
    out["gather_last"] = comm.all_gather(base, "y", dim=-1).wait()
    rs = torch.arange(8.0).view(4, 2) * (grid.coord("z") + 1)
    out["rs0"] = comm.reduce_scatter(rs, "z").wait()
    rs1 = torch.arange(8.0).view(2, 4) * (grid.coord("z") + 1)
    out["rs1"] = comm.reduce_scatter(rs1, "z", dim=1).wait()
    out["records"] = [(rec.op, rec.axis, rec.payload_bytes, rec.group_size) for rec in comm.log.records]
    out["timed"] = all(rec.t_wait_end is not None and rec.duration >= rec.blocked >= 0 for rec in comm.log.records)
    out["coords"] = dict(grid.coords)
    return out


@pytest.mark.slow
def test_collectives_return_correct_data_and_are_logged(pools):
    for res in pools(8).run((2, 2, 2, 1), _primitives):
        c = res["coords"]
        x_peer_sum = float(sum(c["y"] * 2 + c["z"] * 4 + i for i in range(2)))
        assert torch.equal(res["all_reduce"], torch.full((3,), x_peer_sum))
        base = torch.arange(6.0).view(2, 3)
        assert torch.equal(res["gather0"], torch.cat([base, base + 10], 0))
        assert torch.equal(res["gather1"], torch.cat([base, base + 10], 1))
        assert torch.equal(res["gather_last"], res["gather1"])
        z = c["z"]
        assert torch.equal(res["rs0"], (torch.arange(8.0).view(4, 2) * 3)[2 * z : 2 * z + 2])
        assert torch.equal(res["rs1"], (torch.arange(8.0).view(2, 4) * 3)[:, 2 * z : 2 * z + 2])
        assert res["records"] == [
            (Op.ALL_REDUCE, "x", 12, 2),
            (Op.ALL_GATHER, "y", 48, 2),
            (Op.ALL_GATHER, "y", 48, 2),
            (Op.ALL_GATHER, "y", 48, 2),
            (Op.REDUCE_SCATTER, "z", 32, 2),
            (Op.REDUCE_SCATTER, "z", 32, 2),
        ]
        assert res["timed"]


def _inputs_stay_live_until_wait(grid):
    """Bytes torch's memory tracker sees live while a reduce-scatter and an all-gather whose inputs
    the caller dropped are in flight, and after they were waited on."""
    import time

    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    seen = []

    def live() -> int:
        return tracker.get_tracker_snapshot("current")[grid.device]["Total"]

    with tracker:
        for op in ("reduce_scatter", "all_gather"):
            handle = getattr(grid.comm, op)(torch.ones(1 << 18), "z")  # 1 MiB input, caller keeps no reference
            seen.append(live())
            result = handle.wait()
            del handle
            # the handle lets go at wait(); the backend's own work object may hold the storage a
            # moment longer (a loaded host: seconds): wait for the release, up to a minute
            deadline = time.monotonic() + 60.0
            while live() > seen[-1] - (1 << 20) and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append(live())
            del result
    return seen


def test_a_collective_holds_its_input_until_it_is_waited_on(pools):
    # gloo (and MPI) read the input while the collective is in flight: the handle keeps it live, so
    # memory accounting (the planner bench's MemTracker) sees it, and it is released by wait()
    for rs_live, rs_done, ag_live, ag_done in pools(2).run((1, 1, 2, 1), _inputs_stay_live_until_wait):
        mib = 2**20
        assert rs_live >= mib + mib // 2 and rs_done - rs_live <= -mib + 1  # input + half-size output, then output
        assert ag_live >= mib + 2 * mib and ag_done - ag_live <= -mib + 1  # input + doubled output, then output


def _size_one_axes_are_free(grid):
    grid.comm.log.clear()
    t = torch.ones(4)
    same = grid.comm.all_reduce(t, "y").wait() is t and grid.comm.all_gather(t, "z").wait() is t
    return same, len(grid.comm.log.records), grid.comm.log.format_summary()


def test_axes_of_size_one_issue_and_log_nothing(pools):
    for same, n, summary in pools(2).run((2, 1, 1, 1), _size_one_axes_are_free):
        assert same and n == 0 and summary.startswith("comm none")


def _gather_and_scatter_on_either_torch(grid):
    """All-gather and reduce-scatter over z with torch's current names (no deprecation warning),
    then with only the names torch 2.11 has (all_gather_into_tensor, reduce_scatter_tensor)."""
    import warnings

    import torch.distributed as dist

    def run():
        z = grid.coord("z")
        return (
            grid.comm.all_gather(torch.full((2,), float(z)), "z").wait().tolist(),
            grid.comm.reduce_scatter(torch.arange(8.0) * (z + 1), "z").wait().tolist(),  # gloo's own (4 ranks)
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated name would raise here
        current = run()
    renamed = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single") if hasattr(dist, n)}
    try:
        for n in renamed:
            delattr(dist, n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            old = run()
    finally:
        for n, f in renamed.items():
            setattr(dist, n, f)
    return grid.coord("z"), current, old


def test_collectives_run_on_torch_before_and_after_the_rename(pools):
    # GPU hosts run torch 2.11, which predates all_gather_single / reduce_scatter_single
    for z, current, old in pools(4).run((1, 1, 4, 1), _gather_and_scatter_on_either_torch):
        gathered = [float(k) for k in range(4) for _ in range(2)]
        expected = (gathered, [10.0 * 2 * z, 10.0 * (2 * z + 1)])  # the ranks' factors sum to 10
        assert current == expected and old == expected


def _reduce_scatter_routes(grid):
    """Which torch.distributed calls a reduce-scatter over z makes (gloo), and its result."""
    import torch.distributed as dist

    calls = Counter()
    names = ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counted(name, f):
        def call(*args, **kwargs):
            calls[name] += 1
            return f(*args, **kwargs)

        return call

    try:
        for n, f in saved.items():
            setattr(dist, n, counted(n, f))
        g, z = grid.size("z"), grid.coord("z")
        full = torch.arange(4.0 * g).view(2 * g, 2) * (z + 1)  # rows [2z, 2z + 2) are this rank's
        out = grid.comm.reduce_scatter(full, "z").wait()
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return g, z, out, dict(calls)


@pytest.mark.slow
def test_reduce_scatter_exchanges_chunks_on_gloo(pools):
    # gloo's reduce-scatter moves the whole tensor like an all-reduce (and stages a copy of it);
    # axon4d sends each rank the chunk it keeps instead, in one all-to-all: over a pair only the
    # other's half, over more ranks every chunk, summed in rank order on wait
    for ranks in (2, 4, 8):
        for g, z, out, calls in pools(ranks).run((1, 1, ranks, 1), _reduce_scatter_routes):
            total = sum(torch.arange(4.0 * g).view(2 * g, 2) * (k + 1) for k in range(g))
            assert torch.equal(out, total[2 * z : 2 * z + 2])
            native = calls.get("reduce_scatter_single", 0) + calls.get("reduce_scatter_tensor", 0)
            assert (calls.get("all_to_all_single", 0), native) == (1, 0), calls


LAYERS = [(24, 40, True, False), (40, 24, True, True), (24, 36, False, False)]


def _bytes_of_one_step(grid, dtype_name):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    layers = [axon4d.Linear(i, o, bias=b, transpose=t, dtype=dtype) for i, o, b, t in LAYERS]
    x = axon4d.shard_input(torch.randn(8, 3, 24, dtype=dtype)).requires_grad_()
    grid.comm.log.clear()
    y = layers[2](layers[1](layers[0](x)))
    y.float().sum().backward()
    return Counter((r.op, r.axis, r.payload_bytes) for r in grid.comm.log.records)


@pytest.mark.parametrize("grid", [(2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 4, 1), (2, 2, 1, 2), (1, 1, 8, 1)])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.slow
def test_linear_moves_exactly_the_bytes_of_e8_to_e13(pools, grid, dtype_name):
    shape = axon4d.GridShape(*grid)
    tokens = 8 * 3 // shape.size("batch")
    elem = torch.empty(0, dtype=getattr(torch, dtype_name)).element_size()
    expected = Counter()
    for i, o, b, t in LAYERS:
        for c in linear_collectives(i, o, tokens, shape, transpose=t, bias=b, element_size=elem):
            expected[(c.op, c.axis, c.payload_bytes)] += 1
    for counted in pools(8).run(grid, _bytes_of_one_step, dtype_name):
        assert counted == expected


def test_volume_terms_match_the_design_table():
    shape = axon4d.GridShape(2, 4, 2, 2)
    cs = linear_collectives(1024, 4096, 512, shape, transpose=False, bias=True, element_size=2)
    by_term = {(c.term, c.phase): c for c in cs}
    n_w = 4096 * 1024 // (2 * 4)
    e8, e9 = by_term[(Term.E8, "forward")], by_term[(Term.E9, "backward")]
    assert e8.payload_bytes == 512 * 4096 // 4 * 2 and e8.axis == "x"
    assert e9.payload_bytes == 512 * 1024 // 2 * 2 and e9.axis == "y"
    assert by_term[(Term.E10F, "forward")].payload_bytes == n_w * 2 == by_term[(Term.E10B, "backward")].payload_bytes
    assert by_term[(Term.E11, "backward")].payload_bytes == n_w * 2
    e12, e13 = by_term[(Term.E12, "backward")], by_term[(Term.E13, "backward")]
    assert e12.payload_bytes == n_w // 2 * 2 and e12.axis == "data"
    assert e13.payload_bytes == 4096 // 4 * 2 and e13.axis == "batch"
    t = {(c.term, c.phase): c for c in linear_collectives(1024, 4096, 512, shape, transpose=True, element_size=2)}
    assert t[(Term.E8, "forward")].axis == "y" and t[(Term.E8, "forward")].payload_bytes == 512 * 4096 // 2 * 2
    cached = linear_collectives(1024, 4096, 512, shape, cache_weight=True)
    assert [c.phase for c in cached if c.term in (Term.E10F, Term.E10B)] == ["forward"]


def test_the_probe_picks_the_transport_whose_slowest_rank_is_fastest():
    from axon4d.comm.transport import decide_transport

    # rank 0 alone would pick torch; the slowest rank decides: mpi 0.5 s < torch 0.9 s
    per_rank = [{"mpi": 0.4, "torch": 0.2}, {"mpi": 0.5, "torch": 0.9}, {"mpi": 0.3, "torch": 0.3}]
    choice = decide_transport(per_rank)
    assert (choice.name, choice.seconds) == ("mpi", {"mpi": 0.5, "torch": 0.9})
    assert choice.why == "probe over 3 ranks"
    assert decide_transport([{"mpi": 0.7, "torch": 0.6}] * 4).name == "torch"
    assert decide_transport([{"mpi": 0.5, "torch": 0.5}]).name == "mpi"  # an exact tie: the launcher's own
    assert "mpi 0.5 s, torch 0.9 s" in choice.describe()
    with pytest.raises(ValueError, match="rank 1's probe figures"):
        decide_transport([{"mpi": 0.1, "torch": 0.1}, {"mpi": 0.1}])
    with pytest.raises(ValueError, match="at least one rank"):
        decide_transport([])


def test_transport_overrides_and_other_launchers_never_probe(monkeypatch):
    from axon4d import device as devices
    from axon4d.comm.communicator import TransportChoice
    from axon4d.comm.transport import PROBE, choose_transport, settle_transport

    host, accel = devices.HOST, torch.device("meta")  # meta: any device that is not host memory
    monkeypatch.delenv("AXON4D_COMM", raising=False)
    expected = PROBE if importlib.util.find_spec("mpi4py") else "torch"
    assert choose_transport("auto", None, "mpi", host)[0] == expected
    assert choose_transport("auto", None, "torchrun", host) == ("torch", None, "launcher torchrun")
    assert choose_transport("auto", None, "mpi", accel) == ("torch", None, "device meta")
    assert choose_transport("torch", None, "mpi", host) == ("torch", None, "comm='torch'")
    assert choose_transport("auto", "mpi", "mpi", host) == ("mpi", None, 'backend="mpi"')
    for value in ("torch", "mpi"):
        monkeypatch.setenv("AXON4D_COMM", value)
        assert choose_transport("auto", "gloo", "mpi", host) == (value, "gloo", f"AXON4D_COMM={value}")
    monkeypatch.setenv("AXON4D_COMM", "nccl")
    with pytest.raises(ValueError, match="AXON4D_COMM='nccl'"):
        choose_transport("auto", None, "mpi", host)
    with pytest.raises(ValueError, match="comm='fast'"):
        choose_transport("fast", None, "mpi", host)
    assert settle_transport("mpi", "comm='mpi'", host, 0, 4) == TransportChoice("mpi", "comm='mpi'")
    assert settle_transport(PROBE, "probe", host, 0, 1) == TransportChoice("torch", "one rank: no collective to time")


#: where the stand-in device's timeline starts: beyond any host's perf_counter (seconds since boot),
#: so a time read from the host clock instead of a device mark cannot pass for one
DEVICE_EPOCH = 1e9


class _DeviceEvent:
    """A stand-in for an accelerator's timing event: a time, known only once read."""

    def __init__(self, t):
        self.t = t


class _DeviceClock:
    """A clock like an accelerator's (axon4d.device.Clock with on_device): marks are events read later;
    counts how often the hot path would have blocked the host to read one."""

    on_device = True

    def __init__(self):
        import time

        self.now, self.reads = time.perf_counter, 0

    def mark(self):
        return _DeviceEvent(self.now() + DEVICE_EPOCH)  # a device timeline of its own, far ahead of the host's

    def seconds(self, mark):
        self.reads += 1
        return mark if isinstance(mark, float) else mark.t


def _device_timed(grid):
    clock = _DeviceClock()
    grid.comm.use_clock(clock)
    grid.comm.log.clear()
    torch.manual_seed(0)
    layer = axon4d.Linear(16, 16)
    layer(axon4d.shard_input(torch.randn(8, 16))).sum().backward()
    read_during_step = clock.reads
    records, spans = grid.comm.log.records, grid.comm.log.spans
    return {
        "read_during_step": read_during_step,
        "records": len(records),
        "on_device_scale": all(min(r.t_issue, r.t_wait_start, r.t_wait_end) >= DEVICE_EPOCH for r in records),
        "done_before_resume": all(r.t_done is None or r.t_done <= r.t_wait_end for r in records),
        "pending": sum(1 for r in records if r.marks),
        "spans": len(spans) > 0 and all(a >= DEVICE_EPOCH and b >= a for _, a, b in spans),
        "hidden": grid.comm.log.summary()["hidden_pct"],
    }


def test_on_an_accelerator_the_log_times_collectives_by_device_marks_read_after_the_step(pools):
    """On an accelerator (NCCL) the host neither blocks in a wait nor sees completion, so the log takes
    device marks (axon4d.device.Clock: timing events on the current stream) at issue, at the wait and
    where the compute stream resumes, and at completion from the backend future's callback. They are
    read only when the log is — never during the step, which would block the host each time — and
    then every record and compute span is on the device's timeline (here a stand-in clock)."""
    for got in pools(2).run((1, 1, 2, 1), _device_timed):
        assert got["read_during_step"] == 0
        assert got["records"] >= 2  # E10 all-gathers, E11 reduce-scatter
        assert got["on_device_scale"] and got["spans"] and got["done_before_resume"]
        assert got["pending"] == 0
        assert 0.0 <= got["hidden"] <= 100.0


def test_a_completion_reported_after_the_log_was_read_changes_nothing():
    """The transport may report a collective's completion on its own thread after the wait returned,
    even after the log read the record's device marks: the record stays settled (no pending mark,
    its completion no later than the wait's end), whatever the order — the race the device-timed
    test above once lost."""
    from axon4d.comm.log import CommRecord
    from axon4d.layout.geometry import Op

    clock = _DeviceClock()
    late = CommRecord(Op.ALL_GATHER, "z", 2, 64, Term.E10F, t_issue=0.0)
    late.mark("t_issue", clock.mark())
    late.mark("t_wait_start", clock.mark())
    late.mark("t_wait_end", clock.mark())
    late.settle(clock)
    assert late.settled and late.marks is None and late.t_done is None
    late.completed_on(clock)()  # the completion, reported after the read
    assert late.marks is None and late.t_done is None
    late.settle(clock)
    assert late.blocked == late.t_wait_end - late.t_wait_start and late.duration == late.t_wait_end - late.t_issue
    # reported after the wait but before the read: clamped to the wait's end
    early = CommRecord(Op.ALL_GATHER, "z", 2, 64, Term.E10F, t_issue=0.0)
    for field in ("t_issue", "t_wait_start", "t_wait_end"):
        early.mark(field, clock.mark())
    early.completed_on(clock)()
    early.settle(clock)
    assert early.settled and early.marks is None and early.t_done == early.t_wait_end
    # a record read before its wait (a collective still in flight) takes its completion later
    open_ = CommRecord(Op.ALL_GATHER, "z", 2, 64, Term.E10F, t_issue=0.0)
    open_.mark("t_issue", clock.mark())
    open_.settle(clock)
    assert not open_.settled
    open_.completed_on(clock)()
    assert open_.marks is not None and "t_done" in open_.marks


class _CountingDeviceClock(_DeviceClock):
    """An accelerator-like clock that counts the marks (timing events) taken on it."""

    def __init__(self):
        super().__init__()
        self.marks = 0

    def mark(self):
        self.marks += 1
        return super().mark()


class _DoneWork:
    """A collective the transport finished at once, with a completion callback like NCCL's futures."""

    def wait(self):
        return True

    def add_done_callback(self, callback):
        callback()


def _untimed_or_timed(timing):
    """A communicator on a (1,1,2,1) grid over a transport that finishes at once, on a device-like
    clock; one all-reduce and one compute span; (the clock, the communicator)."""
    from axon4d.comm.communicator import Communicator
    from axon4d.grid.shape import GridShape

    transport = types.SimpleNamespace(name="fake", all_reduce=lambda tensor, axis: _DoneWork())
    clock = _CountingDeviceClock()
    comm = Communicator(GridShape.parse((1, 1, 2, 1), 2), transport, clock, timing=timing)
    comm.all_reduce(torch.ones(4), "z", tag="probe").wait()
    start = comm.clock.mark()
    comm.log.add_span("compute", start, comm.clock.mark())
    return clock, comm


def test_with_timing_off_no_device_event_is_taken_and_readers_of_times_say_why(monkeypatch):
    from axon4d import stepstats, trace

    clock, comm = _untimed_or_timed(True)
    assert clock.marks == 6  # issue, completion, wait start and end, the span's two
    assert comm.log.summary()["axes"]["z"]["bytes"] == 16 and len(comm.log.spans) == 1
    clock, comm = _untimed_or_timed(False)
    assert clock.marks == 0
    assert not comm.clock.on_device and comm.device_clock is None
    (record,) = comm.log.records
    assert (record.op.value, record.axis, record.payload_bytes, record.tag) == ("all_reduce", "z", 16, "probe")
    assert record.marks is None and record.t_wait_start is None and record.t_done is None
    assert comm.log.bytes_by_axis() == {"z": 16} and comm.log.spans == []
    untimed = comm.log.summary()  # bytes and counts, no times: what the training job reports then
    assert untimed["axes"]["z"]["bytes"] == 16 and untimed["axes"]["z"]["count"] == 1
    assert untimed["comm_s"] is untimed["hidden_pct"] is None and "not timed" in comm.log.format_summary()
    grid = types.SimpleNamespace(comm=comm, rank=0)
    for read in (lambda: stepstats.report(comm.log), lambda: trace.dump(grid, "unused")):
        with pytest.raises(RuntimeError, match="does not time them \\(AXON4D_COMM_TIMING=0 or timing=False\\)"):
            read()
    monkeypatch.setenv("AXON4D_COMM_TIMING", "0")
    assert _untimed_or_timed(None)[0].marks == 0
    monkeypatch.setenv("AXON4D_COMM_TIMING", "1")
    assert _untimed_or_timed(None)[0].marks == 6


@pytest.mark.parametrize("completion", [1.5, 2.5], ids=["completed-in-the-wait", "reported-after-it"])
@pytest.mark.parametrize("first", ["transport", "wait"])
def test_on_the_host_a_completion_and_the_wait_s_end_keep_the_earlier_time_in_either_order(
    monkeypatch, completion, first
):
    """On the host the transport's thread reports completion (``completed_on``) while the rank's
    own thread stamps its wait (``waited``): whichever comes first, and whether the transport's
    clock read falls inside the wait or after it, the record ends complete at the earlier time,
    never after the wait ended."""
    import types

    from axon4d.comm import log as commlog
    from axon4d.comm.log import CommRecord
    from axon4d.device import HOST
    from axon4d.device.clock import Clock

    monkeypatch.setattr(commlog, "time", types.SimpleNamespace(perf_counter=lambda: completion))
    record = CommRecord(Op.ALL_GATHER, "z", 2, 64, Term.E10F, t_issue=0.0)
    stamps = {"transport": record.completed_on(Clock(HOST)), "wait": lambda: record.waited(1.0, 2.0)}
    for who in (first, "wait" if first == "transport" else "transport"):
        stamps[who]()
    assert (record.t_wait_start, record.t_wait_end) == (1.0, 2.0)
    assert record.t_done == min(completion, 2.0)
    assert record.blocked == min(completion, 2.0) - 1.0 and record.duration == min(completion, 2.0)


def _all_to_all(grid):
    """Rank r of batch sends (r + j) % 3 rows to rank j, each row tagged (sender, receiver, row)."""
    comm = grid.comm
    comm.log.clear()
    r, g = grid.coord("batch"), grid.size("batch")
    send = [(r + j) % 3 for j in range(g)]
    recv = [(i + r) % 3 for i in range(g)]
    rows = [torch.tensor([[float(r), float(j), float(k)]]) for j in range(g) for k in range(send[j])]
    inp = torch.cat(rows) if rows else torch.empty(0, 3)
    out = comm.all_to_all(inp, "batch", send, recv, tag="moe.dispatch").wait()
    bf = comm.all_to_all(inp.bfloat16(), "batch", send, recv).wait()
    errors = {}
    try:
        comm.all_to_all(inp, "batch", send[:-1], recv)
    except ValueError as e:
        errors["count"] = str(e)
    try:
        comm.all_to_all(inp, "batch", [s + 1 for s in send], recv)
    except ValueError as e:
        errors["sum"] = str(e)
    records = [(rec.op, rec.axis, rec.payload_bytes, str(rec.tag)) for rec in comm.log.records]
    return {"out": out, "bf": bf, "recv": recv, "rank": r, "records": records, "errors": errors, "g": g}


@pytest.mark.parametrize("world,grid", [(2, (1, 1, 2, 1)), pytest.param(8, (1, 2, 2, 2), marks=pytest.mark.slow)])
def test_all_to_all_moves_each_rows_split_to_its_rank_and_logs_the_bytes_sent(pools, world, grid):
    for res in pools(world).run(grid, _all_to_all):
        r, g = res["rank"], res["g"]
        want = [[float(i), float(r), float(k)] for i in range(g) for k in range(res["recv"][i])]
        assert res["out"].tolist() == want
        assert res["bf"].float().tolist() == want
        sent = sum((r + j) % 3 for j in range(g)) * 3
        assert res["records"] == [
            (Op.ALL_TO_ALL, "batch", sent * 4, "moe.dispatch"),
            (Op.ALL_TO_ALL, "batch", sent * 2, ""),
        ]
        assert "one row count per rank" in res["errors"]["count"]
        assert "adding up to" in res["errors"]["sum"]
