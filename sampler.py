"""
sampler.py: brorl's rollout engine. N rollouts for each of B prompts, where each prompt is
prefilled ONCE and its N rollouts decode against that single copy of its keys and values.

Why: with N = 512 rollouts of one prompt, model.generate(num_return_sequences=N) prefills the
same prompt N times, stores its keys/values N times, and at every decode step reads them with N
matrix-vector products. Here a decode step of R <= B*N rows attends to
  (a) its prompt's P keys, the same for all N rows of a group: stored once (Hkv, B, P, D) and
      read with ONE batched matrix-matrix product per kv head, each prompt against its own rows
      and query heads;
  (b) its own t generated keys, (R, Hkv, t, D), read per row.
The scores of (a) and (b) go through one softmax, which is exact: the same as merging two
partial softmaxes by their log-sum-exps (the "cascade" trick of FlashInfer / Hydragen).
Rows that finish are dropped once an eighth of them has (SharedPrefixCache.keep), so a long
rollout does not keep the short ones' rows decoding padding, as generate() does.

Any Hugging Face decoder whose layers call transformers' attention interface works (Llama,
Mistral, Qwen2/3, Phi-3, OLMo 2, Gemma 2/3 are tested), sliding-window layers and soft-capped
scores included: importing this module registers the attention implementation "brorl" (the cascade
in decode steps, SDPA everywhere else); load models with
AutoModelForCausalLM.from_pretrained(..., attn_implementation="brorl").

    generate(model, tok, prompts, n, max_new, temperature, top_p, max_rows, seeds,
             system_prompt='') -> Rollouts

n is one int for every prompt, or a list of each prompt's n (--alloc adaptive): one call, chunks
of whole groups packed up to max_rows rows, each prompt's rows on the cache's (B, n_max) grid.

Each prompt's rollouts are drawn from its own seed: for every decode step, the prompt's
generator draws one uniform for each of its n rollouts, finished or not (DRAWS_AHEAD steps at a
time, whatever max_new is), so a rollout is a function of its prompt's seed and its place in the
group alone, not of how prompts were chunked (max_rows), which rows were dropped, or which
process drew them. So are its log-probs, to the bit on the x86_64 CPU it is tested on (one thread
or two): prompts are padded to a multiple of PAD_TO and a decode step runs at least MIN_ROWS rows,
so that no sum's order follows the chunk (below).
"""

import functools
import inspect
import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from kernels import token_logprobs

# A rollout's log-probs must not depend on which other rows share its decode steps. Two things in
# a decode step depend on the chunk: its prompts' padding, and how many rows it decodes. A softmax
# and a matrix product over padding sum in another order when the padding's length changes by
# less than a vector's width, so prompts are padded to a multiple of PAD_TO; and a matrix product
# of a handful of rows takes another path (the tested CPU: 1-3 rows on one thread, fewer than 12 on
# two, whose row split then changes), so a decode step never runs fewer than MIN_ROWS rows: a
# small chunk decodes filler rows beside its own, and finished rows stay on as filler instead of
# being dropped below MIN_ROWS.
PAD_TO = 16
MIN_ROWS = 16


