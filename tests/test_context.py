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

from scalelm.errors import ConfigError
from scalelm.parallel.context import (
    chunk_positions,
    gather_sequence,
    reference_attention,
    ring_attention,
    shard_sequence,
)

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
    out = ring_attention(*parts, chunk_positions(S, r, n, balanced), group, dropout_p=p, seed=seed)
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
    from scalelm.parallel.context import _Block

    def work(balanced: bool) -> list[int]:
        parts = [chunk_positions(32, r, 4, balanced) for r in range(4)]
        blocks = [[_Block(q, k) for k in parts] for q in parts]
        return [sum(0 if b.empty else b.q_pos.numel() * b.k_pos.numel() for b in row) for row in blocks]

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
        out = ring_attention(q, k, v, torch.arange(S), None, dropout_p=p, seed=seed)
        (out * w).sum().backward()
        got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        _assert_matches(got, _reference(torch.float64, p, seed, sdpa=not p), F64)
    with pytest.raises(ValueError, match="positions must be 16 ascending integers"):
        ring_attention(q, k, v, torch.arange(S).flip(0), None)


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
    ring = ring_attention(
        q[1:, 2:], k[1:, 2:], v[1:, 2:], torch.arange(S), None, 0.2, 11, batch_offset=1, head_offset=2
    )
    torch.testing.assert_close(ring, whole[1:, 2:], **F64)
    # and each batch row and head has masks of its own: the same inputs everywhere give different outputs
    same = [t[:1, :1].expand(B, H, S, D) for t in (q, k, v)]
    out = reference_attention(*same, dropout_p=0.2, seed=11).flatten(0, 1)
    assert all(not torch.allclose(out[i], out[j]) for i in range(B * H) for j in range(i))
