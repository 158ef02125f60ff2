"""Ring attention (scalelm.parallel.context) against plain causal attention on the whole sequence.

One spawn of 4 gloo processes runs every distributed case: cp = 4 on all of them, and cp = 2 on the groups {0, 2}
and {1, 3} at the same time (group ranks that are not global ranks, so the ring's neighbour mapping is exercised).
Each group's first rank saves the gathered output and gradients; the parent compares. float64 cases are held to
1e-10 relative, the float32 case to 1e-5 relative (atol 1e-6)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ring_reference import gather_sequence, reference_attention
from scalelm.errors import ConfigError
from scalelm.parallel.context import chunk_positions, ring_attention, shard_sequence

B, H, S, D = 2, 3, 16, 8
F64 = {"rtol": 1e-10, "atol": 1e-12}
F32 = {"rtol": 1e-5, "atol": 1e-6}

# name: (cp, load_balance, dtype, dropout_p, seed); cp = 4 runs on all ranks, "pair0" on {0, 2}, "pair1" on {1, 3}
CASES = {
    "cp4": {
        "cp4-contiguous": (4, False, torch.float64, 0.0, None),
        "cp4-balanced": (4, True, torch.float64, 0.0, None),
        "cp4-balanced-fp32": (4, True, torch.float32, 0.0, None),
        "cp4-balanced-dropout": (4, True, torch.float64, 0.1, 7),
    },
    "pair0": {
        "cp2-contiguous": (2, False, torch.float64, 0.0, None),
        "cp2-contiguous-dropout": (2, False, torch.float64, 0.1, 1234),
    },
    "pair1": {
        "cp2-balanced": (2, True, torch.float64, 0.0, None),
        "cp2-balanced-dropout": (2, True, torch.float64, 0.1, 1234),
    },
}


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v and the loss weights, the same in every process."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(4)]


def _run_case(case, group) -> dict[str, torch.Tensor]:
    cp, balanced, dtype, p, seed = case
    n, r = dist.get_world_size(group), dist.get_rank(group)
    assert n == cp
    q, k, v, w = _inputs(dtype)
    parts = [shard_sequence(t, 2, r, n, balanced).clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*parts, group, dropout_p=p, seed=seed, load_balance=balanced)
    (out * shard_sequence(w, 2, r, n, balanced)).sum().backward()
    result = [out.detach(), *(t.grad for t in parts)]
    result = dict(zip(("out", "dq", "dk", "dv"), (gather_sequence(t, 2, group, balanced) for t in result)))
    result["round_trip"] = gather_sequence(shard_sequence(q, 2, r, n, balanced), 2, group, balanced)
    return result


def _worker(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    # a short timeout: a ring whose messages do not match fails in seconds instead of hanging the suite
    store = f"file://{tmp}/store"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    groups = {"cp4": dist.new_group([0, 1, 2, 3]), "pair0": dist.new_group([0, 2]), "pair1": dist.new_group([1, 3])}
    results = {}
    for kind in ("cp4", "pair0" if rank % 2 == 0 else "pair1"):
        for name, case in CASES[kind].items():
            result = _run_case(case, groups[kind])
            if dist.get_rank(groups[kind]) == 0:
                results[name] = result
    torch.save(results, f"{tmp}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    tmp = tmp_path_factory.mktemp("ring")
    workers = mp.start_processes(_worker, args=(4, str(tmp)), nprocs=4, join=False, start_method="spawn")
    deadline = time.monotonic() + 90
    while not workers.join(timeout=1):  # raises, with the worker's traceback, if one failed
        if time.monotonic() > deadline:
            for process in workers.processes:
                process.kill()
            pytest.fail("the ring attention workers did not finish in 90 s")
    results = {}
    for rank in range(4):
        results |= torch.load(tmp / f"rank{rank}.pt")
    assert set(results) == {name for cases in CASES.values() for name in cases}
    return results


def _reference(dtype: torch.dtype, p: float, seed: int | None, sdpa: bool) -> dict[str, torch.Tensor]:
    q, k, v, w = _inputs(dtype)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if sdpa:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = reference_attention(q, k, v, dropout_p=p, seed=seed)
    (out * w).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _assert_matches(got: dict, want: dict, tol: dict) -> None:
    for key in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(got[key], want[key], **tol, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize(
    "name", ["cp4-contiguous", "cp4-balanced", "cp4-balanced-fp32", "cp2-contiguous", "cp2-balanced"]
)
def test_ring_attention_equals_causal_sdpa_forward_and_backward(ring_results, name):
    cp, _, dtype, _, _ = {n: c for cases in CASES.values() for n, c in cases.items()}[name]
    got = ring_results[name]
    assert got["out"].dtype == dtype and got["out"].shape == (B, H, S, D)
    _assert_matches(got, _reference(dtype, 0.0, None, sdpa=True), F32 if dtype == torch.float32 else F64)
    assert got["dk"].abs().sum() > 0 and got["dv"][:, :, -1].abs().sum() > 0  # the last keys' gradients came home


@pytest.mark.parametrize("name", ["cp2-contiguous-dropout", "cp2-balanced-dropout", "cp4-balanced-dropout"])
def test_ring_attention_with_dropout_equals_the_reference_on_the_whole_sequence(ring_results, name):
    _, _, dtype, p, seed = {n: c for cases in CASES.values() for n, c in cases.items()}[name]
    got = ring_results[name]
    _assert_matches(got, _reference(dtype, p, seed, sdpa=False), F64)
    # dropout changed the result: it is not the undropped attention
    assert not torch.allclose(got["out"], _reference(dtype, 0.0, None, sdpa=True)["out"], atol=1e-3)


def test_gather_sequence_inverts_shard_sequence_on_every_split(ring_results):
    q = _inputs(torch.float64)[0]
    for name, result in ring_results.items():
        assert torch.equal(result["round_trip"], q.to(result["round_trip"].dtype)), name


def test_chunk_positions_cover_the_sequence_once_and_balance_the_causal_work():
    assert chunk_positions(8, 1, 2, load_balance=False).tolist() == [4, 5, 6, 7]
    assert chunk_positions(8, 0, 2, load_balance=True).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 1, 2, load_balance=True).tolist() == [2, 3, 4, 5]
    for balanced in (False, True):
        parts = [chunk_positions(24, r, 4, balanced) for r in range(4)]
        assert all(p.dtype == torch.int64 and torch.all(p[1:] > p[:-1]) for p in parts)
        assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(24))
        work = [int((p + 1).sum()) for p in parts]  # the (query, key) pairs each rank's causal mask keeps
        assert (len(set(work)) == 1) == balanced, work
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    for r in range(4):
        assert torch.equal(shard_sequence(x, 1, r, 4, True), x[:, chunk_positions(24, r, 4, True)])
        assert torch.equal(shard_sequence(x, 1, r, 4, False), x[:, chunk_positions(24, r, 4, False)])


def test_the_balanced_split_gives_every_rank_the_same_attention_work():
    """The (query, key) products each rank computes over the ring: blocks in its queries' future are skipped, and
    only the rows and columns of a block that the mask leaves anything in are computed."""
    from scalelm.parallel.ring_blocks import _Block

    def work(balanced: bool) -> list[int]:
        parts = [chunk_positions(32, r, 4, balanced) for r in range(4)]
        blocks = [[_Block(q.tolist(), k.tolist()) for k in parts] for q in parts]
        return [sum(0 if b.empty else len(b.q_pos) * len(b.k_pos) for b in row) for row in blocks]

    assert work(False) == [64, 128, 192, 256]  # rank r: r + 1 whole 8 x 8 blocks
    assert work(True) == [160] * 4  # its own 8 x 8 block (masked) and three unmasked halves, 8 x 4 or 4 x 8


def test_an_indivisible_sequence_length_is_a_clear_config_error():
    with pytest.raises(ConfigError) as err:
        chunk_positions(30, 0, 2, load_balance=True)
    assert str(err.value) == (
        "data.seq_len=30 is not divisible by 2 x parallel.cp = 4 (context parallelism with load balancing cuts each "
        "sequence into 2 x cp chunks); choose a sequence length that is a multiple of 4"
    )
    with pytest.raises(ConfigError, match=r"data.seq_len=30 is not divisible by parallel.cp = 4 .*multiple of 4$"):
        shard_sequence(torch.zeros(1, 30), 1, 0, 4, load_balance=False)
    assert chunk_positions(30, 0, 3, load_balance=False).tolist() == list(range(10))


def test_one_rank_ring_is_plain_causal_attention_forward_and_backward():
    """group None (no context parallelism) takes the same code, with no messages: the model can always call it."""
    for p, seed in ((0.0, None), (0.1, 5)):
        q, k, v, w = _inputs(torch.float64)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = ring_attention(q, k, v, None, dropout_p=p, seed=seed)
        (out * w).sum().backward()
        got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        _assert_matches(got, _reference(torch.float64, p, seed, sdpa=not p), F64)
    with pytest.raises(TypeError, match="ring_attention takes no positions"):
        ring_attention(q, k, v, torch.arange(S), None)
    with pytest.raises(ValueError, match="attention dropout needs a seed"):
        ring_attention(q, k, v, None, dropout_p=0.1)


def test_reference_attention_is_sdpa_without_dropout_and_its_masks_follow_the_seed():
    plain = _reference(torch.float64, 0.0, None, sdpa=False)
    _assert_matches(plain, _reference(torch.float64, 0.0, None, sdpa=True), F64)
    q, k, v, _ = _inputs(torch.float64)
    a, b = (reference_attention(q, k, v, dropout_p=0.1, seed=s) for s in (1, 2))
    assert torch.equal(a, reference_attention(q, k, v, dropout_p=0.1, seed=1))  # a function of the seed only
    assert not torch.allclose(a, b, atol=1e-3)
    # the kept fraction is 1 - p: ones through the attention give each query the sum of its kept, scaled weights
    ones = torch.ones(4, 8, 128, 1, dtype=torch.float64)
    flat = torch.zeros(4, 8, 128, 1, dtype=torch.float64)  # equal scores: every kept key weighs 1 / (t + 1) / (1 - p)
    kept = reference_attention(flat, flat, ones, dropout_p=0.1, seed=3).squeeze(-1) * 0.9
    counts = kept * torch.arange(1, 129, dtype=torch.float64)
    assert torch.allclose(counts, counts.round(), atol=1e-9)  # whole numbers of kept keys
    fraction = counts.sum() / (4 * 8 * 128 * 129 / 2)
    assert abs(float(fraction) - 0.9) < 0.01, float(fraction)
    with pytest.raises(ValueError, match="needs a seed"):
        reference_attention(q, k, v, dropout_p=0.1)


def test_dropout_masks_do_not_depend_on_the_batch_or_head_split():
    """A rank holding batch rows 1.. and heads 2.. (data or tensor parallelism) draws the masks of the whole batch."""
    q, k, v, _ = _inputs(torch.float64)
    whole = reference_attention(q, k, v, dropout_p=0.2, seed=11)
    part = reference_attention(q[1:, 2:], k[1:, 2:], v[1:, 2:], dropout_p=0.2, seed=11, batch_offset=1, head_offset=2)
    torch.testing.assert_close(part, whole[1:, 2:], rtol=0, atol=0)
    ring = ring_attention(q[1:, 2:], k[1:, 2:], v[1:, 2:], None, 0.2, 11, batch_offset=1, head_offset=2)
    torch.testing.assert_close(ring, whole[1:, 2:], **F64)
    # and each batch row and head has masks of its own: the same inputs everywhere give different outputs
    same = [t[:1, :1].expand(B, H, S, D) for t in (q, k, v)]
    out = reference_attention(*same, dropout_p=0.2, seed=11).flatten(0, 1)
    assert all(not torch.allclose(out[i], out[j]) for i in range(B * H) for j in range(i))


# --- kernels, host syncs, checkpointing, compile, the plan (one process) -------------------------------------------


def _whole(dtype: torch.dtype, length: int, batch: int = 1, heads: int = 2, dim: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch, heads, length, dim, generator=g).to(dtype) for _ in range(4)]


class _CudaStandIns:
    """The CUDA kernels' ops with their signatures and their log-sum-exp's shape, computed by the CPU flash kernel:
    CudaFlash's and CudnnAttention's bookkeeping runs on a CPU. Records what each call got."""

    def __init__(self, cudnn_lse_4d: bool = True):
        self.calls, self.lse_4d = [], cudnn_lse_4d

    def flash_forward(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        self.calls.append(("flash", {t.dtype for t in (q, k, v)}, q.shape[-2], k.shape[-2]))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        rng = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
        return out, lse.float(), None, None, q.shape[-2], k.shape[-2], *rng, torch.empty(0)

    def flash_backward(self, d_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, p, is_causal, seed, off, *, scale):
        assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and lse.is_contiguous()
        assert (max_q, max_k, cum_q, cum_k, p) == (q.shape[-2], k.shape[-2], None, None, 0.0)
        self.calls.append(("flash_backward", {t.dtype for t in (d_out, q, k, v, out)}, max_q, max_k))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse, 0.0, is_causal, scale=scale
        )

    def cudnn_forward(self, q, k, v, bias, compute_lse, dropout_p, is_causal, debug, *, scale):
        assert all(t.is_contiguous() for t in (q, k, v)) and bias is None and compute_lse
        self.calls.append(("cudnn", {t.dtype for t in (q, k, v)}, q.shape[-2], k.shape[-2]))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        seed = torch.zeros((), dtype=torch.int64)
        return out, lse.unsqueeze(-1) if self.lse_4d else lse, None, None, q.shape[-2], k.shape[-2], seed, seed, None

    def cudnn_backward(
        self, d_out, q, k, v, out, lse, seed, off, bias, cum_q, cum_k, max_q, max_k, p, causal, *, scale
    ):
        assert lse.shape == (*q.shape[:3], 1) if self.lse_4d else lse.shape == q.shape[:3]
        assert all(t.is_contiguous() for t in (d_out, q, k, v, out, lse)) and lse.dtype == torch.float32
        self.calls.append(("cudnn_backward", {t.dtype for t in (d_out, q, k, v, out)}, max_q, max_k))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse.flatten(2), 0.0, causal, scale=scale
        )

    def kernels(self):
        from scalelm.parallel.ring_blocks import CudaFlash, CudnnAttention

        flash = CudaFlash(self.flash_forward, self.flash_backward)
        return flash, CudnnAttention(flash, self.cudnn_forward, self.cudnn_backward)


def test_the_cuda_kernels_take_bf16_blocks_and_their_log_sum_exp_merges_in_fp32(monkeypatch):
    """Finding 1: on CUDA each block goes through flash or cuDNN in bf16 with its log-sum-exp; here their stand-ins
    (same signatures and shapes, the CPU kernel inside) under the whole-sequence causal attention, for every split
    of a simulated cp 2 and cp 4 ring (half blocks under load balancing) and a real one of one rank."""
    from scalelm.parallel import context, ring_blocks

    q, k, v, w = _whole(torch.bfloat16, 256)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    want_out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    (want_out * w.float()).sum().backward()
    want = [want_out.detach()] + [t.grad for t in leaves]
    for lse_4d in (True, False):
        stand_ins = _CudaStandIns(lse_4d)
        flash, cudnn = stand_ins.kernels()
        for kernel in (flash, cudnn):
            monkeypatch.setitem(ring_blocks.KERNELS, "cpu", lambda q, kernel=kernel: kernel)
            for cp, balanced in ((1, False), (2, True), (2, False), (4, True)):
                parts = [t.clone().requires_grad_() for t in (q, k, v)]
                if cp == 1:
                    out = ring_attention(*parts)
                else:
                    out = context.simulated_ring_attention(*parts, cp=cp, load_balance=balanced)
                (out * w).sum().backward()
                got = [out.detach()] + [t.grad for t in parts]
                assert all(g.dtype == torch.bfloat16 for g in got)
                for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                    torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=3e-2, msg=f"{kernel.name} {cp} {name}")
        names = {call[0] for call in stand_ins.calls}
        assert names == {"flash", "flash_backward", "cudnn", "cudnn_backward"}
        assert all(call[1] == {torch.bfloat16} for call in stand_ins.calls)  # q, k, v, out, d_out: bf16 blocks
        # cp 2 balanced: 128 x 64 and 64 x 128 half blocks (cuDNN's); cp 4 balanced: 32-long halves go to flash
        assert ("cudnn", {torch.bfloat16}, 64, 128) in stand_ins.calls
        assert ("flash", {torch.bfloat16}, 32, 64) in stand_ins.calls


def test_the_simulated_ring_is_the_real_one_in_float64_with_and_without_dropout():
    """simulated_ring_attention (every rank's blocks on one device, for single-GPU checks) against the reference,
    through the CPU kernel and through the products (dropout): the masks do not depend on the split."""
    from scalelm.parallel.context import simulated_ring_attention

    q, k, v, w = _inputs(torch.float64)
    for p, seed in ((0.0, None), (0.1, 1234)):
        want = _reference(torch.float64, p, seed, sdpa=False)
        for cp, balanced in ((2, False), (4, True)):
            parts = [t.clone().requires_grad_() for t in (q, k, v)]
            out = simulated_ring_attention(*parts, cp, balanced, p, seed)
            (out * w).sum().backward()
            got = {"out": out.detach(), "dq": parts[0].grad, "dk": parts[1].grad, "dv": parts[2].grad}
            _assert_matches(got, want, F64)


class _HostSyncs(TorchDispatchMode):
    """Counts what reads a number back to the host or copies between devices."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default):
            self.ops.append(str(func))
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = kwargs.get("device") if func is torch.ops.aten._to_copy.default else args[0].device
            if target is not None and torch.device(target) != source.device:
                self.ops.append(f"{func} {source.device} -> {target}")
        return func(*args, **kwargs)


def test_the_ring_reads_nothing_back_and_copies_nothing_to_the_device(monkeypatch):
    """Finding 2: a second call's forward and backward, with and without dropout, neither syncs with the host nor
    copies between devices: on the CPU, and on fake CUDA tensors through the real CUDA kernels' meta functions
    (which also checks their arguments and the log-sum-exp shapes), for one rank and a simulated cp 2 ring."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scalelm.parallel import context, ring_blocks

    def step(q, k, v, g, p, cp=1):
        parts = [t.detach().requires_grad_() for t in (q, k, v)]
        seed = torch.zeros((), dtype=torch.int64) if p else None
        if cp == 1:
            out = ring_attention(*parts, None, p, seed, load_balance=True)
        else:
            out = context.simulated_ring_attention(*parts, cp, True, p, seed)
        out.backward(g)
        return parts[0].grad

    q, k, v, g = _whole(torch.float32, 32)
    for p in (0.0, 0.1):
        step(q, k, v, g, p)
        with _HostSyncs() as syncs:
            step(q, k, v, g, p)
        assert syncs.ops == [], (p, syncs.ops)

    context._plan.cache_clear()
    ring_blocks._arange.cache_clear()
    try:  # autograd needs a CUDA runtime for CUDA tensors, fake ones too: the operator's halves, called directly
        with FakeTensorMode():
            q, k, v, g = (torch.empty(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            for kernel in (ring_blocks.CudaFlash(), ring_blocks.CudnnAttention()):
                monkeypatch.setitem(ring_blocks.KERNELS, "cuda", lambda q, kernel=kernel: kernel)
                for p in (0.0, 0.1):
                    seed = torch.zeros((), dtype=torch.int64)
                    options = (seed, None, True, p, 0, 0)
                    simulation = context._Simulation(q, k, v, 2, True, p, seed)
                    with _HostSyncs() as syncs:
                        out, lse = context._ring_forward(q, k, v, *options)
                        grads = context._ring_backward(g, q, k, v, out, lse, *options)
                        outs, lses = simulation.forward()
                        grads += tuple(simulation.backward(g, outs, lses))
                    assert syncs.ops == [], (kernel.name, p, syncs.ops)
                    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and out.dtype == torch.bfloat16
                    assert all(t.shape == q.shape and t.device.type == "cuda" for t in grads)
    finally:  # the caches hold fake tensors now
        context._plan.cache_clear()
        ring_blocks._arange.cache_clear()


def _ring_block(dropout: float, length: int = 64):
    """A transformer block whose attention is the ring over no group (cp of one rank)."""
    from scalelm.config import ModelConfig
    from scalelm.model.transformer import TransformerLM
    from scalelm.parallel.context import SequenceSplit, apply_cp

    torch.manual_seed(0)
    config = ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, dropout=dropout, max_seq_len=length)
    model = TransformerLM(config, 64)
    apply_cp(model, SequenceSplit(None, load_balance=False), 0, 1)
    return model


def _tensors_in(cached):
    """The tensors in selective checkpointing's cache (nested dicts, lists and version wrappers, by torch release)."""
    if isinstance(cached, torch.Tensor):
        yield cached
    elif isinstance(cached, dict):
        for value in cached.values():
            yield from _tensors_in(value)
    elif isinstance(cached, (list, tuple)):
        for value in cached:
            yield from _tensors_in(value)
    elif hasattr(cached, "val"):
        yield from _tensors_in(cached.val)


def test_selective_checkpointing_keeps_the_rings_output_not_its_score_blocks(monkeypatch):
    """Finding 3: the ring is one operator (scalelm::ring_attention) to the checkpoint policy, which keeps its output
    and log-sum-exp; before, it kept every block's products, B x H x L x L scores in fp32. With dropout, the
    products' path; what the block keeps is what selective checkpointing caches plus what autograd saves."""
    from scalelm.parallel import activation_checkpoint
    from scalelm.parallel.context import RING_OP

    assert RING_OP in activation_checkpoint.KEPT_OPS
    batch, heads, length = 2, 2, 64
    caches = []

    def recording(policy):
        contexts = create_selective_checkpoint_contexts(policy)
        caches.append(contexts[0].storage)
        return contexts

    monkeypatch.setattr(activation_checkpoint, "create_selective_checkpoint_contexts", recording)
    for mode in ("selective", "none"):
        model = _ring_block(0.1, length)
        activation_checkpoint.apply_activation_checkpointing(model, mode)
        saved = []

        def pack(t):
            saved.append(t)
            return t

        tokens = torch.randint(0, 64, (batch, length + 1))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        cached = caches.pop() if mode == "selective" else {}
        kept = saved + list(_tensors_in(cached))
        assert max(t.numel() for t in kept) < batch * heads * length * length, (mode, sorted(t.shape for t in kept))
        ring = [
            t.shape for op, value in cached.items() if "scalelm.ring_attention" in str(op) for t in _tensors_in(value)
        ]
        assert ring == ([(batch, heads, length, 8), (batch, heads, length)] if cached else [])  # output, log-sum-exp
        loss.backward()  # the recomputation finds the ring's results in the cache
        assert all(p.grad is not None for p in model.parameters())


def test_the_ring_compiles_without_a_graph_break_with_and_without_checkpointing():
    """Finding 4 for cp: dynamo traces the ring operator (over no group and over a group of one rank) as one node,
    in a block under every checkpointing mode, and the ring with dropout (its seed a traced draw)."""
    import torch._dynamo

    from scalelm.parallel import activation_checkpoint
    from scalelm.parallel.context import RingCore, SequenceSplit

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        one = dist.new_group([0])
        for group, mode in ((None, "none"), (None, "selective"), (None, "full"), (one, "selective")):
            model = _ring_block(0.0, 32)
            for block in model.blocks.values():
                block.attn.core = RingCore(SequenceSplit(group, load_balance=False), 0)
            activation_checkpoint.apply_activation_checkpointing(model, mode)
            torch._dynamo.reset()
            explained = torch._dynamo.explain(model.blocks["0"])(torch.randn(2, 32, 16))
            assert explained.graph_break_count == 0 and explained.graph_count == 1, (mode, explained.break_reasons)
        core = RingCore(SequenceSplit(one, load_balance=True), 0)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda q: core(q, q, q, 0.1))(torch.randn(1, 2, 32, 8))
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def _permuted_inputs(dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    """q, k, v (batch, heads, seq, head_dim) laid out as (batch, seq, heads, head_dim): dense (separate projections),
    and gapped, the model's views of its packed qkv projection."""
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2) for _ in range(3)]
    packed = torch.randn(B, S, H, 3, D, generator=g).to(dtype)
    return {"dense": dense, "gapped": list(packed.permute(3, 0, 2, 1, 4))}