def padded_len(tokens: int) -> int:
    """The prefix length a chunk whose longest prompt has `tokens` tokens is padded to: the next
    multiple of PAD_TO (the memory planner counts the same)."""
    return -(-tokens // PAD_TO) * PAD_TO


class SharedPrefixCache:
    """KV cache of B prompts x N rollouts. Acts as the model's cache (update() stores each new
    token's key/value per row) and, handed to the forward as shared_prefix=, tells
    cascade_attention where the shared prefixes are. Rows can be dropped as they finish (keep()).

    Rows are kept sorted by prompt, n rows a prompt (one int, or each prompt's). For the prefix they
    are laid out on a grid (B, n_max): prompt b's live rows in its n_max slots, empty slots zero,
    so that ONE batched matmul per kv head reads each prompt's keys for exactly its own rows.
    slot[i] is row i's place on the grid (None while the grid is full and in order: equal n,
    before any drop)."""

    def __init__(self, prefix_kv, prefix_len, n, dtype=None):
        B, Hkv, P, D = prefix_kv[0][0].shape
        # Keys and values are stored in the compute dtype (dtype, by default the values'). Under
        # autocast, rotary's fp32 cos/sin promote the keys to fp32, and some transformers versions
        # (5.17) then store the prefill's values in the keys' dtype too, which would make the
        # cache twice the size of bf16 keys and values.
        dtype = dtype or prefix_kv[0][1].dtype
        # Per layer (Hkv, B, P, D): each prompt is stored once.
        self.prefix_kv = [(k.to(dtype).transpose(0, 1).contiguous(),
                           v.to(dtype).transpose(0, 1).contiguous())
                          for k, v in prefix_kv]
        self.B, self.P, self.prefix_len = B, P, prefix_len
        # (B, P) True on each prompt's own tokens, False on its padding (right-padded to P).
        self.real = torch.arange(P, device=prefix_len.device) < prefix_len[:, None]
        # n: rows per prompt, one int for all or one a prompt. (B,)
        counts = torch.as_tensor(n, device=prefix_len.device).expand(B)
        # (R,) the prompt of each row.
        self.row_group = torch.arange(B, device=prefix_len.device).repeat_interleave(counts)
        self.t = 0  # generated tokens stored so far
        R = len(self.row_group)
        # (R, Hkv, capacity, D) each, in the compute dtype.
        self.k = [v.new_empty(R, Hkv, 64, D) for _, v in self.prefix_kv]
        self.v = [v.new_empty(R, Hkv, 64, D) for _, v in self.prefix_kv]
        self._lay_out(counts)

    def _lay_out(self, counts):
        """Place the rows on the (B, n_max) grid, counts (B,) rows of each prompt: n_max = the most
        rows of one prompt, slot[i] = row i's place (None when the grid is full and in order), and
        each row's prefix mask."""
        self.n_max = int(counts.max())
        first = torch.cumsum(counts, 0) - counts  # (B,) index of each prompt's first row
        # (r,) each row's place among its prompt's rows.
        rank = torch.arange(len(self.row_group), device=counts.device) - first[self.row_group]
        self.slot = self.row_group * self.n_max + rank  # (r,) place on the (B, n_max) grid
        if len(self.row_group) == self.B * self.n_max:  # full grid, rows in order: the identity
            self.slot = None
        # (r, 1, 1, P): the keys of each row's own prompt, its padding hidden. The decode step's
        # attention mask.
        self.prefix_mask = self.real[self.row_group][:, None, None]

    def keep(self, rows):
        """Drop every row but `rows` (ascending indices into the current rows): finished rollouts
        stop costing. The survivors are packed onto a smaller grid: n_max = most rows left to a
        prompt. One layer at a time, each old layer freed as its copy is made: the transient is
        one layer's survivors, not a second copy of the whole cache."""
        for i in range(len(self.k)):
            self.k[i] = self.k[i][rows]  # (r, Hkv, capacity, D)
            self.v[i] = self.v[i][rows]
        self.row_group = self.row_group[rows]  # still sorted by prompt
        self._lay_out(torch.bincount(self.row_group, minlength=self.B))  # (B,) rows left a prompt

    def window(self, width: int) -> tuple:
        """The keys the current token sees in a sliding-window layer: those fewer than `width`
        positions back (transformers' rule). (r, 1, 1, P) over the prefix, and (t + 1,) over the
        rows' own tokens (one for all rows: row i's token t is at its prompt's length + t)."""
        pos = self.prefix_len[self.row_group] + self.t  # (r,) the current token's position
        near_prefix = torch.arange(self.P, device=pos.device) > (pos - width)[:, None]  # (r, P)
        near_own = torch.arange(self.t + 1, device=pos.device) > self.t - width  # (t + 1,)
        return near_prefix[:, None, None], near_own

    def to_grid(self, x):
        """(Hkv, r, ...) rows -> (Hkv, B*n_max, ...) grid, zeros in the empty slots."""
        if self.slot is None:
            return x
        return x.new_zeros(x.shape[0], self.B * self.n_max, *x.shape[2:]).index_copy_(
            1, self.slot, x)

    def from_grid(self, x):
        """(Hkv, B*n_max, ...) grid -> (Hkv, r, ...) rows."""
        return x if self.slot is None else x.index_select(1, self.slot)

    def update(self, k, v, layer_idx, *args, **kwargs):
        # k, v: (R, Hkv, 1, D), the current token of every row.
        if self.t == self.k[layer_idx].shape[2]:
            # The cache is full: double its capacity (amortised O(1) a token).
            self.k[layer_idx] = torch.cat([self.k[layer_idx], torch.empty_like(self.k[layer_idx])],
                                          2)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], torch.empty_like(self.v[layer_idx])],
                                          2)
        self.k[layer_idx][:, :, self.t] = k[:, :, 0]  # cast to the compute dtype on the way in
        self.v[layer_idx][:, :, self.t] = v[:, :, 0]
        return self.k[layer_idx][:, :, : self.t + 1], self.v[layer_idx][:, :, : self.t + 1]


