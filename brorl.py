"""
brorl: BroRL (arXiv 2510.01180) in one file. RL with verifiable rewards, scaled along the
*breadth* axis: hundreds of rollouts per prompt instead of more steps.

One step, as implemented (PAPER.md section 2 is the ProRL v2 recipe that BroRL keeps):
  1. rollout     sample N completions for each prompt. Each prompt is prefilled ONCE; its N
                 rollouts decode against that single copy of its keys/values (cascade attention:
                 the shared prefix read by one batched matmul for all N rows, each rollout's own
                 tokens separately, one exact softmax over both).
  2. reward      rule-based verifier (verify.py): 1 correct, 0 otherwise.
  3. dynamic     drop groups whose N rewards are all equal (no signal) and keep sampling new
     sampling    prompts until B groups survive, or a cap on rounds is hit (reported).
  4. advantages  REINFORCE++-baseline: r - mean_group(r), then normalised over the batch
                 (default); or GRPO's (r - mean_group) / std_group.
  5. update      PPO-clip with decoupled bounds (clip-higher, 0.2 / 0.28), token-level mean over
                 the mini-batch's response tokens, optional k2 KL to a periodically reset
                 reference, a fixed number of mini-batch updates, AdamW, gradient clipping.
                 Every log-prob (old, reference, current) goes through kernels.token_logprobs.
  6. eval/log    held-out pass@1 (temperature 0.6, top_p 0.95, and greedy) and unbiased pass@k;
                 the correct mass Q(x) of a fixed probe set (the quantity the paper's theory is
                 about); one log line per step, metrics.jsonl and metrics.png in --out.

Where this simplifies the paper:
  1. One process, one device, one engine: the trainer samples its own rollouts, so the
     sampler/trainer mismatch that truncated importance sampling corrects is absent (we log
     max|ratio-1| on the first mini-batch of each step: 0 up to float rounding).
  2. The default is a toy: a 0.62M-parameter character-level model warm-started on a mixture
     of right and systematically wrong addition procedures (data.py). RL has to select the right
     one, as RLVR selects among behaviours a real model already has.
  3. Rollouts of a step are sampled in memory-bounded chunks of prompts, not by a server.
  4. The learning rate is not scaled by sqrt(samples per step) automatically; set --lr.

Run:
  python brorl.py                              # embedded tiny model + task, CPU, a few minutes
  python brorl.py --preset hard                # the correct procedure is rare: breadth matters
  python brorl.py --preset paper --model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B \
      --task math:agentica-org/DeepScaleR-Preview-Dataset           # the real job, one GPU
  python brorl.py --help                       # every flag
"""

import argparse
import dataclasses
import functools
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# On a shared CPU, OpenMP threads that spin-wait for each other get descheduled mid-spin: a
# rollout ran 3-7x slower here than with passive waiting (bench.py). Must precede torch's import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.utils import logging as hf_logging

import data
import verify
from kernels import token_logprobs

# ----------------------------------------------------------------------------
# Config: one typed source of truth; every field is a --flag, its comment is the --help


@dataclass
class Config:
    # model and task
    model: str = str(data.EMBEDDED_MODEL)  # HF hub id or local dir (default: the embedded tiny model)
    task: str = "arith"  # "arith" (embedded addition task) or "math:<.jsonl path or hub dataset id>"
    digits: int = 3  # arith: digits per operand (the difficulty knob)
    dtype: str = "auto"  # compute dtype (autocast); weights and AdamW stay fp32. auto: fp32 CPU, bf16 CUDA
    device: str = "auto"  # auto = cuda if available else cpu
    seed: int = 0  # seeds prompts, sampling and init of everything random
    # rollout (paper: N=512 rollouts, B=128 prompts per step)
    n_rollouts: int = 512  # N: rollouts per prompt (paper 512; ProRL 16)
    prompts_per_step: int = 2  # B: groups kept per step after dynamic sampling (paper 128)
    max_new_tokens: int = 6  # response length cap; a truncated response gets reward 0
    temperature: float = 1.0  # rollout temperature, also used by every training log-prob
    top_p: float = 1.0  # rollout nucleus; 1.0 keeps log-probs exact w.r.t. the tempered softmax
    max_rows: int = 4096  # most rollouts decoded at once (memory); prompts are chunked to fit
    # dynamic sampling (DAPO)
    dynamic_sampling: bool = True  # drop groups whose rewards are all equal (zero advantage)
    max_rounds: int = 8  # cap on sampling rounds per step; fewer than B groups are used if hit
    # advantages
    adv_norm: str = "batch"  # batch: REINFORCE++-baseline (ProRL v2); group: GRPO's std_group
    # policy update
    lr: float = 2e-4  # AdamW, constant (paper: 2e-6 x sqrt(64k/8k) for a 1.5B model; 5e-4 here overshoots)
    weight_decay: float = 0.0  # AdamW weight decay (unstated in the paper)
    n_minibatches: int = 2  # optimizer updates per step; BroRL keeps this fixed as N grows
    micro_batch: int = 512  # rows per forward/backward: changes memory, never the gradient
    clip_low: float = 0.2  # PPO eps_low
    clip_high: float = 0.28  # PPO eps_high (clip-higher, DAPO; ProRL v1 used 0.4)
    loss_agg: str = "token"  # token: mean over the mini-batch's tokens (DAPO); sequence: per-row mean
    kl_coef: float = 0.0  # k2 KL to a reference; 0 disables it (ProRL v2 configs: 1e-4)
    ref_reset_every: int = 100  # steps between reference resets to the current policy
    grad_clip: float = 1.0  # max global grad norm
    # schedule, eval, output
    steps: int = 100  # training steps
    eval_every: int = 25  # held-out eval period in steps (also at the start and the end)
    eval_prompts: int = 64  # held-out prompts per eval
    eval_samples: int = 32  # samples per eval prompt (pass@1 is their mean, pass@k unbiased)
    probe_prompts: int = 16  # fixed held-out prompts whose correct mass Q(x) is tracked (N each)
    save: bool = True  # save the final policy (HF format) to <out>/ckpt
    out: str = ""  # run directory (default: runs/<task>-<time>)
    preset: str = ""  # a named bundle of overrides, applied before the other flags (see PRESETS)


