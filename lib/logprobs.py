"""
logprobs.py: the update's log-probs of its batch (lib/step.Batch). response_logprobs runs each
prompt once and its N rows against that one prompt's keys and values (as the sampler does), the
output layer skipped where logits = hidden @ W.T (plain_head: kernels.linear_logprobs never holds
the logits); a KV cache that stays right when activation checkpointing replays a layer
(ReplayCache); and, before an update, the old policy's and the KL reference's log-probs
(old_logprobs, reference_logprobs).
"""

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kernels import linear_logprobs, token_logprobs
from lib import distributed
from lib.lora import as_reference
from lib.policy import autocast, compute_dtype
from lib.step import Batch
from sampler import cache_kwarg


# Config fields with which a transformers model changes its logits after the output layer
# (logits = f(hidden @ W.T)): soft-capping (Gemma 2/3), a scale (Cohere), a divisor (Granite), a
# multiplier (Falcon-H1). Such a model's log-probs are taken from its full logits instead.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                    "lm_head_multiplier")


def plain_head(model):
    """The output embedding's weight (V, H) when logits = hidden @ weight.T exactly (a bias-free
    linear head, no transform in the config), so log-probs can skip the logits; else None. Sharded
    (K > 1), the weight is whole only inside the root's forward (distributed.in_forward): call it
    there."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or not plain_logits(model.config):
        return None
    return head.weight


def plain_logits(model_config) -> bool:
    """Whether the config applies nothing to hidden @ W.T (the planner's test of the path that
    runs)."""
    return not [k for k in LOGIT_TRANSFORMS if getattr(model_config, k, None) not in (None, 1, 1.0)]


class ReplayCache(DynamicCache):
    """The update's KV cache, safe under --grad_ckpt: activation checkpointing replays each decoder
    layer's forward in the backward, and a DynamicCache would append that layer's keys a second
    time (a (.., P+2T, D) cache: wrong shapes). Here update() appends to what the layer held when
    the cache was made (`prefix`: per layer (k, v), or nothing), however often a layer runs."""

    def __init__(self, prefix=()):
        # No config: every layer keeps all its keys, sliding-window layers too; the masks built
        # here index the whole prefix and sampler.attend applies the window.
        super().__init__()
        for i, (k, v) in enumerate(prefix):
            super().update(k, v, i)
        self.base = [k.shape[-2] for k, _ in prefix]  # per layer: the prefix's length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # a replay, or the prefix
        if layer_idx < len(self.layers) and self.layers[layer_idx].is_initialized:
            n = self.base[layer_idx] if layer_idx < len(self.base) else 0
            layer = self.layers[layer_idx]
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def response_logprobs(model, batch: Batch, rows, temperature, with_entropy=False):
    """Log-probs (r, T) of the response tokens of batch rows `rows`, through the one log-prob
    kernel. Like the sampler, each prompt is run once (not once per row) and no logits are made
    at prompt positions: the responses attend to their prompt's keys/values, gathered per row,
    so the gradient of all N rows flows back into the one prompt pass. With a plain linear head
    the decoder's hidden states go to kernels.linear_logprobs, which never holds the (r, T, V)
    logits; any other head (plain_head) gives logits, then kernels.token_logprobs."""
    if len(rows) == 0:  # K > 1: this rank holds none of these rows
        return idle_logprobs(model, batch, temperature, with_entropy)
    run = lambda: logprobs_pass(model, batch, rows, temperature, with_entropy)
    # K > 1: the whole pass is one forward of the sharded model (distributed.in_forward), so that
    # FSDP gathers the root's parameters (embeddings, final norm, head) for all of it, head included
    return distributed.in_forward(model, run) if distributed.world_size() > 1 else run()


def idle_logprobs(model, batch: Batch, temperature, with_entropy):
    """The (0, T) log-probs of a rank that holds none of a micro-batch's rows (K > 1), computed
    from one empty row (a 1-token prompt, 2 padding response tokens), which makes the same calls
    to the model as any micro-batch: every rank joins each of FSDP's collectives. The result is in
    the graph, so that the backward joins too."""
    dev = batch.resp.device
    idle = Batch(prompt=torch.zeros(1, 1, dtype=torch.long, device=dev),
                 prompt_mask=torch.ones(1, 1, dtype=torch.bool, device=dev),
                 resp=torch.zeros(1, 2, dtype=torch.long, device=dev),
                 resp_mask=torch.zeros(1, 2, dtype=torch.bool, device=dev),
                 group=torch.zeros(1, dtype=torch.long, device=dev))
    logp = response_logprobs(model, idle, torch.zeros(1, dtype=torch.long, device=dev),
                             temperature)  # (1, 2)
    out = batch.sampler_logp[:0] + 0.0 * logp.sum()  # (0, T)
    return (out, out) if with_entropy else out


def logprobs_pass(model, batch, rows, temperature, with_entropy):
    """response_logprobs' forward: the prompts once, then the responses against their prompt's
    keys."""
    head = plain_head(model)
    net = model.get_decoder() if head is not None else model  # hidden states, or logits
    states = lambda out: out.last_hidden_state if head is not None else out.logits
    keep_last = {} if head is not None else dict(logits_to_keep=1)  # no (g, P, V) prompt logits
    groups, row_group = batch.group[rows].unique(return_inverse=True)  # (g,), (r,)
    pm = batch.prompt_mask[groups]  # (g, P)
    resp, mask = batch.resp[rows], batch.resp_mask[rows]  # (r, T)
    # trim trailing padding, keep 2
    T = max(int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1, 2)
    # 1. each prompt once; its last position predicts response token 0. Prompts are left-padded: a
    # padding position attends to itself (its output is never used), as a row with no key at all
    # gives NaN in some CUDA attention kernels
    g, P = pm.shape
    eye = torch.eye(P, dtype=torch.bool, device=pm.device)  # (P, P)
    # (g, P, P): causal over real keys, + itself
    prompt_attn = eye.new_ones(P, P).tril() & pm[:, None, :] | eye
    cache = ReplayCache()
    first = states(net(batch.prompt[groups], attention_mask=prompt_attn[:, None],
                       position_ids=(pm.long().cumsum(1) - 1).clamp(min=0),
                       **keep_last, **{cache_kwarg(net): cache}))[:, -1:]  # (g, 1, H) or (g, 1, V)
    # index_select, not x[row_group]: its backward (index_add_) is deterministic on a CPU, while
    # indexing's (index_put_ with accumulate) adds the N rows' gradients in a racy order
    x = first.index_select(0, row_group)  # (r, 1, H or V)
    # 2. response tokens 0..T-2 predict tokens 1..T-1 (T >= 2: always two calls to the model, as
    # FSDP needs the same calls on every rank; a 1-token batch has a padding column, pack_groups)
    row_cache = ReplayCache([(layer.keys.index_select(0, row_group),
                              layer.values.index_select(0, row_group))
                             # per layer (g, Hkv, P, D) -> (r, Hkv, P, D)
                             for layer in cache.layers])
    r = len(rows)
    # (T-1, T-1): every row sees itself
    causal = torch.ones(T - 1, T - 1, dtype=torch.bool, device=pm.device).tril()
    # (r, T-1, P+T-1)
    attn = torch.cat([pm[row_group, None, :].expand(r, T - 1, P), causal.expand(r, -1, -1)], -1)
    pos = pm.sum(1)[row_group, None] + torch.arange(T - 1, device=pm.device)  # (r, T-1)
    rest = states(net(resp[:, : T - 1], attention_mask=attn[:, None], position_ids=pos,
                      **{cache_kwarg(net): row_cache}))  # (r, T-1, H or V)
    # (r, T, H or V): hidden states are small, logits only without a plain head
    x = torch.cat([x, rest], 1)
    targets = resp[:, :T].masked_fill(~mask[:, :T], -100)  # (r, T)
    if head is not None:
        out = linear_logprobs(x, head, targets, temperature, with_entropy=with_entropy)
    else:
        out = token_logprobs(x, targets, temperature, with_entropy=with_entropy)
    pad = lambda x: F.pad(x, (0, mask.shape[1] - T))  # back to the batch's T
    return tuple(pad(x) for x in out) if with_entropy else pad(out)


def uses_sampler_logp(cfg, model) -> bool:
    """--old_logp auto: the sampler's log-probs when the forward runs in float32 (fp32 weights, no
    autocast), where they equal a trainer forward's up to rounding (tested; logged as max|ratio-1|);
    a recompute in bf16, where the decode and the training forward round differently."""
    w = next(model.parameters())
    fp32 = w.dtype == torch.float32 and compute_dtype(cfg, w.device) == torch.float32
    return cfg.old_logp == "sampler" or (cfg.old_logp == "auto" and fp32)


def old_logprobs(model, batch: Batch, chunks, cfg, dev) -> tuple:
    """Before an update, over this rank's rows (chunks: its micro-batches on `dev`): the old
    policy's log-probs and entropies (r, T), the sampler's (uses_sampler_logp: the same weights, no
    update yet) or a trainer forward's (the paper's setup: sampler and trainer numerics differ)."""
    with torch.no_grad(), autocast(cfg, dev):
        if uses_sampler_logp(cfg, model):
            old_logp, ent = batch.sampler_logp, batch.sampler_entropy  # (r, T) each
        else:
            each = [response_logprobs(model, batch, rows, cfg.temperature, True) for rows in chunks]
            old_logp, ent = (torch.cat(x) for x in zip(*each))  # (r, T) each
    return old_logp, ent


def reference_logprobs(ref_model, batch: Batch, chunks, cfg, dev) -> torch.Tensor:
    """--kl_coef: the KL reference's log-probs (r, T) over this rank's rows (chunks, as
    old_logprobs'), before an update; with LoRA, of the policy with the reference's adapter."""
    with torch.no_grad(), autocast(cfg, dev), as_reference(ref_model) as ref:
        return torch.cat([response_logprobs(ref, batch, rows, cfg.temperature)
                          for rows in chunks])  # (r, T)