# The attention "brorl" outside decode steps (the prompt's prefill, the update's passes,
# lib/logprobs.py), for every model family it serves (lib/attention.unsupported says which it
# cannot).
# transformers hands each layer's attention function the layer's own settings as keyword arguments:
# `sliding_window` in a sliding-window layer (Mistral, Phi-3, Gemma 2/3, Qwen with
# use_sliding_window), `softcap` where the scores are soft-capped (Gemma 2's
# attn_logit_softcapping). Both are applied here, whatever mask the call brings: transformers' own
# masks (the prefill) carry the window already, the update's carry none, and applying the window
# twice changes nothing. Without either, the call is transformers' SDPA unchanged. Decode steps are
# cascade_attention (below), which applies the same two settings to its shared-prefix scores.


def visible_keys(q_len: int, kv_len: int, window, device) -> torch.Tensor:
    """(q_len, kv_len) bool: the keys each query may see when the queries are the last q_len of the
    kv_len positions (a prompt alone, or responses after their prompt's keys): those at or before
    it and, with a sliding window, fewer than `window` positions before it (transformers' rule,
    kv > q - window). Indices stand for positions: left-padding shifts a row's real keys and its
    queries alike, so their distances are kept."""
    q = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]  # (q_len, 1)
    k = torch.arange(kv_len, device=device)  # (kv_len,)
    return (k <= q) & (k > q - window) if window else k <= q


def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
           sliding_window=None, softcap=None, **kwargs):
    """Attention outside decode steps: query (b, H, q, D), key/value (b, Hkv, k, D), attention_mask
    (b, 1, q, >= k) bool or None (causal). Returns (b, q, H, D) and None, as transformers wants."""
    kv_len = key.shape[-2]
    if sliding_window and kv_len > sliding_window:  # some key lies a window or more back
        # (1, 1, q, k)
        near = visible_keys(query.shape[-2], kv_len, sliding_window, query.device)[None, None]
        attention_mask = near if attention_mask is None else attention_mask[..., :kv_len] & near
    if softcap:
        return softcapped_attention(module, query, key, value, attention_mask, scaling, dropout,
                                    softcap)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                  dropout=dropout, **kwargs)


def softcapped_attention(module, query, key, value, attention_mask, scaling, dropout, softcap):
    """Gemma 2's attention in plain torch, as its eager attention: the scores soft-capped,
    softcap * tanh(s / softcap), then masked, then a float32 softmax (SDPA has no soft-cap). A key
    is hidden by the dtype's least value, not -inf, so that a query with no visible key (a padding
    row) gives no NaN."""
    G = query.shape[1] // key.shape[1]  # G query heads share one kv head (GQA)
    key, value = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)  # (b, H, k, D) each
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    s = torch.matmul(query, key.transpose(-1, -2)) * scale  # (b, H, q, k)
    s = softcap * torch.tanh(s / softcap)
    if attention_mask is None:  # transformers' plain causal mask, left to SDPA's is_causal
        attention_mask = visible_keys(query.shape[-2], key.shape[-2], None, query.device)
    s = s.masked_fill(~attention_mask[..., : key.shape[-2]], torch.finfo(s.dtype).min)
    p = torch.softmax(s.float(), -1).to(query.dtype)  # (b, H, q, k)
    p = torch.nn.functional.dropout(p, dropout, training=module.training)
    return torch.matmul(p, value).transpose(1, 2).contiguous(), None  # (b, q, H, D)


