"""
planner.py: the memory a brorl run needs, estimated before it runs. A pure function of the model's
config (widths, layers, heads, vocabulary), the run's Config fields and the world size: no weights
are loaded, so `python brorl.py --plan --model <hub id>` answers for a 7B model on a laptop.

Two phases peak separately (brorl.py never holds both at once):
  rollout  the weights (+ AdamW state, which lives across steps, + the reference policy), the KV
           cache of one chunk of rows x (prompt + max_new_tokens) in the compute dtype, the
           sampling step's (rows, V) buffers, and the chunk's outputs;
  update   weights, AdamW state, the reference policy when --kl_coef > 0, the step's (rows, T)
           tensors, and the larger of two moments never alive at once: one micro-batch's forward
           and backward (each decoder layer's activations, or with --grad_ckpt each layer's input
           and one layer's; the attention mask; the logits and their gradient; the gradients when
           an earlier micro-batch of the mini-batch made them) and AdamW's step (the gradients and
           the temporary of its foreach implementation, the square root of every second moment).
The per-token constants below count what autograd keeps for a Qwen2/Llama decoder layer under
autocast (checked against measured peaks, tests/test_onegpu.py and tests/test_rehearsal.py). The
estimate is of tensor bytes; an allocator adds its fragmentation on top (a margin on CUDA).

    plan(model_config, cfg, prompt_tokens, world_size=1) -> {"rollout": [(item, bytes)], "update":
    [...]}; fit(model_config, cfg, prompt_tokens, memory_bytes) -> (max_rows, micro_batch) or an
    error line; step_seconds(...): a roofline estimate of a step's time on one GPU.
lib/plan.plan_memory prints a run's plan and fits its flags; tools/memcheck.py measures the
peaks, to check the estimate.
"""

import dataclasses
import math

import torch

import kernels
from lib import distributed, logprobs
from sampler import MIN_ROWS, padded_len

GB = 2**30
# default --memory_gb on CUDA: 90% of the device (allocator fragmentation, CUDA context)
CUDA_MARGIN = 0.90


def _shape(mc):
    """(H, I, L, V, heads, kv heads, head dim) of a Hugging Face decoder config."""
    H, nh = mc.hidden_size, mc.num_attention_heads
    hd = getattr(mc, "head_dim", None) or H // nh
    return (H, mc.intermediate_size, mc.num_hidden_layers, mc.vocab_size, nh,
            mc.num_key_value_heads, hd)


def param_counts(mc) -> tuple:
    """(all parameters, parameters of Linear layers incl. the LM head): autocast keeps a
    low-precision copy of each Linear weight it uses."""
    H, I, L, V, nh, nkv, hd = _shape(mc)
    # q, k, v, o (+ qkv biases)
    attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H + (nh + 2 * nkv) * hd
    mlp = 3 * H * I  # gate, up, down
    tied = getattr(mc, "tie_word_embeddings", False)
    # embeddings, layers (2 norms), final norm
    total = V * H * (1 if tied else 2) + L * (attn + mlp + 2 * H) + H
    return total, L * (attn + mlp) + V * H


def lora_param_count(mc, cfg) -> int:
    """Parameters of a rank-r LoRA adapter (--lora_rank) on the --lora_targets of every decoder
    layer: r * (fan_in + fan_out) each, for the Qwen2/Llama projections and Phi-3's fused ones;
    0 without LoRA."""
    H, I, L, V, nh, nkv, hd = _shape(mc)
    shapes = dict(q_proj=(H, nh * hd), k_proj=(H, nkv * hd), v_proj=(H, nkv * hd),
                  o_proj=(nh * hd, H), gate_proj=(H, I), up_proj=(H, I), down_proj=(I, H),
                  qkv_proj=(H, (nh + 2 * nkv) * hd), gate_up_proj=(H, 2 * I))
    r = getattr(cfg, "lora_rank", 0)
    return L * r * sum(sum(shapes.get(t, (0, 0))) for t in cfg.lora_targets.split(",")) if r else 0