def test_the_ring_operators_fake_kernels_lay_out_their_outputs_as_the_real_ones_do():
    """Review 3 finding 11: the ring's outputs are always contiguous, whatever q, k, v's strides; fake kernels that
    kept a permuted input's strides made compiled code read them wrong (Inductor's stride check failed on the model's
    own gapped views). torch.library.opcheck compares the fake and real outputs' metadata, and checks the operators'
    registrations (every check once: AOT dispatch costs a second a call), on dense and gapped permuted inputs, with
    and without dropout, in fp32 and bf16."""
    forward, backward = torch.ops.scalelm.ring_attention.default, torch.ops.scalelm.ring_attention_backward.default
    cases = ((torch.float32, "dense", 0.0), (torch.float32, "gapped", 0.1), (torch.bfloat16, "gapped", 0.0))
    for i, (dtype, layout, p) in enumerate(cases):
        checks = {} if i == 0 else {"test_utils": ("test_schema", "test_faketensor")}  # {}: all of them
        q, k, v = _permuted_inputs(dtype)[layout]
        options = (torch.tensor(7) if p else None, None, False, p, 0, 0)
        assert not q.is_contiguous()
        torch.library.opcheck(forward, (q.clone().requires_grad_(), k, v, *options), **checks)
        out, lse = forward(q, k, v, *options)
        d_out = _permuted_inputs(dtype)["dense"][0]
        torch.library.opcheck(backward, (d_out, q, k, v, out, lse, *options), **checks)


