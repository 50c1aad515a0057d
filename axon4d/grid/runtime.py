"""Starting and stopping axon4d in a process: ``init()``, ``get_grid()``, ``shutdown()``.

``init`` reads the launcher (torchrun, mpirun/mpiexec, srun, or a lone process), creates the
default process group with the backend that fits the device (bound to it when it is an
accelerator), validates the grid on every rank before any group exists, and builds it. The grid it returns is also the default for layers created without
an explicit ``grid=``.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from axon4d import device as devices
from axon4d.comm.communicator import TransportChoice
from axon4d.comm.transport import PROBE, choose_transport, settle_transport
from axon4d.grid import launch
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import GridShape
from axon4d.options.overlap_policy import AUTO, OverlapPolicy
from axon4d.options.precision import Precision
from axon4d.plan.auto import choose, choose_overlap

_state: dict[str, object] = {"grid": None, "owns_world": False, "launch": None, "probed": None}


def init(
    grid: GridShape | Sequence[int] | dict[str, int] | str = (1, 1, 1, -1),
    *,
    backend: str | None = None,
    device: str | torch.device | None = None,
    comm: str = "auto",
    overlap: OverlapPolicy | bool | str | dict[str, Any] | None = AUTO,
    seed: int | None = None,
    timeout_s: float = 600.0,
    plan: dict[str, Any] | None = None,
    precision: Precision | str | None = None,
    comm_timing: bool | None = None,
    expert_layout: ExpertLayout | str | None = None,
) -> Grid:
    """Join the job and build the 4D grid ``(x, y, z, data)``; return it and make it current.

    ``grid`` may hold one -1 ("the rest"); the default is pure data parallelism. ``backend`` is
    the torch.distributed backend (default: NCCL with accelerators, gloo otherwise); ``device``
    overrides the compute device; ``comm`` chooses the communication layer's transport: "torch",
    "mpi" (also ``backend="mpi"``), or "auto": ``$AXON4D_COMM`` ("torch"/"mpi") when set; else,
    when launched by mpirun/mpiexec on the host with mpi4py present, the faster of the two by a
    short probe on the world group (all-reduce, all-gather, reduce-scatter at 64 KiB and 4 MiB;
    every rank takes the same verdict; measured once per job, reused by later ``init`` calls);
    else torch (axon4d.comm.transport.choose_transport, settle_transport). The choice and the probe's
    figures are ``grid.comm.transport_choice``, logged on rank 0 (logger "axon4d.comm.transport", INFO).
    ``device="cuda"`` (no index) is this rank's own accelerator, as when ``device`` is not given.
    ``overlap`` is the overlap policy
    (axon4d.options.overlap_policy.OverlapPolicy.parse: True/None = all on, False/"off", "oag,oar", a dict), or
    "auto" (the default): all on, with the knobs the planner predicts fastest for this grid where
    ``plan`` names the model and a machine description is named (``plan["machine"]`` or
    $AXON4D_MACHINE; no file is read unless named), else the default knobs
    (axon4d.plan.auto.choose_overlap).
    ``seed``, if given, seeds torch's generator identically on every rank.
    ``grid="auto"`` lets the planner choose (axon4d.plan.auto.choose_grid) for ``plan`` =
    {"model": ModelConfig or size name, "batch": sequences, "machine": name or file, ...}; to build
    and time the planner's best few plans for your model first and take the fastest measured,
    ``axon4d.try_plans`` (then ``init(**tried.init_args())``).
    ``precision`` sets the dtypes of master weights, compute and gradient reductions for every
    layer on the grid (axon4d.options.precision: "fp32", "bf16", "bf16-fp32-reduce", "bf16-fp8-gather");
    a name given here is the planner's too (``plan["precision"]``) unless ``plan`` names one.
    ``comm_timing``: whether collectives are timed (default ``$AXON4D_COMM_TIMING``, on unless "0");
    off, an accelerator records no timing events per collective and the log holds no times
    (axon4d.comm.log).
    ``expert_layout``: where MoE layers built on the grid place their experts
    (axon4d.grid.expert_layout: e.g. "ep=world,tp=1", whole experts over every rank; default
    experts over data × z, each split over x·y); a layer may be given its own.
    Raises ``ValueError`` on every rank, before any collective, if the grid does not fit.
    A default process group that exists already (the caller's, or one an earlier ``init()`` in this
    job created; see ``shutdown``) is used as it is.
    """
    info = _joining()
    if expert_layout is not None:  # a pinned layout: the planner prices it (grid="auto", overlap="auto")
        expert_layout = ExpertLayout.parse(expert_layout)
        plan = {**plan, "expert_layout": expert_layout} if plan is not None else None
    shape, overlap, chosen_layout = _shape_and_overlap(grid, overlap, plan, precision, info)
    dev = devices.rank_device(None if device is None else torch.device(device), info.local_rank)
    devices.bind(dev)
    if seed is not None:
        torch.manual_seed(seed)
    transport, backend, why = choose_transport(comm, backend, info.launcher, dev)
    policy = OverlapPolicy.parse(overlap)  # raises before any group exists
    mixed = Precision.parse(precision)  # likewise
    layout = ExpertLayout.parse(expert_layout if expert_layout is not None else chosen_layout or None)
    if not dist.is_initialized():
        launch.start_world(info, backend or devices.default_backend(dev), timeout_s, device=dev)
        _state["owns_world"], _state["launch"] = True, info
    choice = _settled_transport(transport, why, dev, info)
    new = Grid(
        shape,
        dev,
        choice.name,
        launcher=info.launcher,
        precision=mixed,
        overlap=policy,
        timing=comm_timing,
        timeout_s=timeout_s,
        expert_layout=layout,
    )
    new.comm.transport_choice = choice
    _state["grid"] = new
    return new


def _joining() -> launch.LaunchInfo:
    """The rank, world size and local rank ``init`` builds the grid for: the launcher's, or those of
    the world an earlier ``init`` created. ``RuntimeError`` when a grid is built already."""
    if _state["grid"] is not None:
        raise RuntimeError(
            f"axon4d.init() was already called and built {_state['grid']}; "
            "call axon4d.shutdown() first to build another grid"
        )
    info = launch.detect()
    if _state["owns_world"] and dist.is_initialized():
        info = _state["launch"]  # type: ignore[assignment]  # the world an earlier init() created
    return info


def _shape_and_overlap(
    grid: GridShape | Sequence[int] | dict[str, int] | str,
    overlap: OverlapPolicy | bool | str | dict[str, Any] | None,
    plan: dict[str, Any] | None,
    precision: Precision | str | None,
    info: launch.LaunchInfo,
) -> tuple[GridShape, OverlapPolicy | bool | str | dict[str, Any] | None, str]:
    """``init``'s grid shape and overlap policy for the world of ``info``, and the expert layout
    the planner chose ("" where it chose none): ``grid="auto"`` the planner's grid for ``plan`` (and
    its knobs under ``overlap="auto"``, its layout for an MoE model), ``overlap="auto"`` on a given
    grid the knobs the planner predicts fastest there; the planner prices ``precision``'s
    collectives unless ``plan`` names a precision or a workload."""
    if plan is not None and isinstance(precision, str) and "precision" not in plan and "workload" not in plan:
        plan = {**plan, "precision": precision}  # the planner prices what this grid's collectives move
    if isinstance(grid, str):
        if grid != "auto":
            raise ValueError(f"grid={grid!r}: give (x, y, z, data) sizes or 'auto' (the planner chooses)")
        chosen = choose(info.world_size, overlap=overlap, rank=info.rank, **(plan or {}))
        grid, overlap, layout = chosen.shape, chosen.overlap if overlap == AUTO else overlap, chosen.expert_layout
    else:
        layout = ""
    shape = GridShape.parse(grid, info.world_size)
    if overlap == AUTO:
        priced = {**(plan or {}), **({"expert_layout": layout} if layout else {})}  # the layout the grid builds
        overlap = choose_overlap(shape, rank=info.rank, **priced)
    return shape, overlap, layout


def _settled_transport(transport: str, why: str, dev: torch.device, info: launch.LaunchInfo) -> TransportChoice:
    """The transport ``choose_transport`` named, settled on the world (``settle_transport``); a
    probe is run once per world: a world ``init`` created keeps its verdict for later calls."""
    choice = _state["probed"] if transport == PROBE else None  # a probe is run once per world
    if not isinstance(choice, TransportChoice):
        choice = settle_transport(transport, why, dev, info.rank, info.world_size)
        if choice.seconds is not None and _state["owns_world"]:
            _state["probed"] = choice
    return choice


def get_grid() -> Grid:
    """The grid built by ``axon4d.init()``; raises ``RuntimeError`` if there is none."""
    grid = _state["grid"]
    if grid is None:
        raise RuntimeError("no axon4d grid: call axon4d.init(grid=(x, y, z, data)) first")
    assert isinstance(grid, Grid)
    return grid


def resolve(grid: Grid | None) -> Grid:
    """``grid`` if given, else the current one."""
    return grid if grid is not None else get_grid()


def shutdown(clean: bool | None = None) -> None:
    """Destroy the current grid's groups; ``init()`` may then build another grid in this process.

    The default process group that ``init()`` created stays until the process exits (it is
    destroyed then): under torchrun, destroying it and creating it again in the same job hangs
    (tests/test_launch.py builds two grids in one job). A default group the caller created is
    never touched.

    Called while an exception propagates (from a ``finally``), it enters no barrier: the other
    ranks may be inside a collective this rank will never join, and the barrier would hang it
    instead of letting its error end the job (docs/reliability.md). ``clean`` says so explicitly
    (False: no barrier and no draining, as after an error every rank agreed on)."""
    grid = _state["grid"]
    if grid is None:
        return
    assert isinstance(grid, Grid)
    _state["grid"] = None
    if clean is None:
        clean = sys.exc_info()[0] is None
    if dist.is_initialized() and clean:
        grid.comm.barrier()  # a rank leaving early can abort the others (docs/design.md §7)
    grid.destroy(drain=clean)  # collects what refers to its groups (Grid.destroy)


def _at_exit() -> None:
    """Shut down, then destroy the default process group if ``init()`` created it."""
    shutdown()
    if _state["owns_world"] and dist.is_initialized():
        dist.destroy_process_group()
    _state["owns_world"], _state["launch"], _state["probed"] = False, None, None


atexit.register(_at_exit)
