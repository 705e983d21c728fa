"""
bench_kernels.py: the log-prob kernels of kernels.py measured. Parts (--part, default all):

  correctness  max |error| against float64 of the Triton kernel (on a CPU: the interpreter), the torch
               reference and torch computing in the logits' dtype (the bar for bf16/fp16)
  logprobs     token_logprobs' memory and speed: on a GPU, bf16 fwd / fwd+bwd against the naive
               log_softmax and torch.compile of it, each shape's first and last 64 rows checked against
               float64 after the whole call; on a CPU, the peak memory of the reference against the naive path
  linear       linear_logprobs against whole logits then token_logprobs (GPU: bf16; CPU: fp32, one fresh
               process per path)
  compiled     every @triton.jit kernel compiled ahead of time for sm_80 and sm_90 (no GPU needed):
               registers per thread, spills, occupancy (ptxas -v)
  peers        (not in all) one log-prob + entropy pass in the unit TRL reports its fused kernel in:
               on a GPU, ms at 8,192 tokens, H = 4096, V = 151,936, bf16, forward and forward +
               backward, for linear_logprobs, the Triton kernel on given logits and the unfused
               torch pass, the ratio beside TRL's 14x; on a CPU, linear_logprobs against TRL 1.16's
               chunked log-prob function (--trl: a Python with TRL), time and peak memory

Commands:
  python -m tools.bench_kernels                            # everything, for the device at hand
  python -m tools.bench_kernels --part correctness
  python -m tools.bench_kernels --part logprobs --shapes 65536x151936 --compiled_shapes 0
  python -m tools.bench_kernels --tune                     # GPU: a few launch configs, fwd+bwd ms
  python -m tools.bench_kernels --part peers               # GPU: TRL's unit
  python -m tools.bench_kernels --part peers --trl /tmp/trl-venv/bin/python  # CPU: against TRL
Figures: docs/results/kernel.md.
"""

import argparse
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kernels  # sets TRITON_INTERPRET before triton is imported when there is no GPU
import triton  # noqa: E402
from kernels import IGNORE_INDEX, KERNEL_DTYPES, linear_logprobs, token_logprobs, token_logprobs_ref  # noqa: E402
from lib.config import OneLineParser  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent  # the repository root: children run as `python -m tools.bench_kernels`