def test_the_plan_counts_the_rings_working_memory():
    """Finding 1's plan: the block at work holds (4 + 8e) bytes per token and d/t through a fused kernel, and a
    score block of the local length through the products (dropout, or fp32 on GPUs), 8 or 20 bytes a score, with
    16 bytes per token and d/t (32 in bf16: the blocks' fp32 copies)."""
    from dataclasses import replace

    from scalelm.config import load_config
    from scalelm.parallel.dims import ParallelDims
    from scalelm.plan.memory import Workload, plan_memory, ring_fused, ring_transient_bytes

    overrides = ["model.d_model=768", "model.n_heads=12", "data.seq_len=8192", "model.max_seq_len=8192"]
    config = load_config(None, overrides + ["model.dropout=0.0", "train.precision=bf16"])
    work, dims, tokens = Workload(config, 33280, device="cuda"), ParallelDims(cp=4), 2 * 2048
    assert ring_fused(work) and ring_transient_bytes(work, dims, tokens) == tokens * 768 * (4 + 8 * 2)
    assert ring_transient_bytes(work, ParallelDims(cp=4, tp=2), tokens) == tokens * 384 * (4 + 8 * 2)
    dropout = replace(work, config=load_config(None, overrides + ["model.dropout=0.1", "train.precision=bf16"]))
    assert not ring_fused(dropout)
    assert ring_transient_bytes(dropout, dims, tokens) == tokens * (2048 * 12 * 20 + 768 * 32)  # 2 x 12 x 2048^2 scores
    fp32 = replace(work, config=load_config(None, overrides + ["model.dropout=0.0", "train.precision=fp32"]))
    assert not ring_fused(fp32) and ring_transient_bytes(fp32, dims, tokens) == tokens * (2048 * 12 * 8 + 768 * 16)
    assert ring_fused(replace(fp32, device="cpu"))
    # the plan's buffers carry it: the products' block is the larger by far at cp_long's shapes
    assert plan_memory(dropout, dims).bytes["buffers"] - plan_memory(work, dims).bytes["buffers"] == pytest.approx(
        ring_transient_bytes(dropout, dims, plan_memory(work, dims).micro_batch_tokens)
        - ring_transient_bytes(work, dims, plan_memory(work, dims).micro_batch_tokens),
        rel=1e-9,
    )


