"""
bench.py: the speed benchmark (its figures: docs/results/speed.md). Every figure is measured in one run, on one saved
randomly initialised model (same weights for every contender), with every response forced to
its full length, and reported as the median of several interleaved repeats (A B A B ...).

Parts:
  sampler  rollout tokens/s of brorl's sampler (prefill once, cascade attention) vs Hugging Face
           model.generate(num_return_sequences=N) at (N, prompt, new) = (512, 16, 32) and
           (512, 256, 64). Ours runs with eos_id=-1 (no token equals it, so it never stops);
           generate with min_new_tokens=max_new_tokens. Same sampling: T=1, top_p=1, top_k off.
  varlen   the same two samplers when lengths vary (EOS made likelier; N=512, prompt 64, up to 128
           new): ours drops finished rows, generate decodes them as padding. Real tokens/s.
  step     completions/s and peak RSS of brorl.rl_step (rollout + reward + update) with
           2 prompts x N rollouts, N in {64, 512}, 32 new tokens, the same micro-batch for both;
           one fresh subprocess per (N, repeat), so its peak RSS (VmHWM) is that configuration's own.
           Lengths are held fixed by a tokenizer whose EOS id is -1 and no EOS in the model's
           generation_config; every response is then "truncated" and scores 0, which changes
           the advantages' values (all 0), not the work: the update still runs its forward and
           backward over every token.
  gpu      (CUDA) the same three parts in bf16 on a randomly initialised model with
           Qwen2.5-0.5B's architecture (peak GPU memory instead of RSS), then rollout samples/s
           for N in {16, 64, 256, 512} at a fixed number of samples per step.
  compiled the sampler's decode step compiled (static_decode_chunk below: a static cache and
           rows, torch.compile) against the eager sampler and generate, at (512, 16, 32), at 1 and 2
           threads, the compile timed and also counted in a rate (not part of "all"); then, on a
           CPU, a whole rl_step (2 x 64 rollouts) with its norms and gated MLPs compiled
           (compile_pointwise) against eager: the update's forward and backward so treated. On a
           machine with CUDA it runs there instead (bf16, the 0.5b model, CUDA graphs; the
           decode step only); CUDA_VISIBLE_DEVICES= keeps it on the CPU.
  lora     rollout tokens/s with a rank-8 LoRA adapter on every attention and MLP projection
           (lora.add_lora), unmerged (brorl's choice: exact, the base weights never rewritten)
           against merged into the weights (peft's merge_adapter), and without an adapter;
           on CUDA in bf16 if available, else this CPU in fp32.

--dtype bfloat16 (default float32) runs the CPU parts sampler, varlen and step as a CPU that
computes bf16 natively (AVX512_BF16, AMX) would: brorl as brorl.py --dtype bfloat16 runs (fp32
weights and AdamW, matmuls under bf16 autocast, old log-probs recomputed), generate with its weights
in bf16 (torch_dtype, what a Hugging Face user does; no casts a call, the stronger baseline), TRL's
GRPOTrainer with bf16=True (accelerate's autocast, fp32 weights), and the matmul floor in bf16:
each dtype against its own floor.

Every speed is also shown as a fraction of this machine's matmul floor, measured at the start of
the same run (matmul_floor: the best GFLOP/s of a plain torch.mm of the model's MLP shape, at the
run's threads and dtype): the model FLOPs the speed implies (model_gflop) over that rate. It says
how much of what the machine's matmuls can do a figure reaches, which a bare tokens/s cannot.

--tiny runs any part (gpu included, on a CPU when there is no GPU) at toy sizes: a check that
every part still runs (tests/test_bench.py), not a measurement.

--model times a real model instead (a folder, a hub id, or an alias such as smollm2-135m-instruct:
lib/pretrained.py), its weights as saved: the sampler and the step at each N of --ns (default 64
and 512) with --new tokens (default 32), from the first prompts of --task (default arith) in the
model's chat template if it has one. The sampler and the step (TRL's too) get the same prompts.
With --model, --part all is those two; --step_ns times the step at some N of --ns only, and
--trl_ns TRL (another N's ratio extrapolated from its nearest N's completions/s, and said so).

Commands:
  python -m tools.bench                    # sampler + step on this CPU (fp32, ~2.4M params)
  python -m tools.bench --part sampler --repeats 5
  python -m tools.bench --part gpu         # on a CUDA machine
  python -m tools.bench --part all --tiny  # every CPU part at toy sizes (seconds)
  python -m tools.bench --part lora        # LoRA decoding, merged or not
  python -m tools.bench --part compiled    # the compiled decode step vs eager vs generate, 1 and 2
                                           # threads (compiling takes a minute or two)
  python -m tools.bench --save DIR         # write the bench model, tokenizer, prompts.json
  python -m tools.bench --model smollm2-135m-instruct --task math:assets/smollm2/add2.jsonl \
      --part sampler --ns 64,512 --new 16 --threads 1      # a real model (docs/results/speed.md)
  python -m tools.bench --model smollm2-135m-instruct --task math:assets/smollm2/add2.jsonl \
      --new 16 --threads 1 --dtype bfloat16 --trl /tmp/trl-venv/bin/python --trl_ns 64
                                           # sampler and step in bf16, TRL's bf16=True at N = 64
  bash tools/bench_trl.sh                  # TRL GRPOTrainer on the same model, in its own venv
  bash tools/bench_trl.sh --model smollm2-135m-instruct 64 --new 16   # ... on a real model
  python -m tools.bench --part step --trl /tmp/trl-venv/bin/python  # TRL interleaved with ours
"""

import argparse
import dataclasses
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config,
                          Qwen2ForCausalLM)
from transformers.utils import logging as hf_logging

import brorl
import data
from kernels import token_logprobs
from lib.config import OneLineParser
from lib.errors import fail
import sampler
from lib import pretrained, setup

ROOT = Path(__file__).resolve().parent.parent  # the repository root: children run as `python -m tools.bench`

# Architectures. "tiny": the CPU bench model (~2.4M params with the 258-token byte
# vocabulary). "0.5b": Qwen2.5-0.5B's config numbers, randomly initialised (the GPU part).
ARCHS = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
                 rope_theta=1e6, rms_norm_eps=1e-6, vocab_size=151936),
}
SAMPLER_CASES = [(512, 16, 32), (512, 256, 64)]  # (N, prompt tokens, new tokens): short and long prompts
# Every part's sizes, full and --tiny: sampler cases; varlen (N, prompt, new); step N values and new
# tokens; breadth N values, samples per step, prompt, new; the rows of the matmul floor's product
# (between a decode step's 512 rows and an update micro-batch's 64 rows x 32 tokens)
SIZES = {"full": dict(sampler=SAMPLER_CASES, compiled=[(512, 16, 32)], varlen=(512, 64, 128), step_ns=[64, 512],
                      step_new=32,
                      breadth_ns=[16, 64, 256, 512], breadth=(2048, 256, 128), floor_rows=1024),
         "tiny": dict(sampler=[(8, 4, 4)], compiled=[(8, 4, 4)], varlen=(8, 8, 8), step_ns=[4], step_new=4,
                      breadth_ns=[2, 4], breadth=(8, 8, 4), floor_rows=64)}


