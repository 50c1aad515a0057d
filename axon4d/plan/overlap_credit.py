"""Overlap credit: how much of a step's communication the overlap mechanisms hide (docs/design.md §4, §6).

The input is the step's linear layer kinds in forward order, each as a ``Window``: how often it
runs, the compute of its forward and backward windows, and the seconds of its collectives by term
(E8, E9, E10f, E10b, E11, E12, E13; priced by ``axon4d.plan.cost``). Nothing here prices anything:
this module only decides which collective hides behind which window, never more than the compute
in that window times the machine's overlap efficiency:

    forward window of layer i  = its GEMM + the non-GEMM work after it (attention, GELU, …)
        hides: OAG — layer i+1's Z all-gather (E10f) prefetched;
               chunked E8 — (k−1)/k of layer i's forward all-reduce, within (k−1)/k of its GEMM
                 (k the forward all-reduces E8 is issued as, ``geometry.forward_chunk_count``)
    backward window of layer i = the non-GEMM backward work after layer i + its dX and dW GEMMs
        hides: OAR — layer i's E9 all-reduce, within its dW GEMM;
               ORS — layer i+1's E11 reduce-scatter; ODP — layer i+1's E12 (and E13) all-reduce;
               OAG — layer i−1's backward all-gather (E10b) prefetched
    deeper overlap: with ``oag_depth`` d > 1 a gather is issued d layers ahead, so what of it the
        window before its layer could not hide may go into the spare of the d − 1 windows before
        that; with ``ors_inflight`` k > 1 a reduce-scatter may spill into the k − 1 backward
        windows after its own. Spare is handed out in the order the collectives were issued (one
        link, first come first served), over the repeated block in its steady state
        (``deeper_overlap``)

Block layers are repeated n_layers times and their neighbours wrap around the block. Which
mechanisms are on is the library's own ``axon4d.options.overlap_policy.OverlapPolicy``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from axon4d.layout.geometry import Term
from axon4d.options.overlap_policy import OverlapPolicy

#: the overlap mechanisms credited, in the order ``Credit.by_mechanism`` lists them
MECHANISMS = ("oag", "oar", "ors", "odp", "chunks")


@dataclasses.dataclass(frozen=True)
class Window:
    """One linear layer kind as the overlap schedule sees it (seconds of one run on one rank)."""

    count: int  # runs per step
    repeated: bool  # one of the block's layers (repeated n_layers times; its neighbours wrap around)
    forward_s: float  # the forward window: the layer's forward + the non-GEMM work after it
    forward_gemm_s: float  # of which the forward GEMM (what a chunked E8 overlaps)
    backward_s: float  # the backward window: the non-GEMM backward after the layer + its dX, dW and elementwise
    dw_s: float  # the dW GEMM (what OAR overlaps)
    chunks: int  # forward all-reduces E8 is issued as
    comm: Mapping[Term, float]  # term (E8, E9, E10f, E10b, E11, E12, E13) -> seconds


@dataclasses.dataclass
class Credit:
    """Seconds hidden per step, by mechanism (``MECHANISMS``), and per run of each window."""

    by_mechanism: dict[str, float]
    per_window: list[float]  # hidden in window i's forward and backward, one run of layer i

    @property
    def total(self) -> float:
        return sum(self.by_mechanism.values())


def credit(windows: Sequence[Window], overlap: OverlapPolicy, efficiency: float) -> Credit:
    """What ``overlap`` hides of the collectives of ``windows`` (the step's layers in forward order),
    each window hiding at most ``efficiency`` × its compute: the one-window credits of the module
    docstring, then what deeper prefetching and more reduce-scatters in flight add."""
    block = [i for i, w in enumerate(windows) if w.repeated]

    def neighbour(i: int, step: int) -> Window | None:
        if i in block:
            return windows[block[(block.index(i) + step) % len(block)]]
        j = i + step
        return windows[j] if 0 <= j < len(windows) else None

    hidden = dict.fromkeys(MECHANISMS, 0.0)
    per_window: list[float] = []
    spare_f: dict[int, float] = {}  # window -> capacity left after the one-window credits below
    spare_b: dict[int, float] = {}
    short: dict[str, dict[int, float]] = {"oag_f": {}, "oag_b": {}, "ors": {}}  # window -> not yet hidden
    for i, w in enumerate(windows):
        n, c = w.count, w.comm
        # forward window
        cap = efficiency * w.forward_s
        h_f = 0.0
        if w.chunks > 1:
            k = w.chunks
            h = min(c[Term.E8] * (k - 1) / k, efficiency * w.forward_gemm_s * (k - 1) / k, cap)
            hidden["chunks"] += n * h
            h_f += h
        nxt = neighbour(i, +1)
        if overlap.oag and nxt is not None:
            h = min(nxt.comm.get(Term.E10F, 0.0), cap - h_f)
            hidden["oag"] += n * h
            h_f += h
            short["oag_f"][i] = nxt.comm.get(Term.E10F, 0.0) - h
        spare_f[i] = cap - h_f
        # backward window
        cap = efficiency * w.backward_s
        h_b = 0.0
        if overlap.oar and Term.E9 in c:
            h = min(c[Term.E9], efficiency * w.dw_s, cap)
            hidden["oar"] += n * h
            h_b += h
        later = neighbour(i, +1)  # its backward ran just before this layer's
        if later is not None:
            if overlap.ors:
                h = min(later.comm.get(Term.E11, 0.0), cap - h_b)
                hidden["ors"] += n * h
                h_b += h
                short["ors"][i] = later.comm.get(Term.E11, 0.0) - h
            if overlap.odp:
                h = min(later.comm.get(Term.E12, 0.0) + later.comm.get(Term.E13, 0.0), cap - h_b)
                hidden["odp"] += n * h
                h_b += h
        earlier = neighbour(i, -1)
        if overlap.oag and earlier is not None and not overlap.oag_keep:
            h = min(earlier.comm.get(Term.E10B, 0.0), cap - h_b)
            hidden["oag"] += n * h
            h_b += h
            short["oag_b"][i] = earlier.comm.get(Term.E10B, 0.0) - h
        spare_b[i] = cap - h_b
        per_window.append(h_f + h_b)
    if block:
        for mech, i, h in deeper_overlap(block, spare_f, spare_b, short, overlap):
            hidden[mech] += windows[i].count * h
            per_window[i] += h
    return Credit(hidden, per_window)


def deeper_overlap(
    block: list[int],
    spare_f: dict[int, float],
    spare_b: dict[int, float],
    short: dict[str, dict[int, float]],
    overlap: OverlapPolicy,
) -> list[tuple[str, int, float]]:
    """(mechanism, window, seconds) hidden beyond the one-window credits of ``credit``.

    ``block`` lists the repeated layers' indices in forward order; ``spare_f``/``spare_b`` map each
    to the capacity its forward/backward window has left; ``short`` maps each window to what of the
    collective credited there is still exposed: "oag_f" the next layer's forward gather, "oag_b"
    the previous layer's backward gather, "ors" the later layer's reduce-scatter. With
    ``oag_depth`` d a gather was issued d − 1 windows before the one credited, and may use those
    windows' spare; with ``ors_inflight`` k a reduce-scatter may use the k − 1 backward windows
    after its own. The block is unrolled over enough repetitions that the middle one sees the
    steady state (every window has neighbours on both sides); its credits are returned, per run of
    the block. Each window's spare goes to the collectives in the order they were issued."""
    d = overlap.oag_depth if overlap.oag else 1
    k = overlap.ors_inflight if overlap.ors else 1
    reach = max(d, k) - 1
    if reach == 0:
        return []
    size = len(block)
    periods = 4 * -(-reach // size) + 1
    middle = range((periods // 2) * size, (periods // 2 + 1) * size)
    out: list[tuple[str, int, float]] = []
    mechanism = {"oag_f": "oag", "oag_b": "oag", "ors": "ors"}

    def hand_out(order: list[int], spare: dict[int, float], jobs: list[tuple[int, str, int, range]]) -> None:
        """``jobs``: (issue position, mechanism, owner position, window positions), in any order;
        positions index the unrolled ``order`` (layer indices, in the pass's own order)."""
        left = [spare[order[t % size]] for t in range(periods * size)]
        for _, mech, owner, windows in sorted(jobs, key=lambda j: (j[0], j[2])):
            need = short[mech][order[owner % size]]
            for t in windows:
                if need <= 0:
                    break
                if 0 <= t < len(left) and left[t] > 0:
                    h = min(need, left[t])
                    left[t] -= h
                    need -= h
                    if owner in middle:
                        out.append((mechanism[mech], order[t % size], h))

    if d > 1 and short["oag_f"]:  # the gather credited at window t was issued at window t − d + 1
        hand_out(
            block,
            spare_f,
            [
                (t - d + 1, "oag_f", t, range(t - d + 1, t))
                for t in range(periods * size)
                if block[t % size] in short["oag_f"]
            ],
        )
    backward = block[::-1]
    jobs = []
    if d > 1 and short["oag_b"]:
        jobs += [
            (t - d + 1, "oag_b", t, range(t - d + 1, t))
            for t in range(periods * size)
            if backward[t % size] in short["oag_b"]
        ]
    if k > 1 and short["ors"]:  # issued just before window t, left running for k − 1 more windows
        jobs += [
            (t - 1, "ors", t, range(t + 1, t + k)) for t in range(periods * size) if backward[t % size] in short["ors"]
        ]
    if jobs:
        hand_out(backward, spare_b, jobs)
    return out
