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
fused-softmax kernels). Saved for the backward: lse (R,), and the logits and targets by
reference (no copy). Backward: a second pass that recomputes p = exp(x - lse) block by block and
writes the gradient straight into the logits' dtype.
Nothing of size (R, V) is ever held in fp32: the only (R, V) tensor made is the gradient itself.
Rows whose target is -100 are ignored: logp 0, entropy 0, gradient exactly 0.

Backends of `token_logprobs`:
- CUDA tensors: the Triton kernels below (backend="auto" or "triton").
- CPU tensors: `token_logprobs_ref`, plain torch, chunked over rows (backend="auto" or "torch").
  backend="triton" on a CPU runs the same kernels through the Triton interpreter (slow; for tests),
  or says in one line why it cannot here (interpreter_problem: triton 3.6 with numpy >= 2.4).

From hidden states: `linear_logprobs(hidden, weight, targets)` returns what
token_logprobs(hidden @ weight.T, targets) returns, with gradients for hidden and weight, but makes
the logits one chunk of positions at a time (LINEAR_CHUNK_BYTES) and drops them; its backward makes
each chunk's logits again (the upstream gradient of a log-prob is only known after the forward).

Measured in `python -m tools.bench_kernels`: the correctness summary, the kernels compiled for
sm_80 / sm_90 (registers, spills, occupancy), the memory/speed tables and an opt-in tuning sweep.
"""

import contextlib
import functools
import math
import os

import torch

# With no GPU the kernels can only run in the Triton interpreter, and triton decides at
# @triton.jit time: triton 3.7 reads TRITON_INTERPRET each time a decorator runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    # Triton ships for Linux only: elsewhere (a Mac) every call takes the torch reference, and the
    # kernels below are defined as plain functions that nothing launches.
    import types
    triton, tl = types.SimpleNamespace(jit=lambda fn: fn), types.SimpleNamespace(constexpr=int)
    HAS_TRITON = False
from torch.utils.checkpoint import checkpoint  # noqa: E402

# But triton.language's own @jit helpers (tl.max, tl.sum, tl.zeros, ...) were decorated when it
# was first imported. If that was before the line above (torch._dynamo, torch.compile and
# torch.utils.checkpoint import triton), they are compiled-mode functions that raise "Cannot call
# @triton.jit'd outside of the scope of a kernel" inside an interpreted kernel: re-wrap them.
# One wrapper per helper, so the interpreter's `combine_fn == tl.standard._sum_combine` holds.
if (HAS_TRITON and triton.knobs.runtime.interpret
        and isinstance(tl.standard.max, triton.runtime.JITFunction)):
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
# 8 warps. Chosen by reasoning, not yet measured on a GPU: `python -m tools.bench_kernels --tune`
# sweeps a few alternatives on the GPU at hand (autotuning is opt-in, never on by default).
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
    of `linear_logprobs`, which makes its own backward from lse. float64 logits stay float64.
    On a CPU the passes over the vocabulary cost more than the chunk's matmul (one (682, 49152) bf16
    chunk at one thread: the matmul 0.27 s, the passes 0.49 s in the plain form, 0.25 s in this
    one), so they are few: the fp32 copy (bf16 logits, or tempered ones) is tempered and shifted in
    place, lse is torch.logsumexp's own sequence of operations (the same bits) keeping exp(x - m),
    and the entropy reuses it, as the kernel does (H = lse - sum p x = log s - sum exp(x - m) (x -
    m) / s, s = sum exp(x - m))."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (r, V); fp32 is no copy
    own = x is not logits  # a buffer of our own, changed in place from here
    if temperature != 1:
        x, own = (x.div_(temperature) if own else x / temperature), True
    valid = targets != IGNORE_INDEX  # (r,)
    x_t = x.gather(-1, targets.clamp(min=0)[:, None])[:, 0]  # (r,) clamp: -100 -> col 0
    m = x.amax(-1, keepdim=True)  # (r, 1)
    m.masked_fill_(m.abs() == math.inf, 0)  # (as torch.logsumexp does)
    y = x.sub_(m) if own else x - m  # (r, V) x - m
    e = torch.exp(y) if with_entropy else y.exp_()  # (r, V) exp(x - m)
    s = e.sum(-1)  # (r,)
    log_s = s.log()  # (r,)
    lse = log_s + m[:, 0]  # (r,)
    logp = torch.where(valid, (x_t - lse).clamp(max=0), 0.0)  # <= 0 against the last ulp
    if not with_entropy:
        return logp, None, lse
    # -inf logits have e = 0: the clamp makes their term 0 * (-max float), not 0 * -inf = nan
    entropy = log_s - torch.linalg.vecdot(e, y.clamp_(min=torch.finfo(y.dtype).min)) / s
    return logp, torch.where(valid, entropy, 0.0), lse


def logprobs_bwd_ref(logits, targets, lse, grad_logp, temperature):
    """The backward kernel's contract in plain torch: (onehot(t) - p) * grad_logp / T, (r, V) in
    the logits' dtype; exactly 0 on ignored rows. Made in place in the fp32 copy where there is
    one (bf16 logits, or a temperature)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (r, V) fp32 (fp64 stays)
    own = x is not logits
    if temperature != 1:
        x, own = (x.div_(temperature) if own else x / temperature), True
    valid = targets != IGNORE_INDEX  # (r,)
    # (r,) the upstream gradient times 1/T: the chain rule through x = logits / T.
    g = torch.where(valid, grad_logp.to(x.dtype), 0.0) / temperature
    p = x.sub_(lse[:, None]) if own else torch.sub(x, lse[:, None])  # (r, V) x - lse
    grad = p.exp_().mul_(-g[:, None])  # (r, V) = -p g / T, one buffer
    grad.scatter_add_(-1, targets.clamp(min=0)[:, None], g[:, None])  # + onehot g / T
    grad[~valid] = 0.0  # touches the ignored rows only; -0.0 and nan-free whatever their logits
    return grad.to(logits.dtype)


