"""One block of ring attention (scalelm.parallel.context runs the ring): a rank's queries against one key/value
block, in the part of it that the causal mask leaves anything in (`_Block`), and the log-sum-exp merge that folds
the block's result into the running one (`_merge`; fp32).

Each block goes through a fused attention kernel in the inputs' dtype that returns its log-sum-exp and never holds
its score matrix (what torch's own context_parallel merges on): on CUDA in fp16/bf16 from sm80 on FlashAttention
(`_scaled_dot_product_flash_attention`), on sm90 cuDNN's (`_scaled_dot_product_cudnn_attention`), on the CPU
`_scaled_dot_product_flash_attention_for_cpu`, each with its backward. `KERNELS` picks one per device type (tests
replace it). With dropout, and where no kernel fits (fp32 on CUDA), a block goes through plain matrix products in the
accumulation dtype (fp32), which hold its score matrix; their backward recomputes the probabilities from the whole
attention's log-sum-exp. In a bf16 run they are IEEE fp32, an order of magnitude slower on a GPU than its bf16
kernels, and hold an fp32 score block with the mask's int64 hash (20 bytes a score): what dropout costs a cp run,
which the memory plan counts (scalelm.plan.memory.ring_transient_bytes) and the step-time plan does not.

Attention dropout draws its masks from a counter-based hash of (seed, batch, head, query position, key position),
so they do not depend on cp or on the split: a run with cp = 2 drops the same probabilities as one without.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence

import torch

_aten = torch.ops.aten


# --- dropout masks ---------------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Chris Wellons' integer hash), in place, on values in [0, 2^32) held in int64: its multipliers are
    below 2^31, so no product leaves int64's range and the result is the same on every device and build."""
    x.bitwise_xor_(x >> 16)
    x.mul_(0x21F0AAAD).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x735A2D97).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def _seed_hash(seed: torch.Tensor) -> torch.Tensor:
    """The seed folded into the hash, a 0-dim int64 tensor where the seed is (a CPU one mixes into device tensors
    as a scalar, without a copy to the device)."""
    seed = seed.to(torch.int64)
    h = _mix32_((seed & _M32) ^ 0x9E3779B9)
    return _mix32_(h ^ ((seed >> 32) & _M32))


@functools.lru_cache(maxsize=64)
def _arange(start: int, count: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + count, dtype=torch.int64, device=device)