# Presets are named bundles of overrides, never a second source of defaults.
PRESETS = {
    # the correct procedure is rare in the warm start (a few percent): breadth has to find it
    "hard": dict(model=str(data.EMBEDDED_MODEL_HARD)),
    # the paper's recipe for a 1.5B model on one GPU (pass --model and --task math:...). Memory sets
    # max_rows (KV cache: ~28 KB a token for R1-Distill-1.5B) and micro_batch (bf16 logits: 2.5 GB
    # a row at 8k tokens x 152k vocabulary); the paper used 16k-token responses on 64 GPUs.
    "paper": dict(n_rollouts=512, prompts_per_step=128, max_new_tokens=8192, lr=2e-6 * math.sqrt(8),
                  n_minibatches=4, micro_batch=4, kl_coef=1e-4, ref_reset_every=200,
                  steps=200, eval_every=25, eval_prompts=256, eval_samples=16, max_rows=512),
}


def field_help():
    """--help text for each field: the comment that follows it in the Config source."""
    src = inspect.getsource(Config)
    return dict(re.findall(r"^\s+(\w+): [^#\n]+#\s*(.+)$", src, flags=re.M))


def parse_config(argv=None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    helps = field_help()
    for f in dataclasses.fields(Config):
        kind = {bool: lambda s: s.lower() in ("1", "true", "yes")}.get(f.type, f.type)
        parser.add_argument(f"--{f.name}", type=kind, default=None, help=helps.get(f.name, ""),
                            metavar=f.type.__name__.upper())
    args = vars(parser.parse_args(argv))
    overrides = {k: v for k, v in args.items() if v is not None}
    preset = overrides.get("preset", "")
    if preset and preset not in PRESETS:
        parser.error(f"--preset {preset!r}: unknown (choose from {sorted(PRESETS)})")
    cfg = Config(**{**PRESETS.get(preset, {}), **overrides})
    problem = check_config(cfg)
    if problem:
        parser.error(problem)
    return cfg


def check_config(cfg: Config) -> str:
    """The first thing wrong with cfg, as one line naming the flag, or ''."""
    checks = [
        (cfg.n_rollouts >= 2, f"--n_rollouts {cfg.n_rollouts}: need N >= 2 (advantages compare rollouts)"),
        (cfg.prompts_per_step >= 1, f"--prompts_per_step {cfg.prompts_per_step}: need B >= 1"),
        (cfg.max_new_tokens >= 1, f"--max_new_tokens {cfg.max_new_tokens}: need >= 1"),
        (cfg.temperature > 0, f"--temperature {cfg.temperature}: need > 0 for rollouts"),
        (0 < cfg.top_p <= 1, f"--top_p {cfg.top_p}: need 0 < top_p <= 1"),
        (cfg.adv_norm in ("batch", "group"), f"--adv_norm {cfg.adv_norm!r}: choose batch or group"),
        (cfg.loss_agg in ("token", "sequence"), f"--loss_agg {cfg.loss_agg!r}: choose token or sequence"),
        (cfg.n_minibatches >= 1 and cfg.micro_batch >= 1, "--n_minibatches and --micro_batch must be >= 1"),
        (cfg.max_rows >= 1, f"--max_rows {cfg.max_rows}: need >= 1"),
        (cfg.dtype in ("auto", "float32", "bfloat16"), f"--dtype {cfg.dtype!r}: choose auto, float32 or bfloat16"),
        (cfg.steps >= 0 and cfg.eval_every >= 1, "--steps must be >= 0 and --eval_every >= 1"),
        (cfg.max_rounds >= 1, f"--max_rounds {cfg.max_rounds}: need >= 1"),
    ]
    return next((msg for ok, msg in checks if not ok), "")


# ----------------------------------------------------------------------------
# Rollouts: prefill each prompt once, decode its N rollouts against one shared copy of its KV
#
# A decode step of R = B*N rows attends to (a) its prompt's P keys, the same for all N rows of
# a group, and (b) its own t generated keys. Plain generate() stores (a) N times and reads it
# with N matrix-vector products; here (a) is stored once, shape (B, Hkv, P, D), and read with
# one matrix-matrix product for all N rows (the "cascade" trick). The scores of (a) and (b) go
# through one softmax, which is exact: the same as merging two partial softmaxes by their lse.


class SharedPrefixCache:
    """KV cache of B prompts x N rollouts. Acts as the model's cache (update() stores each new
    token's key/value per row) and, handed over in the attention-mask dict, tells
    cascade_attention where the shared prefix is."""

    def __init__(self, prefix_kv, prefix_len, n: int):
        self.prefix_kv = prefix_kv  # per layer (k, v), each (B, Hkv, P, D), right-padded
        B, Hkv, P, D = prefix_kv[0][0].shape
        pad = torch.arange(P, device=prefix_len.device)[None, :] >= prefix_len[:, None]  # (B, P)
        self.prefix_bias = torch.zeros(B, 1, 1, P, device=pad.device).masked_fill(pad[:, None, None], -math.inf)
        self.n, self.t = n, 0  # rollouts per prompt; generated tokens stored so far
        self.k = [k.new_empty(B * n, Hkv, 64, D) for k, _ in prefix_kv]  # (R, Hkv, capacity, D)
        self.v = [v.new_empty(B * n, Hkv, 64, D) for _, v in prefix_kv]

    def update(self, k, v, layer_idx, *args, **kwargs):
        # k, v: (R, Hkv, 1, D), the current token of every row
        if self.t == self.k[layer_idx].shape[2]:  # full: double the capacity (amortised O(1) a token)
            self.k[layer_idx] = torch.cat([self.k[layer_idx], torch.empty_like(self.k[layer_idx])], 2)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], torch.empty_like(self.v[layer_idx])], 2)
        self.k[layer_idx][:, :, self.t] = k[:, :, 0]
        self.v[layer_idx][:, :, self.t] = v[:, :, 0]
        return self.k[layer_idx][:, :, : self.t + 1], self.v[layer_idx][:, :, : self.t + 1]


