"""
Token log-probabilities (and entropy) from logits, without an fp32 copy of the logits.

For every row r of logits (R, V) and its target token t_r, with temperature T:

    x      = logits / T                                   # the tempered logits
    lse_r  = log sum_j exp(x_rj)                          # log-sum-exp, one float per row
    logp_r = x_rt - lse_r                                 # <= 0 always
    H_r    = lse_r - sum_j p_rj x_rj,  p = exp(x - lse)   # entropy of the tempered distribution
    d logp_r / d logits_rj = (onehot(t_r)_j - p_rj) / T   # the backward: this times upstream grad

Forward: one pass over the vocabulary in blocks, keeping a running max m, a running sum
s = sum exp(x - m) and t = sum exp(x - m) (x - m) for the entropy; when the max grows from m
to m', old sums are rescaled by exp(m - m') (the "online softmax" of the flash-attention and
fused-softmax kernels). Only lse (R,) is saved. Backward: a second pass that recomputes
p = exp(x - lse) block by block and writes the gradient straight into the logits' dtype.
Nothing of size (R, V) is ever held in fp32: the only (R, V) tensor made is the gradient itself.
Rows whose target is -100 are ignored: logp 0, entropy 0, gradient exactly 0.

Backends of `token_logprobs`:
- CUDA tensors: the Triton kernels below (backend="auto" or "triton").
- CPU tensors: `token_logprobs_ref`, plain torch, chunked over rows (backend="auto" or "torch").
  backend="triton" on a CPU runs the same kernels through the Triton interpreter (slow; for tests).

From hidden states: `linear_logprobs(hidden, weight, targets)` returns what
token_logprobs(hidden @ weight.T, targets) returns, with gradients for hidden and weight, but makes
the logits one chunk of positions at a time (LINEAR_CHUNK_BYTES) and drops them; its backward makes
each chunk's logits again (the upstream gradient of a log-prob is only known after the forward).

Run `python kernels.py` for the correctness summary, the kernels compiled for sm_80 / sm_90
(registers, spills, occupancy) and the memory/speed tables (see the bottom).
"""

import contextlib
import functools
import os
import sys

import torch

# With no GPU the kernels can only run in the Triton interpreter, and triton decides at
# @triton.jit time: triton 3.7 reads TRITON_INTERPRET each time a decorator runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

# But triton.language's own @jit helpers (tl.max, tl.sum, tl.zeros, ...) were decorated when it
# was first imported. If that was before the line above (torch._dynamo, torch.compile and
# torch.utils.checkpoint import triton), they are compiled-mode functions that raise "Cannot call
# @triton.jit'd outside of the scope of a kernel" inside an interpreted kernel: re-wrap them.
# One wrapper per helper, so the interpreter's `combine_fn == tl.standard._sum_combine` holds.
if triton.knobs.runtime.interpret and isinstance(tl.standard.max, triton.runtime.JITFunction):
    from triton.runtime.interpreter import InterpretedFunction
    _wrapped = {}
    for _module in (tl, tl.standard):
        for _name, _fn in list(vars(_module).items()):
            if isinstance(_fn, triton.runtime.JITFunction):
                _wrapped.setdefault(_fn, InterpretedFunction(_fn.fn))
                setattr(_module, _name, _wrapped[_fn])

IGNORE_INDEX = -100  # target value of positions to skip (padding, prompt tokens), as in torch
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REF_DTYPES = KERNEL_DTYPES + (torch.float64,)  # float64: the reference is also the test oracle

# The one default launch config. A tile of BLOCK_R rows x BLOCK_V vocabulary columns:
# 8 rows per program gives R/8 programs (1024 at R = 8192: several per SM of an H100/H200's 132)
# and is what keeps the CPU interpreter fast (it pays per program and per op, not per element);
# 1024 columns = 2 KiB of bf16 per row per step, 8K fp32 values per tile = 32 per thread at
# 8 warps. Chosen by reasoning, not yet measured on a GPU: `python kernels.py --tune` sweeps a
# few alternatives on the GPU at hand (autotuning is opt-in, never on by default).
BLOCK_R, BLOCK_V, NUM_WARPS = 8, 1024, 8
# The reference works on chunks of ~4M elements (16 MiB in fp32) so it, too, never makes a full
# fp32 copy of big logits; the size only trades Python overhead against memory.
REF_CHUNK_ELEMENTS = 2**22
# linear_logprobs makes the logits of one chunk of positions at a time: as many positions as fit
# in this many bytes of fp32 logits (~220 positions at V = 151,936). A call holds up to about 2x
# this at once (the chunk's logits and the softmax or gradient made from them; 3x with a copy in
# fp32 of bf16 logits), plus the weight's gradient (V, D) in backward. The trade: the (V, D)
# gradient is read and written once per chunk, which must cost little next to the chunk's three
# matmuls (on this CPU it does from ~100 positions; a GPU, with far more FLOPs per byte, wants
# larger chunks: pass chunk_bytes). A memory planner can import it.
LINEAR_CHUNK_BYTES = 128 * 2**20


# -----------------------------------------------------------------------------
# Input checks and the plain-torch reference (the spec, the test oracle, the CPU path)