# -----------------------------------------------------------------------------
# Compiled for real GPUs, without one: every @triton.jit kernel of kernels.py, ahead of time

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
    triton: with TRITON_INTERPRET=1 (kernels.py sets it without a GPU) it runs in a subprocess."""
    if triton.knobs.runtime.interpret:
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        out = subprocess.run([sys.executable, "-m", "tools.bench_kernels", "--compile-json"], cwd=ROOT,
                             env=env, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"compiling the kernels failed:\n{out.stderr[-3000:]}")
        rows = json.loads(out.stdout.splitlines()[-1])
        return [r for r in rows if r["arch"] in archs and r["dtype"] in [str(d)[6:] for d in dtypes]]
    jitted = [v for v in vars(kernels).values() if isinstance(v, triton.runtime.JITFunction)]
    rows = []
    for kernel in jitted:
        for arch in archs:
            for dtype in dtypes:
                src = triton.compiler.ASTSource(fn=kernel, signature=_kernel_signature(kernel, dtype),
                                                constexprs=dict(BLOCK_R=kernels.BLOCK_R, BLOCK_V=kernels.BLOCK_V))
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                          options=dict(num_warps=kernels.NUM_WARPS))
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
                warps = min(64, 65536 // (per_warp * kernels.NUM_WARPS) * kernels.NUM_WARPS)
                rows.append(dict(kernel=kernel.__name__, arch=arch, dtype=str(dtype)[6:], regs=regs,
                                 spill_bytes=spills, warps_per_sm=warps))
    return rows


def _compiled_table():
    print(f"\nCompiled ahead of time (triton {triton.__version__}, ptxas -v), BLOCK_R = {kernels.BLOCK_R}, "
          f"BLOCK_V = {kernels.BLOCK_V}, {kernels.NUM_WARPS} warps")
    print(f"{'kernel':>22} {'GPU':>18} {'logits':>9} {'regs':>5} {'spills B':>9} {'occupancy':>14}")
    for r in compile_kernels():
        print(f"{r['kernel']:>22} {GPU_ARCHS[r['arch']]:>18} {r['dtype']:>9} {r['regs']:5d} "
              f"{r['spill_bytes']:9d} {r['warps_per_sm']:3d}/64 warps")
    print("  occupancy: resident warps per SM that the registers allow (65,536 per SM, at most\n"
          "  2,048 threads = 64 warps), in blocks of the kernel's warps")

# -----------------------------------------------------------------------------
# Correctness, memory and speed

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
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=gen).requires_grad_()  # (N, D) hidden states
    w = (torch.randn(V, D, generator=gen) / D**0.5).requires_grad_()  # (V, D): logits ~ randn
    t = torch.randint(0, V, (N,), generator=gen)
    g = torch.randn(N, generator=gen)  # upstream gradient
    fn = {"logits": lambda h, w, t: token_logprobs(h @ w.T, t),  # the logits made whole, as before
          "linear": lambda h, w, t: linear_logprobs(h, w, t),
          # log-prob and entropy (the peers' pass), the log-probs' gradient (the entropy a metric):
          # ours, and TRL's chunked function (in a Python where TRL is installed)
          "linear+entropy": lambda h, w, t: linear_logprobs(h, w, t, with_entropy=True)[0],
          "trl": lambda h, w, t: _trl_chunked()(h, w, None, t, 1.0, TRL_VOCAB_CHUNK, None, 1.0,
                                                ("entropy",))[0]}[path]

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
    print(f"\nCPU, fp32, {N} positions x D = {D} -> V = {V} (minutes): forward + backward (the gradients of "
          f"hidden and weight included);\nlogits alone = {N * V * 4 / 2**30:.2f} GiB, one chunk = "
          f"{kernels.LINEAR_CHUNK_BYTES // (4 * V)} positions")
    print(f"{'path':>34} {'peak extra MiB':>15} {'time s':>7}")
    res = {}
    for path, name in [("logits", "hidden @ W.T, then token_logprobs"), ("linear", "linear_logprobs")]:
        out = subprocess.run([sys.executable, "-m", "tools.bench_kernels", "--linear-child", path,
                              str(N), str(D), str(V)], capture_output=True, text=True, check=True, cwd=ROOT)
        res[path] = peak, sec = tuple(float(x) for x in out.stdout.split()[-2:])
        print(f"{name:>34} {peak / 2**20:15.0f} {sec:7.2f}")
    print(f"  linear_logprobs: {res['logits'][0] / res['linear'][0]:.1f}x less memory, "
          f"{res['linear'][1] / res['logits'][1]:.2f}x the time")
    print("  peak extra: the process's resident high-water mark (VmHWM) during one forward +\n"
          "  backward, above its resident size before (each path in a fresh process); time: that\n"
          "  same run, on this machine's threads (first touch of fresh memory included, on both paths)")

# -----------------------------------------------------------------------------
# In the peers' unit: one log-prob + entropy pass at the shape TRL reports

# TRL's fused Triton log-prob + entropy kernel (huggingface/trl PR 7253) as its maintainers report
# it: one H100, bf16, V = 151,936, H = 4096, 8,192 tokens: 0.89 ms, against 12.8 ms for the unfused
# pass (log_softmax, gather, entropy), 14.4x.
PEER_SHAPE = (8192, 4096, 151936)  # tokens, H, V
TRL_MS = {"fused": 0.89, "unfused": 12.8}
TRL_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE (1.16): its vocabulary tile


def _trl_chunked():
    """TRL's chunked log-prob + entropy of hidden @ weight.T (trl.kernels.chunked_logprob, 1.16):
    its autograd Function's apply (on a CPU its tiles fold in torch)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    return ChunkedLogProbFunction.apply