def test_the_plan_counts_what_dropout_costs_the_ring_in_bf16():
    """Review 3 finding 14: with dropout a bf16 ring runs its blocks as fp32 matrix products in place of the bf16
    kernel. Its plan holds, beyond the kernel's, each score's fp32 value and the mask's int64 hash with its shifted
    temporary (20 bytes a score), and the block's fp32 copies of its queries, keys, values and output gradient and
    fp32 gradients in place of the kernel's bf16 ones and copies (32 - (4 + 8 x 2) = 12 bytes per token and d/t)."""
    from scalelm.config import load_config
    from scalelm.parallel.dims import ParallelDims
    from scalelm.plan.memory import Workload, plan_memory

    shape = ["model.d_model=256", "model.n_heads=4", "data.seq_len=512", "model.max_seq_len=512"]
    dims = ParallelDims(cp=4, tp=2)
    configs = {p: load_config(None, [*shape, f"model.dropout={p}", "train.precision=bf16"]) for p in (0.0, 0.1)}
    plans = {p: plan_memory(Workload(config, 512, "cuda"), dims) for p, config in configs.items()}
    tokens = plans[0.0].micro_batch_tokens
    scores, width = tokens * (512 // 4) * 4 / 2, tokens * 256 / 2  # per rank: L a/t scores and d/t per token
    extra = plans[0.1].bytes["buffers"] - plans[0.0].bytes["buffers"]
    assert extra == pytest.approx(scores * 20 + width * 12, rel=1e-9)