def layer_activation_bytes(mc, c: int) -> float:
    """Bytes autograd keeps per token for one decoder layer; c = compute dtype bytes (2 bf16, 4
    fp32). fp32: each RMSNorm keeps its input, the normalised product and its output (3 x 4H);
    rotary keeps q, k and their rotated halves; SDPA q, k and v (expanded to all heads, GQA) and its
    output; o_proj its input; the SwiGLU MLP gate, up, silu(gate) and their product (4 x 4I).
    bf16 autocast: the residual stream and the norms stay fp32 and each Linear keeps a bf16 cast of
    its input; projections, rotary inputs, SDPA and the MLP are bf16."""
    H, I, L, V, nh, nkv, hd = _shape(mc)
    if c == 4:
        return 24 * H + 8 * (nh + nkv) * hd + 20 * nh * hd + 16 * I
    return 28 * H + 4 * (nh + nkv) * hd + 10 * nh * hd + 8 * I


def sampling_bytes_per_row(V: int, c: int, top_p: float) -> int:
    """The sampling step's (rows, V) buffers per row: the logits (c), fp32 probabilities and their
    cumulative sum, and the log-prob kernel's chunk; top_p < 1 adds the sort (values + int64
    indices)."""
    per = c + 4 + 8  # logits, probs, the cumulative sum (float64)
    if top_p < 1:
        per += 4 + 8 + 4 + 1  # sorted values, their int64 indices, the masked copy, the drop mask
    return V * per


def kv_capacity(max_new: int) -> int:
    """The sampler's cache capacity for max_new tokens: 64, doubled while full (sampler.py)."""
    cap = 64
    while cap < max_new - 1:
        cap *= 2
    return cap


