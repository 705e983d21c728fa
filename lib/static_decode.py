"""
static_decode.py: the sampler's decode step written so that torch.compile traces it once (opt-in:
sampler.generate_group_chunk's eager loop is the reference; tools/bench.py measures both). The
eager step is bound by unfused elementwise work (RMSNorm, rotary, the gated MLP, the cache
writes), which a compiler fuses; gpt-fast's recipe is a step with static shapes, compiled once.

What makes one graph serve every step:
  - a static cache: each row's own keys and values in (R, Hkv, max_new, D) per layer, written at
    step t and read under the mask column <= t; t and the positions are tensors, not Python ints
    (a Python int is specialised: today's cache recompiles at every position);
  - static rows: the R = B x n rows of a chunk decode every step; a finished row decodes padding
    (the eager loop drops finished rows instead, which changes the shapes);
  - the prompts' shared prefix is read as in sampler.cascade_attention, each prompt's keys once
    against its own n rows x G query heads (one batched matmul per kv head), in one softmax with
    the row's own keys.
Prefill, the draws (pick_tokens) and the log-probs stay eager and are the sampler's own.

Supported: Qwen2/Llama-style decoders (RMSNorm, rotary, GQA attention with optional q/k/v biases,
SwiGLU MLP), full attention, default rotary. Equal to the eager loop to fp32 rounding (tested):
the same greedy tokens, log-probs within rounding.

    decode_chunk(model, prompt_ids, seeds, n, max_new, temperature, top_p, eos_id, pad_id,
                 compiled=True) -> (tokens, mask, logp, entropy, truncated), as
                 sampler.generate_group_chunk's for one chunk of n rollouts a prompt
"""

import math

import torch
import torch.nn.functional as F

from kernels import token_logprobs
import sampler

# Compiled steps by (model, R, B, P, max_new, dtype): one compile each, reused by every call.
_STEPS = {}


def rotate_half(x):
    """(..., D) -> (..., D): [-x2, x1], rotary's pairing of the two halves."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def decode_step(model, tok, pos, t, ks, vs, pks, pvs, pad_bias, n: int):
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
    if not all(hasattr(model.model.layers[0], a) for a in ("self_attn", "mlp", "input_layernorm")):
        raise ValueError(f"the compiled decode step covers Qwen2/Llama decoders, not "
                         f"{type(model).__name__}")


def compiled_step(model, key):
    """The decode step for one static shape key, compiled on first use (torch.compile, inductor;
    fullgraph: a graph break would be a silent slowdown)."""
    key = (id(model), *key)
    if key not in _STEPS:
        _STEPS[key] = torch.compile(decode_step, fullgraph=True, dynamic=False)
    return _STEPS[key]


@torch.no_grad()
def decode_chunk(model, prompt_ids, seeds, n, max_new, temperature, top_p, eos_id, pad_id,
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
    # Per layer (R, Hkv, T, D): each row's own keys and values, zero before they are written.
    ks = [torch.zeros(R, Hkv, T, D, dtype=dtype, device=dev) for _ in pks]
    vs = [torch.zeros(R, Hkv, T, D, dtype=dtype, device=dev) for _ in pks]
    step = compiled_step(model, (R, B, P, T, dtype)) if compiled else decode_step
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