def _check_inputs(logits, targets, temperature, dtypes, validate=True):
    """Raise ValueError naming what is wrong; cheap except for one pass over targets (and a host
    sync), which validate=False skips: for callers whose targets are in range by construction."""
    if not isinstance(logits, torch.Tensor) or logits.ndim < 1 or logits.shape[-1] == 0:
        raise ValueError("logits must be a tensor of shape (..., V) with V >= 1")
    if logits.dtype not in dtypes:
        raise ValueError(f"logits dtype must be one of {dtypes}, got {logits.dtype}")
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
        got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets)
        raise ValueError(f"targets must be an int64 (torch.long) tensor, got {got}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal logits shape "
                         f"without the last (vocabulary) dim {tuple(logits.shape[:-1])}")
    if targets.device != logits.device:
        raise ValueError(f"targets on {targets.device} but logits on {logits.device}")
    if not (isinstance(temperature, (int, float)) and 0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not validate:
        return
    V = logits.shape[-1]
    bad = ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= V)  # (...)
    if bad.any():  # one host sync; an out-of-range target would read out of bounds in the kernel
        raise ValueError(f"targets must be in [0, {V}) or {IGNORE_INDEX} (ignore), "
                         f"found {targets[bad][0].item()}")


def _ref_rows(logits, targets, temperature, with_entropy):
    """logp (r,) and entropy (r,) or None, for logits (r, V) and targets (r,)."""
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(compute)  # (r, V) fp32 (fp64 as the oracle)
    x = x / temperature if temperature != 1 else x  # tempered logits; T = 1 skips a full pass
    logp_all = torch.log_softmax(x, dim=-1)  # (r, V) = x - lse, chunk-sized only
    valid = targets != IGNORE_INDEX  # (r,)
    logp = logp_all.gather(-1, targets.clamp(min=0)[:, None])[:, 0]  # (r,) clamp: -100 -> col 0
    logp = torch.where(valid, logp, 0.0)  # where, not multiply: grad at ignored rows is exactly 0
    if not with_entropy:
        return logp, None
    with torch.no_grad():  # the entropy is a metric, no gradient
        p = logp_all.exp()  # (r, V)
        # 0 log 0 = 0 at -inf logits: the clamp makes it 0 * (-max float), not 0 * -inf = nan
        entropy = -(p * logp_all.clamp(min=torch.finfo(compute).min)).sum(-1)
    return logp, torch.where(valid, entropy, 0.0)