class _Dropout:
    """What a block needs to regenerate its masks (inactive where dropout_p is 0: no masks computed).

    Each coordinate is folded into the hash in turn (xor, then mix), the cheap ones on small tensors first; a mask
    entry drops where the hash, a uniform integer in [0, 2^32), is below p 2^32."""

    def __init__(
        self, dropout_p: float, seed: torch.Tensor | None, batch: int, heads: int, offsets: tuple[int, int], device
    ):
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
        if dropout_p and seed is None:
            raise ValueError("attention dropout needs a seed: its masks are a function of it, the same on every rank")
        self.p = dropout_p
        self.factor = 1.0 / (1.0 - dropout_p)
        self.threshold = math.ceil(dropout_p * 2.0**32)  # exact: scaling a double by 2^32 rounds nothing
        if dropout_p:
            self.seed = _seed_hash(seed)
            self.batch = _arange(offsets[0], batch, torch.device(device))
            self.heads = _arange(offsets[1], heads, torch.device(device))

    def dropped(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Which (batch, head, query, key) entries drop, (B, H, Lq, Lk) bool; None without dropout."""
        if not self.p:
            return None
        h = _mix32_(self.seed ^ self.batch.view(-1, 1, 1, 1))
        h = _mix32_(h ^ self.heads.view(1, -1, 1, 1))
        h = _mix32_(h ^ q_pos.view(1, 1, -1, 1))
        h = _mix32_(h ^ k_pos.view(1, 1, 1, -1))
        return h < self.threshold

    def apply_(self, probs: torch.Tensor, dropped: torch.Tensor | None) -> torch.Tensor:
        """`probs` with the dropped entries zeroed and the rest scaled by 1 / (1 - p), in place."""
        return probs if dropped is None else probs.masked_fill_(dropped, 0.0).mul_(self.factor)


# --- a block's bounds ------------------------------------------------------------------------------------------------


class _Block:
    """The part of a (query block, key block) pair that the causal mask leaves anything in: the queries from `rows`
    on (the earlier ones see none of the keys) and the keys before `cols` (no query sees the later ones).

    Positions ascend, so both are ranges. Under the load-balanced split this halves every block but a rank's own,
    and leaves the half unmasked: that, not the skipped blocks, is what evens the ranks' work out. What is left is
    unmasked, or (a rank's own block: the same positions) causal, or, for positions no split makes, a general mask
    (`masked`). Computed once per shape, in Python: the bounds are ints, read from no tensor."""

    def __init__(self, q_pos: Sequence[int], k_pos: Sequence[int]):
        q_pos, k_pos = list(q_pos), list(k_pos)
        self.rows = bisect.bisect_left(q_pos, k_pos[0])
        self.cols = bisect.bisect_right(k_pos, q_pos[-1])
        self.empty = self.rows == len(q_pos) or self.cols == 0
        self.q_pos, self.k_pos = q_pos[self.rows :], k_pos[: self.cols]
        self.masked = not self.empty and self.k_pos[-1] > self.q_pos[0]
        self.causal = self.masked and self.q_pos == self.k_pos


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: fp32 for fp32 and narrower, float64 kept (the exact tests)."""
    return torch.promote_types(dtype, torch.float32)


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.to(_acc_dtype(t.dtype))


# --- fused kernels ---------------------------------------------------------------------------------------------------


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """t.contiguous(), through the dispatcher alone (Tensor.contiguous needs the device's runtime, which fake CUDA
    tensors in the CPU tests lack)."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


class CpuFlash:
    """torch's CPU flash kernel: any float dtype; the log-sum-exp (B, H, Lq) in the accumulation dtype."""

    name = "cpu_flash"

    def forward(self, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's output in q's dtype, normalised over its own keys, and its natural log-sum-exp (B, H, Lq)."""
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(self, d_out, q, k, v, out, lse, causal: bool, scale: float):
        """dq, dk, dv in q's dtype, from the whole attention's output rows and log-sum-exp."""
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )


class CudaFlash:
    """FlashAttention 2 (fp16/bf16, sm80 and later, head dims to 256, multiples of 8); its log-sum-exp is (B, H, Lq)
    fp32 in natural log. The ops are attributes so that tests can run this bookkeeping on a CPU stand-in."""

    name = "cuda_flash"

    def __init__(
        self,
        forward_op=_aten._scaled_dot_product_flash_attention.default,
        backward_op=_aten._scaled_dot_product_flash_attention_backward.default,
    ):
        self.forward_op, self.backward_op = forward_op, backward_op

    def forward(self, q, k, v, causal: bool, scale: float):
        out, lse, *_ = self.forward_op(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse

    def backward(self, d_out, q, k, v, out, lse, causal: bool, scale: float):
        # philox seed and offset: read only with dropout, which this kernel never gets
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        lq, lk = q.shape[-2], k.shape[-2]
        return self.backward_op(d_out, q, k, v, out, lse, None, None, lq, lk, 0.0, causal, unused, unused, scale=scale)


class CudnnAttention:
    """cuDNN's fused attention (the faster one on sm90). Its log-sum-exp is (B, H, Lq, 1) in recent torch, (B, H, Lq)
    in older: returned as (B, H, Lq), and given back to the backward in the forward's shape. Every tensor goes in
    contiguous: torch 2.9-2.11 cache cuDNN's graphs by q, k, v's strides alone, so the output and its gradient must
    come in one layout. Blocks whose lengths are not multiples of 64 go to `fallback` (same log-sum-exp)."""

    name = "cudnn"

    def __init__(
        self,
        fallback=None,
        forward_op=_aten._scaled_dot_product_cudnn_attention.default,
        backward_op=_aten._scaled_dot_product_cudnn_attention_backward.default,
    ):
        self.fallback = fallback or CudaFlash()
        self.forward_op, self.backward_op = forward_op, backward_op
        self.lse_trailing_one = True  # torch 2.13's shape; set by each forward

    def _fits(self, q, k) -> bool:
        return q.shape[-2] % 64 == 0 and k.shape[-2] % 64 == 0

    def forward(self, q, k, v, causal: bool, scale: float):
        if not self._fits(q, k):
            return self.fallback.forward(q, k, v, causal, scale)
        q, k, v = (_contiguous(t) for t in (q, k, v))
        out, lse, *_ = self.forward_op(q, k, v, None, True, 0.0, causal, False, scale=scale)
        self.lse_trailing_one = lse.dim() == 4
        return out, lse.flatten(2)

    def backward(self, d_out, q, k, v, out, lse, causal: bool, scale: float):
        if not self._fits(q, k):
            return self.fallback.backward(d_out, q, k, v, out, lse, causal, scale)
        d_out, q, k, v, out = (_contiguous(t) for t in (d_out, q, k, v, out))
        lse = _contiguous(lse.unsqueeze(-1) if self.lse_trailing_one else lse)
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        lq, lk = q.shape[-2], k.shape[-2]
        return self.backward_op(
            d_out, q, k, v, out, lse, unused, unused, None, None, None, lq, lk, 0.0, causal, scale=scale
        )


CPU_FLASH, CUDA_FLASH, CUDNN = CpuFlash(), CudaFlash(), CudnnAttention()
PREFER_CUDNN_ON_SM90 = True  # bench/gpu_paths.py compares the two


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _cpu_kernel(q: torch.Tensor):
    return CPU_FLASH


def _cuda_kernel(q: torch.Tensor):
    """Flash or cuDNN where they take the block's dtype and head size, else None (matrix products)."""
    dim = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or dim % 8 or dim > 256:
        return None
    capability = _capability(q.device)
    if capability < (8, 0):
        return None
    if capability == (9, 0) and dim <= 128 and PREFER_CUDNN_ON_SM90:
        return CUDNN
    return CUDA_FLASH


# device type -> the fused kernel for a block like q (None: matrix products)
KERNELS = {"cpu": _cpu_kernel, "cuda": _cuda_kernel}


def fused_kernel(q: torch.Tensor):
    """The kernel that the ring runs q's blocks through without dropout; None: matrix products."""
    select = KERNELS.get(q.device.type)
    return None if select is None else select(q)


# --- one block -------------------------------------------------------------------------------------------------------


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, hidden: torch.Tensor | None) -> torch.Tensor:
    s = torch.matmul(_acc(q), _acc(k).transpose(-2, -1)).mul_(scale)
    return s if hidden is None else s.masked_fill_(hidden, float("-inf"))


def _logsumexp(s: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp over the last dimension with one temporary of s's size (torch's holds two); every row has a
    finite entry."""
    top = s.amax(-1, keepdim=True)
    return torch.sub(s, top).exp_().sum(-1).log_().add_(top.squeeze(-1))


def _block_forward(q, k, v, positions, block: _Block, scale: float, drop: _Dropout, kernel):
    """A block's attention output, normalised over its own keys, and its log-sum-exp: what the ring merges. By
    matrix products in the accumulation dtype where dropout needs them (or no kernel fits): the probabilities
    overwrite the scores, so the block holds one score matrix (and the mask's hash while it is made)."""
    q_pos, k_pos, hidden = positions
    if kernel is not None and not drop.p and (not block.masked or block.causal):
        return kernel.forward(q, k, v, block.causal, scale)
    s = _scores(q, k, scale, hidden)
    lse = _logsumexp(s)
    p = drop.apply_(s.sub_(lse.unsqueeze(-1)).exp_(), drop.dropped(q_pos, k_pos))
    return torch.matmul(p, _acc(v)), lse


def _product_backward(d_out, q, k, v, lse, delta, positions, scale: float, drop: _Dropout):
    """A block's dq, dk, dv by matrix products (accumulation dtype), from the whole attention's log-sum-exp: the
    probabilities are recomputed against the final normalisation, so the blocks' gradients add up."""
    q_pos, k_pos, hidden = positions
    d_out, q, k, v = _acc(d_out), _acc(q), _acc(k), _acc(v)
    p = _scores(q, k, scale, hidden).sub_(lse.unsqueeze(-1)).exp_()  # undropped; masked entries exp(-inf) = 0
    dropped = drop.dropped(q_pos, k_pos)
    kept = p if dropped is None else drop.apply_(p.clone(), dropped)
    dv = torch.matmul(kept.transpose(-2, -1), d_out)
    del kept
    dp = drop.apply_(torch.matmul(d_out, v.transpose(-2, -1)), dropped)
    ds = dp.sub_(delta).mul_(p)
    dq = torch.matmul(ds, k).mul_(scale)
    dk = torch.matmul(ds.transpose(-2, -1), q).mul_(scale)
    return dq, dk, dv


# --- the merge -------------------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor, block: _Block, dim: int = 2) -> torch.Tensor:
    """The block's queries' part of `t` along its sequence dimension (a view by narrow: indexing from Python needs
    the device's runtime, which fake CUDA tensors in the CPU tests lack)."""
    return t.narrow(dim, block.rows, t.size(dim) - block.rows)


def _cols(t: torch.Tensor, block: _Block) -> torch.Tensor:
    return t.narrow(-2, 0, block.cols)


def _merge(out: torch.Tensor, lse: torch.Tensor, block: _Block, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Fold a block's result into the running ones: `out` in place (accumulation dtype), the log-sum-exp returned."""
    out, merged = _rows(out, block), torch.logaddexp(_rows(lse, block, -1), lse_b.to(lse.dtype))  # lse_b is finite
    out.mul_(torch.exp(_rows(lse, block, -1) - merged).unsqueeze(-1))
    out.addcmul_(out_b, torch.exp(lse_b - merged).unsqueeze(-1))
    return merged if block.rows == 0 else torch.cat([lse.narrow(-1, 0, block.rows), merged], -1)