class NeverEos:
    """The tokenizer with an EOS id that no sampled token can equal: every rollout runs to
    max_new_tokens. Everything else (pad id, encode, decode) is the wrapped tokenizer's."""
    eos_token_id = -1

    def __init__(self, tok):
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, *args, **kwargs):
        return self.tok(*args, **kwargs)


def load_tokenizer():
    """The embedded model's tokenizer if it is built, else the same 258-token byte vocabulary."""
    tok = AutoTokenizer.from_pretrained(data.EMBEDDED_MODEL) if data.EMBEDDED_MODEL.is_dir() else data.build_tokenizer()
    tok.model_max_length = 4096  # the byte tokenizer says 64 (the arith task); prompts here are longer
    return tok


def save_bench_model(out: Path, arch: str, dtype, seed: int = 0):
    """Write a randomly initialised Qwen2, its tokenizer and the step part's prompts to `out`;
    return its number of parameters."""
    tok = load_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen2Config(**{"vocab_size": len(tok), **ARCHS[arch]}, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    write_prompts(out / "prompts.json", data.arith_problems("train", 2, seed=seed))  # e.g. "123+456="
    print(f"bench model '{arch}': {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"V={cfg.vocab_size}, {dtype}, saved to {out}")
    return sum(p.numel() for p in model.parameters())  # the tied embedding counted once


def write_prompts(file: Path, examples: list):
    """The step part's prompts (2 a step), for brorl's children and TRL's alike."""
    file.write_text(json.dumps([{"prompt": e["prompt"], "answer": e["answer"]} for e in examples]))


def real_model(name: str, task: str, out: Path) -> tuple:
    """--model: (its folder or hub id, its parameter count) for an alias, folder or hub id, and
    the first 2 training prompts of `task` written to out/prompts.json."""
    path = pretrained.resolve(name)  # an alias: its folder (converted once, cached)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        fail(f"--model {name}: could not load its config ({str(e).splitlines()[0]})")
    with torch.device("meta"):  # the shapes alone: no weights read, no memory
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    write_prompts(out / "prompts.json", data.load_task(task, "train", n=2, seed=0))
    return path, params


def load_model(path, attn: str, device, dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(device).eval()
    assert model.config._attn_implementation == attn, model.config._attn_implementation
    return model


def peak_rss_mb() -> float:
    """Peak resident memory of this process. Linux's ru_maxrss survives fork + exec (a child of a
    big parent reports the parent's peak), so read VmHWM, the peak of this process's own memory."""
    status = Path("/proc/self/status")
    if status.exists():
        return next(int(ln.split()[1]) for ln in status.read_text().splitlines() if ln.startswith("VmHWM")) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, bytes on macOS


def timed(fn):
    """(seconds, fn()), synchronising the GPU on both sides."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


# ----------------------------------------------------------------------------
# The matmul floor, and a speed's model FLOPs as a fraction of it


def matmul_floor(device, dtype, rows, hidden, inter, tries=20, calls=5):
    """This machine's matmul rate now, in GFLOP/s: the best of `tries` timings of `calls` torch.mm
    products (rows, H) @ (H, I), the shape of the model's MLP projection on a batch of rows, at
    this process's thread count and the run's dtype. The model's FLOPs cannot run faster than its
    matmuls do, so the time its FLOPs would take at this rate is a floor under every figure.
    The product goes into one preallocated output: a fresh (rows, I) tensor per call costs page
    faults, not arithmetic (on the 2-core CPU, 75 instead of 100 GFLOP/s at (1024, 256, 768)).
    Many short timings, the best kept, let a run on a loaded machine find a quiet moment."""
    a = torch.randn(rows, hidden, device=device, dtype=dtype)  # (rows, H)
    b = torch.randn(hidden, inter, device=device, dtype=dtype)  # (H, I)
    out = torch.empty(rows, inter, device=device, dtype=dtype)  # (rows, I)
    torch.mm(a, b, out=out)  # warm-up: the first call picks its kernel
    run = lambda: [torch.mm(a, b, out=out) for _ in range(calls)]
    best = min(timed(run)[0] for _ in range(tries))
    return 2 * rows * hidden * inter * calls / best / 1e9  # a multiply-add is 2 FLOPs


def model_gflop(params, tokens, backward=False):
    """The model FLOPs of `tokens` tokens, in GFLOP: 2 x params x tokens for a forward (every weight
    is one multiply-add per token; the tied embedding counts once, as the output layer's matmul,
    its lookup being free), x3 for a forward and a backward (the backward costs two forwards: the
    gradients of the activations and of the weights). Attention's scores and weighted sums are
    left out, so a fraction of the floor reads a little low, most at long prompts. Tokens/s in,
    GFLOP/s out."""
    return 2 * params * tokens * (3 if backward else 1) / 1e9


def pct(share):
    """A share of the floor as a percentage to 3 significant digits (4.12%, 0.0134%)."""
    return f"{100 * share:.3g}%"


# ----------------------------------------------------------------------------
# Part 1: the sampler vs model.generate


def random_prompt(length: int, seed: int) -> list:
    """Token ids of `length` random printable ASCII bytes (the byte tokenizer's id = byte value)."""
    rng = random.Random(seed)
    return [rng.randrange(33, 127) for _ in range(length)]


def run_ours(model, ids, n, new, pad_id, amp=None):
    """amp: under autocast to that dtype (compute_in), as brorl.py's rollout phase."""
    with compute_in(model.device, amp):
        tokens, mask = sampler.generate_group_chunk(model, [ids], [0], [(n, 0, n)], new, 1.0, 1.0,
                                                    -1, pad_id)[:2]
    assert mask.all() and tokens.shape == (n, new)  # every row ran to full length
    return tokens


def run_generate(model, ids, n, new, tok, forced=True):
    """(n, <= new) new tokens, pad after EOS; forced: every row runs to `new` tokens."""
    x = torch.tensor([ids], device=model.device)  # (1, P); generate copies it N times
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, num_return_sequences=n,
                         max_new_tokens=new, min_new_tokens=new if forced else None, temperature=1.0,
                         top_p=1.0, top_k=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assert not forced or out.shape == (n, len(ids) + new)
    return out[:, len(ids):]


def interleaved(contenders: dict, repeats: int) -> dict:
    """{name: [(seconds, result), ...]}: every contender run `repeats` times, interleaved A B A B ..."""
    runs = {k: [] for k in contenders}
    for _ in range(repeats):
        for k, fn in contenders.items():
            runs[k].append(timed(fn))
    return runs


def compute_in(device, amp):
    """brorl's side computing in `amp` (a dtype, or None: in its weights' dtype) as brorl.py
    computes on a CPU with --dtype bfloat16: weights fp32, matmuls under autocast, a fresh region
    per call as a step's rollout phase is one (lib/policy.autocast)."""
    return torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None)


def load_pair(path, device, dtype, amp=None):
    """(brorl's model, generate's). amp (the CPU's --dtype bfloat16): brorl's weights fp32, run
    under compute_in, and generate's in `dtype`, as a Hugging Face user loads a model to run it in
    bf16 (the faster of its two ways on a CPU: no casts a call); else both in `dtype`."""
    return (load_model(path, "brorl", device, torch.float32 if amp else dtype),
            load_model(path, "sdpa", device, dtype))


def says(dtype, amp=None) -> str:
    """How each side computes, for a part's header."""
    name = str(dtype).removeprefix("torch.")
    return (f"{name}: brorl fp32 weights under {name} autocast, generate {name} weights" if amp
            else name)


def bench_sampler(path, device, dtype, cases, repeats, tok, params, floor, prompt=None, amp=None):
    """prompt: one prompt's token ids for every case (a real model's); else random ones of each
    case's length. amp: brorl's side under autocast to it with fp32 weights (load_pair)."""
    ours, hf = load_pair(path, device, dtype, amp)
    ids = prompt or random_prompt(24, seed=0)
    # same weights, same logic: greedy tokens agree (and warms both paths up)
    with compute_in(device, amp):
        a = sampler.generate_group_chunk(ours, [ids], [0], [(1, 0, 1)], 16, 0.0, 1.0, -1,
                                         tok.pad_token_id)[0]  # (1, 16)
    b = hf.generate(torch.tensor([ids], device=device), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                    pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # (1, 24 + 16)
    agree = (a == b[:, len(ids):]).float().mean().item()
    print(f"\n== sampler: rollout tokens/s, {says(dtype, amp)}, median of {repeats} (greedy "
          f"agreement ours vs generate: {agree:.0%})")
    print(f"{'N':>5} {'prompt':>6} {'new':>4} | {'brorl tok/s':>11} {'generate tok/s':>14} | "
          f"{'ratio':>6} | {'floor: brorl':>12} {'generate':>8}")
    results = []
    for n, p, new in cases:
        ids = prompt or random_prompt(p, seed=p)
        contenders = {"brorl": lambda: run_ours(ours, ids, n, new, tok.pad_token_id, amp),
                      "generate": lambda: run_generate(hf, ids, n, new, tok)}
        times = {k: [dt for dt, _ in runs] for k, runs in interleaved(contenders, repeats).items()}
        tps = {k: n * new / statistics.median(v) for k, v in times.items()}
        ratio = tps["brorl"] / tps["generate"]
        # the generated tokens' forwards only: the prompt's prefill (once for ours, N times for
        # generate's) is left out: the same useful work for both
        share = {k: model_gflop(params, v) / floor for k, v in tps.items()}
        print(f"{n:>5} {p:>6} {new:>4} | {tps['brorl']:>11.0f} {tps['generate']:>14.0f} | {ratio:>5.2f}x"
              f" | {pct(share['brorl']):>12} {pct(share['generate']):>8}"
              f"   (s per run: brorl {' '.join(f'{t:.2f}' for t in times['brorl'])};"
              f" generate {' '.join(f'{t:.2f}' for t in times['generate'])})")
        results.append(dict(n=n, prompt=p, new=new, **{f"{k}_tok_s": v for k, v in tps.items()},
                            ratio=ratio, **{f"{k}_floor": v for k, v in share.items()}))
    return results


# ----------------------------------------------------------------------------
# The compiled contender: the sampler's decode step with static shapes, for torch.compile
#
# static_decode_chunk is sampler.generate_group_chunk's decode loop written so that torch.compile
# traces its step once (the eager loop is the reference; bench_compiled measures both). A
# 2-thread profile of the eager step was dominated by unfused elementwise work (RMSNorm, rotary,
# the gated MLP, the cache writes), which a compiler fuses; gpt-fast's recipe is a step with static
# shapes, compiled once. What makes one graph serve every step:
#   - a static cache: each row's own keys and values in (R, Hkv, max_new, D) per layer, written at
#     step t and read under the mask column <= t; t and the positions are tensors, not Python ints
#     (a Python int is specialised: the sampler's cache would recompile at every position);
#   - static rows: the R = B x n rows of a chunk decode every step; a finished row decodes padding
#     (the eager loop drops finished rows instead, which changes the shapes);
#   - the prompts' shared prefix read as in sampler.cascade_attention, each prompt's keys once
#     against its own n rows x G query heads (one batched matmul per kv head), in one softmax with
#     the row's own keys.
# Prefill, the draws (pick_tokens) and the log-probs stay eager and are the sampler's own.
# Supported: Qwen2/Llama-style decoders (RMSNorm, rotary, GQA attention with optional q/k/v
# biases, SwiGLU MLP), full attention, default rotary. Equal to the eager loop to fp32 rounding
# (tests/test_sampler.py): the same greedy tokens, log-probs within rounding.

# Compiled steps by (model, R, B, P, max_new, dtype): one compile each, reused by every call; and
# their caches, allocated once: CUDA graphs replay a step only if the tensors it writes in place
# stay at one address (marked static), else torch.compile skips them.
_STEPS, _CACHES = {}, {}


def rotate_half(x):
    """(..., D) -> (..., D): [-x2, x1], rotary's pairing of the two halves."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def static_decode_step(model, tok, pos, t, ks, vs, pks, pvs, pad_bias, n: int):
    """One decode step of R rows: tok (R,) int64, pos (R,) int64 positions, t () int64 the step
    (the cache column written); ks, vs per layer (R, Hkv, T, D) each row's own keys and values,
    written here at column t; pks, pvs per layer (B, Hkv, P, D) the prompts' keys and values;
    pad_bias (B, 1, 1, P) float, -inf on each prompt's padding. Returns the logits (R, V)."""
    core, cfg = model.model, model.config
    R, T = tok.shape[0], ks[0].shape[2]
    B, Hkv, P, D = pks[0].shape
    H = cfg.num_attention_heads
    G = H // Hkv  # query heads a kv head
    rope = core.rotary_emb
    # (R, D) rotary's cos and sin at each row's position.
    freqs = pos[:, None].float() * rope.inv_freq[None].float()  # (R, D / 2)
    emb = torch.cat([freqs, freqs], -1)  # (R, D)
    cos, sin = emb.cos() * rope.attention_scaling, emb.sin() * rope.attention_scaling
    # (1, 1, 1, T): the columns this step reads (the row's tokens 0..t).
    own_bias = torch.where(torch.arange(T, device=tok.device) <= t, 0.0, -math.inf)[None, None,
                                                                                     None]
    x = core.embed_tokens(tok)  # (R, H_model)
    for i, layer in enumerate(core.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)  # (R, H_model)
        q = attn.q_proj(h).view(R, H, D)
        k = attn.k_proj(h).view(R, Hkv, D)
        v = attn.v_proj(h).view(R, Hkv, D)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]  # (R, H, D)
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]  # (R, Hkv, D)
        # The cache written in place at column t, a tensor: one graph for every step.
        ks[i].index_copy_(2, t.view(1), k[:, :, None])  # (R, Hkv, T, D)
        vs[i].index_copy_(2, t.view(1), v[:, :, None])
        q = (q * attn.scaling).view(R, Hkv, G, D)
        # (a) The prefix: per kv head one batched matmul over the B prompts, each prompt's P
        # keys against its own n rows x G heads. (B, Hkv, n*G, D) -> (B, Hkv, n*G, P)
        q_grid = q.view(B, n, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * G, D)
        s_a = torch.matmul(q_grid, pks[i].transpose(-1, -2)) + pad_bias  # (B, Hkv, n*G, P)
        s_a = s_a.view(B, Hkv, n, G, P).permute(0, 2, 1, 3, 4).reshape(R, Hkv, G, P)
        # (b) Each row's own tokens 0..t. (R, Hkv, G, T)
        s_b = torch.matmul(q, ks[i].transpose(-1, -2)) + own_bias
        p = torch.softmax(torch.cat([s_a, s_b], -1).float(), -1).to(q.dtype)  # (R, Hkv, G, P+T)
        p_grid = p[..., :P].reshape(B, n, Hkv, G, P).permute(0, 2, 1, 3, 4).reshape(
            B, Hkv, n * G, P)  # (B, Hkv, n*G, P)
        out_a = torch.matmul(p_grid, pvs[i]).view(B, Hkv, n, G, D).permute(0, 2, 1, 3, 4)
        out = out_a.reshape(R, Hkv, G, D) + torch.matmul(p[..., P:], vs[i])  # (R, Hkv, G, D)
        x = x + attn.o_proj(out.reshape(R, H * D))  # (R, H_model)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(core.norm(x))  # (R, V)


def check_supported(model):
    """One line (ValueError) for a model the static step does not cover."""
    cfg = model.config
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    rope = getattr(cfg, "rope_scaling", None) or {}
    if types != {"full_attention"} or rope.get("rope_type", "default") != "default":
        raise ValueError(f"the compiled decode step covers full attention and default rotary "
                         f"only, not {sorted(types)} / {rope.get('rope_type')}")
    # By class, not by attribute names: Mistral, Phi-3, Qwen3 and Gemma have the same names but
    # add what the step leaves out (a window, fused projections, q/k norms, soft-capping).
    if type(model).__name__ not in ("Qwen2ForCausalLM", "LlamaForCausalLM"):
        raise ValueError(f"the compiled decode step covers Qwen2/Llama decoders, not "
                         f"{type(model).__name__}")


def compiled_step(model, key):
    """The decode step for one static shape key, compiled on first use (torch.compile, inductor;
    fullgraph: a graph break would be a silent slowdown; on CUDA with CUDA graphs, mode
    "reduce-overhead", each step's logits read before the next replay overwrites them)."""
    key = (id(model), *key)
    if key not in _STEPS:
        mode = "reduce-overhead" if model.device.type == "cuda" else None
        _STEPS[key] = torch.compile(static_decode_step, fullgraph=True, dynamic=False, mode=mode)
    return _STEPS[key]


@torch.no_grad()
def static_decode_chunk(model, prompt_ids, seeds, n, max_new, temperature, top_p, eos_id, pad_id,
                 compiled=True):
    """n rollouts of each prompt (a chunk of B x n rows), decoded with the static step (compiled,
    or traced eagerly with compiled=False): (tokens, mask, logp, entropy, truncated), the first
    four (B*n, max_new), the last (B*n,). Same draws as sampler.generate_group_chunk: each
    prompt's uniforms from its own seed, DRAWS_AHEAD steps at a time."""
    check_supported(model)
    dev = model.device
    gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
    B, R, T = len(prompt_ids), len(prompt_ids) * n, max_new
    prefix_kv, first_logits, prompt_len, dtype = sampler.prefill(model, prompt_ids)
    # Per layer (B, Hkv, P, D) in the compute dtype.
    pks = [k.to(dtype).contiguous() for k, _ in prefix_kv]
    pvs = [v.to(dtype).contiguous() for _, v in prefix_kv]
    P, Hkv, D = pks[0].shape[2], pks[0].shape[1], pks[0].shape[3]
    col = torch.arange(P, device=dev)
    # (B, 1, 1, P): -inf on each prompt's padding.
    pad_bias = torch.zeros(B, P, device=dev).masked_fill(col >= prompt_len[:, None], -math.inf)[
        :, None, None].to(dtype)
    # Per layer (R, Hkv, T, D): each row's own keys and values, zero before they are written; one
    # pair a compiled shape, reused.
    new = lambda: [[torch.zeros(R, Hkv, T, D, dtype=dtype, device=dev) for _ in pks]
                   for _ in "kv"]
    key = (id(model), dev, R, B, P, T, Hkv, D, len(pks), dtype)
    if compiled and key not in _CACHES:
        _CACHES[key] = new()
        for x in _CACHES[key][0] + _CACHES[key][1]:
            torch._dynamo.mark_static_address(x)
    ks, vs = _CACHES[key] if compiled else new()
    for x in ks + vs:
        x.zero_()
    step = compiled_step(model, (R, B, P, T, dtype)) if compiled else static_decode_step
    eos_ids = torch.as_tensor(eos_id, device=dev)
    tokens = torch.full((R, T), pad_id, dtype=torch.long, device=dev)  # (R, T)
    logp, entropy = torch.zeros(R, T, device=dev), torch.zeros(R, T, device=dev)  # (R, T)
    mask = torch.zeros(R, T, dtype=torch.bool, device=dev)  # (R, T)
    start = prompt_len.repeat_interleave(n)  # (R,) each row's first new position
    logits = first_logits.repeat_interleave(n, 0)  # (R, V)
    done = torch.zeros(R, dtype=torch.bool, device=dev)  # (R,)
    for t in range(T):
        if temperature and t % sampler.DRAWS_AHEAD == 0:
            # (DRAWS_AHEAD, R): each prompt's n uniforms a step from its own generator.
            u_ahead = torch.cat([torch.rand(sampler.DRAWS_AHEAD, n, generator=g, device=dev,
                                            dtype=torch.float64) for g in gens], 1)
        u = u_ahead[t % sampler.DRAWS_AHEAD] if temperature else None  # (R,)
        tok = torch.where(done, pad_id, sampler.pick_tokens(logits, temperature, top_p, u))
        tokens[:, t], mask[:, t] = tok, ~done
        logp[:, t], entropy[:, t] = token_logprobs(logits, tok.masked_fill(done, -100),
                                                   temperature or 1.0, with_entropy=True,
                                                   validate=False)
        done = done | torch.isin(tok, eos_ids)
        if t == T - 1 or bool(done.all()):
            break
        logits = step(model, tok, start + t, torch.tensor(t, device=dev), ks, vs, pks, pvs,
                      pad_bias, n)
    return tokens, mask, logp, entropy, ~done


def bench_compiled(path, device, dtype, cases, repeats, tok, params, threads, floor_shape):
    """The sampler's decode loop three ways, side by side at each thread count: compiled
    (static_decode_chunk: static cache and rows, torch.compile'd step), eager (the sampler,
    generate_group_chunk), and generate. Tokens/s, median of interleaved repeats; the compile is
    the first compiled call (its time printed, and a rate with it counted once over the repeats);
    each thread count's own matmul floor."""
    ours, hf = load_model(path, "brorl", device, dtype), load_model(path, "sdpa", device, dtype)
    run_static = lambda ids, n, new: static_decode_chunk(ours, [ids], [0], n, new, 1.0, 1.0, -1,
                                                         tok.pad_token_id)[0]
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        floor = matmul_floor(device, dtype, *floor_shape)
        where = (f"{torch.cuda.get_device_name()}, CUDA graphs" if device.type == "cuda"
                 else f"{n_threads} thread(s)")
        print(f"\n== compiled decode step, {where}, {dtype}, median of {repeats}; matmul "
              f"floor {floor:.1f} GFLOP/s")
        print(f"{'N':>5} {'prompt':>6} {'new':>4} | {'compiled':>8} {'eager':>7} {'generate':>8} "
              f"tok/s | {'c/eager':>7} {'c/gen':>6} | compile s | c incl. compile | floor: c, "
              f"eager, generate")
        for n, p, new in cases:
            ids = random_prompt(p, seed=p)
            compile_s = timed(lambda: run_static(ids, n, new))[0]  # the first call compiles
            contenders = {"compiled": lambda: run_static(ids, n, new),
                          "eager": lambda: run_ours(ours, ids, n, new, tok.pad_token_id),
                          "generate": lambda: run_generate(hf, ids, n, new, tok)}
            times = {k: [dt for dt, _ in runs]
                     for k, runs in interleaved(contenders, repeats).items()}
            tps = {k: n * new / statistics.median(v) for k, v in times.items()}
            counted = n * new * repeats / (sum(times["compiled"]) + compile_s)
            if device.type == "cuda":  # Did the graphs replay, or did torch.compile skip them?
                from torch._dynamo.utils import counters
                print(f"CUDA graphs skipped by torch.compile: "
                      f"{counters['inductor']['cudagraph_skips']} time(s) (0: they replayed)")
            share = {k: pct(model_gflop(params, v) / floor) for k, v in tps.items()}
            print(f"{n:>5} {p:>6} {new:>4} | {tps['compiled']:>8.0f} {tps['eager']:>7.0f} "
                  f"{tps['generate']:>8.0f}       | {tps['compiled'] / tps['eager']:>6.2f}x "
                  f"{tps['compiled'] / tps['generate']:>5.2f}x | {compile_s:>9.1f} | "
                  f"{counted:>9.0f} tok/s | {share['compiled']}, {share['eager']}, "
                  f"{share['generate']}")


def compile_pointwise(model):
    """Compile the parts of each decoder layer that are elementwise work around matmuls (RMSNorms,
    the gated MLP), dynamic shapes: the same treatment as the decode step, for the update's
    forward and backward, whose shapes change every micro-batch. In place; returns the model."""
    for layer in model.model.layers:
        for part in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp):
            part.compile(dynamic=True)
    model.model.norm.compile(dynamic=True)
    return model


def bench_compiled_update(path, n, new, micro_batch, steps, threads, prompts=None):
    """rl_step (2 prompts x n, `new` tokens, nothing dropped) with compile_pointwise against eager,
    in one process, steps interleaved: each arm's median rollout and update seconds over `steps`
    steps after a warm-up step (the compiled arm's warm-up includes its compile)."""
    device = torch.device("cpu")
    tok, examples, cfg = step_setup(path, n, new, micro_batch, prompts)
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        arms = {}
        for name in ("eager", "compiled"):
            model = load_model(path, "brorl", device, torch.float32)
            model.generation_config.eos_token_id = None  # every rollout runs to `new` tokens
            model = compile_pointwise(model) if name == "compiled" else model
            arms[name] = dict(model=model, rng=random.Random(0),
                              opt=torch.optim.AdamW(model.parameters(), lr=cfg.lr),
                              gen=torch.Generator().manual_seed(0), rows=[])
        step = lambda a, i: brorl.rl_step(a["model"], a["model"], None, a["opt"], tok, cfg,
                                          examples, a["rng"], i, a["gen"], 1.0)
        warm = {name: timed(lambda: step(a, 0))[0] for name, a in arms.items()}
        for i in range(1, 1 + steps):
            for a in arms.values():
                m = step(a, i)
                a["rows"].append((m["time_rollout"], m["time_update"]))
        med = {name: [statistics.median(x) for x in zip(*a["rows"])] for name, a in arms.items()}
        (er, eu), (cr, cu) = med["eager"], med["compiled"]
        print(f"\n== the step with its norms and gated MLPs compiled (dynamic shapes), "
              f"{n_threads} thread(s): 2 prompts x {n}, {new} new, micro_batch {micro_batch}, "
              f"median of {steps} steps")
        print(f"eager: rollout {er:.3f} s, update {eu:.3f} s (warm-up step {warm['eager']:.1f} s)")
        print(f"compiled: rollout {cr:.3f} s, update {cu:.3f} s (warm-up step with the compile "
              f"{warm['compiled']:.1f} s)")
        print(f"compiled / eager speed: rollout {er / cr:.2f}x, update {eu / cu:.2f}x, step "
              f"{(er + eu) / (cr + cu):.2f}x")


# ----------------------------------------------------------------------------
# Part 2: a full rl_step (rollout + reward + update), one subprocess per configuration


def step_setup(model_dir, n, new, micro_batch, prompts=None, dtype="auto"):
    """What a timed rl_step of the bench model needs: the tokenizer that never ends a rollout, the
    saved prompts (B of them; prompts.json beside the model unless a file is given), and a Config
    of B x n rollouts of `new` tokens, nothing dropped, in compute dtype `dtype` (brorl's --dtype:
    auto is bf16 on CUDA and fp32 on a CPU here, as rl_step reads it without setup's pick_dtype)."""
    tok = NeverEos(AutoTokenizer.from_pretrained(model_dir))
    saved = json.loads(Path(prompts or Path(model_dir) / "prompts.json").read_text())
    examples = [dict(e, task="arith") for e in saved]
    B = len(examples)
    cfg = brorl.Config(model=str(model_dir), n_rollouts=n, prompts_per_step=B, max_new_tokens=new,
                       dynamic_sampling=False, micro_batch=micro_batch, max_rows=max(4096, B * n),
                       dtype=dtype)
    # --verifier auto resolved as a run resolves it.
    cfg = dataclasses.replace(cfg, verifier=setup.pick_verifier(cfg))
    return tok, examples, cfg


def step_child(args):
    """Runs in its own process: warm-up + `steps` rl_steps; prints one JSON line."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # brorl's own configuration: fp32 weights, autocast to --dtype (auto: bf16 on CUDA, fp32 here)
    model = load_model(args.model_dir, "brorl", device, torch.float32)
    model.generation_config.eos_token_id = None  # sampler.generate stops on these ids too
    tok, examples, cfg = step_setup(args.model_dir, args.n, args.new, args.micro_batch,
                                    args.prompts, args.dtype or "auto")
    B = len(examples)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    rng, gen_cpu = random.Random(0), torch.Generator().manual_seed(0)
    rows = []
    for i in range(1 + args.steps):  # step 0 is the warm-up, not timed
        dt, m = timed(lambda: brorl.rl_step(model, model, None, opt, tok, cfg, examples, rng, i, gen_cpu, 1.0))
        assert m["resp_len"] == args.new and m["groups_kept"] == B, m  # full length, nothing dropped
        if i:
            rows.append((dt, m["time_rollout"], m["time_update"]))
    step_s, roll_s, upd_s = (statistics.median(x) for x in zip(*rows))
    out = dict(n=args.n, step_s=step_s, rollout_s=roll_s, update_s=upd_s, completions_s=B * args.n / step_s,
               peak_rss_mb=peak_rss_mb())
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(out))


def bench_step(path, ns, new, micro_batch, steps, repeats, threads, params, floor, trl_python="",
               prompts=None, dtype=None, trl_ns=None):
    """prompts: the prompts.json both trainers read (default: the one beside the model). dtype:
    the compute dtype both trainers are given ('float32', 'bfloat16': brorl's --dtype, TRL's
    bf16=); None: brorl's --dtype auto (as it was before pick_dtype: fp32 on a CPU, bf16 on CUDA)
    and TRL's fp32. trl_ns: the N values at which TRL runs (default every N)."""
    prompts = Path(prompts or Path(path) / "prompts.json")
    trl_ns = [n for n in ns if n in trl_ns] if trl_ns else ns
    trl_said = f"; TRL: bf16={dtype == 'bfloat16'}" if trl_python else ""
    said = (f"{dtype} (brorl: --dtype {dtype}, fp32 weights and AdamW{trl_said})" if dtype
            else ("bfloat16 autocast" if torch.cuda.is_available() else "float32")
            + " (the bench's default; --dtype bfloat16 for bf16 on a CPU)"
            + (", TRL fp32" if trl_python else ""))
    print(f"\n== step: 2 prompts x N, {new} new tokens, micro_batch {micro_batch}, {said}, median "
          f"of {repeats} processes x {steps} steps (after one warm-up step each)")
    common = ["--model_dir", str(path), "--prompts", str(prompts), "--new", str(new),
              "--micro_batch", str(micro_batch), "--steps", str(steps), "--threads", str(threads),
              *(["--dtype", dtype] if dtype else [])]
    runs = {("brorl", n): [sys.executable, "-m", "tools.bench", "--child", *common] for n in ns}
    if trl_python:  # TRL's GRPOTrainer in its own venv (tools/bench_trl.sh), interleaved with ours
        trl = [trl_python, str(Path(__file__).with_name("bench_trl.py")), *common]
        runs.update({("TRL", n): trl for n in trl_ns})
    res = {k: [] for k in runs}
    for _ in range(repeats):  # interleaved across processes: brorl 64, brorl 512, TRL 64, ...
        for (name, n), cmd in runs.items():
            out = subprocess.run(cmd + ["--n", str(n)], capture_output=True, text=True, cwd=ROOT)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not line:
                sys.exit(f"{name} N={n} failed:\n{out.stderr[-3000:]}")
            res[name, n].append(json.loads(line[0][7:]))
    mem = "peak_cuda_mb" if torch.cuda.is_available() else "peak_rss_mb"
    print(f"{'':>5} {'N':>5} | {'completions/s':>13} {'step s':>7} {'rollout s':>9} {'update s':>8}"
          f" | {mem:>12} | {'floor: step':>11} {'rollout':>7} {'update':>7} | step s per process")
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0] if isinstance(v[0][f], float)}
           for k, v in res.items()}
    B = len(json.loads(prompts.read_text()))  # prompts per step
    for (name, n), m in med.items():
        # A step's model FLOPs: its B*N*new response tokens once forward (the rollout) and once
        # forward and backward (the update). The prompts' passes (once per prompt) are left out,
        # and so is any extra forward (TRL's old log-probs, bf16's recomputed ones): the same
        # useful work for both trainers.
        gflop = dict(rollout=model_gflop(params, B * n * new),
                     update=model_gflop(params, B * n * new, backward=True))
        gflop["step"] = gflop["rollout"] + gflop["update"]
        m.update({f"floor_{f}": g / m[f"{f}_s"] / floor for f, g in gflop.items() if f"{f}_s" in m})
        shares = " ".join(f"{pct(m[f'floor_{f}']) if f'floor_{f}' in m else '-':>{w}}"
                          for f, w in (("step", 11), ("rollout", 7), ("update", 7)))
        parts = " ".join(f"{m[f]:>{w}.2f}" if f in m else f"{'-':>{w}}" for f, w in (("rollout_s", 9), ("update_s", 8)))
        runs_s = " ".join(f"{r['step_s']:.2f}" for r in res[name, n])
        print(f"{name:>5} {n:>5} | {m['completions_s']:>13.0f} {m['step_s']:>7.2f} {parts} | "
              f"{m.get(mem, 0):>12.0f} | {shares} | {runs_s}")
    lo, hi = ns[0], ns[-1]
    if hi != lo:
        print(f"brorl {mem} N={hi} / N={lo}: {med['brorl', hi][mem] / med['brorl', lo][mem]:.2f}x")
    for n in ns if trl_python else []:
        if n in trl_ns:
            print(f"brorl / TRL completions/s at N={n}: "
                  f"{med['brorl', n]['completions_s'] / med['TRL', n]['completions_s']:.2f}x")
            continue
        # TRL not run at this N: its completions/s taken as at its nearest N that ran (a step's
        # time linear in its completions), which flatters TRL where generate slows per token as
        # N grows (docs/results/speed.md).
        near = min(trl_ns, key=lambda x: abs(x - n))
        trl_s = med["TRL", near]["step_s"] * n / near
        print(f"brorl / TRL completions/s at N={n}: "
              f"{med['brorl', n]['completions_s'] / med['TRL', near]['completions_s']:.2f}x "
              f"extrapolated (TRL not run at N={n}: its N={near} completions/s, a step of "
              f"{trl_s:.0f} s)")
    return med