def token_logprobs_ref(logits, targets, temperature=1.0, with_entropy=False, validate=True):
    """Reference of `token_logprobs` in plain torch; same arguments, same results.

    Rows are processed in chunks of ~REF_CHUNK_ELEMENTS; with autograd on, each chunk is
    checkpointed (recomputed in backward), so no (R, V) fp32 tensor is kept alive. The gradient
    comes from torch autograd, independently of the kernel's hand-written backward.
    """
    _check_inputs(logits, targets, temperature, REF_DTYPES, validate)
    V = logits.shape[-1]
    x, tgt = logits.reshape(-1, V), targets.reshape(-1)  # (R, V), (R,)
    rows = max(1, REF_CHUNK_ELEMENTS // V)  # rows per chunk
    run = _ref_rows
    if torch.is_grad_enabled() and logits.requires_grad:
        run = functools.partial(checkpoint, _ref_rows, use_reentrant=False)
    # split (not slicing in a loop): its backward is one concatenation, not one full-size
    # zero tensor per chunk
    outs = [run(xc, tc, temperature, with_entropy)
            for xc, tc in zip(x.split(rows), tgt.split(rows))]
    logp = torch.cat([o[0] for o in outs]).view(targets.shape)  # (...)
    if not with_entropy:
        return logp
    return logp, torch.cat([o[1] for o in outs]).view(targets.shape)  # (...), (...)



def logprobs_fwd_ref(logits, targets, temperature, with_entropy=True):
    """The forward kernel's contract in plain torch, without autograd: logits (r, V), targets (r,)
    -> logp (r,), entropy (r,) or None, lse (r,), fp32. With `logprobs_bwd_ref` it is the CPU path
    of `linear_logprobs`, which makes its own backward from lse. float64 logits stay float64."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (r, V); no copy when fp32
    x = x / temperature if temperature != 1 else x
    lse = torch.logsumexp(x, -1)  # (r,)
    valid = targets != IGNORE_INDEX  # (r,)
    x_t = x.gather(-1, targets.clamp(min=0)[:, None])[:, 0]  # (r,) clamp: -100 -> col 0
    logp = torch.where(valid, (x_t - lse).clamp(max=0), 0.0)  # <= 0 against the last ulp
    if not with_entropy:
        return logp, None, lse
    p = torch.sub(x, lse[:, None]).exp_()  # (r, V) softmax
    entropy = torch.special.entr(p).sum(-1)  # -sum p log p, entr(0) = 0
    return logp, torch.where(valid, entropy, 0.0), lse


def logprobs_bwd_ref(logits, targets, lse, grad_logp, temperature):
    """The backward kernel's contract in plain torch: (onehot(t) - p) * grad_logp / T, (r, V) in
    the logits' dtype; exactly 0 on ignored rows."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (r, V) fp32 (fp64 stays)
    x = x / temperature if temperature != 1 else x
    valid = targets != IGNORE_INDEX  # (r,)
    g = torch.where(valid, grad_logp.to(x.dtype), 0.0) / temperature  # (r,) chain rule through x / T
    grad = torch.sub(x, lse[:, None]).exp_().mul_(-g[:, None])  # (r, V) = -p g / T, one buffer
    grad.scatter_add_(-1, targets.clamp(min=0)[:, None], g[:, None])  # + onehot g / T
    grad[~valid] = 0.0  # touches the ignored rows only; -0.0 and nan-free whatever their logits
    return grad.to(logits.dtype)


def linear_logprobs_ref(hidden, weight, targets, temperature=1.0, with_entropy=False):
    """Reference of `linear_logprobs`: the logits made whole, then `token_logprobs_ref`."""
    return token_logprobs_ref(hidden @ weight.T, targets, temperature, with_entropy)  # (..., V) logits

# -----------------------------------------------------------------------------
# Triton kernels. Each program owns BLOCK_R rows and walks the vocabulary in BLOCK_V steps.
# Rules kept everywhere: offsets in int64 (R*V passes 2^31 at 14k rows of a 151,936 vocab),
# every load masked (an unmasked out-of-bounds load crashes the interpreter), every load cast to
# fp32 at once (all math in fp32; bf16 arithmetic is also wrong in the interpreter).
# A row r of the logits lives at (r // T_inner) * stride_b + (r % T_inner) * stride_t: the
# logits are seen as (B, T_inner, V) with any strides, so a sliced logits[:, :-1] is not copied.

@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr, targets_ptr, logp_ptr, entropy_ptr, lse_ptr,
    inv_temp, R, T_inner, V, stride_b, stride_t,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) int64
    tgt = tl.load(targets_ptr + rows, mask=rows < R, other=-100)  # (BLOCK_R,) int64
    valid = (rows < R) & (tgt != -100)  # ignored rows are never read
    row_ptr = logits_ptr + (rows // T_inner) * stride_b + (rows % T_inner) * stride_t
    # Running max m, s = sum exp(x - m), t = sum exp(x - m) * (x - m), all (BLOCK_R,).
    # m starts finite, not -inf, so that 0 * (m - m_new) on the first block is 0, not nan.
    m = tl.full((BLOCK_R,), -1e30, tl.float32)
    s = tl.zeros((BLOCK_R,), tl.float32)
    t = tl.zeros((BLOCK_R,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        mask = valid[:, None] & (cols < V)[None, :]  # (BLOCK_R, BLOCK_V)
        x = tl.load(row_ptr[:, None] + cols[None, :], mask=mask, other=-float("inf"))
        x = x.to(tl.float32) * inv_temp  # (BLOCK_R, BLOCK_V); masked columns are -inf
        m_new = tl.maximum(m, tl.max(x, axis=1))
        alpha = tl.exp(m - m_new)  # rescales the old sums to the new max
        d = x - m_new[:, None]  # (BLOCK_R, BLOCK_V), <= 0
        e = tl.exp(d)
        # d is -inf where e = 0 (masked columns, -inf logits): zero it so 0 * log 0 counts as 0
        d = tl.where(e > 0, d, 0.0)
        # sum e^(x-m')(x-m') over old columns = alpha * (t + (m - m') * s)
        t = alpha * (t + (m - m_new) * s) + tl.sum(e * d, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new
    # The target's tempered logit, computed exactly as in the loop, so x_t <= m holds bitwise.
    x_t = tl.load(row_ptr + tgt, mask=valid, other=0.0).to(tl.float32) * inv_temp
    s = tl.where(valid, s, 1.0)  # ignored rows read nothing (s = 0): avoid log 0 and 0 / 0
    log_s = tl.log(s)  # s >= 1 on valid rows: the max column contributes exp(0)
    # logp = x_t - lse = (x_t - m) - log s <= 0; the min guards the last ulp against fp rounding
    # (the compiler may fuse x_t * inv_temp - m into one fma).
    logp = tl.minimum((x_t - m) - log_s, 0.0)
    entropy = log_s - t / s  # lse - E[x] = log s - E[x - m]
    tl.store(logp_ptr + rows, tl.where(valid, logp, 0.0), mask=rows < R)
    tl.store(entropy_ptr + rows, tl.where(valid, entropy, 0.0), mask=rows < R)
    tl.store(lse_ptr + rows, tl.where(valid, m + log_s, 0.0), mask=rows < R)


@triton.jit
def _logprobs_bwd_kernel(
    logits_ptr, targets_ptr, lse_ptr, grad_logp_ptr, grad_ptr,
    inv_temp, R, T_inner, V, stride_b, stride_t,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) int64
    tgt = tl.load(targets_ptr + rows, mask=rows < R, other=-100)  # (BLOCK_R,)
    valid = (rows < R) & (tgt != -100)
    lse = tl.load(lse_ptr + rows, mask=valid, other=0.0)  # (BLOCK_R,) from the forward
    # upstream grad times 1/T: the chain rule through x = logits / T; 0 on ignored rows
    g = tl.load(grad_logp_ptr + rows, mask=valid, other=0.0) * inv_temp  # (BLOCK_R,)
    row_ptr = logits_ptr + (rows // T_inner) * stride_b + (rows % T_inner) * stride_t
    out_ptr = grad_ptr + rows * V  # the gradient is a fresh contiguous (R, V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        in_bounds = (rows < R)[:, None] & (cols < V)[None, :]  # (BLOCK_R, BLOCK_V)
        x = tl.load(row_ptr[:, None] + cols[None, :], mask=in_bounds & valid[:, None],
                    other=-float("inf"))
        x = x.to(tl.float32) * inv_temp  # same expression as the forward
        p = tl.exp(x - lse[:, None])  # (BLOCK_R, BLOCK_V) softmax, recomputed
        onehot = (cols[None, :] == tgt[:, None]).to(tl.float32)
        grad = tl.where(valid[:, None], (onehot - p) * g[:, None], 0.0)  # exact 0 on ignored rows
        tl.store(out_ptr[:, None] + cols[None, :], grad.to(grad_ptr.dtype.element_ty),
                 mask=in_bounds)


# -----------------------------------------------------------------------------
# Launchers: check, allocate, launch

def _row_view(logits):
    """logits (..., V) as (B, T_inner, V) with last stride 1, a view whenever torch allows."""
    V = logits.shape[-1]
    x = logits.reshape(-1, *logits.shape[-2:]) if logits.ndim >= 2 else logits.view(1, 1, V)
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(kernel, logits, *args):
    """Launch kernel over the rows of logits; args: the kernel's arguments after logits_ptr
    up to inv_temp (the launcher fills in R, T_inner, V, strides and the config)."""
    if logits.device.type == "cpu" and isinstance(kernel, triton.runtime.JITFunction):
        raise ValueError("backend='triton' on a CPU tensor needs the Triton interpreter: set "
                         "TRITON_INTERPRET=1 before kernels.py is imported, or use a CUDA tensor")
    if logits.numel() == 0:  # no rows: nothing to launch (a grid of 0 programs is an error)
        return
    x = _row_view(logits)  # (B, T_inner, V)
    R, V = x.shape[0] * x.shape[1], x.shape[2]
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[(triton.cdiv(R, BLOCK_R),)](
            x, *args, R, x.shape[1], V, x.stride(0), x.stride(1),
            BLOCK_R=BLOCK_R, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)


def logprobs_fwd(logits, targets, temperature):
    """Forward kernel: logits (..., V), targets (...) -> logp, entropy (...) and lse (R,), fp32."""
    tgt = targets.reshape(-1).contiguous()  # (R,)
    logp, entropy, lse = (torch.empty(tgt.shape, dtype=torch.float32, device=tgt.device)
                          for _ in range(3))
    _launch(_logprobs_fwd_kernel, logits, tgt, logp, entropy, lse, 1.0 / temperature)
    return logp.view(targets.shape), entropy.view(targets.shape), lse


def logprobs_bwd(logits, targets, lse, grad_logp, temperature):
    """Backward kernel: d(sum grad_logp * logp) / d logits, (..., V) in the logits' dtype."""
    tgt = targets.reshape(-1).contiguous()  # (R,)
    g = grad_logp.reshape(-1).float().contiguous()  # (R,) may arrive expanded (stride 0)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # (..., V)
    _launch(_logprobs_bwd_kernel, logits, tgt, lse, g, grad, 1.0 / temperature)
    return grad


# -----------------------------------------------------------------------------
# Autograd

class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature):
        logp, entropy, lse = logprobs_fwd(logits, targets, temperature)
        ctx.save_for_backward(logits, targets, lse)  # logits is saved by reference, not copied
        ctx.temperature = temperature  # the very same value in both passes
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: a clear error if tried
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        return logprobs_bwd(logits, targets, lse, grad_logp, ctx.temperature), None, None



def _no_autocast(device_type):
    """The chunk matmuls run in a dtype chosen once (see linear_logprobs), autocast or not."""
    return torch.autocast(device_type, enabled=False)


class _LinearLogprobs(torch.autograd.Function):
    """token_logprobs(hidden @ weight.T) over chunks of `rows` positions: a chunk's logits are made,
    its log-probs taken, and the logits dropped. Backward makes each chunk's logits again (the
    upstream gradient is only known after the forward) and accumulates the gradients of hidden
    and weight. `fwd`, `bwd`: logprobs_fwd/bwd (Triton) or logprobs_fwd_ref/bwd_ref (torch)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, dtype, rows, fwd, bwd):
        # hidden (N, D), weight (V, D), targets (N,); dtype: what the matmul runs in
        w = weight.to(dtype)  # (V, D); no copy unless autocast lowers the precision
        out_dtype = torch.promote_types(dtype, torch.float32)  # fp32 (fp64 for a float64 oracle)
        logp, entropy, lse = (hidden.new_zeros(len(targets), dtype=out_dtype) for _ in range(3))
        with _no_autocast(hidden.device.type):
            for i in range(0, len(targets), rows):
                logits = hidden[i: i + rows].to(dtype) @ w.T  # (c, V): the only logits alive
                lp, ent, lse[i: i + rows] = fwd(logits, targets[i: i + rows], temperature, with_entropy)
                logp[i: i + rows] = lp.view(-1)
                if with_entropy:
                    entropy[i: i + rows] = ent.view(-1)
                del logits, lp, ent  # before the next chunk's logits are made
        ctx.save_for_backward(hidden, weight, targets, lse)  # saved by reference: no copies
        ctx.temperature, ctx.dtype, ctx.rows, ctx.bwd = temperature, dtype, rows, bwd
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        dtype, rows = ctx.dtype, ctx.rows
        w = weight.to(dtype)  # (V, D)
        grad_h = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)  # (N, D)
        acc = torch.promote_types(dtype, torch.float32)  # the weight's gradient is summed in fp32
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)  # (V, D)
        with _no_autocast(hidden.device.type):
            for i in range(0, len(targets), rows):
                h = hidden[i: i + rows].to(dtype)  # (c, D)
                logits = h @ w.T  # (c, V), the forward's logits made again
                g = ctx.bwd(logits, targets[i: i + rows], lse[i: i + rows], grad_logp[i: i + rows],
                            ctx.temperature)  # (c, V) gradient of the logits, in dtype
                del logits
                grad_h[i: i + rows] = g @ w  # (c, D)
                if dtype == acc:  # accumulate in place: no (V, D) temporary
                    grad_w.addmm_(g.T, h)
                else:  # each chunk's bf16/fp16 product rounds once, the sum is fp32
                    grad_w += g.T @ h  # (torch has no CPU matmul from bf16 to fp32)
                del g  # before the next chunk's logits: one chunk alive at a time
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), None, None, None, None, None, None, None


# -----------------------------------------------------------------------------
# The public function

def token_logprobs(logits, targets, temperature=1.0, with_entropy=False, backend="auto", validate=True):
    """Log-probabilities of `targets` under softmax(logits / temperature), fp32, differentiable.

    logits (..., V) fp32/bf16/fp16; targets (...) int64, -100 = ignore (logp 0, entropy 0, grad 0).
    Returns logp (...), or (logp, entropy) with with_entropy (entropy carries no gradient).
    backend: "auto" (Triton on CUDA, torch reference on CPU), "triton" (the kernels; on a CPU
    through the Triton interpreter) or "torch" (the reference). validate=False skips the range
    check of the targets and its host sync (the sampler's own draws are in range by construction).
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch" or (backend == "auto" and not getattr(logits, "is_cuda", False)):
        return token_logprobs_ref(logits, targets, temperature, with_entropy, validate)
    _check_inputs(logits, targets, temperature, KERNEL_DTYPES, validate)
    logp, entropy = _TokenLogprobs.apply(logits, targets, float(temperature))
    return (logp, entropy) if with_entropy else logp



def linear_logprobs(hidden, weight, targets, temperature=1.0, with_entropy=False, backend="auto",
                    chunk_bytes=LINEAR_CHUNK_BYTES):
    """token_logprobs(hidden @ weight.T, targets, ...) without ever holding the whole logits.

    hidden (..., D) (the model's last hidden states), weight (V, D) (its output embedding, tied or
    not); targets (...) int64, -100 = ignore. Returns logp (...) fp32, or (logp, entropy); the
    gradient flows to hidden and weight. Positions are taken in chunks of chunk_bytes of fp32
    logits (LINEAR_CHUNK_BYTES). The matmul runs in autocast's dtype when autocast is on for
    hidden's device (as the model's own output layer would), else in hidden's dtype, which must
    then be weight's. backend: "auto" (Triton on CUDA, torch on CPU), "triton" or "torch".
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if not (isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.ndim == 2
            and hidden.ndim >= 1 and hidden.shape[-1] == weight.shape[1] and weight.shape[0] >= 1):
        raise ValueError("hidden must be (..., D) and weight (V, D), got "
                         f"{getattr(hidden, 'shape', hidden)} and {getattr(weight, 'shape', weight)}")
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    elif hidden.dtype == weight.dtype:
        dtype = hidden.dtype
    else:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype} (without autocast)")
    V = weight.shape[0]
    # the same checks as token_logprobs on a stride-0 stand-in for the (..., V) logits (no memory)
    triton_ = backend == "triton" or (backend == "auto" and hidden.is_cuda)
    _check_inputs(hidden.new_empty((), dtype=dtype).expand(*hidden.shape[:-1], V), targets,
                  temperature, KERNEL_DTYPES if triton_ else REF_DTYPES)
    if triton_:
        fwd = lambda x, t, temp, with_entropy: logprobs_fwd(x, t, temp)  # entropy comes free
        bwd = logprobs_bwd
    else:
        fwd, bwd = logprobs_fwd_ref, logprobs_bwd_ref
    rows = max(1, chunk_bytes // (4 * V))  # positions per chunk
    logp, entropy = _LinearLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                          targets.reshape(-1), float(temperature), with_entropy,
                                          dtype, rows, fwd, bwd)
    logp, entropy = logp.view(targets.shape), entropy.view(targets.shape)  # (...), (...)
    return (logp, entropy) if with_entropy else logp


# -----------------------------------------------------------------------------
# Compiled for real GPUs, without one: every @triton.jit kernel above, ahead of time

GPU_ARCHS = {80: "A100 (sm_80)", 90: "H100/H200 (sm_90)"}  # 65,536 registers, 2,048 threads per SM


def _kernel_signature(kernel, dtype):
    """Argument types of one of this file's kernels: the logits and their gradient in the logits'
    dtype, targets int64, other pointers fp32, inv_temp fp32, integers i32 (as triton specialises
    a launch whose sizes fit in 32 bits), the block sizes constexpr."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    sig = {}
    for arg in kernel.arg_names:
        if arg in ("logits_ptr", "grad_ptr"):
            sig[arg] = "*" + names[dtype]
        elif arg == "targets_ptr":
            sig[arg] = "*i64"
        elif arg.endswith("_ptr"):
            sig[arg] = "*fp32"
        elif arg in ("BLOCK_R", "BLOCK_V"):
            sig[arg] = "constexpr"
        else:
            sig[arg] = "fp32" if arg == "inv_temp" else "i32"
    return sig


def compile_kernels(archs=tuple(GPU_ARCHS), dtypes=KERNEL_DTYPES):
    """Compile every kernel for each CUDA arch and logits dtype with triton (no GPU needed), then
    ask the ptxas bundled with triton (-v) for registers per thread and spills. Returns a list of
    dicts (kernel, arch, dtype, regs, spill_bytes, warps_per_sm). Needs compiled, not interpreted,
    triton: with TRITON_INTERPRET=1 (set above on a machine without a GPU) it runs in a subprocess."""
    import json
    import re
    import subprocess
    import tempfile
    if triton.knobs.runtime.interpret:
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile-json"],
                             env=env, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"compiling the kernels failed:\n{out.stderr[-3000:]}")
        rows = json.loads(out.stdout.splitlines()[-1])
        return [r for r in rows if r["arch"] in archs and r["dtype"] in [str(d)[6:] for d in dtypes]]
    from triton.backends.compiler import GPUTarget
    kernels = [v for v in globals().values() if isinstance(v, triton.runtime.JITFunction)]
    rows = []
    for kernel in kernels:
        for arch in archs:
            for dtype in dtypes:
                src = triton.compiler.ASTSource(fn=kernel, signature=_kernel_signature(kernel, dtype),
                                                constexprs=dict(BLOCK_R=BLOCK_R, BLOCK_V=BLOCK_V))
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                          options=dict(num_warps=NUM_WARPS))
                ptx = compiled.asm["ptx"]
                gpu = re.search(r"^\.target (\w+)", ptx, re.M).group(1)  # sm_80, sm_90a
                with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                    f.write(ptx)
                    f.flush()
                    info = subprocess.run([triton.knobs.nvidia.ptxas.path, "-v", f"--gpu-name={gpu}",
                                           "-o", os.devnull, f.name], capture_output=True,
                                          text=True, check=True).stderr
                regs = int(re.search(r"Used (\d+) registers", info).group(1))
                spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
                spills = int(spill.group(1)) + int(spill.group(2))  # no line: an error, not 0
                # registers are allocated per warp in units of 256 (8 per thread): blocks of
                # NUM_WARPS warps fit while 65,536 registers last, up to 64 warps (2,048 threads)
                per_warp = -(-regs // 8) * 8 * 32
                warps = min(64, 65536 // (per_warp * NUM_WARPS) * NUM_WARPS)
                rows.append(dict(kernel=kernel.__name__, arch=arch, dtype=str(dtype)[6:], regs=regs,
                                 spill_bytes=spills, warps_per_sm=warps))
    return rows


def _compiled_table():
    print(f"\nCompiled ahead of time (triton {triton.__version__}, ptxas -v), BLOCK_R = {BLOCK_R}, "
          f"BLOCK_V = {BLOCK_V}, {NUM_WARPS} warps")
    print(f"{'kernel':>22} {'GPU':>18} {'logits':>9} {'regs':>5} {'spills B':>9} {'occupancy':>14}")
    for r in compile_kernels():
        print(f"{r['kernel']:>22} {GPU_ARCHS[r['arch']]:>18} {r['dtype']:>9} {r['regs']:5d} "
              f"{r['spill_bytes']:9d} {r['warps_per_sm']:3d}/64 warps")
    print("  occupancy: resident warps per SM that the registers allow (65,536 per SM, at most\n"
          "  2,048 threads = 64 warps), in blocks of the kernel's warps")

# -----------------------------------------------------------------------------
# Benchmark: `python kernels.py` (CPU: correctness + memory; GPU: speed + memory)

def _naive(logits, targets, temperature=1.0):
    """The usual way, and what the kernel replaces: fp32 log_softmax over all of (R, V)."""
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets != IGNORE_INDEX)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _correctness_table(rows=8, V=5003, temperature=0.7):
    """Max abs error vs the float64 reference: kernel, our reference, torch in the dtype."""
    where = "GPU" if torch.cuda.is_available() else "interpreter"
    print(f"correctness: max |error| vs float64, ({rows}, {V}) logits ~ 4*randn, "
          f"T = {temperature}, 2 ignored rows; kernel = Triton ({where})")
    print(f"{'dtype':>9} {'path':>22} {'logp':>9} {'entropy':>9} {'grad':>9}")
    gen = torch.Generator().manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x64 = (4 * torch.randn(rows, V, generator=gen, dtype=torch.float64)).to(dev)
    tgt = torch.randint(0, V, (rows,), generator=gen).to(dev)
    tgt[[1, 5]] = IGNORE_INDEX
    g = torch.randn(rows, generator=gen, dtype=torch.float64).to(dev)  # upstream gradient
    for dtype in KERNEL_DTYPES:
        xd = x64.to(dtype)
        x_ref = xd.double().requires_grad_()  # float64 oracle on the very same (rounded) inputs
        lp_ref, h_ref = token_logprobs_ref(x_ref, tgt, temperature, with_entropy=True)
        (lp_ref * g).sum().backward()
        paths = {
            "kernel": lambda x: token_logprobs(x, tgt, temperature, True, backend="triton"),
            "reference": lambda x: token_logprobs_ref(x, tgt, temperature, True),
            f"torch in {str(dtype)[6:]}": lambda x: _torch_in_dtype(x, tgt, temperature),
        }
        for name, fn in paths.items():
            x = xd.clone().requires_grad_()
            lp, h = fn(x)
            (lp * g.to(lp.dtype)).sum().backward()
            print(f"{str(dtype)[6:]:>9} {name:>22} {_max_err(lp, lp_ref):9.2e} "
                  f"{_max_err(h, h_ref):9.2e} {_max_err(x.grad, x_ref.grad):9.2e}")
    if not torch.cuda.is_available():
        print("  the interpreter truncates fp32 -> bf16 when storing the gradient (up to 1 ulp);\n"
              "  a GPU rounds to nearest (half an ulp), like the reference")


def _torch_in_dtype(x, tgt, temperature):
    """torch's own computation kept in the logits' dtype: the bar for fp16/bf16 error."""
    logp_all = torch.log_softmax(x / temperature, -1)  # (R, V) in x.dtype
    valid = tgt != IGNORE_INDEX
    logp = logp_all.gather(-1, tgt.clamp(min=0)[:, None])[:, 0] * valid
    entropy = -(logp_all.exp() * logp_all).sum(-1) * valid
    return logp, entropy.detach()


def _cpu_peak_bytes(fn):
    """Peak bytes held by torch's CPU allocator while fn runs, above what was held before.

    Read from the profiler's allocation/free events ("[memory]", +/- bytes, in time order);
    counts tensors only (not Python objects or allocator caching)."""
    import gc
    from torch.profiler import ProfilerActivity, profile
    gc.collect()  # free what earlier runs left behind before the count starts
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _cuda_peak_bytes(fn):
    """Peak bytes held by torch's CUDA allocator while fn runs, above what was held before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _bench_cpu_memory(rows=1024, V=32000):
    import time
    gen = torch.Generator().manual_seed(0)
    x0 = (4 * torch.randn(rows, V, generator=gen)).bfloat16()
    tgt = torch.randint(0, V, (rows,), generator=gen)
    print(f"\nCPU peak memory, bf16 logits ({rows}, {V}) = {x0.numel() * 2 / 2**20:.0f} MiB, "
          f"forward + backward; gradient (same size, bf16) included")
    print(f"{'path':>30} {'peak extra MiB':>15} {'x logits':>9} {'time s':>7}")
    for name, fn in [("naive log_softmax(x.float())", _naive),
                     ("token_logprobs (reference)", lambda x, t: token_logprobs(x, t))]:
        x = x0.clone().requires_grad_()

        def step():
            fn(x, tgt).sum().backward()
        times = []
        for _ in range(3):  # the first is a warm-up
            x.grad = None
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        x.grad = None
        peak = _cpu_peak_bytes(step)
        x.grad = None
        print(f"{name:>30} {peak / 2**20:15.0f} {peak / (x0.numel() * 2):9.1f} "
              f"{min(times[1:]):7.2f}")
    print("  peak: bytes live in torch's CPU allocator (profiler events) above those before;\n"
          "  time: best of 2 after a warm-up, on this machine's threads. The Triton path is not\n"
          "  measured on a CPU: the interpreter is a test tool, not a backend.")



def _linear_cpu_child(path, N, D, V):
    """In a fresh process: one forward + backward of `path` ("logits" or "linear") at (N, D, V),
    fp32; prints its peak extra resident bytes and its time (one run: minutes on a small CPU)."""
    import ctypes
    import time
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=gen).requires_grad_()  # (N, D) hidden states
    w = (torch.randn(V, D, generator=gen) / D**0.5).requires_grad_()  # (V, D): logits ~ randn
    t = torch.randint(0, V, (N,), generator=gen)
    g = torch.randn(N, generator=gen)  # upstream gradient
    fn = {"logits": lambda h, w, t: token_logprobs(h @ w.T, t),  # the logits made whole, as before
          "linear": lambda h, w, t: linear_logprobs(h, w, t)}[path]

    def step(h=h, w=w, t=t, g=g):
        h.grad = w.grad = None
        (fn(h, w, t) * g).sum().backward()
    # a tiny call first, so that one-time setup (lazy imports, thread pools) is not measured
    step(*(x.detach()[:8].requires_grad_() for x in (h, w)), t[:8] % 8, g[:8])

    def status(key):  # kB -> bytes, from /proc/self/status
        line = next(x for x in open("/proc/self/status") if x.startswith(key))
        return int(line.split()[1]) * 1024
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand back what making the inputs freed
    base = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark VmHWM to now
        f.write("5")
    t0 = time.perf_counter()
    step()  # the gradients of h and w (N*D + V*D floats) are part of the peak, on both paths
    print(status("VmHWM:") - base, time.perf_counter() - t0)


def _bench_linear_cpu(N=4096, D=896, V=151936):
    """linear_logprobs against logits-then-token_logprobs, fp32, one fresh process per path."""
    import subprocess
    print(f"\nCPU, fp32, {N} positions x D = {D} -> V = {V} (minutes): forward + backward (the gradients of "
          f"hidden and weight included);\nlogits alone = {N * V * 4 / 2**30:.2f} GiB, one chunk = "
          f"{LINEAR_CHUNK_BYTES // (4 * V)} positions")
    print(f"{'path':>34} {'peak extra MiB':>15} {'time s':>7}")
    res = {}
    for path, name in [("logits", "hidden @ W.T, then token_logprobs"), ("linear", "linear_logprobs")]:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--linear-child", path,
                              str(N), str(D), str(V)], capture_output=True, text=True, check=True)
        res[path] = peak, sec = tuple(float(x) for x in out.stdout.split()[-2:])
        print(f"{name:>34} {peak / 2**20:15.0f} {sec:7.2f}")
    print(f"  linear_logprobs: {res['logits'][0] / res['linear'][0]:.1f}x less memory, "
          f"{res['linear'][1] / res['logits'][1]:.2f}x the time")
    print("  peak extra: the process's resident high-water mark (VmHWM) during one forward +\n"
          "  backward, above its resident size before (each path in a fresh process); time: that\n"
          "  same run, on this machine's threads (first touch of fresh memory included, on both paths)")

def _cuda_time_ms(fn, reps=10):
    """Median milliseconds of fn, by CUDA events, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _bench_gpu(shapes=((8192, 151936), (32768, 32000), (65536, 151936))):
    """bf16 speed and memory on the GPU at hand, against the naive path and torch.compile of it.

    n = bytes of the logits. "copy" = torch.empty_like(x).copy_(x), measured here: it moves
    exactly the bytes fwd+bwd must move (read the logits, write the gradient), so
    copy/f+b = copy ms / fwd+bwd ms is the achieved fraction of copy bandwidth for those bytes.
    Two passes also re-read the logits in backward (the upstream gradient is not known in the
    forward), so copy/f+b is at most ~67%; "f+b GB/s" counts that real traffic, 3n."""
    compiled = torch.compile(_naive, dynamic=False)
    paths = {"triton": lambda x, t: token_logprobs(x, t, backend="triton"),
             "naive": _naive, "naive compiled": compiled}
    print(f"\nGPU {torch.cuda.get_device_name()}, bf16 logits, median of 10 (CUDA events)")
    print(f"{'rows':>6} {'V':>7} {'path':>15} {'fwd ms':>8} {'fwd GB/s':>9} {'f+b ms':>8} "
          f"{'f+b GB/s':>9} {'copy/f+b':>9} {'peak GiB':>9} {'x logits':>9}")
    for rows, V in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(rows, V, generator=gen, device="cuda", dtype=torch.bfloat16).mul_(4)
        t = torch.randint(0, V, (rows,), generator=gen, device="cuda")
        g = torch.randn(rows, generator=gen, device="cuda")  # upstream gradient
        n = x.numel() * x.element_size()  # bytes of the logits
        copy_ms = _cuda_time_ms(lambda: torch.empty_like(x).copy_(x))
        # correctness on a slice against the float64 reference, on the GPU itself
        sl = x[:64].double().requires_grad_()
        lp_ref = token_logprobs_ref(sl, t[:64])
        lp_ref.backward(g[:64].double())
        sk = x[:64].clone().requires_grad_()
        lp = token_logprobs(sk, t[:64], backend="triton")
        lp.backward(g[:64])
        print(f"{rows:6d} {V:7d} copy {copy_ms:.2f} ms = {2 * n / copy_ms / 1e6:.0f} GB/s; "
              f"64 rows vs float64: max|logp err| {_max_err(lp, lp_ref):.1e}, "
              f"max|grad err| {_max_err(sk.grad, sl.grad):.1e}, max logp {lp.max().item():.1e}")
        del sl, sk, lp, lp_ref
        for name, fn in paths.items():
            xg = x.detach().requires_grad_()

            def fwd():
                with torch.no_grad():
                    fn(xg, t)

            def fwd_bwd():
                xg.grad = None  # each call allocates its own gradient, as in training
                fn(xg, t).backward(g)
            try:
                fwd_ms, fb_ms = _cuda_time_ms(fwd), _cuda_time_ms(fwd_bwd)
                xg.grad = None
                peak = _cuda_peak_bytes(fwd_bwd)  # bytes, the gradient included
                print(f"{'':>14} {name:>15} {fwd_ms:8.2f} {n / fwd_ms / 1e6:9.0f} {fb_ms:8.2f} "
                      f"{3 * n / fb_ms / 1e6:9.0f} {100 * copy_ms / fb_ms:8.0f}% "
                      f"{peak / 2**30:9.2f} {peak / n:9.2f}")
            except torch.OutOfMemoryError:
                print(f"{'':>14} {name:>15} out of memory")
            xg.grad = None
            torch.cuda.empty_cache()
        del x
        torch.cuda.empty_cache()
    print("  peak = max_memory_allocated during one forward+backward minus before, the bf16 "
          "gradient (1.00 x logits) included")



def _bench_linear_gpu(N=16384, D=1536, V=151936):
    """linear_logprobs against whole logits then token_logprobs, bf16 hidden and weight, on the GPU:
    forward + backward time and peak memory, the gradients of hidden and weight included."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, D, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(V, D, generator=gen, device="cuda") / D**0.5).bfloat16().requires_grad_()
    t = torch.randint(0, V, (N,), generator=gen, device="cuda")
    g = torch.randn(N, generator=gen, device="cuda")
    flops = 4 * 2 * N * D * V  # four matmuls: forward, and in backward the recompute + two gradients
    paths = {"logits, token_logprobs": lambda: token_logprobs(h @ w.T, t),
             "linear_logprobs": lambda: linear_logprobs(h, w, t),
             "linear, 1 GiB chunks": lambda: linear_logprobs(h, w, t, chunk_bytes=2**30)}
    print(f"\nGPU, bf16, {N} positions x D = {D} -> V = {V}, forward + backward (median of 10)")
    print(f"{'path':>24} {'f+b ms':>8} {'TFLOP/s (4 mm)':>15} {'peak GiB':>9}")
    for name, fn in paths.items():
        def step():
            h.grad = w.grad = None
            (fn() * g).sum().backward()
        try:
            ms = _cuda_time_ms(step)
            h.grad = w.grad = None
            peak = _cuda_peak_bytes(step)
            print(f"{name:>24} {ms:8.2f} {flops / ms / 1e9:15.0f} {peak / 2**30:9.2f}")
        except torch.OutOfMemoryError:
            print(f"{name:>24} out of memory")
        h.grad = w.grad = None
        torch.cuda.empty_cache()
    print("  peak = max_memory_allocated during one forward+backward minus before, gradients included;\n"
          "  TFLOP/s counts four matmuls for every path (the logits path makes only three): it compares times")

def _tune(rows=32768, V=151936):
    """Opt-in sweep of launch configs on the GPU at hand; prints fwd+bwd ms, does not persist."""
    global BLOCK_R, BLOCK_V, NUM_WARPS
    x = torch.randn(rows, V, device="cuda", dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (rows,), device="cuda")
    g = torch.randn(rows, device="cuda")
    default = (BLOCK_R, BLOCK_V, NUM_WARPS)

    def step():
        x.grad = None  # each call allocates its own gradient, as in training
        token_logprobs(x, t, backend="triton").backward(g)
    for config in [(1, 4096, 8), (2, 2048, 8), (4, 1024, 4), (4, 2048, 8), (8, 1024, 8),
                   (8, 2048, 8), (16, 512, 8), (16, 1024, 16)]:
        BLOCK_R, BLOCK_V, NUM_WARPS = config
        ms = _cuda_time_ms(step)
        print(f"BLOCK_R={config[0]:3d} BLOCK_V={config[1]:5d} num_warps={config[2]:3d}: "
              f"{ms:.2f} ms fwd+bwd ({rows}, {V})")
    BLOCK_R, BLOCK_V, NUM_WARPS = default


if __name__ == "__main__":
    if "--linear-child" in sys.argv:  # one measurement of _bench_linear_cpu
        path, N, D, V = sys.argv[sys.argv.index("--linear-child") + 1:][:4]
        _linear_cpu_child(path, int(N), int(D), int(V))
        sys.exit()
    if "--compile-json" in sys.argv:  # compile_kernels in a process where triton compiles
        import json
        print(json.dumps(compile_kernels()))
        sys.exit()
    if "--tune" in sys.argv:
        _tune()
        sys.exit()
    _correctness_table()
    if torch.cuda.is_available():
        _bench_gpu()
        _bench_linear_gpu()
    else:
        _bench_cpu_memory()
        _bench_linear_cpu()
    _compiled_table()