def cascade_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered as the attention implementation "brorl". Decode steps (attention_mask is a
    SharedPrefixCache) use the shared prefix; everything else is the model's usual SDPA."""
    cache = attention_mask
    if not isinstance(cache, SharedPrefixCache):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise NotImplementedError("cascade decoding supports full attention only")
    pk, pv = cache.prefix_kv[module.layer_idx]  # (B, Hkv, P, D)
    B, Hkv, P, D = pk.shape
    R, H = query.shape[:2]  # query (R, H, 1, D), R = B * N
    N, G = cache.n, H // Hkv  # G query heads share one kv head (GQA)
    # (a) shared prefix: all N rows and G heads of a group are the M = N*G rows of one matmul
    q_a = query.view(B, N, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, N * G, D)
    s_a = torch.matmul(q_a, pk.transpose(-1, -2)).float() * scaling + cache.prefix_bias  # (B, Hkv, N*G, P)
    s_a = s_a.view(B, Hkv, N, G, P).permute(0, 2, 1, 3, 4).reshape(R, Hkv, G, P)
    # (b) each row's own generated tokens, key/value (R, Hkv, t, D)
    s_b = torch.matmul(query.view(R, Hkv, G, D), key.transpose(-1, -2)).float() * scaling  # (R, Hkv, G, t)
    # one softmax over both parts: exact (the same as merging two partial softmaxes by their lse)
    p = torch.softmax(torch.cat([s_a, s_b], -1), -1).to(value.dtype)  # (R, Hkv, G, P + t)
    p_a = p[..., :P].reshape(B, N, Hkv, G, P).permute(0, 2, 1, 3, 4).reshape(B, Hkv, N * G, P)
    out_a = torch.matmul(p_a, pv).view(B, Hkv, N, G, D).permute(0, 2, 1, 3, 4).reshape(R, Hkv, G, D)
    out = out_a + torch.matmul(p[..., P:], value)  # (R, Hkv, G, D)
    return out.reshape(R, 1, H, D), None  # HF wants (batch, q_len, heads, head_dim)