def _unfused(logits, targets):
    """The unfused pass TRL times: fp32 log_softmax over all of (N, V), the targets' gathered, and
    the entropy from the same log-probabilities. (N,) each."""
    logp_all = torch.log_softmax(logits.float(), -1)  # (N, V)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]  # (N,)
    return logp, -(logp_all.exp() * logp_all).sum(-1)  # (N,), (N,)


def _bench_peers_gpu(N, H, V):
    """ms of one log-prob + entropy pass at TRL's shape, bf16, forward and forward + backward (the
    log-probs' gradient; the entropy is a metric on every path here), for linear_logprobs (from
    hidden states and the head: its matmuls included), the Triton kernel on given logits, and the
    unfused torch pass on the same logits; the ratio beside TRL's."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, H, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=gen, device="cuda") / H**0.5).bfloat16().requires_grad_()
    t = torch.randint(0, V, (N,), generator=gen, device="cuda")  # (N,)
    g = torch.randn(N, generator=gen, device="cuda")  # (N,) upstream gradient of the log-probs
    with torch.no_grad():
        x = (h @ w.T).requires_grad_()  # (N, V) bf16 logits, given to the two logits paths
    paths = {"linear_logprobs (h, W)": (lambda: linear_logprobs(h, w, t, with_entropy=True),
                                        (h, w)),
             "Triton kernel (logits)": (lambda: token_logprobs(x, t, with_entropy=True,
                                                               backend="triton"), (x,)),
             "unfused torch (logits)": (lambda: _unfused(x, t), (x,))}
    print(f"\nIn the peers' unit: {N} tokens, H = {H}, V = {V}, bf16, {torch.cuda.get_device_name()}"
          f", median of 10 (CUDA events)")
    print(f"{'path':>24} {'fwd ms':>8} {'f+b ms':>8}")
    ms = {}
    for name, (fn, leaves) in paths.items():
        def fwd():
            with torch.no_grad():
                fn()

        def fwd_bwd():
            for leaf in leaves:
                leaf.grad = None  # each call allocates its own gradients, as in training
            (fn()[0] * g).sum().backward()
        try:
            ms[name] = (_cuda_time_ms(fwd), _cuda_time_ms(fwd_bwd))
            print(f"{name:>24} {ms[name][0]:8.2f} {ms[name][1]:8.2f}")
        except torch.OutOfMemoryError:
            print(f"{name:>24} out of memory")
        for leaf in leaves:
            leaf.grad = None
        torch.cuda.empty_cache()
    tri, naive = ms.get("Triton kernel (logits)"), ms.get("unfused torch (logits)")
    if tri and naive:
        print(f"  unfused / Triton kernel: forward {naive[0] / tri[0]:.1f}x, forward + backward "
              f"{naive[1] / tri[1]:.1f}x; TRL reports {TRL_MS['unfused'] / TRL_MS['fused']:.1f}x "
              f"({TRL_MS['fused']} vs {TRL_MS['unfused']} ms, one H100, its fused kernel)")


def _bench_peers_cpu(trl_python, N=512, H=896, V=151936):
    """linear_logprobs against TRL's chunked log-prob function (trl_python: a Python with TRL 1.16
    importable), log-prob and entropy of the same (N, H) x (V, H) fp32 inputs, forward + backward,
    each in a fresh process: peak extra memory and time."""
    print(f"\nCPU, fp32, {N} positions x H = {H} -> V = {V}: log-prob + entropy forward, the "
          f"log-probs' backward (the gradients of hidden and weight included), one fresh process "
          f"each, {torch.get_num_threads()} threads")
    print(f"{'path':>34} {'peak extra MiB':>15} {'time s':>7}")
    res = {}
    for path, name, python in [("linear+entropy", "kernels.linear_logprobs", sys.executable),
                               ("trl", "TRL 1.16 ChunkedLogProbFunction", trl_python)]:
        if not python:
            print(f"{name:>34}  skipped: no --trl Python given")
            continue
        out = subprocess.run([python, "-m", "tools.bench_kernels", "--linear-child", path,
                              str(N), str(H), str(V)], capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            print(f"{name:>34}  failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        res[path] = peak, sec = tuple(float(x) for x in out.stdout.split()[-2:])
        print(f"{name:>34} {peak / 2**20:15.0f} {sec:7.2f}")
    if len(res) == 2:
        (m_ours, s_ours), (m_trl, s_trl) = res["linear+entropy"], res["trl"]
        print(f"  linear_logprobs against TRL's: {m_ours / m_trl:.2f}x the memory, "
              f"{s_ours / s_trl:.2f}x the time")


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


def _check_rows_gpu(x, t, g):
    """The kernel on the whole (rows, V) call, forward and backward, its first and last 64 rows
    compared with the float64 reference: the last rows sit past element 2^31 at the largest shapes."""
    xg = x.detach().requires_grad_()
    lp = token_logprobs(xg, t, backend="triton")  # (rows,) the whole call, as in training
    lp.backward(g)
    errs = []
    for sl in (slice(0, 64), slice(len(x) - 64, len(x))):
        x64 = x[sl].double().requires_grad_()  # (64, V) float64 oracle on the same bf16 values
        lp_ref = token_logprobs_ref(x64, t[sl])
        lp_ref.backward(g[sl].double())
        errs.append((_max_err(lp[sl], lp_ref), _max_err(xg.grad[sl], x64.grad)))
        del x64, lp_ref
    return errs, lp.max().item()


def _bench_gpu(shapes, compiled_shapes=1):
    """bf16 speed and memory on the GPU at hand, against the naive path and, at the first
    `compiled_shapes` shapes only (each compile costs tens of seconds), torch.compile of it.

    n = bytes of the logits. "copy" = torch.empty_like(x).copy_(x), measured here: it moves
    exactly the bytes fwd+bwd must move (read the logits, write the gradient), so
    copy/f+b = copy ms / fwd+bwd ms is the achieved fraction of copy bandwidth for those bytes.
    Two passes also re-read the logits in backward (the upstream gradient is not known in the
    forward), so copy/f+b is at most ~67%; "f+b GB/s" counts that real traffic, 3n."""
    compiled = torch.compile(_naive, dynamic=False)
    print(f"\nGPU {torch.cuda.get_device_name()}, bf16 logits, median of 10 (CUDA events)")
    print(f"{'rows':>6} {'V':>7} {'path':>15} {'fwd ms':>8} {'fwd GB/s':>9} {'f+b ms':>8} "
          f"{'f+b GB/s':>9} {'copy/f+b':>9} {'peak GiB':>9} {'x logits':>9}")
    for i, (rows, V) in enumerate(shapes):
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(rows, V, generator=gen, device="cuda", dtype=torch.bfloat16).mul_(4)  # (rows, V)
        t = torch.randint(0, V, (rows,), generator=gen, device="cuda")  # (rows,)
        g = torch.randn(rows, generator=gen, device="cuda")  # (rows,) upstream gradient
        n = x.numel() * x.element_size()  # bytes of the logits
        copy_ms = _cuda_time_ms(lambda: torch.empty_like(x).copy_(x))
        (first, last), max_lp = _check_rows_gpu(x, t, g)
        torch.cuda.empty_cache()
        print(f"{rows:6d} {V:7d} copy {copy_ms:.2f} ms = {2 * n / copy_ms / 1e6:.0f} GB/s; vs float64, "
              f"max|logp err| / max|grad err|: first 64 rows {first[0]:.1e} / {first[1]:.1e}, "
              f"last 64 rows {last[0]:.1e} / {last[1]:.1e}; max logp {max_lp:.1e}")
        paths = {"triton": lambda x, t: token_logprobs(x, t, backend="triton"), "naive": _naive}
        if i < compiled_shapes:  # the baseline last: a slow compile must not hold back the rows above
            paths["naive compiled"] = compiled
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
    x = torch.randn(rows, V, device="cuda", dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (rows,), device="cuda")
    g = torch.randn(rows, device="cuda")
    default = (kernels.BLOCK_R, kernels.BLOCK_V, kernels.NUM_WARPS)  # the launcher reads these at each call

    def step():
        x.grad = None  # each call allocates its own gradient, as in training
        token_logprobs(x, t, backend="triton").backward(g)
    for config in [(1, 4096, 8), (2, 2048, 8), (4, 1024, 4), (4, 2048, 8), (8, 1024, 8),
                   (8, 2048, 8), (16, 512, 8), (16, 1024, 16)]:
        kernels.BLOCK_R, kernels.BLOCK_V, kernels.NUM_WARPS = config
        ms = _cuda_time_ms(step)
        print(f"BLOCK_R={config[0]:3d} BLOCK_V={config[1]:5d} num_warps={config[2]:3d}: "
              f"{ms:.2f} ms fwd+bwd ({rows}, {V})")
    kernels.BLOCK_R, kernels.BLOCK_V, kernels.NUM_WARPS = default


def parse_shape(ap, flag, text, parts):
    """(a, b, ...) from "AxBx...": `parts` positive integers, else one line naming the flag."""
    dims = text.split("x")
    if len(dims) != parts or not all(d.isdigit() and int(d) > 0 for d in dims):
        ap.error(f"{flag} {text}: need {parts} positive integers joined by 'x', e.g. 4096x576x49152")
    return tuple(int(d) for d in dims)


def main():
    ap = OneLineParser(prog="python -m tools.bench_kernels", description="log-prob kernels: correctness, compiled registers, memory, speed")
    ap.add_argument("--part", default="all",
                    choices=["all", "correctness", "compiled", "logprobs", "linear", "peers"],
                    help="correctness: the error table; compiled: ptxas registers/spills (no GPU needed); "
                         "logprobs / linear: memory and speed of token_logprobs / linear_logprobs")
    ap.add_argument("--shapes", default="8192x151936,32768x32000,65536x151936",
                    help="GPU logprobs part: rows x V of bf16 logits, comma-separated")
    ap.add_argument("--compiled_shapes", type=int, default=3,
                    help="GPU logprobs part: torch.compile baseline at this many of the first shapes")
    ap.add_argument("--linear_shape", default="",
                    help="linear part: positions x H x V (default 4096x896x151936 on a CPU, "
                         "16384x1536x151936 on a GPU); SmolLM2-135M's head: 4096x576x49152")
    ap.add_argument("--tune", action="store_true", help="GPU: sweep a few launch configs, print fwd+bwd ms")
    ap.add_argument("--trl", default="",
                    help="peers part on a CPU: a Python with TRL 1.16 importable (its own venv)")
    ap.add_argument("--compile-json", action="store_true", help=argparse.SUPPRESS)  # compile_kernels' child
    ap.add_argument("--linear-child", nargs=4, help=argparse.SUPPRESS)  # one measurement of _bench_linear_cpu
    args = ap.parse_args()
    linear_shape = parse_shape(ap, "--linear_shape", args.linear_shape, 3) if args.linear_shape else ()
    if args.linear_child:
        path, N, D, V = args.linear_child
        return _linear_cpu_child(path, int(N), int(D), int(V))
    if args.compile_json:  # compile_kernels in a process where triton compiles
        return print(json.dumps(compile_kernels()))
    if args.tune:
        return _tune()
    cuda = torch.cuda.is_available()
    if args.part in ("all", "correctness"):
        _correctness_table()
    if args.part in ("all", "logprobs"):
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        _bench_gpu(shapes, args.compiled_shapes) if cuda else _bench_cpu_memory()
    if args.part in ("all", "linear"):
        _bench_linear_gpu(*linear_shape) if cuda else _bench_linear_cpu(*linear_shape)
    if args.part in ("all", "compiled"):
        _compiled_table()
    if args.part == "peers":  # not in "all": the GPU's is its own step of .ci/gpu
        _bench_peers_gpu(*PEER_SHAPE) if cuda else _bench_peers_cpu(args.trl)


if __name__ == "__main__":
    main()
