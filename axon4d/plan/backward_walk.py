"""The backward pass walked event by event: the live bytes on one rank and their peak (docs/design.md §4, §5).

Transient: the peak is found by walking the backward pass in order (``BackwardWalk``): at its
start every activation saved under the recompute policy is live, with the logits (in the step's
dtype) and what the final norm keeps; the loss's backward adds the logits' gradient (same dtype)
and at most two fp32 row chunks of ``CE_CHUNK_BYTES`` (axon4d.nn.loss; none for fp32 logits), the
final norm's backward its temporaries (``NORM_BACKWARD_TEMPORARIES``); then each layer's backward
allocates its input gradient, the gathered weight block (E10, when G_z > 1) and the dW block
(computed into E11's zero-padded input, no copy), then issues E11: its gradient shard and, over
more than two ranks, the chunks the host's exchange receives (axon4d.comm.communicator), held with the earlier
layers' still-running reduce-scatters until the scheduler waits on them; it frees what it had
saved. The optimizer step adds its per-tensor temporaries.
"""

from __future__ import annotations

import itertools

from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import weight_shard_numel
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan import moe_memory, moe_placement
from axon4d.plan.saved import (
    NORM_BACKWARD_TEMPORARIES,
    block_activation_elements,
    block_saved,
    block_tensors,
    final_norm_saved,
)
from axon4d.plan.workload import Workload

#: fp32 bytes of one row chunk of the vocabulary-parallel loss (``axon4d.nn.loss.CHUNK_BYTES``: the
#: planner may not import the layers; tests/test_plan.py checks the two agree)
CE_CHUNK_BYTES = 32 * 2**20

#: the linear layer kinds in the order their backward runs (the block's four repeat n_layers times)
BACKWARD_ORDER = ("head", "mlp_down", "mlp_up", "attn_out", "qkv")