# Every model is loaded with attn_implementation="brorl": SDPA everywhere but in decode steps.
AttentionInterface.register("brorl", cascade_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("brorl", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def cache_kwarg(model) -> str:
    """transformers renamed past_key_values= to cache= (5.2x); accept both."""
    return _cache_kwarg(type(model))


@functools.lru_cache
def _cache_kwarg(cls) -> str:  # inspecting a signature costs ~10 ms: once per model class
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


@dataclass
class Rollouts:
    prompt_ids: list  # B lists of prompt token ids
    tokens: torch.Tensor  # (B*N, T) response tokens, pad after EOS
    mask: torch.Tensor  # (B*N, T) bool, True on response tokens (EOS included)
    logp: torch.Tensor  # (B*N, T) the sampler's log-probs of its tokens (0 on padding)
    truncated: torch.Tensor  # (B*N,) bool: hit max_new without EOS
    texts: list  # B*N decoded responses, EOS stripped
    n: int  # rollouts per prompt


def pick_tokens(logits, temperature: float, top_p: float, gen):
    """Sample one token per row from logits (R, V): greedy when temperature == 0."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)  # (R, V)
    if top_p < 1.0:  # nucleus: keep the smallest prefix of sorted tokens whose mass reaches top_p
        sorted_p, idx = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # mass before a token already reaches top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(drop, 0.0))
    # inverse-CDF draw: ~10x faster than torch.multinomial at (512, 258) on a CPU (bench.py)
    cdf = probs.cumsum(-1)  # (R, V)
    u = torch.rand(cdf.shape[0], 1, generator=gen, device=cdf.device) * cdf[:, -1:]  # (R, 1)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[1] - 1)  # p = 0 never drawn


@torch.no_grad()
def generate_group_chunk(model, prompt_ids, n, max_new, temperature, top_p, eos_id, pad_id, gen):
    """Rollouts for a chunk of prompts: (tokens, mask, logp), each (len(prompt_ids)*n, T)."""
    dev, cache_kw = model.device, cache_kwarg(model)
    # Prefill: each prompt once, alone (no padding inside it), its KV kept once.
    per_layer, first_logits = None, []
    for ids in prompt_ids:
        cache = DynamicCache(config=model.config)
        out = model(torch.tensor([ids], device=dev), **{cache_kw: cache}, logits_to_keep=1)
        first_logits.append(out.logits[0, -1])  # (V,)
        kv = [(layer.keys, layer.values) for layer in cache.layers]  # per layer (1, Hkv, P_b, D)
        per_layer = [[x] for x in kv] if per_layer is None else [p + [x] for p, x in zip(per_layer, kv)]
    P = max(len(ids) for ids in prompt_ids)
    pad_to = lambda x: F.pad(x, (0, 0, 0, P - x.shape[2]))  # right-pad the sequence dim to P
    prefix_kv = [(torch.cat([pad_to(k) for k, _ in layer]), torch.cat([pad_to(v) for _, v in layer]))
                 for layer in per_layer]  # per layer (B, Hkv, P, D)
    prompt_len = torch.tensor([len(ids) for ids in prompt_ids], device=dev)  # (B,)
    cache = SharedPrefixCache(prefix_kv, prompt_len, n)
    masks = {t: cache for t in set(getattr(model.config, "layer_types", None) or ["full_attention"])}

    R, eos_ids = len(prompt_ids) * n, torch.as_tensor(eos_id, device=dev)  # one id or several
    logits = torch.stack(first_logits).repeat_interleave(n, 0)  # (R, V), row r is prompt r // n
    tokens = torch.full((R, max_new), pad_id, dtype=torch.long, device=dev)  # (R, T)
    logp = torch.zeros(R, max_new, device=dev)  # (R, T)
    done = torch.zeros(R, dtype=torch.bool, device=dev)  # (R,)
    mask = torch.zeros(R, max_new, dtype=torch.bool, device=dev)  # (R, T)
    for t in range(max_new):
        tok = pick_tokens(logits, temperature, top_p, gen)  # (R,)
        tok = torch.where(done, pad_id, tok)
        tokens[:, t], mask[:, t] = tok, ~done
        # the log-prob of the drawn token (0 where done); greedy (T = 0) records it at T = 1
        logp[:, t] = token_logprobs(logits, tok.masked_fill(done, -100), temperature or 1.0)
        done = done | torch.isin(tok, eos_ids)
        if done.all() or t == max_new - 1:
            break
        pos = (prompt_len.repeat_interleave(n) + t)[:, None]  # (R, 1) position of this token
        out = model(tok[:, None], position_ids=pos, attention_mask=masks, **{cache_kw: cache})
        cache.t += 1
        logits = out.logits[:, -1]  # (R, V)
    return tokens, mask, logp, ~done


def generate(model, tok, prompts, n, max_new, temperature, top_p, max_rows, gen) -> Rollouts:
    """N rollouts for each prompt string, decoded in chunks of <= max_rows rows."""
    prompt_ids = [encode_prompt(tok, p) for p in prompts]
    if n <= max_rows:  # whole groups per chunk
        per = max_rows // n
        jobs = [(prompt_ids[i: i + per], n) for i in range(0, len(prompt_ids), per)]
    else:  # a group does not fit: split its N rows into parts, each re-prefilling the prompt
        jobs = [([ids], min(max_rows, n - j)) for ids in prompt_ids for j in range(0, n, max_rows)]
    eos = {tok.eos_token_id, *listify(model.generation_config.eos_token_id)} - {None}  # chat models have several
    parts = [generate_group_chunk(model, ids, rows, max_new, temperature, top_p, sorted(eos),
                                  tok.pad_token_id, gen) for ids, rows in jobs]
    tokens, mask, logp, truncated = (torch.cat(x) for x in zip(*parts))
    texts = tok.batch_decode(tokens.masked_fill(~mask, tok.pad_token_id), skip_special_tokens=True)
    return Rollouts(prompt_ids, tokens, mask, logp, truncated, texts, n)


def listify(x) -> list:
    return x if isinstance(x, list) else [x]


def encode_prompt(tok, prompt: str) -> list:
    """Token ids of a prompt; chat models get their chat template."""
    if tok.chat_template:
        return list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"])
    return tok(prompt, add_special_tokens=True)["input_ids"]


# ----------------------------------------------------------------------------
# Reward and dynamic sampling


def score(rollouts: Rollouts, answers, task: str) -> torch.Tensor:
    """Rewards (B, N): the verifier on each response; a truncated response scores 0."""
    golds = [a for a in answers for _ in range(rollouts.n)]
    r = torch.tensor(verify.rewards(rollouts.texts, golds, task=task), dtype=torch.float32)  # (B*N,)
    r[rollouts.truncated.cpu()] = 0.0
    return r.view(-1, rollouts.n)


def sample_step_groups(model, tok, cfg, train_set, rng, gen, keep_est):
    """Sample groups until B survive dynamic sampling (or max_rounds hits). Returns the kept
    groups as (rollouts, group index, rewards (N,)), at most B of them, and bookkeeping."""
    B, N = cfg.prompts_per_step, cfg.n_rollouts
    kept, stats = [], dict(groups_generated=0, groups_survived=0, rounds=0, rewards=[], tokens=0)
    while len(kept) < B and stats["rounds"] < cfg.max_rounds:
        # ask for enough prompts to fill B at the keep rate seen so far (this step's, else recent steps')
        rate = stats["groups_survived"] / stats["groups_generated"] if stats["groups_generated"] else keep_est
        want = min(math.ceil((B - len(kept)) / max(rate, 0.1)), 4 * B)
        batch = rng.sample(train_set, want)
        ro = generate(model, tok, [ex["prompt"] for ex in batch], N, cfg.max_new_tokens,
                      cfg.temperature, cfg.top_p, cfg.max_rows, gen)
        r = score(ro, [ex["answer"] for ex in batch], batch[0]["task"])  # (want, N)
        stats["rounds"] += 1
        stats["groups_generated"] += want
        stats["tokens"] += int(ro.mask.sum())
        stats["rewards"].append(r)
        for g in range(want):
            if not cfg.dynamic_sampling or r[g].min() != r[g].max():
                kept.append((ro, g, r[g]))
        stats["groups_survived"] = len(kept)
    kept = kept[:B]  # DAPO keeps exactly B; extra survivors of the last round are dropped
    stats["groups_kept"] = len(kept)
    return kept, stats


def pack_groups(kept) -> dict:
    """Kept groups -> one training batch: G prompts, left-padded to P, and R = G*N responses,
    right-padded to T, each response row pointing at its prompt (`group`)."""
    G, n, dev = len(kept), kept[0][0].n, kept[0][0].tokens.device
    P = max(len(ro.prompt_ids[g]) for ro, g, _ in kept)
    prompt = torch.zeros(G, P, dtype=torch.long)  # (G, P), pad id irrelevant: masked
    prompt_mask = torch.zeros(G, P, dtype=torch.bool)  # (G, P)
    for i, (ro, g, _) in enumerate(kept):
        ids = ro.prompt_ids[g]
        prompt[i, P - len(ids):], prompt_mask[i, P - len(ids):] = torch.tensor(ids), True
    resp = torch.cat([ro.tokens[g * n: (g + 1) * n] for ro, g, _ in kept])  # (R, T_max)
    resp_mask = torch.cat([ro.mask[g * n: (g + 1) * n] for ro, g, _ in kept])  # (R, T_max)
    T = int(resp_mask.any(0).nonzero().max()) + 1  # drop all-padding columns
    return dict(prompt=prompt.to(dev), prompt_mask=prompt_mask.to(dev), resp=resp[:, :T],
                resp_mask=resp_mask[:, :T], group=torch.arange(G, device=dev).repeat_interleave(n))


# ----------------------------------------------------------------------------
# Advantages


def compute_advantages(rewards: torch.Tensor, norm: str = "batch", eps: float = 1e-6) -> torch.Tensor:
    """rewards (G, N) -> advantages (G, N). A group whose rewards are all equal gets exactly 0:
    it carries no signal, and the batch-mean subtraction must not leak rounding noise into it."""
    centred = rewards - rewards.mean(1, keepdim=True)  # (G, N)
    informative = (rewards.max(1).values > rewards.min(1).values)[:, None]  # (G, 1)
    if norm == "group":  # GRPO: per-group std
        adv = centred / (rewards.std(1, keepdim=True) + eps)
    else:  # REINFORCE++-baseline: normalise over the whole batch (ProRL v2, BroRL)
        adv = (centred - centred.mean()) / (centred.std() + eps) if centred.numel() > 1 else centred
    return torch.where(informative, adv, torch.zeros_like(adv))


# ----------------------------------------------------------------------------
# Policy update


def response_logprobs(model, batch, rows, temperature, with_entropy=False):
    """Log-probs (r, T) of the response tokens of batch rows `rows`, through the one log-prob
    kernel. Like the sampler, each prompt is run once (not once per row) and no logits are made
    at prompt positions: the responses attend to their prompt's keys/values, gathered per row,
    so the gradient of all N rows flows back into the one prompt pass."""
    groups, row_group = batch["group"][rows].unique(return_inverse=True)  # (g,), (r,)
    pm = batch["prompt_mask"][groups]  # (g, P)
    resp, mask = batch["resp"][rows], batch["resp_mask"][rows]  # (r, T)
    T = int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1  # trim trailing padding
    # 1. each prompt once; its last position predicts response token 0
    cache = DynamicCache(config=model.config)
    first = model(batch["prompt"][groups], attention_mask=pm.long(), position_ids=(pm.long().cumsum(1) - 1).clamp(min=0),
                  logits_to_keep=1, **{cache_kwarg(model): cache}).logits  # (g, 1, V)
    logits = first[row_group]  # (r, 1, V)
    if T > 1:  # 2. response tokens 0..T-2 predict tokens 1..T-1
        row_cache = DynamicCache(config=model.config)
        for i, layer in enumerate(cache.layers):  # per layer (g, Hkv, P, D) -> (r, Hkv, P, D)
            row_cache.update(layer.keys[row_group], layer.values[row_group], i)
        r, P = len(rows), pm.shape[1]
        causal = torch.ones(T - 1, T - 1, dtype=torch.bool, device=pm.device).tril()  # (T-1, T-1)
        attn = torch.cat([pm[row_group, None, :].expand(r, T - 1, P), causal.expand(r, -1, -1)], -1)  # (r, T-1, P+T-1)
        pos = pm.sum(1)[row_group, None] + torch.arange(T - 1, device=pm.device)  # (r, T-1)
        rest = model(resp[:, : T - 1], attention_mask=attn[:, None], position_ids=pos,
                     **{cache_kwarg(model): row_cache}).logits  # (r, T-1, V)
        logits = torch.cat([logits, rest], 1)  # (r, T, V)
    targets = resp[:, :T].masked_fill(~mask[:, :T], -100)  # (r, T)
    out = token_logprobs(logits, targets, temperature, with_entropy=with_entropy)
    pad = lambda x: F.pad(x, (0, mask.shape[1] - T))  # back to the batch's T
    return tuple(pad(x) for x in out) if with_entropy else pad(out)


def loss_weights(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Per-token weights (r, T) of a mini-batch, fixed BEFORE micro-batching so that any micro-batch
    size gives the same gradient. token: 1 / (valid tokens in the mini-batch) (DAPO, ProRL v2);
    sequence: 1 / (row length * rows), the older per-sequence mean."""
    m = mask.float()
    if agg == "token":
        return m / m.sum().clamp(min=1)
    return m / m.sum(1, keepdim=True).clamp(min=1) / m.shape[0]


def ppo_token_loss(logp, old_logp, adv, clip_low, clip_high):
    """PPO-clip with decoupled bounds, per token (r, T); adv (r,) broadcast along T."""
    ratio = torch.exp(logp - old_logp)  # (r, T)
    unclipped = ratio * adv[:, None]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv[:, None]
    return -torch.min(unclipped, clipped), ratio


def kl_k2(logp, ref_logp):
    """k2 estimator of KL(policy || ref) per token: 0.5 * log-ratio^2, log-ratio clamped to +-10."""
    return 0.5 * (logp - ref_logp).clamp(-10, 10) ** 2


def update_policy(model, ref_model, opt, batch, adv, cfg, gen_cpu):
    """n_minibatches optimizer steps over the batch; returns the update's metrics."""
    R = batch["resp"].shape[0]
    micro = lambda idx: [idx[i: i + cfg.micro_batch] for i in range(0, len(idx), cfg.micro_batch)]
    # old (and reference) log-probs and the entropy metric, once, before any update
    chunks = micro(torch.arange(R, device=adv.device))
    with torch.no_grad():
        old_logp, ent = (torch.cat(x) for x in zip(*[response_logprobs(model, batch, rows, cfg.temperature, True)
                                                      for rows in chunks]))  # (R, T) each
        ref_logp = torch.cat([response_logprobs(ref_model, batch, rows, cfg.temperature)
                              for rows in chunks]) if cfg.kl_coef > 0 else None  # (R, T)
    ent = ent[batch["resp_mask"]]
    m = dict(entropy=ent.mean().item(), clip_frac=0.0, kl=0.0, grad_norm=0.0, max_ratio_dev=0.0)
    perm = torch.randperm(R, generator=gen_cpu).to(adv.device)
    n_tok = 0
    for k, mb in enumerate(perm.chunk(cfg.n_minibatches)):
        w = loss_weights(batch["resp_mask"][mb], cfg.loss_agg)  # (r, T), sums to 1
        opt.zero_grad(set_to_none=True)
        for j in range(0, len(mb), cfg.micro_batch):
            rows, wr = mb[j: j + cfg.micro_batch], w[j: j + cfg.micro_batch]
            mask = batch["resp_mask"][rows]
            logp = response_logprobs(model, batch, rows, cfg.temperature)  # (r, T)
            tok_loss, ratio = ppo_token_loss(logp, old_logp[rows], adv[rows], cfg.clip_low, cfg.clip_high)
            if ref_logp is not None:
                kl = kl_k2(logp, ref_logp[rows])
                tok_loss = tok_loss + cfg.kl_coef * kl
                m["kl"] += (kl * mask).sum().item()
            (tok_loss * wr).sum().backward()
            # diagnostics: clipped = the gradient is zero because the clip is active
            a = adv[rows][:, None]
            clipped = ((ratio > 1 + cfg.clip_high) & (a > 0)) | ((ratio < 1 - cfg.clip_low) & (a < 0))
            m["clip_frac"] += (clipped & mask).sum().item()
            n_tok += mask.sum().item()
            if k == 0:  # one engine, no update yet: ratio == 1 up to float rounding (batch shapes differ)
                m["max_ratio_dev"] = max(m["max_ratio_dev"], ((ratio - 1).abs() * mask).max().item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        if not math.isfinite(norm):  # never step on a NaN/inf gradient
            raise FloatingPointError(f"gradient norm is {norm} in mini-batch {k}; it was not applied")
        m["grad_norm"] += norm / cfg.n_minibatches
        opt.step()
    m["clip_frac"] /= max(n_tok, 1)
    m["kl"] /= max(n_tok, 1)
    return m


# ----------------------------------------------------------------------------
# One step


def rl_step(model, ref_model, opt, tok, cfg, train_set, rng, gen, gen_cpu, keep_est) -> dict:
    """rollout -> reward -> dynamic sampling -> advantages -> policy update; returns the metrics."""
    model.eval()
    t0 = time.perf_counter()
    kept, stats = sample_step_groups(model, tok, cfg, train_set, rng, gen, keep_est)
    t_roll = time.perf_counter() - t0
    upd = {}
    if kept:  # else every group was all-right or all-wrong: nothing to learn from this step
        batch = pack_groups(kept)
        adv = compute_advantages(torch.stack([r for _, _, r in kept]), cfg.adv_norm).flatten()  # (R,)
        model.train()
        upd = update_policy(model, ref_model, opt, batch, adv.to(model.device), cfg, gen_cpu)
    return step_metrics(stats, t_roll, time.perf_counter() - t0 - t_roll, upd)


# ----------------------------------------------------------------------------
# Evaluation and diagnostics: pass@k and the probe set's correct mass


def evaluate(model, tok, examples, cfg, gen) -> dict:
    """Held-out pass@1 and pass@k at the paper's eval sampling (T=0.6, top_p=0.95), and greedy.
    pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) from n samples (data.pass_at_k)."""
    prompts, answers, task = [e["prompt"] for e in examples], [e["answer"] for e in examples], examples[0]["task"]
    n = cfg.eval_samples
    ro = generate(model, tok, prompts, n, cfg.max_new_tokens, 0.6, 0.95, cfg.max_rows, gen)
    correct = score(ro, answers, task)  # (P, n)
    greedy = score(generate(model, tok, prompts, 1, cfg.max_new_tokens, 0.0, 1.0, cfg.max_rows, gen), answers, task)
    ks = [2 ** i for i in range(int(math.log2(n)) + 1)]
    m = {"eval_pass@1": correct.mean().item(), "eval_greedy_pass@1": greedy.mean().item()}
    for k in ks[1:]:
        m[f"eval_pass@{k}"] = sum(data.pass_at_k(n, int(c), k) for c in correct.sum(1)) / len(examples)
    m["eval_pass@k"] = m[f"eval_pass@{ks[-1]}"] if len(ks) > 1 else m["eval_pass@1"]
    return m


def probe_mass(model, tok, probe, cfg, gen, start=None) -> tuple:
    """Correct mass Q(x) of each probe prompt, estimated by the pass rate of N rollouts at the
    training temperature. pass@k(x) = 1 - (1 - Q(x))^k rises with it (PAPER.md section 3)."""
    ro = generate(model, tok, [e["prompt"] for e in probe], cfg.n_rollouts, cfg.max_new_tokens,
                  cfg.temperature, cfg.top_p, cfg.max_rows, gen)
    q = score(ro, [e["answer"] for e in probe], probe[0]["task"]).mean(1)  # (P,)
    m = {"mass_mean": q.mean().item()}
    if start is not None:
        delta = q - start
        m.update(mass_rose=(delta > 0).float().mean().item(), mass_fell=(delta < 0).float().mean().item(),
                 mass_worst_drop=max(0.0, -delta.min().item()))
    return q, m


def step_metrics(stats, t_roll, t_upd, upd) -> dict:
    """The per-step dict: rollout statistics over ALL generated groups, before filtering."""
    r = torch.cat(stats["rewards"])  # (groups generated, N)
    return {
        "reward_mean": r.mean().item(),
        "keep_rate": stats["groups_survived"] / max(stats["groups_generated"], 1),  # before truncation to B
        "groups_kept": stats["groups_kept"], "sample_rounds": stats["rounds"],
        "zero_adv_frac": (r.max(1).values == r.min(1).values).float().mean().item(),
        "pass@1": r.mean().item(), "pass@N": (r.max(1).values > 0).float().mean().item(),
        "resp_len": stats["tokens"] / r.numel(), "tokens_per_s": stats["tokens"] / max(t_roll, 1e-9),
        "time_rollout": t_roll, "time_update": t_upd, **upd,
    }


PLOTS = [("reward_mean", "train reward"), ("eval_pass@1", "held-out pass@1 (T=0.6)"),
         ("eval_pass@k", "held-out pass@k (k = eval samples)"), ("keep_rate", "dynamic-sampling keep rate"),
         ("entropy", "token entropy"), ("resp_len", "response length"),
         ("mass_mean", "probe correct mass Q"), ("kl", "k2 KL to reference (0 if off)")]


def plot_metrics(rows, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 4, figsize=(16, 6.5))
    for ax, (key, title) in zip(axes.flat, PLOTS):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, ms=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------
# Setup and the loop


def fail(msg: str):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def load_policy(cfg, device):
    """Model and tokenizer from a hub id or a local dir; one clear line if that is impossible."""
    looks_local = cfg.model.startswith((".", "/", "~")) or cfg.model.count("/") > 1  # not "org/name"
    if looks_local and not Path(cfg.model).expanduser().is_dir():
        fail(f"--model {cfg.model}: no such directory")
    try:
        tok = AutoTokenizer.from_pretrained(cfg.model)
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, attn_implementation="brorl")
    except (OSError, ValueError) as e:
        fail(f"--model {cfg.model}: could not load ({str(e).splitlines()[0]})")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.to(device), tok


def make_run_dir(cfg) -> Path:
    out = Path(cfg.out or f"runs/{cfg.task.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        fail(f"--out {out}: cannot write there ({e.strerror})")
    return out


def save_atomic(model, tok, cfg, path: Path):
    """Write the checkpoint into a temp dir, then rename: never a half-written checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "brorl_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def train(cfg: Config) -> list:
    hf_logging.disable_progress_bar()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[cfg.dtype]
    # fp32 master weights and AdamW state; matmuls in `dtype` (a bf16 weight would round away lr ~1e-6 updates)
    amp = lambda: torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    try:  # data first: a bad --task fails before anything is written
        train_set = data.load_task(cfg.task, "train", seed=cfg.seed, digits=cfg.digits)
        held_out = data.load_task(cfg.task, "test", seed=cfg.seed, digits=cfg.digits)
    except (ValueError, OSError) as e:
        fail(f"--task {cfg.task}: {e}")
    model, tok = load_policy(cfg, device)
    out = make_run_dir(cfg)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    print(json.dumps(dataclasses.asdict(cfg), indent=1))
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {device}, {dtype}; "
          f"train {len(train_set)} / held-out {len(held_out)} prompts; run dir {out}")

    ref_model = None
    if cfg.kl_coef > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, attn_implementation="brorl")
        ref_model.to(device).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    rng = random.Random(cfg.seed)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    gen_cpu = torch.Generator().manual_seed(cfg.seed)
    eval_set = random.Random(cfg.seed + 1).sample(held_out, min(cfg.eval_prompts, len(held_out)))
    probe = eval_set[: cfg.probe_prompts]

    metrics_file = open(out / "metrics.jsonl", "w")
    rows, keep_est = [], 0.5

    def log_eval(q_start=None):
        """Held-out pass@k, and the probe set's correct mass relative to step 0."""
        model.eval()
        with amp():
            m = evaluate(model, tok, eval_set, cfg, gen)
            q, mq = probe_mass(model, tok, probe, cfg, gen, start=q_start)
        return {**m, **mq}, q

    m0, q_start = log_eval()
    rows.append({"step": 0, **m0})
    metrics_file.write(json.dumps(rows[0]) + "\n")
    tqdm.write(f"eval step 0: " + " ".join(f"{k}={v:.3f}" for k, v in rows[0].items() if k != "step"))
    bar = tqdm(range(1, cfg.steps + 1), desc="brorl", dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        try:
            with amp():
                m = {"step": step, **rl_step(model, ref_model, opt, tok, cfg, train_set, rng, gen, gen_cpu, keep_est)}
        except FloatingPointError as e:  # the bad mini-batch was not applied: stop before training on it
            fail(f"step {step}: {e}")
        keep_est = 0.8 * keep_est + 0.2 * m["keep_rate"]
        if ref_model is not None and step % cfg.ref_reset_every == 0:
            ref_model.load_state_dict(model.state_dict())  # ProRL: reset the reference, keep Adam state
        # --- eval, log, checkpoint
        if step % cfg.eval_every == 0 or step == cfg.steps:
            m.update(log_eval(q_start)[0])
        rows.append(m)
        metrics_file.write(json.dumps(m) + "\n")
        metrics_file.flush()
        if "eval_pass@1" in m:
            plot_metrics(rows, out / "metrics.png")  # refreshed at every eval, not only at the end
        line = (f"step {step:4d} | reward {m['reward_mean']:.3f} | keep {m['keep_rate']:.2f} | "
                f"ent {m.get('entropy', 0):.3f} | clip {m.get('clip_frac', 0):.3f} | "
                f"|r-1| {m.get('max_ratio_dev', 0):.1e} | len {m['resp_len']:.1f} | "
                f"{m['tokens_per_s']:.0f} tok/s | roll {m['time_rollout']:.2f}s upd {m['time_update']:.2f}s")
        if "eval_pass@1" in m:
            line += f" | eval pass@1 {m['eval_pass@1']:.3f} pass@k {m['eval_pass@k']:.3f} Q {m['mass_mean']:.3f}"
        tqdm.write(line)
    metrics_file.close()
    if cfg.save:
        save_atomic(model, tok, cfg, out / "ckpt")
    first, last = rows[0], rows[-1]
    if "eval_pass@1" in last:
        print(f"held-out pass@1 {first['eval_pass@1']:.3f} -> {last['eval_pass@1']:.3f}, "
              f"pass@k {first['eval_pass@k']:.3f} -> {last['eval_pass@k']:.3f}; wrote {out}")
    return rows


if __name__ == "__main__":
    train(parse_config())