def cascade_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      shared_prefix=None, sliding_window=None, softcap=None, **kwargs):
    """Registered as the attention implementation "brorl". Decode steps (shared_prefix is a
    SharedPrefixCache, attention_mask its prefix_mask) use the shared prefixes; everything else is
    attend (SDPA). The layer's sliding_window and softcap apply in both."""
    cache = shared_prefix
    if cache is None:
        return attend(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    # (Hkv, B, P, D): each prompt of the chunk, stored once.
    pk, pv = cache.prefix_kv[module.layer_idx]
    Hkv, B, P, D = pk.shape
    R, H = query.shape[:2]  # query (R, H, 1, D), R rows still decoding
    G = H // Hkv  # G query heads share one kv head (GQA)
    # (R, Hkv, G, D): the query is scaled once, in the cache's dtype (rotary made it fp32).
    q = (query * scaling).to(pk.dtype).view(R, Hkv, G, D)
    # (a) The prefixes: per kv head, ONE batched matmul over the B prompts, each prompt's P keys
    # against its own rows x G heads (rows on the (B, n_max) grid).
    q_grid = cache.to_grid(q.transpose(0, 1)).reshape(Hkv, B, -1, D)  # (Hkv, B, n_max*G, D)
    s_a = torch.matmul(q_grid, pk.transpose(-1, -2)).float()  # (Hkv, B, n_max*G, P)
    s_a = cache.from_grid(s_a.view(Hkv, -1, G, P)).transpose(0, 1)  # (R, Hkv, G, P)
    # (b) Each row's own generated tokens, key/value (R, Hkv, t, D).
    s_b = torch.matmul(q, key.transpose(-1, -2)).float()  # (R, Hkv, G, t)
    if softcap:  # Gemma 2 squashes each score into (-softcap, softcap), before the mask
        s_a, s_b = softcap * torch.tanh(s_a / softcap), softcap * torch.tanh(s_b / softcap)
    # Hidden: each prompt's padding (attention_mask, (R, 1, 1, P)) and, in a sliding-window layer,
    # every key `sliding_window` or more positions back, of the prompt or of the row's own.
    if sliding_window:
        near_prefix, near_own = cache.window(sliding_window)  # (R, 1, 1, P), (t,)
        attention_mask = attention_mask & near_prefix
        s_b = s_b.masked_fill(~near_own, -math.inf)
    s_a = s_a.masked_fill(~attention_mask, -math.inf)
    # One softmax over both parts is exact: the same as merging two partial softmaxes by their
    # lse.
    p = torch.softmax(torch.cat([s_a, s_b], -1), -1).to(value.dtype)  # (R, Hkv, G, P + t)
    # (Hkv, B, n_max*G, P)
    p_grid = cache.to_grid(p[..., :P].transpose(0, 1)).reshape(Hkv, B, -1, P)
    # (R, Hkv, G, D)
    out_a = cache.from_grid(torch.matmul(p_grid, pv).view(Hkv, -1, G, D)).transpose(0, 1)
    out = out_a + torch.matmul(p[..., P:], value)  # (R, Hkv, G, D)
    return out.reshape(R, 1, H, D), None  # HF wants (batch, q_len, heads, head_dim)


# Every model is loaded with attn_implementation="brorl": the cascade in decode steps, attend
# (SDPA) everywhere else.
AttentionInterface.register("brorl", cascade_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("brorl", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def cache_kwarg(model) -> str:
    """transformers renamed past_key_values= to cache= (5.2x); accept both."""
    return _cache_kwarg(type(model))


@functools.lru_cache
def _cache_kwarg(cls) -> str:
    # Inspecting a signature costs ~10 ms, so it is done once per model class.
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


@dataclass
class Rollouts:
    prompt_ids: list  # B lists of prompt token ids
    tokens: torch.Tensor  # (B*N, T) response tokens, pad after EOS; on the CPU (as every field)
    mask: torch.Tensor  # (B*N, T) bool, True on response tokens (EOS included)
    logp: torch.Tensor  # (B*N, T) the sampler's log-probs of its tokens (0 on padding)
    # (B*N, T) the entropy of the tempered next-token distribution (0 on padding).
    entropy: torch.Tensor
    truncated: torch.Tensor  # (B*N,) bool: hit max_new without EOS
    texts: list  # B*N decoded responses, EOS stripped
    n: int | list  # rollouts per prompt: one int for all, or a list of each prompt's (B*N: their
                   # sum; a prompt's rows follow the previous prompt's)

    def group(self, g: int, keep=None) -> "Rollouts":
        """Prompt g's rollouts (those in keep, indices among its n; default all) as a Rollouts of
        their own, copied: a view would hold (and, sent to another process, carry) the whole
        batch's storage."""
        if isinstance(self.n, int):
            first, n = g * self.n, self.n
        else:
            first, n = sum(self.n[:g]), self.n[g]
        # (n',) the group's rows in the batch.
        rows = first + (torch.arange(n) if keep is None else torch.as_tensor(keep))
        return Rollouts([self.prompt_ids[g]], self.tokens[rows], self.mask[rows],
                        self.logp[rows], self.entropy[rows], self.truncated[rows],
                        [self.texts[i] for i in rows.tolist()], len(rows))


# The two-level draw's block: pick_tokens picks one of ceil(V / DRAW_BLOCK) blocks of the
# vocabulary, then a token within it. Why 1024 columns: a block's float32 sum is off by well under
# 1e-6 of its own mass, the second level's float64 CDF is (R, 1024) per token, a 150th of Qwen's
# 152k vocabulary; and a vocabulary of at most one block (the byte-level 258) is drawn in one
# level, with no block bookkeeping.
DRAW_BLOCK = 1024
# Each prompt's generator draws the uniforms of this many decode steps at once: one call per
# prompt every 32 tokens, not every token (with B prompts a chunk, that would be B small kernel
# launches a token on a GPU). On a CPU the numbers are those of one draw a step (the generator's
# stream is consumed in the same order).
DRAWS_AHEAD = 32


def sampling_probs(logits, temperature: float, top_p: float):
    """The distribution (R, V) float32 that pick_tokens draws from (unnormalised after a nucleus
    cut)."""
    # (R, V)
    probs = torch.softmax(logits.float() / temperature if temperature != 1 else logits.float(), -1)
    if top_p < 1.0:
        # Nucleus: keep the smallest prefix of sorted tokens whose mass reaches top_p. A token is
        # dropped when the mass before it already reaches top_p.
        sorted_p, idx = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(drop, 0.0))
    return probs


def block_cdf(probs):
    """(R, ceil(V / DRAW_BLOCK)) float64: the cumulative mass of the vocabulary's blocks, each
    block's mass a float32 sum (a float64 one costs 25x more on a CPU), the running sum across
    blocks float64."""
    V = probs.shape[1]
    full = V - V % DRAW_BLOCK  # columns in whole blocks
    # (R, V // DRAW_BLOCK) the whole blocks' masses.
    masses = [probs[:, :full].unflatten(1, (-1, DRAW_BLOCK)).sum(-1)] if full else []
    if full < V:
        masses.append(probs[:, full:].sum(-1, keepdim=True))  # (R, 1) the last, partial block
    return torch.cat(masses, 1).cumsum(-1, dtype=torch.float64)  # (R, nb)


def sampling_cdf(logits, temperature: float, top_p: float):
    """The whole CDF (R, V) float64 that pick_tokens draws from, though it never builds it (for
    tests): in block j, token v's interval is block j's share of [0, total), split in proportion
    to the float64 CDF of the block's probabilities (one block: that CDF). Its widths are the
    probabilities to a relative ~1e-7 (the float32 block sums), never an absolute step: a float32
    CDF moves in steps of 6e-8 near 1, and over a 152k vocabulary most of a peaked distribution's
    tail then got an interval of 0 or of one step."""
    probs = sampling_probs(logits, temperature, top_p)  # (R, V)
    R, V = probs.shape
    if V <= DRAW_BLOCK:
        return probs.cumsum(-1, dtype=torch.float64)  # (R, V)
    cdf = block_cdf(probs)  # (R, nb)
    start = F.pad(cdf, (1, 0))[:, :-1]  # (R, nb) mass before each block
    # (R, nb, DRAW_BLOCK) the float64 CDF within each block.
    inner = F.pad(probs, (0, cdf.shape[1] * DRAW_BLOCK - V)).view(R, -1, DRAW_BLOCK).cumsum(
        -1, dtype=torch.float64)
    # (R, nb, DRAW_BLOCK) each token's share of its block; 0 in empty blocks.
    share = inner / inner[..., -1:].clamp(min=torch.finfo(torch.float64).tiny)
    return (start[..., None] + (cdf - start)[..., None] * share).flatten(1)[:, :V]  # (R, V)


def search_cdf(cdf, x):
    """(R, 1): in each row of cdf (R, C) float64, the first column above x (R, 1) >= 0, x first
    capped just below the row's total (x = u * total can round up to it): never past the last
    column with mass, never on a column without (its cdf equals the one before)."""
    total = cdf[:, -1:]  # (R, 1)
    return torch.searchsorted(
        cdf, torch.minimum(x, torch.nextafter(total, torch.zeros_like(total))), right=True)


def pick_tokens(logits, temperature: float, top_p: float, u):
    """One token per row of logits (R, V), drawn by inverse CDF (sampling_cdf's) with the row's
    uniform u (R,) float64 in [0, 1), in two levels: the block, from the blocks' cumulative
    masses; then the token, from the float64 CDF of that block alone, the offset into the block
    rescaled to it. Greedy when temperature == 0 (u unused). One uniform a row, made by the
    caller, so a row's draw depends on nothing else."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = sampling_probs(logits, temperature, top_p)  # (R, V)
    V = probs.shape[1]
    if V <= DRAW_BLOCK:  # one block
        cdf = probs.cumsum(-1, dtype=torch.float64)  # (R, V)
        return search_cdf(cdf, u[:, None] * cdf[:, -1:]).squeeze(-1)  # (R,)
    cdf = block_cdf(probs)  # (R, nb)
    x = u[:, None] * cdf[:, -1:]  # (R, 1) float64
    j = search_cdf(cdf, x)  # (R, 1) the block: cdf[j - 1] <= x < cdf[j], so its mass > 0
    # (R, 1) the mass before block j.
    start = torch.where(j > 0, cdf.gather(1, (j - 1).clamp(min=0)), 0.0)
    # (R, DRAW_BLOCK) block j's columns.
    cols = j * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)
    # (R, DRAW_BLOCK) the float64 CDF of block j alone.
    inner = probs.gather(1, cols.clamp(max=V - 1)).masked_fill(cols >= V, 0.0).cumsum(
        -1, dtype=torch.float64)
    # (R, 1) the offset into block j, rescaled to its own CDF.
    y = (x - start) / (cdf.gather(1, j) - start) * inner[:, -1:]
    return (j * DRAW_BLOCK + search_cdf(inner, y)).squeeze(-1)  # (R,)


def prefill(model, prompt_ids) -> tuple:
    """Each prompt run once, alone (no padding inside it): per layer its keys and values (B, Hkv,
    P, D), right-padded to the longest prompt P; the logits of each prompt's last token (B, V);
    the prompts' lengths (B,); and the compute dtype (autocast's when it is on, what the layers'
    values come out in; else the weights')."""
    dev, cache_kw = model.device, cache_kwarg(model)
    per_layer, first_logits = None, []
    for ids in prompt_ids:
        # No config: every layer keeps all its keys, sliding-window layers too (transformers'
        # cache for the config would keep a window's worth); the decode steps apply the window.
        cache = DynamicCache()
        out = model(torch.tensor([ids], device=dev), **{cache_kw: cache}, logits_to_keep=1)
        first_logits.append(out.logits[0, -1])  # (V,)
        # Per layer (1, Hkv, P_b, D).
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        per_layer = ([[x] for x in kv] if per_layer is None
                     else [p + [x] for p, x in zip(per_layer, kv)])
    P = padded_len(max(len(ids) for ids in prompt_ids))
    pad_to = lambda x: F.pad(x, (0, 0, 0, P - x.shape[2]))  # right-pad the sequence dim to P
    # Per layer (B, Hkv, P, D).
    prefix_kv = [(torch.cat([pad_to(k) for k, _ in layer]),
                  torch.cat([pad_to(v) for _, v in layer]))
                 for layer in per_layer]
    prompt_len = torch.tensor([len(ids) for ids in prompt_ids], device=dev)  # (B,)
    dtype = (torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type)
             else model.dtype)
    return prefix_kv, torch.stack(first_logits), prompt_len, dtype  # ..., (B, V), (B,), dtype


@torch.no_grad()
def generate_group_chunk(model, prompt_ids, seeds, parts, max_new, temperature, top_p, eos_id,
                         pad_id):
    """The rollouts of a chunk of prompts, each prompt's drawn from its own seed: parts[b] =
    (n_b, lo, hi) gives prompt b's rollouts lo..hi-1 of its n_b. Returns (tokens, mask, logp,
    entropy, truncated), the first four (R, T), the last (R,), R = the sum of hi - lo, rows sorted
    by prompt."""
    dev, cache_kw = model.device, cache_kwarg(model)
    gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
    counts = torch.tensor([hi - lo for _, lo, hi in parts], device=dev)  # (B,) rows per prompt
    # Filler rows, finished from the start, so that a step decodes >= MIN_ROWS rows; they join
    # the last prompt's rows and are cut from the outputs.
    fill = max(MIN_ROWS - sum(hi - lo for _, lo, hi in parts), 0)
    counts[-1] += fill

    def uniforms():
        # (DRAWS_AHEAD, R): each prompt draws for all n_b of its rollouts, and this chunk keeps
        # its own part's.
        return torch.cat([torch.rand(DRAWS_AHEAD, n_b, generator=g, device=dev,
                                     dtype=torch.float64)[:, lo:hi]
                          for g, (n_b, lo, hi) in zip(gens, parts)]
                         + [torch.zeros(DRAWS_AHEAD, fill, device=dev, dtype=torch.float64)], 1)

    prefix_kv, first_logits, prompt_len, dtype = prefill(model, prompt_ids)
    cache = SharedPrefixCache(prefix_kv, prompt_len, counts, dtype)

    # eos_id may be one id or several. R rows decode, the fill last among them, and leave at the
    # end.
    R, eos_ids = int(counts.sum()), torch.as_tensor(eos_id, device=dev)
    tokens = torch.full((R, max_new), pad_id, dtype=torch.long, device=dev)  # (R, T) outputs
    # (R, T) each.
    logp, entropy = torch.zeros(R, max_new, device=dev), torch.zeros(R, max_new, device=dev)
    mask = torch.zeros(R, max_new, dtype=torch.bool, device=dev)  # (R, T)
    # The rows still decoding, r <= R of them: their output row, position offset and state.
    rows = torch.arange(R, device=dev)  # (r,) indices into the outputs
    # (r, 1) the position of each row's first new token.
    row_start = prompt_len.repeat_interleave(counts)[:, None]
    logits = first_logits.repeat_interleave(counts, 0)  # (r, V): its prompt's next-token logits
    done = torch.arange(R, device=dev) >= R - fill  # (r,) finished, not yet dropped: the filler
    for t in range(max_new):
        if temperature and t % DRAWS_AHEAD == 0:
            u_ahead = uniforms()  # (DRAWS_AHEAD, R)
        # (r,) the rows still decoding take their uniforms.
        u = u_ahead[t % DRAWS_AHEAD, rows] if temperature else None
        tok = pick_tokens(logits, temperature, top_p, u)  # (r,)
        tok = torch.where(done, pad_id, tok)
        tokens[rows, t], mask[rows, t] = tok, ~done
        # The drawn token's log-prob and the distribution's entropy (0 where done) go through the
        # trainer's kernel at the trainer's temperature; greedy decoding (T = 0) records them at
        # T = 1. The targets are our own draws, in range, so there is no check, whose host sync
        # would stall every token.
        logp[rows, t], entropy[rows, t] = token_logprobs(logits, tok.masked_fill(done, -100),
                                                         temperature or 1.0,
                                                         with_entropy=True, validate=False)
        done = done | torch.isin(tok, eos_ids)
        n_done = int(done.sum())  # the decode loop's one host sync per token
        if n_done == len(done) or t == max_new - 1:
            break
        if len(done) > MIN_ROWS and 8 * n_done >= len(done):
            # An eighth of the rows has finished: drop them (each drop copies the own KV), but
            # keep MIN_ROWS rows, the first finished ones as filler. A stable sort puts the rows
            # still decoding first, each group in order: no host sync beyond n_done.
            keep = max(len(done) - n_done, MIN_ROWS)
            live = torch.sort(torch.argsort(done.byte(), stable=True)[:keep])[0]  # (r',)
            rows, row_start, tok, done = rows[live], row_start[live], tok[live], done[live]
            cache.keep(live)
        # The step's mask is each row's prompt keys, (r, 1, 1, P): a 4D mask, which every family's
        # forward hands to its attention as it is. The cache reaches cascade_attention as
        # shared_prefix=: a forward passes its extra keyword arguments down to the attention.
        out = model(tok[:, None], position_ids=row_start + t, attention_mask=cache.prefix_mask,
                    shared_prefix=cache, **{cache_kw: cache})
        cache.t += 1
        logits = out.logits[:, -1]  # (r, V)
    truncated = torch.zeros(R, dtype=torch.bool, device=dev)  # (R,) dropped rows had finished
    truncated[rows] = ~done
    return tuple(x[: R - fill] for x in (tokens, mask, logp, entropy, truncated))


def generate(model, tok, prompts, n, max_new, temperature, top_p, max_rows, seeds,
             system_prompt="") -> Rollouts:
    """n rollouts for each prompt string (one int for all, or a list of each prompt's n), decoded in
    chunks of <= max_rows rows. seeds: one int per prompt (its rollouts' random stream), or a
    torch.Generator to draw them from."""
    prompt_ids = [encode_prompt(tok, p, system_prompt) for p in prompts]
    if isinstance(seeds, torch.Generator):
        seeds = draw_seeds(seeds, len(prompts))
    sizes = [n] * len(prompts) if isinstance(n, int) else list(n)
    # Chat models have several end-of-sequence ids.
    eos = {tok.eos_token_id, *listify(model.generation_config.eos_token_id)} - {None}
    # Each chunk's outputs leave the accelerator as soon as it is done: the device holds one
    # chunk.
    parts = [tuple(x.cpu() for x in generate_group_chunk(
                 model, [prompt_ids[b] for b in chunk], [seeds[b] for b in chunk],
                 [(sizes[b], lo, hi) for b, (lo, hi) in chunk.items()], max_new, temperature,
                 top_p, sorted(eos), tok.pad_token_id))
             for chunk in chunk_rows(sizes, max_rows)]
    tokens, mask, logp, entropy, truncated = (torch.cat(x) for x in zip(*parts))  # on the CPU
    # (B*N,) each row's real tokens: decode those, not T columns of padding.
    lengths = mask.sum(1).tolist()
    texts = tok.batch_decode([row[:k] for row, k in zip(tokens.tolist(), lengths)],
                             skip_special_tokens=True)
    return Rollouts(prompt_ids, tokens, mask, logp, entropy, truncated, texts, n)


def chunk_rows(sizes: list, max_rows: int) -> list:
    """The chunks the sampler decodes, in prompt order, each a dict {prompt: (lo, hi)} of the
    rollouts lo..hi-1 of its sizes[prompt] that it draws: whole groups while the next one fits in
    max_rows rows; a group of more than max_rows rows alone, split into parts of max_rows, each
    re-prefilling its prompt. With one n for all this is max_rows // n whole groups a chunk."""
    chunks, chunk, rows = [], {}, 0
    for b, n in enumerate(sizes):
        if chunk and (rows + n > max_rows or n > max_rows):
            chunks.append(chunk)
            chunk, rows = {}, 0
        if n > max_rows:
            chunks += [{b: (j, min(j + max_rows, n))} for j in range(0, n, max_rows)]
            continue
        chunk[b], rows = (0, n), rows + n
    return chunks + [chunk] * bool(chunk)


def round_seeds(seed: int, step: int, rnd: int, n: int) -> list:
    """One seed per prompt of a sampling round: rollouts are a function of (seed, step, prompt)
    only, never of the process that draws them nor of how many there are."""
    # A str seeds Random the same everywhere.
    stream = random.Random(f"rollouts/{seed}/{step}/{rnd}")
    return [stream.getrandbits(62) for _ in range(n)]


def draw_seeds(gen: torch.Generator, n: int) -> list:
    """n seeds for n prompts' rollouts, drawn from a generator."""
    return torch.randint(2 ** 62, (n,), generator=gen, device=gen.device).tolist()


def listify(x) -> list:
    return x if isinstance(x, list) else [x]


def encode_prompt(tok, prompt: str, system_prompt: str = "") -> list:
    """Token ids of a prompt. A tokenizer with a chat template gets it: the prompt as the user's
    message (after the system prompt, if one is given), then the assistant's turn opened; else the
    prompt's own tokens (a system prompt there is an error: there is no turn to put it in)."""
    if tok.chat_template:
        chat = [{"role": "system", "content": system_prompt}] if system_prompt else []
        chat.append({"role": "user", "content": prompt})
        return list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"])
    if system_prompt:
        raise ValueError("--system_prompt needs a tokenizer with a chat template")
    return tok(prompt, add_special_tokens=True)["input_ids"]