def bench_varlen(path, device, dtype, repeats, tok, params, floor, n, prompt, new, eos_push=3.0,
                 amp=None):
    """Rollouts of varied length (EOS made likelier: lengths ~geometric, capped at `new`): our
    sampler drops finished rows (SharedPrefixCache.keep); generate keeps decoding them as padding.
    Real tokens per second, each path's own EOS draws. amp: as bench_sampler's."""
    models = load_pair(path, device, dtype, amp)
    ids = random_prompt(prompt, seed=1)
    with torch.no_grad():  # push EOS's (tied) output row along the prompt's mean final hidden state
        h = models[0].model(torch.tensor([ids], device=device)).last_hidden_state[0].mean(0)
        for m in models:
            m.lm_head.weight[tok.eos_token_id] += (eos_push * h / h.norm() ** 2).to(m.dtype)

    def ours():
        with compute_in(device, amp):
            return int(sampler.generate_group_chunk(models[0], [ids], [0], [(n, 0, n)], new, 1.0,
                                                    1.0, [tok.eos_token_id], tok.pad_token_id)[1]
                       .sum())
    contenders = {  # each returns its number of real tokens (EOS included, padding not)
        "brorl": ours,
        "generate": lambda: int((run_generate(models[1], ids, n, new, tok, forced=False)
                                 != tok.pad_token_id).sum())}
    runs = interleaved(contenders, repeats)
    med = {k: statistics.median(n_tok / dt for dt, n_tok in v) for k, v in runs.items()}
    lengths = {k: statistics.mean(n_tok / n for _, n_tok in v) for k, v in runs.items()}
    print(f"\n== varied lengths: N={n}, prompt {prompt}, up to {new} new, real tokens/s, "
          f"{says(dtype, amp)}, median of {repeats}")
    print(f"brorl {med['brorl']:.0f} | generate {med['generate']:.0f} | {med['brorl'] / med['generate']:.2f}x"
          f" | floor: brorl {pct(model_gflop(params, med['brorl']) / floor)}, generate"
          f" {pct(model_gflop(params, med['generate']) / floor)}"
          f"   (mean length: brorl {lengths['brorl']:.1f}, generate {lengths['generate']:.1f})")


