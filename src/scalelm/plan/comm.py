"""The bytes one GPU sends per optimizer step under a layout, collective by collective, and the link that carries them.

Ring algorithms, as NCCL runs them for large messages; n is the group's size, B a message's bytes:

    all-reduce       2 (n - 1)/n B      DDP's gradients (fp32); HSDP's gradient shards across the replicas
    all-gather       (n - 1)/n B        FSDP's weights before a unit's forward, and again before its backward
                                        unless reshard_after_forward is off (in the compute precision)
    reduce-scatter   (n - 1)/n B        FSDP's gradients (fp32), once per step (accumulation skips the others)
    TP all-reduce    2 (n - 1)/n B      per block, two forward (after attention, after the FFN) and two backward
                                        (one each in a mixture of experts' block: the mixture is not split),
                                        B = tokens x d_model in the compute precision; with sequence parallelism the
                                        same bytes as a reduce-scatter and an all-gather each; and the vocabulary-split
                                        embedding's rows, forward (B = tokens x d_model in the weight's dtype)
    send/recv        B                  a pipeline stage's activations forward and their gradients back,
                                        B = micro-batch tokens x d_model, per micro-batch and stage boundary
    CP ring          B                  per block and pass: cp - 1 key/value blocks forward (B = 2 x a rank's
                                        tokens x d_model / tp in the compute precision), backward the same and cp
                                        hops of their fp32 gradients
    EP all-to-all    (n - 1)/n B        per mixture and pass, over the ep ranks: forward the routed rows to their
                                        experts' ranks and back (dispatch and combine, B = tokens x top_k x d_model
                                        in the compute precision, of which (ep - 1)/ep leave the rank under uniform
                                        routing), each after an all-to-all of the rows' counts (B = experts int64);
                                        backward the two gradients the same way (activation checkpointing
                                        recomputes none of them)
    EP FSDP          as FSDP's rows     a mixture's experts (a rank's ep share) gathered and their gradients
                                        reduce-scattered over efsdp (dp_shard / ep), the shards all-reduced over
                                        dp_replicate: FSDP's collectives, one unit per mixture, on their own groups

With expert parallelism the FSDP rows above count every parameter but the experts, which the EP FSDP rows count.

With context parallelism FSDP's group is dp_shard x cp, and every activation counts a rank's 1/cp of the tokens.

The link is the slowest one a group's ranks span: within a node (NVLink, PCIe) or across nodes (the network), from
where the mesh puts the ranks (scalelm.parallel.dims: tp innermost, pp outermost). Small collectives (the gradient
norm, the loss, tensor parallelism's replicated norms) are left out; the experts' row counts are not (one per
mixture and pass, each waited for: their latency, not their bytes).

Each flow also says how it is cut into messages (FSDP: one per unit; DDP: its gradient buckets; TP: one per
all-reduce; a pipeline: one per micro-batch and boundary; EP: one per all-to-all), as the machine's baseline
measures collectives (scalelm.measure.baseline: the op, a message as the whole buffer): the step-time model
(scalelm.plan.steptime) prices each flow at its message size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from scalelm.model.architecture import QKV_WEIGHT, is_moe_block
from scalelm.parallel.dims import ParallelDims
from scalelm.plan.memory import Workload, block_indices, fsdp_unit, gathered, rank_tensors

INTRA, INTER = "intra-node", "inter-node"
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default, which scalelm keeps
COUNT_BYTES = 8  # an expert's row count in the dispatch's first all-to-all (int64, scalelm.model.moe.tally's)


@dataclass(frozen=True)
class Traffic:
    collective: str
    dim: str  # the mesh dimension whose groups run it
    bytes: int  # sent by one GPU per optimizer step
    link: str  # INTRA or INTER
    op: str  # as the baseline names it: all_reduce, all_gather, reduce_scatter, send_recv; all_to_all
    messages: int  # per optimizer step
    message_bytes: int  # one message's buffer (all_gather's output, reduce_scatter's input)
    overlaps: str | None  # the pass a GPU runs it beside (forward, backward), or None where compute waits for it

    def to_dict(self) -> dict:
        return asdict(self)


def link(dims: ParallelDims, dim: str, gpus_per_node: int) -> str:
    """Whether every group along `dim` stays on one node when ranks fill nodes of `gpus_per_node` in order."""
    spans = any(len({rank // gpus_per_node for rank in group}) > 1 for group in dims.groups(dim))
    return INTER if spans else INTRA


def traffic(work: Workload, dims: ParallelDims, gpus_per_node: int) -> list[Traffic]:
    """What one GPU (of the pipeline rank holding the most parameters) sends per step."""
    config = work.config
    options, d, e = config.parallel, config.model.d_model, work.compute_bytes
    global_batch, micro = config.batch.sizes(dims.dp_size)
    per_rank_batch = global_batch // dims.dp_size
    accumulation = max(1, per_rank_batch // micro)
    chunks = work.layout(dims).microbatches
    passes = accumulation * chunks  # forward passes per step
    tensors = max(rank_tensors(work, dims), key=lambda mine: sum(t.numel(dims.tp) for t in mine))
    sharded = [t for t in tensors if fsdp_unit(t, dims) == t.unit]  # all but the experts under expert parallelism
    params = sum(t.numel(dims.tp) for t in sharded)  # this rank's parameters before FSDP cuts them
    head = sum(t.numel(dims.tp) for t in tensors if t.unit == "head")  # never resharded between forward and backward
    units = len({t.unit for t in tensors})  # FSDP's: the embedding, each block, the head, the root
    out = []

    def add(collective: str, dim: str, op: str, payload: float, messages: int, overlaps: str | None) -> None:
        """`messages` collectives of `op` over the groups along `dim` moving `payload` bytes in all (a ring's share
        each)."""
        if payload > 0 and messages > 0:
            n = len(dims.groups(dim)[0])
            sent = (2 if op == "all_reduce" else 1) * (n - 1) / n * payload if op != "send_recv" else payload
            wire = link(dims, dim, gpus_per_node)
            out.append(Traffic(collective, dim, int(sent), wire, op, messages, int(payload / messages), overlaps))

    tokens = per_rank_batch * config.data.seq_len // dims.cp  # this rank's, over the step's passes
    if dims.sharded:
        over = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
        # prefetched: the next unit's while this one computes
        add("all-gather weights (FSDP forward)", over, "all_gather", passes * params * e, passes * units, "forward")
        if options.reshards(dims.pp):
            regathered, gathers = passes * (params - head) * e, passes * (units - (1 if head else 0))
            add("all-gather weights (FSDP backward)", over, "all_gather", regathered, gathers, "backward")
        add("reduce-scatter gradients (FSDP)", over, "reduce_scatter", params * 4, units, "backward")
        if dims.dp_replicate > 1:
            shards = -(-params // dims.shard_size) * 4
            add("all-reduce gradient shards (HSDP replicas)", "dp_replicate", "all_reduce", shards, units, "backward")
    elif dims.dp_replicate > 1:
        gradients = params * 4
        buckets = -(-gradients // DDP_BUCKET_BYTES)
        # a bucket as soon as its gradients are ready
        add("all-reduce gradients (DDP)", "dp_replicate", "all_reduce", gradients, buckets, "backward")
    blocks = sum(1 for t in tensors if t.name.endswith(QKV_WEIGHT))
    if dims.tp > 1:
        # waited for: the next matrix product needs the sum; a mixture's block sums its attention's only (the
        # mixture computes whole on every rank of the group)
        mixtures = sum(1 for t in tensors if t.name.endswith("ffn.router.weight"))
        sums = 4 * blocks - 2 * mixtures
        activations = sums * tokens * d * e
        add(
            "all-reduce activations (TP, 4 per block, 2 per mixture's)",
            "tp",
            "all_reduce",
            activations,
            sums * passes,
            None,
        )
        if any(t.unit == "embed" and t.tp_dim is not None for t in tensors):
            # the vocabulary-split embedding's rows summed, forward only, in the weight's dtype (FSDP's bf16 copy)
            looked_up = tokens * d * (e if dims.sharded else 4)
            add("all-reduce embedding rows (TP, vocabulary-split)", "tp", "all_reduce", looked_up, passes, None)
    if dims.pp > 1:
        virtual = work.layout(dims).virtual_stages
        transfers = 2 * virtual * accumulation * chunks
        boundary = transfers * tokens // chunks * d * e
        add("send activations and gradients (PP)", "pp", "send_recv", boundary, transfers, None)
    if dims.cp > 1:
        block = 2 * tokens * d / dims.tp  # a rank's keys and values, over the step's passes
        hops = blocks * passes * (dims.cp - 1)
        forward = blocks * (dims.cp - 1) * block * e
        backward = blocks * ((dims.cp - 1) * block * e + dims.cp * block * 4)  # and the blocks' fp32 gradients
        # the next block travels while this one computes
        add("send key/value blocks (CP ring, forward)", "cp", "send_recv", forward, hops, "forward")
        add(
            "send key/value blocks and their gradients (CP ring, backward)",
            "cp",
            "send_recv",
            backward,
            hops + blocks * passes * dims.cp,
            "backward",
        )
    if dims.ep > 1:
        for flow in expert_flows(work, dims, tensors, tokens, passes):
            add(*flow)
    return out


def expert_flows(work: Workload, dims: ParallelDims, tensors: list, tokens: int, passes: int) -> list[tuple]:
    """Expert parallelism's collectives on a rank holding `tensors`, with `tokens` over the step's `passes` (the
    module docstring's EP rows), as `traffic`'s add takes them: the all-to-alls, waited for (the experts need their
    rows), and FSDP's over the experts, overlapped as FSDP's are."""
    model, e = work.config.model, work.compute_bytes
    mixtures = sum(is_moe_block(model, i) for i in block_indices(tensors))
    if not mixtures:
        return []
    rows = mixtures * tokens * model.moe.top_k * model.d_model * e  # every mixture's routed rows, one way
    calls = mixtures * passes  # of each all-to-all
    share = sum(gathered(t, dims) for t in tensors if t.expert)  # the experts of a rank's ep share, all mixtures
    counts = calls * model.moe.experts * COUNT_BYTES
    flows = [
        ("all-to-all row counts (EP)", "ep", "all_to_all", counts, calls, None),
        ("all-to-all dispatch and combine (EP, forward)", "ep", "all_to_all", 2 * rows, 2 * calls, None),
        ("all-to-all gradients (EP, backward)", "ep", "all_to_all", 2 * rows, 2 * calls, None),
    ]
    if dims.expert_shards > 1:
        flows.append(
            ("all-gather experts (EP FSDP forward)", "efsdp", "all_gather", passes * share * e, calls, "forward")
        )
        if work.config.parallel.reshards(dims.pp):
            flows.append(
                ("all-gather experts (EP FSDP backward)", "efsdp", "all_gather", passes * share * e, calls, "backward")
            )
        flows.append(
            ("reduce-scatter expert gradients (EP FSDP)", "efsdp", "reduce_scatter", share * 4, mixtures, "backward")
        )
    if dims.dp_replicate > 1:
        shards = -(-share // dims.expert_shards) * 4
        flows.append(
            (
                "all-reduce expert gradient shards (EP replicas)",
                "dp_replicate",
                "all_reduce",
                shards,
                mixtures,
                "backward",
            )
        )
    return flows


def totals(flows: list[Traffic]) -> dict[str, int]:
    """Bytes per step by link."""
    return {link: sum(f.bytes for f in flows if f.link == link) for link in (INTRA, INTER)}