def rollout_rows(cfg, n: int, prompts: int) -> int:
    """Rows decoded at once for n rollouts of `prompts` prompts: whole groups up to max_rows
    (sampler.generate)."""
    if n > cfg.max_rows:
        return cfg.max_rows
    return min(cfg.max_rows // n, prompts) * n


def most_rollouts(cfg) -> int:
    """The most rollouts one prompt gets in a training step: N, or under --alloc adaptive the
    ceiling --max_rollouts (at most the step's budget R), whatever the estimate allocates."""
    if getattr(cfg, "alloc", "uniform") != "adaptive":
        return cfg.n_rollouts
    return min(cfg.max_rollouts, step_budget(cfg))


def step_budget(cfg) -> int:
    """--alloc adaptive's rollouts a step, R (0: B x N)."""
    return cfg.rollout_budget or cfg.prompts_per_step * cfg.n_rollouts


def plan(mc, cfg, prompt_tokens: int, world_size: int = 1) -> dict:
    """Estimated peak bytes of each phase on one rank, itemised: {"rollout": [(item, bytes)],
    "update": [...]}. world_size K > 1 (torchrun, distributed.py): weights, gradients and AdamW
    state are sharded 1/K; a full fp32 replica samples the rollouts; each rank samples its share of
    the prompts."""
    H, I, L, V, nh, nkv, hd = _shape(mc)
    c = 2 if _compute_bytes(cfg) == 2 else 4
    total, linear = param_counts(mc)
    B, N, T = cfg.prompts_per_step, most_rollouts(cfg), cfg.max_new_tokens
    adaptive = getattr(cfg, "alloc", "uniform") == "adaptive"
    P, K = prompt_tokens, world_size
    shard = f", 1/{K} shard" if K > 1 else ""
    # --lora_rank: the weights frozen, the adapter alone trained (gradients, AdamW state); the KL's
    # reference shares the base weights and copies the adapter
    lora = lora_param_count(mc, cfg)
    trained = lora or total / K
    state = ([(f"weights (fp32{shard})", 4 * total / K)]
             + [("LoRA adapter (fp32)", 4 * lora)] * (lora > 0))
    state.append((f"AdamW state (fp32 m, v{shard})", 8 * trained))
    if K > 1:
        state.append(("full replica: rollouts, eval, checkpoints (fp32)", 4 * total))
    if cfg.kl_coef > 0:
        state.append(("reference policy (fp32)" if not lora
                      else "reference: a copy of the LoRA adapter", 4 * (lora or total)))
    if c == 2:
        state.append(("autocast's bf16 weight copies", 2 * linear))

    # rollout: the largest chunk of training, eval (top_p 0.95) and probe sampling
    def chunk(rows, top_p, prompts):
        cap = kv_capacity(T)
        # A decode step runs >= MIN_ROWS rows (filler rows beside a small chunk's), its prompts
        # padded to a multiple of sampler.PAD_TO tokens (padded_len).
        rows = max(rows, MIN_ROWS)
        # + one layer doubling
        kv = L * rows * nkv * hd * 2 * c * cap + rows * nkv * hd * 2 * c * cap // 2
        prefix = L * prompts * nkv * hd * 2 * c * padded_len(P)
        return [("KV cache (rows x max_new_tokens) + prompts", kv + prefix),
                ("sampling buffers (rows, V)", rows * sampling_bytes_per_row(V, c, top_p)),
                # 17 bytes a token: int64 token, bool mask, fp32 logp, entropy.
                ("chunk outputs (rows, T)", rows * T * 17)]
    # Each rank samples its share of the prompts: uniform rounds of up to 4B prompts, N rollouts
    # each; or --alloc adaptive's one call of B candidates, up to the ceiling each and R in all,
    # packed into chunks of max_rows rows (sampler.chunk_rows).
    train_prompts, eval_prompts = math.ceil(4 * B / K), math.ceil(cfg.eval_prompts / K)
    # The largest training chunk's rows and prompts.
    rows, prompts = rollout_rows(cfg, N, train_prompts), min(train_prompts,
                                                             max(cfg.max_rows // N, 1))
    if adaptive:
        prompts = math.ceil(B / K)
        rows = min(cfg.max_rows, step_budget(cfg), prompts * N)
    chunks = [chunk(rows, cfg.top_p, prompts),
              chunk(rollout_rows(cfg, cfg.eval_samples, eval_prompts), 0.95,
                    min(eval_prompts, max(cfg.max_rows // cfg.eval_samples, 1)))]
    rollout = state + max(chunks, key=lambda items: sum(b for _, b in items))

    # update: one micro-batch of r rows x T tokens on top of the step's state
    # rows a rank trains per step: its even share of the kept groups (adaptive: groups of up to the
    # ceiling, R rows at most in all)
    R = math.ceil(B / K) * min(cfg.train_rollouts or N, N)
    if adaptive:
        R = min(R, step_budget(cfg))
    per_minibatch = math.ceil(R / cfg.n_minibatches)  # the rows of one AdamW step on this rank
    r = min(cfg.micro_batch, per_minibatch)
    per_layer = layer_activation_bytes(mc, c)
    # Each prompt runs once per micro-batch, and a micro-batch's rows are drawn from a permutation
    # of the step's rows: it can hold a row of every group this rank trains.
    g = min(r, math.ceil(B / K))
    tokens = r * T + g * P
    if cfg.grad_ckpt:
        # each layer's fp32 input + one layer replayed; the row cache (each row's prompt keys and
        # values, then its own: keys fp32, rotary's output under autocast, values in c bytes) lives
        # through the backward, which replays every layer with it
        acts = (L * tokens * 4 * H + tokens * per_layer
                + L * (r * (P + T) + g * P) * nkv * hd * (4 + c) + r * P * 2 * nh * hd * c)
    else:
        # + each row's copy of its prompt's keys and values, expanded to all heads (GQA), that
        # attention keeps for the backward
        acts = L * (tokens * per_layer + r * P * 2 * nh * hd * c)
    # embeddings, LM head, final norm
    root = V * H * (1 if getattr(mc, "tie_word_embeddings", False) else 2) + H
    # FSDP gathers parameters in the compute dtype (distributed.shard); a layer's full gradient is
    # in that dtype too, cast to fp32 for the reduction when it is bf16
    layer = (total - root) / L
    fsdp = ([("FSDP: gathered root and 2 layers, a layer's full gradient", c * root
              + (3 * c + 4 * (c == 2)) * layer)] * (K > 1))
    n_state = 2 + (lora > 0)  # weights, (adapter,) AdamW
    grads = 4 * trained
    name = f"gradients (fp32{shard})" if not lora else "gradients of the adapter"
    # Two moments that are never alive at once, and the peak is the larger: a micro-batch's
    # forward and backward, and AdamW's step after the mini-batch's last backward.
    micro = [(f"activations of one micro-batch ({r} rows{', grad_ckpt' if cfg.grad_ckpt else ''})",
              acts), ("attention mask (r, T, P + T)", r * T * (P + T) * (1 + c)),
             ("logits and their gradient"
              + ("" if logprobs.plain_logits(mc) else " (whole: not a plain head)"),
              logits_bytes(r * T, V, H, c, logprobs.plain_logits(mc)))]
    if per_minibatch > r:  # a mini-batch of several micro-batches: from its second, all gradients
        micro.insert(0, (name, grads))
    else:  # one micro-batch a mini-batch (zero_grad sets them to None before it): the backward
        # makes the gradients as it frees the activations, so only what they exceed those by counts
        micro.insert(0, (name + ": excess over activations",
                         max(grads - acts, 0)))
    # foreach AdamW takes the square root of every second moment at once
    step = [(name, grads), ("AdamW step's temporaries (foreach: sqrt of v)", 4 * (lora or total))]
    update = [*state[:n_state], *fsdp, *state[n_state:],
              ("step's (rows, T) tensors", R * T * (8 + 1 + 4 * (4 + (cfg.kl_coef > 0)))),
              *max(micro, step, key=lambda items: sum(b for _, b in items))]
    return {"rollout": rollout, "update": update}


def logits_bytes(rows: int, V: int, H: int, c: int, plain: bool = True) -> int:
    """The update's logits and their gradient. With kernels.linear_logprobs (brorl.py's path for a
    plain linear head) one chunk of positions at a time: the chunk's logits, the softmax or gradient
    made from them and an fp32 copy (~3 x LINEAR_CHUNK_BYTES). Without it, the whole (rows, V)
    logits of the response pass, their concatenation and their gradient in c bytes, and the
    reference's fp32 chunks (2^22 elements). Either way the (V, H) gradients of the LM head and the
    embedding before they are accumulated (under autocast the head's is bf16, then cast to fp32).
    plain: the config puts nothing after hidden @ W.T (logprobs.plain_head), on one process or K
    (the log-prob pass runs inside the sharded model's forward: distributed.in_forward)."""
    heads = V * H * (4 + 4 + (2 if c == 2 else 0))
    chunk_bytes = getattr(kernels, "LINEAR_CHUNK_BYTES", None)
    if chunk_bytes is not None and plain:
        return 3 * min(rows * V * 4, chunk_bytes) + heads
    return rows * V * 3 * c + 4 * 4 * min(rows * V, 2**22) + heads


def _compute_bytes(cfg) -> int:
    device = "cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"
    dtype = cfg.dtype if cfg.dtype != "auto" else distributed.device_default_dtype(device)
    return 2 if dtype == "bfloat16" else 4


def peaks(table: dict) -> dict:
    return {phase: sum(b for _, b in items) for phase, items in table.items()}


def fit(mc, cfg, prompt_tokens: int, memory_bytes: float, world_size: int = 1):
    """(max_rows, micro_batch): the largest not above cfg's that fit memory_bytes (one rank's) in
    both phases; or a string, one line naming what to lower, when even the smallest chunk does
    not fit."""
    import dataclasses
    plan_k = lambda c: plan(mc, c, prompt_tokens, world_size)
    over = lambda c, phase: peaks(plan_k(c))[phase] > memory_bytes
    # Small sizes in MB, never "0.0 GB".
    gib = lambda x: f"{x / GB:.1f} GB" if x >= 0.1 * GB else f"{x / 2 ** 20:.1f} MB"
    rows = fit_rows(mc, cfg, prompt_tokens, memory_bytes, world_size)
    if rows is None:
        one = peaks(plan_k(dataclasses.replace(cfg, max_rows=1)))["rollout"]
        return (f"--memory_gb {memory_bytes / GB:g}: even the smallest rollout chunk "
                f"({MIN_ROWS} rows decoding) needs {gib(one)} "
                f"(lower --max_new_tokens or --eval_samples, or use a smaller --model)")
    mb = cfg.micro_batch
    while mb > 1 and over(dataclasses.replace(cfg, max_rows=rows, micro_batch=mb), "update"):
        mb = mb // 2 if mb & (mb - 1) == 0 else 2 ** int(math.log2(mb))
    if over(dataclasses.replace(cfg, max_rows=rows, micro_batch=mb), "update"):
        need = peaks(plan_k(dataclasses.replace(cfg, micro_batch=1)))["update"]
        hint = "--grad_ckpt 1, " if not cfg.grad_ckpt else ""
        return (f"--memory_gb {memory_bytes / GB:g}: the update of one row needs {gib(need)} "
                f"(try {hint}a lower --max_new_tokens, --kl_coef 0, or a smaller --model)")
    return rows, mb


def fit_rows(mc, cfg, prompt_tokens: int, memory_bytes: float, world_size: int = 1):
    """The largest max_rows not above cfg's whose rollout fits memory_bytes, or None: whole groups
    (multiples of N, adaptive: of its ceiling) down to one group, then powers of two below N, and of
    those below MIN_ROWS only the largest (the sampler decodes MIN_ROWS rows in any chunk)."""
    N = most_rollouts(cfg)
    powers = (2**j for j in range(int(math.log2(min(N, cfg.max_rows))) + 1))
    options = sorted({*(k * N for k in range(1, cfg.max_rows // N + 1)), *powers}, reverse=True)
    # Below MIN_ROWS the sampler decodes MIN_ROWS rows all the same: of the smaller options only the
    # largest is kept, which costs MIN_ROWS rows (less than the next larger option may).
    options = ([x for x in options if x >= MIN_ROWS]
               + [x for x in options if x < MIN_ROWS][:1])
    fits = lambda x: peaks(plan(mc, dataclasses.replace(cfg, max_rows=x), prompt_tokens,
                                world_size))["rollout"] <= memory_bytes
    return next((x for x in options if x <= cfg.max_rows and fits(x)), None)


def default_memory_bytes(device) -> float:
    """--memory_gb 0: the CUDA device's total memory less a margin; on a CPU, the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory * CUDA_MARGIN
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def format_plan(table: dict, memory_bytes: float | None = None) -> str:
    """The table every run prints before its first step (and --plan alone)."""
    lines = []
    for phase, items in table.items():
        total = sum(b for _, b in items)
        lines.append(f"{phase} peak (estimate): {total / GB:8.2f} GB"
                     + (f" of {memory_bytes / GB:.1f} GB" if memory_bytes else ""))
        lines += [f"    {name:<48s} {b / GB:8.3f} GB" for name, b in items]
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Time per step on one GPU: a roofline estimate, not a measurement

# dense bf16 peak, HBM3 bandwidth
H100 = dict(name="one H100 80GB SXM", flops=989e12, bytes_s=3.35e12)
MFU = 0.4  # fraction of the peak that eager bf16 matmuls reach (assumed)
OP_S = 5e-6  # seconds per eager kernel launch on the decode path (assumed)
# eager ops per decoder layer per decode step (cascade attention, rotary, norms, MLP)
OPS_PER_LAYER = 60


def step_seconds(mc, cfg, prompt_tokens: int, gpu=H100, keep: float = 0.5,
                 world_size: int = 1) -> dict:
    """Rough seconds per step on `world_size` GPUs, each doing 1/K of the work (no communication
    counted): every response at full length, `keep` of the groups surviving
    dynamic sampling. A decode step costs its matmul FLOPs or its bytes (bf16 weights, the KV cache
    read, the (rows, V) sampling buffers), whichever is slower, plus its kernel launches; the update
    costs 2 FLOPs per Linear weight per token for each forward (old log-probs, policy, the
    replay under --grad_ckpt, the reference) and 4 for the backward."""
    H, I, L, V, nh, nkv, hd = _shape(mc)
    _, linear = param_counts(mc)
    B, N, T, P = cfg.prompts_per_step, cfg.n_rollouts, cfg.max_new_tokens, prompt_tokens
    rows = rollout_rows(cfg, N, 4 * B)
    chunks = math.ceil(B / keep * N / rows)
    flop_s = gpu["flops"] * MFU
    bytes_step = (2 * linear + rows * (P + T / 2) * L * nkv * hd * 4
                  + rows * V * sampling_bytes_per_row(1, 2, 1.0))
    per_token = max(2 * linear * rows / flop_s,
                    bytes_step / gpu["bytes_s"]) + (L * OPS_PER_LAYER + 50) * OP_S
    rollout = chunks * T * per_token / world_size
    forwards = 1 + (cfg.old_logp != "sampler") + cfg.grad_ckpt + (cfg.kl_coef > 0)
    m = cfg.train_rollouts or N  # rows trained per group
    update = B * m * (P / m + T) * 2 * linear * (forwards + 2) / flop_s / world_size
    return {"rollout": rollout, "update": update, "step": rollout + update}