def linear_logprobs_ref(hidden, weight, targets, temperature=1.0, with_entropy=False):
    """Reference of `linear_logprobs`: the logits made whole, then `token_logprobs_ref`."""
    # The logits hidden @ weight.T are (..., V), made whole.
    return token_logprobs_ref(hidden @ weight.T, targets, temperature, with_entropy)

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


def interpreter_problem() -> str:
    """Why the Triton interpreter (backend="triton" on a CPU tensor) cannot run here, in one
    line; '' if it can. Triton 3.6's interpreter converts numpy arrays to Python scalars in a way
    numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars", inside every
    kernel); 3.7's does not."""
    if not HAS_TRITON:
        return "needs triton, which is not installed (it ships for Linux only)"
    try:
        import numpy  # the interpreter runs every program on numpy arrays
    except ImportError:
        return "the Triton interpreter needs numpy: pip install numpy"
    version = lambda v: tuple(int(x) for x in v.split("+")[0].split(".")[:2])  # "3.6.0" -> (3, 6)
    if version(triton.__version__) < (3, 7) and version(numpy.__version__) >= (2, 4):
        return (f"triton {triton.__version__}'s CPU interpreter fails with numpy "
                f"{numpy.__version__} (>= 2.4): "
                "pip install 'numpy<2.4' (or triton>=3.7), or use backend='torch'")
    return ""


def _launch(kernel, logits, *args):
    """Launch kernel over the rows of logits; args: the kernel's arguments after logits_ptr
    up to inv_temp (the launcher fills in R, T_inner, V, strides and the config)."""
    if not HAS_TRITON:
        raise ValueError("backend='triton' needs triton, which is not installed "
                         "(it ships for Linux only)")
    if logits.device.type == "cpu" and isinstance(kernel, triton.runtime.JITFunction):
        raise ValueError("backend='triton' on a CPU tensor needs the Triton interpreter: set "
                         "TRITON_INTERPRET=1 before kernels.py is imported, or use a CUDA tensor")
    if logits.device.type == "cpu" and (problem := interpreter_problem()):
        raise ValueError(f"backend='triton' on a CPU tensor: {problem}")
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
                lp, ent, lse[i: i + rows] = fwd(logits, targets[i: i + rows], temperature,
                                                with_entropy)
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
        # One gradient per argument of forward: hidden and weight have one, the rest none.
        return (grad_h.to(hidden.dtype), grad_w.to(weight.dtype),
                None, None, None, None, None, None, None)


# -----------------------------------------------------------------------------
# The public function

def token_logprobs(logits, targets, temperature=1.0, with_entropy=False, backend="auto",
                   validate=True):
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
    if not (isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)
            and weight.ndim == 2 and hidden.ndim >= 1 and hidden.shape[-1] == weight.shape[1]
            and weight.shape[0] >= 1):
        raise ValueError("hidden must be (..., D) and weight (V, D), got "
                         f"{getattr(hidden, 'shape', hidden)} and "
                         f"{getattr(weight, 'shape', weight)}")
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    elif hidden.dtype == weight.dtype:
        dtype = hidden.dtype
    else:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype} "
                         "(without autocast)")
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