class BackwardWalk:
    """Live bytes on one rank from the end of the forward through the backward pass, event by event
    as the scheduler allocates and frees them; ``peak`` is the most seen. ``run`` walks the loss and
    the head, the first block after it and the last block (blocks are alike: the extremes are the
    ends; the blocks between add what the first one left).

    What is live when (bytes on one rank; b tokens; a weight block is n_W = shard·G_z elements,
    ``block``): "+" stays live after the event, "−" is freed by it, "~" is live only while it runs.

    ===========================  ======================================================================
    event (method)               live
    ===========================  ======================================================================
    start                        + every saved activation, the logits, the head's input and what the
                                 final norm keeps (``acts``; ``final_norm_saved``)
    loss backward (``head``)     ~ the logits' gradient (their dtype) and ≤ 2 fp32 row chunks, the head's
                                 gathered block (the probe's mean-square loss: ~4 fp32 logit-sized
                                 temporaries); − the logits
    final norm's backward        ~ its temporaries, after the head's backward; − what it saved
    a layer's backward           ~ the block gathered over z (E10b, ``gathered``; none with keep)
    (``layer``)                  ~ dX and the dW block (computed into E11's padded input, ``dw``)
                                 ~ OAG's blocks of the next ``oag_depth`` layers (``prefetched``)
                                 that exist (an MoE block's: its shared experts', attention's)
                                 ~ its own E11, issued: the shard and received chunks (``issued``)
                                 ~ the newest earlier E11s still running — ``ors_inflight`` under
                                 ORS, one under ODP alone — with their received chunks (``in_flight``)
                                 ~ the input balanced recomputation re-makes
    its E11 waited on (``done``) + its gradient shard and bias slice (``grad``); − the block kept for
                                 it (``kept``; not in a held backward that carries it, ``released``);
                                 − the saved tensors and gradient its backward consumed
    activation's, attention's    ~ their gradients (GELU: one (b, F/G_y), SwiGLU: two; attention: dq,
    backward (``note``)          dk, dv and the assembled qkv gradient)
    ``free``                     − saved tensors consumed
    ``rebuild`` (full)           + the block's activations, re-made from its saved input, and the
                                 blocks its re-run keeps (keep-for-backward); ~ an MoE layer's re-run's
                                 forward rows (``moe_memory.forward_held``)
    ``forward_end``              ~ before the backward, the last block's MoE layer at its gated sum:
                                 every activation but the head's, and its forward's rows
    an MoE block's MLP           ~ the gated sum's gradients; + the rows' gradient through the shared
    (``moe_block_backward``)     experts' backward; ~ the experts' gradients; − what the layer and
                                 the norm saved (``moe_memory.backward_phases``)
    ===========================  ======================================================================

    In one block, in backward order: MLP down (its dX stays as the activation's incoming gradient;
    frees the saved activation output), the activation's backward, MLP up (frees that gradient, the
    up output, SwiGLU's silu(gate) and the norm's tensors), attention output, attention's backward
    (q, k, v, rotated q, k and the LSE replaced by the qkv gradient), QKV (frees that gradient and
    the first norm's tensors).
    """

    def __init__(
        self,
        wl: Workload,
        shape: GridShape,
        recompute: str,
        overlap: OverlapPolicy,
        staged_reduce_scatter: bool,
        acts: float,
        grad_share: float = 1.0,
        grad_bytes: int | None = None,
        wire_bytes: int | None = None,
        fp8_gather: bool = False,
        carried: bool = False,
        cast_weights: bool = False,
        widened_gemms: bool = False,
    ) -> None:
        self.wl, self.shape, self.recompute, self.overlap = wl, shape, recompute, overlap
        self.carried = carried  # a held backward under accumulation: kept blocks stay for the next micro-batch
        # fp32 master weights cast to the 16-bit compute dtype at each use: with G_z = 1 there is no
        # gather, but a layer's block (and OAG's next ones) is still a cast copy of its weight
        self.cast = cast_weights
        self.grad_share = grad_share  # a layer's gradient bytes live after its backward, per gradient byte
        self.grad_bytes = wl.element_size if grad_bytes is None else grad_bytes  # per gradient element
        # per element of a dW block and of its reduce-scatter over z (E11: ``geometry.wire_dtype``)
        self.wire_bytes = self.grad_bytes if wire_bytes is None else wire_bytes
        self.fp8 = fp8_gather and shape.z > 1  # a gathered block arrives as bytes, restored beside them
        self.elem = wl.element_size
        # the host's dW GEMM of 16-bit inputs into fp32 sums widens both first (axon4d.device.mm_widening)
        self.widened = widened_gemms and self.elem != self.wire_bytes
        self.specs = {s.name: s for s in wl.linears()}
        #: a block's linear layers in backward order (an MoE block's MLP is its shared experts', if any)
        self.order = [n for n in BACKWARD_ORDER[1:] if n in self.specs]
        self.t = {k: v * self.elem for k, v in block_tensors(wl, shape).items()}  # one block's tensors, bytes
        saved = block_saved(wl, shape, "none" if recompute == "full" else recompute)
        self.saved = {k: v * (4 if k == "lse" else self.elem) for k, v in saved.items()}  # what a block keeps
        self.rebuilt = block_activation_elements(wl, shape, "none")  # (16-bit, fp32) a rebuilt block keeps
        self.live = self.peak = acts
        m = wl.model
        tokens = wl.local_tokens(shape)
        # an MoE block: its MoE layer's backward phases, what its forward holds and the gradients it
        # leaves (plan.moe_memory)
        lay = wl.expert_layout
        share = min(self.grad_share, 1.0) * self.grad_bytes  # a new gradient's bytes per element
        # the share's forward chunks, each taking the experts' weights again (``moe_placement.moe_chunks``)
        chunks = moe_placement.moe_chunks(m, tokens, shape, self.elem, overlap, wl.accelerator, lay) if m.moe else 1
        self.moe_phases = moe_memory.backward_phases(m, tokens, shape, self.elem, share, wl.imbalance, lay, chunks)
        # what its forward holds beside its saved tensors: (at the pairs, where a re-run stops; at the gated sum)
        self.moe_forward = moe_memory.forward_held(m, tokens, shape, self.elem, chunks, wl.imbalance, lay)
        self.moe_grads = moe_memory.grad_elements(m, shape, lay) * self.grad_bytes if m.moe else 0.0
        z = shape.z
        # a layer's forward block kept for its backward: every block gathered over z under keep-for-backward,
        # and on one rank under mixed precision the weight's cast copy (axon4d.nn.local_linear)
        self.local_cast = cast_weights and shape.world_size == 1
        self.keep = (overlap.oag_keep and z > 1) or self.local_cast
        self.inflight = overlap.ors_inflight if overlap.ors and z > 1 else 1
        self.reduces = (overlap.ors and z > 1) or (overlap.odp and shape.data > 1)
        # over more than two ranks the host's reduce-scatter receives every rank's chunk into a buffer
        # the input's size until it is waited on (axon4d.comm.gloo_exchange.ExchangedChunks) where the backend stages
        self.received = 1.0 if z > 2 and staged_reduce_scatter else 0.0

    # -- sizes, bytes -----------------------------------------------------------------------------------
    def shard(self, name: str) -> int:
        """Elements of ``name``'s weight shard on this rank (⌈n_W/G_z⌉)."""
        s = self.specs[name]
        return weight_shard_numel(s.in_features, s.out_features, self.shape, s.transpose)

    def block(self, name: str) -> float:
        """``name``'s whole weight block, n_W (0 for a layer kind the step lacks)."""
        return 0.0 if name not in self.specs else self.shard(name) * self.shape.z * self.elem

    def blocks(self, first: list[str], repeated: list[str] | tuple[str, ...], n: int) -> float:
        """The first ``n`` blocks of ``first`` followed by ``repeated`` over and over."""
        return sum(map(self.block, itertools.islice(itertools.chain(first, itertools.cycle(repeated)), n)))

    def gathered(self, name: str) -> float:
        """The block gathered over z for ``name``'s backward (E10b; none with keep-for-backward, nor
        on one rank, whose forward's copy is kept)."""
        if self.overlap.oag_keep or self.keep or (self.shape.z == 1 and not self.cast):
            return 0.0
        return self.block(name) * (1 + 1 / self.elem if self.fp8 else 1)

    def dw(self, name: str) -> float:
        """The dW block, computed straight into E11's zero-padded input, in the gradients' dtype
        (fp32 sums when training in 16 bits with fp32 reductions: ``wire_bytes``)."""
        return self.block(name) / self.elem * self.wire_bytes

    def prefetched(self, name: str) -> float:
        """OAG's prefetched blocks of the next ``oag_depth`` layers, alive during ``name``'s backward."""
        if not self.overlap.oag or self.overlap.oag_keep or (self.shape.z == 1 and not self.cast):
            return 0.0
        if self.shape.world_size == 1:  # one rank computes without the scheduler: nothing prefetched
            return 0.0
        return self.blocks(self.after(name), self.order, self.overlap.oag_depth)  # blocks repeat

    def after(self, name: str) -> list[str]:
        """The block's layers whose backward follows ``name``'s in the same block (all of them after
        the head's, or after an MoE layer's ``"moe"``: its block's layers), in order."""
        if name not in self.order:
            return list(self.order)
        return self.order[self.order.index(name) + 1 :]

    def issued(self, name: str) -> float:
        """Once ``name``'s own E11 is issued: the shard it fills and the chunks it receives."""
        shard = self.shard(name)
        return (shard + self.received * shard * self.shape.z) * self.wire_bytes if self.shape.z > 1 else 0.0

    def in_flight(self, name: str, first: bool) -> float:
        """What the ``inflight`` newest reduce-scatters of layers whose backward ran before ``name``'s
        still hold (their gradient blocks, and the received chunks). In the first block after the
        head only the head's and this block's have run; in later blocks, the previous block's too."""
        if name == "head" or not self.reduces or self.shape.z == 1:
            # without z there is no E11: E12 reduces the gradient shard itself, counted by ``grad``
            return 0.0
        earlier = self.order[: self.order.index(name)][::-1]
        first_names, repeated = (earlier + ["head"], []) if first else (earlier, self.order[::-1])
        blocks = self.blocks(first_names, repeated, self.inflight) / self.elem * self.wire_bytes  # gradient blocks
        return blocks * (1 + self.received)

    def grad(self, name: str) -> float:
        """The gradient ``name`` keeps once its E11 is waited on: its shard, and its bias's slice."""
        s = self.specs[name]
        bias = s.local(self.shape)[1] if s.bias else 0  # all-reduced over batch, never staged
        return (self.grad_share * self.shard(name) + min(self.grad_share, 1.0) * bias) * self.grad_bytes

    def widening(self, name: str) -> float:
        """The fp32 copies of dY and X the host's dW GEMM makes of 16-bit inputs (``widened``)."""
        if not self.widened:
            return 0.0
        in_l, out_l = self.specs[name].local(self.shape)
        return self.wl.local_tokens(self.shape) * (in_l + out_l) * 4

    def kept(self, name: str) -> float:
        """The weight block kept for ``name`` (``keep``): freed once its backward ran."""
        return self.block(name) if self.keep else 0.0

    def released(self, name: str) -> float:
        """The kept block ``name``'s backward frees: none in a held backward (``carried``) where the
        block is carried to the next micro-batch — every layer's but a block's under full
        recomputation, which its next forward gathers again (``axon4d.plan.layers.carried``). One
        rank's cast copies are never carried: each micro-batch's forward casts again."""
        if self.carried and not self.local_cast and (name == "head" or self.recompute != "full"):
            return 0.0
        return self.kept(name)

    # -- events -----------------------------------------------------------------------------------------
    def note(self, extra: float = 0.0) -> None:
        """A moment at which ``extra`` bytes are live beside ``live``."""
        self.peak = max(self.peak, self.live + extra)

    def layer(self, name: str, dx: float, first: bool = True, remade: float = 0.0) -> None:
        """``name``'s backward at its peak (``dx``: its input gradient's bytes; ``remade``: the input
        balanced recomputation re-makes): its own reduce-scatter just issued, the earlier ones still
        running (the scheduler completes the older ones only after issuing the new one)."""
        held = self.gathered(name) + dx + self.dw(name) + self.prefetched(name) + self.widening(name)
        self.note(held + self.issued(name) + self.in_flight(name, first) + remade)

    def done(self, name: str, freed: float = 0.0, held: float = 0.0) -> None:
        """``name``'s backward over: its gradient kept, its kept block freed, ``freed`` bytes freed
        and ``held`` bytes (a gradient the next op consumes) still live."""
        self.live += self.grad(name) + held - freed - self.released(name)

    def free(self, nbytes: float) -> None:
        """Saved tensors a backward consumed, freed."""
        self.live -= nbytes

    def rebuild(self) -> None:
        """Full recomputation: this block's activations re-made from its saved input, with the blocks
        its re-run gathers and keeps for backward."""
        kept = sum(map(self.kept, BACKWARD_ORDER[1:]))
        self.live += self.rebuilt[0] * self.elem + self.rebuilt[1] * 4 - self.t["x0"] + kept

    # -- the walk ---------------------------------------------------------------------------------------
    def forward_end(self) -> None:
        """The last block's MoE layer at its gated sum in the forward, before the backward starts:
        every saved activation live but the head's and the final norm's, not made yet, and what
        the layer's forward holds beside its saved tensors (``moe_memory.forward_held``). Under
        full recomputation the layer saves nothing but its dispatched rows (counted with the
        blocks' inputs) and holds the same locals."""
        if not self.wl.model.moe:
            return
        m, shape, b = self.wl.model, self.shape, self.wl.local_tokens(self.shape)
        head = b * (m.vocab_size // shape.y + m.hidden // shape.x) * self.elem + final_norm_saved(self.wl, shape)
        self.note(self.moe_forward[1] - (head if self.wl.head else 0.0))

    def head(self) -> None:
        """The loss's backward, then the head's; the head's input is freed and its dX, the same size,
        is the incoming gradient of the last block's output."""
        m, shape, b = self.wl.model, self.shape, self.wl.local_tokens(self.shape)
        n_v = b * (m.vocab_size // shape.y)  # this rank's logits, (b, vocab/G_y)
        x_in = b * (m.hidden // shape.x) * self.elem
        # with G_z > 1 the head's forward-gathered block is still referenced during the loss's backward
        # (measured on CPU/gloo; with keep-for-backward it is the kept one, counted in the activations)
        if not self.wl.norms:
            # the probe's mean-square loss holds ~4 logit-sized fp32 temporaries at once (measured: the
            # mean's expanded gradient, pow's self·2 and its product, the result); they go with the logits
            self.note(4 * n_v * 4 + self.gathered("head"))
            self.layer("head", x_in)
            self.done("head", freed=x_in + n_v * 4, held=x_in)
            return
        # axon4d's vocabulary-parallel cross-entropy (axon4d.nn.loss): the logits' gradient in their
        # dtype, made one row chunk at a time through at most two fp32 chunks (none for fp32 logits,
        # computed in place); then the saved logits are freed and the gradient is the head's dY
        dlogits = n_v * self.elem
        chunks = 0 if self.wl.dtype == "float32" else 2 * min(n_v * 4, CE_CHUNK_BYTES)
        self.note(dlogits + chunks + self.gathered("head"))
        self.live += dlogits - n_v * self.elem
        self.layer("head", x_in)
        self.done("head", freed=x_in + dlogits, held=x_in)
        # the final norm's backward, its input gradient (the head's dX) live: its temporaries, then
        # what it saved is freed
        kind = self.wl.norm_kernel(shape)
        self.note(NORM_BACKWARD_TEMPORARIES[kind] * b * (m.hidden // shape.x) * 4)
        self.free(final_norm_saved(self.wl, shape))

    def block_backward(self, first: bool) -> None:
        """One block's backward (``first``: the block right after the head)."""
        if self.recompute == "full":
            self.rebuild()
        self.note()
        if self.wl.model.moe:
            if self.recompute == "full":  # its re-run's peak, stopped before the combines: its rows held
                self.note(self.moe_forward[0])
            self.moe_block_backward(first)  # the rows its forward kept stay to the step's end, with the graph
            return
        self.mlp_backward(first)
        self.attention_and_qkv(first)

    def mlp_backward(self, first: bool) -> None:
        """A block's dense MLP's backward (an MoE block's shared experts'), down then up."""
        t, s, balanced = self.t, self.saved, self.recompute == "balanced"
        # dX (b, F/G_y), then the activation's backward, then MLP up; under balanced recomputation
        # each GEMM's backward first re-makes the input it did not keep (the activation, the norm output)
        self.layer("mlp_down", t["act"], first, remade=t["act"] if balanced else 0.0)
        self.done("mlp_down", freed=s["act"], held=t["act"])
        # the activation's backward: GELU's gradient, or SwiGLU's d(gate) and d(up) ((b, F/G_y)
        # each); under balanced recomputation SwiGLU's product needs silu(gate) re-made (GELU's
        # backward needs only its input, which the up projection's output is); beside them MLP up's
        # block, prefetched during MLP down's backward, and MLP down's reduce-scatter, still running
        gated = self.wl.model.gated
        grads = t["act"] * ((2 if gated else 1) + (1 if balanced and gated else 0))
        self.note(grads + self.prefetched("mlp_down") + self.in_flight("mlp_up", first))
        self.layer("mlp_up", t["x1"], first, remade=t["x1"] if balanced else 0.0)
        # frees dX of MLP down, the up output, what the activation and the norm kept (the MoE
        # layer's router and experts keep the norm's output past the shared experts' backward)
        self.done("mlp_up", freed=t["act"] + s["mid"] + s["up"] + (0.0 if self.wl.model.moe else s["norm2"]))

    def moe_block_backward(self, first: bool) -> None:
        """An MoE block's MLP backward in the order autograd runs it (``moe_memory.BackwardPhases``):
        the gated sum's, then the shared experts' MLP (if any) with the MoE layer's saved tensors
        and the rows' gradient live, then the experts', the router's; then attention and QKV.
        Beside the MoE layer's phases: OAG's blocks of the layers after it (prefetched when the
        layer before ran) and the reduce-scatters of the layers before it, which no layer of the
        MoE layer waits on."""
        s, ph = self.saved, self.moe_phases
        inflight = self.in_flight(self.order[0], first) if self.order else 0.0
        self.note(ph.gated_sum + self.prefetched("moe") + inflight)
        self.live += ph.handed_on
        if "mlp_down" in self.specs:
            self.mlp_backward(first)
            # the shared experts' input gradient, held while the experts' and router's add to it
            inflight = self.in_flight(self.order[2], first) if len(self.order) > 2 else 0.0
            self.note(ph.experts + self.t["x1"] + self.prefetched("mlp_up") + inflight)
        else:
            self.note(ph.experts + self.prefetched("moe") + inflight)
        # the experts' and router's gradients kept; what the layer saved, the rows' gradient and the
        # norm's output (the router's and the shared experts' input) freed
        self.live += min(self.grad_share, 1.0) * self.moe_grads - s["moe"] - ph.handed_on - s["norm2"]
        self.attention_and_qkv(first)

    def attention_and_qkv(self, first: bool) -> None:
        """A block's backward from the attention output projection down to QKV."""
        t, s, balanced = self.t, self.saved, self.recompute == "balanced"
        self.layer("attn_out", t["att"], first)  # then attention: dq, dk, dv and their assembled qkv gradient
        self.done("attn_out")
        self.note(t["att"] + 2 * t["qkv"] + t["kv_grad"])  # context parallelism's key/value gradients too
        self.free(s["attention"] - t["qkv"] + s["lse"])  # q, k, v are replaced by their gradient
        self.layer("qkv", t["x0"], first, remade=t["x0"] if balanced else 0.0)
        self.done("qkv", freed=t["qkv"] + s["norm1"])

    def last_blocks(self, first: bool) -> float:
        """The peak live bytes of the pass's last two blocks' backward (one, for a model of one
        block), from what is live now at the start of block 1's (``first``: it is the block right
        after the head)."""
        for i in range(min(self.wl.model.n_layers, 2)):
            self.block_backward(first=first and i == 0)
        return self.peak

    def run(self) -> float:
        """The peak live bytes of the step's backward (and of the forward's end, ``forward_end``):
        ``walk_kinds`` of this walk's blocks alone."""
        return walk_kinds([(self, self.wl.model.n_layers)])


def walk_kinds(walks: list[tuple[BackwardWalk, int]]) -> float:
    """The peak live bytes of the backward of a model whose blocks are of several kinds: ``walks``
    holds each kind's walk (``BackwardWalk`` of a workload whose blocks are all of that kind, the
    first one's starting from the step's live bytes) and how many blocks of it the model has, in
    the order the backward reaches them (the MoE blocks, the last ones, before the dense blocks of
    ``first_k_dense``). The forward's end (``forward_end``), the head's backward, then per kind its
    first block walked, the rest of its blocks but the last repeating that block's change of live
    bytes, and its last block walked. A kind's first block starts from the live bytes
    the kind before it left, with its own blocks' layers as the ones the scheduler prefetches and
    still reduces (the boundary's one block of the other kind is not modelled)."""
    head = walks[0][0]
    head.forward_end()
    if head.wl.head:
        head.head()
    live, peak, first = head.live, head.peak, True
    for walk, count in walks:
        walk.live, walk.peak = live, peak
        start = walk.live
        walk.block_backward(first=first)
        if count > 1:
            walk.live = start + (count - 1) * (walk.live - start)
            walk.block_backward(first=False)
        live, peak, first = walk.live, walk.peak, False
    return peak