# ----------------------------------------------------------------------------
# Part 3 (GPU): samples/s as N grows at a fixed number of samples per step


def bench_breadth(path, device, dtype, ns, samples, prompt, new, repeats, tok, params, floor):
    model = load_model(path, "brorl", device, dtype)
    print(f"\n== breadth: rollout samples/s at {samples} samples per step (B = {samples}/N prompts), "
          f"prompt {prompt}, new {new}, median of {repeats}")
    for n in ns:
        ids = [random_prompt(prompt, seed=b) for b in range(samples // n)]
        fn = lambda: sampler.generate_group_chunk(model, ids, list(range(len(ids))), [(n, 0, n)] * len(ids), new, 1.0, 1.0, -1,
                                                  tok.pad_token_id)
        fn()  # warm-up
        t = statistics.median(timed(fn)[0] for _ in range(repeats))
        tok_s = samples * new / t
        print(f"N={n:>4} B={samples // n:>4} | {samples / t:>8.1f} samples/s  {tok_s:>9.0f} tok/s"
              f" | floor {pct(model_gflop(params, tok_s) / floor)}")


def bench_lora(path, device, dtype, repeats, params, floor, n=512, prompt=64, new=64):
    from lib import lora
    model, pad = load_model(path, "brorl", device, dtype), AutoTokenizer.from_pretrained(path).pad_token_id
    ids = random_prompt(prompt, seed=1)
    plain = statistics.median(dt for dt, _ in interleaved({"x": lambda: run_ours(model, ids, n, new, pad)}, repeats)["x"])
    model = lora.add_lora(model, 8, 0, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")

    def merged():
        model.merge_adapter()
        try:
            return run_ours(model, ids, n, new, pad)
        finally:
            model.unmerge_adapter()

    times = {k: statistics.median(dt for dt, _ in v) for k, v in interleaved(
        {"unmerged": lambda: run_ours(model, ids, n, new, pad), "merged": merged}, repeats).items()}
    print(f"\n== lora: rollout tokens/s, N={n}, prompt {prompt}, new {new}, median of {repeats} ({device}, {dtype}): "
          f"no adapter {n * new / plain:.0f}, unmerged {n * new / times['unmerged']:.0f}, "
          f"merged (incl. merge + unmerge) {n * new / times['merged']:.0f}")
    # the base model's FLOPs for all three: the adapter's own (rank 8, on every projection: ~5% of
    # the tiny model's parameters, ~1% of the 0.5B's) are left out
    seconds = dict(plain=plain, unmerged=times["unmerged"], merged=times["merged"])
    shares = {k: model_gflop(params, n * new / t) / floor for k, t in seconds.items()}
    print("floor: " + ", ".join(f"{k} {pct(v)}" for k, v in shares.items()))


def main(argv=None):
    ap = OneLineParser(prog="python -m tools.bench", description="brorl speed benchmark")
    ap.add_argument("--part", default="all",
                    choices=["sampler", "varlen", "step", "all", "gpu", "lora", "compiled"])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    ap.add_argument("--steps", type=int, default=3, help="step part: timed rl_steps per process")
    ap.add_argument("--micro_batch", type=int, default=64, help="step part: rows per forward/backward")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--trl", default="", help="step part: also run TRL with this python (see tools/bench_trl.sh)")
    ap.add_argument("--step_ns", default="", help="with --model: the step's N values, "
                    "comma-separated, each one of --ns (default every N of --ns)")
    ap.add_argument("--trl_ns", default="", help="with --trl: the N values, comma-separated, at "
                    "which TRL runs (default every N; another N's ratio is extrapolated, said so)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="the CPU parts sampler, varlen and step (default float32): bfloat16 runs "
                    "brorl as brorl.py --dtype bfloat16 does (fp32 weights, bf16 autocast), "
                    "generate with bf16 weights, TRL with bf16=True, the matmul floor in bf16")
    ap.add_argument("--save", default="", help="only write the bench model to this dir (with "
                    "--model: only its prompts.json and model_dir, the folder it resolved to)")
    ap.add_argument("--model", default="", help="time this model (a folder, hub id or alias) instead "
                    "of the random bench model: sampler and step at each N of --ns")
    ap.add_argument("--task", default="arith", help="with --model: the task whose first 2 training "
                    "prompts are timed (any --task of brorl.py)")
    ap.add_argument("--ns", default="", help="with --model: N values, comma-separated (default 64,512)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes and model: checks that a part runs (any device)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one step-part process
    ap.add_argument("--model_dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--new", type=int, default=None,
                    help="with --model: new tokens a rollout, sampler and step (default 32)")
    ap.add_argument("--prompts", default="", help=argparse.SUPPRESS)  # the step children's prompts
    args = ap.parse_args(argv)
    for name in ("repeats", "steps", "micro_batch", "threads", "n", "new"):  # before any work: each must be >= 1
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: need >= 1")
    if not args.model and not args.child:
        for flag, given in (("--ns", args.ns), ("--new", args.new), ("--task", args.task != ap.get_default("task")),
                            ("--step_ns", args.step_ns)):
            if given:
                ap.error(f"{flag}: only with --model (the bench model's sizes are fixed: SIZES)")
    if args.dtype and not args.child and args.part in ("gpu", "lora", "compiled"):
        ap.error(f"--dtype {args.dtype}: only with --part sampler, varlen, step or all (--part "
                 f"{args.part} has its own dtype: bf16 on CUDA, else fp32)")
    ns, step_ns, trl_ns = [], [], []
    for flag, text, into in (("--ns", args.ns, ns), ("--step_ns", args.step_ns, step_ns),
                             ("--trl_ns", args.trl_ns, trl_ns)):
        if text:
            try:
                into.extend(int(x) for x in text.split(","))
            except ValueError:
                into.clear()
            if not into or min(into) < 1:
                ap.error(f"{flag} {text}: need positive integers, comma-separated (e.g. 64,512)")
    if trl_ns and not args.trl:
        ap.error(f"--trl_ns {args.trl_ns}: only with --trl")
    if args.model:  # the N values checked before the model loads
        ns = ns or (SIZES["tiny"]["step_ns"] if args.tiny else [64, 512])
        if not set(step_ns) <= set(ns):
            ap.error(f"--step_ns {args.step_ns}: each must be one of --ns ({','.join(map(str, ns))})")
        if trl_ns and not set(trl_ns) <= set(step_ns or ns):
            ap.error(f"--trl_ns {args.trl_ns}: each must be an N of the step "
                     f"({','.join(map(str, step_ns or ns))})")
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # On a CPU, freed memory is kept as brorl.py's runs keep it (lib/setup.keep_freed_memory), in this
    # process (the sampler part, both its sides) and in the step part's children.
    kept = not torch.cuda.is_available() and setup.keep_freed_memory()
    if args.child:
        return step_child(args)
    if args.save and args.model:  # what TRL's side needs of a real model (tools/bench_trl.sh)
        Path(args.save).mkdir(parents=True, exist_ok=True)
        path, _ = real_model(args.model, args.task, Path(args.save))
        return (Path(args.save) / "model_dir").write_text(path + "\n")
    if args.save:
        return save_bench_model(Path(args.save), "tiny", torch.float32)
    gpu = args.part == "gpu" or (args.part in ("lora", "compiled") and torch.cuda.is_available())
    size = SIZES["tiny" if args.tiny else "full"]
    if gpu and not torch.cuda.is_available() and not args.tiny:
        sys.exit("--part gpu needs CUDA (torch.cuda.is_available() is False); --tiny runs its driver on a CPU")
    device = torch.device("cuda" if gpu and torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if gpu or args.dtype == "bfloat16" else torch.float32
    # --dtype bfloat16 on a CPU: brorl's side under autocast with fp32 weights, as brorl.py runs
    amp = torch.bfloat16 if args.dtype == "bfloat16" and not gpu else None
    # OpenMP's wait policy moves every CPU figure (docs/results/speed.md#openmps-wait-policy): say which one this run had
    print(f"torch {torch.__version__}, {device}, {dtype}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset: spin, then sleep)')}"
          + (", freed memory kept (glibc mallopt, as a brorl.py run)" if kept else ""))
    with tempfile.TemporaryDirectory() as tmp:
        path, prompts, prompt = Path(tmp), Path(tmp) / "prompts.json", None
        if args.model:  # its weights as saved; its prompts from --task; each N of --ns
            path, params = real_model(args.model, args.task, Path(tmp))
            config, tok = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
            if tok.pad_token_id is None:  # as lib/policy.py loads such a tokenizer
                tok.pad_token = tok.eos_token
            dims = config.hidden_size, config.intermediate_size
            prompt = sampler.encode_prompt(tok, json.loads(prompts.read_text())[0]["prompt"])
            new = args.new or (size["step_new"] if args.tiny else 32)
            size = dict(size, sampler=[(n, len(prompt), new) for n in ns],
                        step_ns=step_ns or ns, step_new=new)
            print(f"model {args.model} ({path}): {params / 1e6:.1f}M params, V={config.vocab_size}, "
                  f"{dtype}; prompt {len(prompt)} tokens (--task {args.task}'s first)")
        else:
            arch = "0.5b" if gpu and not args.tiny else "tiny"
            # saved in fp32 where brorl's side keeps fp32 weights (amp): the weights fp32 runs use
            params = save_bench_model(path, arch, torch.float32 if amp else dtype)
            tok = AutoTokenizer.from_pretrained(path)
            dims = ARCHS[arch]["hidden_size"], ARCHS[arch]["intermediate_size"]
        if trl_ns and not set(trl_ns) <= set(size["step_ns"]):  # (the bench model's sizes)
            ap.error(f"--trl_ns {args.trl_ns}: each must be an N of the step "
                     f"({','.join(map(str, size['step_ns']))})")
        # the floor before any part, in this process at its thread count (the step's children's)
        shape = (size["floor_rows"], *dims)
        floor = matmul_floor(device, dtype, *shape)
        rows, H, I = shape
        print(f"matmul floor: {floor:.1f} GFLOP/s (the best of 20 timings of 5 torch.mm "
              f"({rows}, {H}) @ ({H}, {I}), {dtype}, {torch.get_num_threads()} threads); "
              "'floor' below: a speed's model FLOPs (2 x params a token forward, x3 with the "
              "backward) over it")
        if args.part == "lora":
            return bench_lora(path, device, dtype, args.repeats, params, floor)
        if args.part == "compiled":  # CPU: at 1 and 2 threads (their own floors), or --threads alone
            threads = [1, 2] if args.threads == 2 and not gpu else [args.threads]
            bench_compiled(path, device, dtype, size["compiled"], args.repeats, tok, params,
                           threads, shape)
            if device.type == "cpu":  # the update with the same treatment
                bench_compiled_update(path, size["step_ns"][0], size["step_new"],
                                      args.micro_batch, max(args.steps, 5), threads, prompts)
            return
        if args.part in ("sampler", "all", "gpu"):
            bench_sampler(path, device, dtype, size["sampler"], args.repeats, tok, params, floor,
                          prompt, amp)
        # a real model's "all" is what --model times: the sampler and the step
        if args.part in ("varlen", "gpu") or (args.part == "all" and not args.model):
            bench_varlen(path, device, dtype, args.repeats, tok, params, floor, *size["varlen"],
                         amp=amp)
        if args.part in ("step", "all", "gpu"):
            trl = "" if gpu else args.trl  # bench_trl.py runs TRL on the CPU only
            bench_step(path, size["step_ns"], size["step_new"], args.micro_batch, args.steps, args.repeats,
                       args.threads, params, floor, trl, prompts, args.dtype, trl_ns)
        if gpu:
            bench_breadth(path, device, dtype, size["breadth_ns"], *size["breadth"], args.repeats,
                          tok, params, floor)
        # once more at the end: under other load the two differ, and so show what it did to them
        print(f"\nmatmul floor at the end: {matmul_floor(device, dtype, *shape):.1f} GFLOP/s (the "
              f"shares above are of the first, {floor:.1f})")


if __name__ == "__main__":
    main()
