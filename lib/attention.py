"""
attention.py: the attention of every forward but a decode step (the prompt's prefill, the update's
passes), for every model family the attention "brorl" serves, and the families it cannot serve.

transformers hands each layer's attention function the layer's own settings as keyword arguments:
`sliding_window` in a sliding-window layer (Mistral, Phi-3, Gemma 2/3, Qwen with
use_sliding_window), `softcap` where the scores are soft-capped (Gemma 2's attn_logit_softcapping).
Both are applied here, whatever mask the call brings: transformers' own masks (the prefill) carry
the window already, the update's (lib/logprobs.py) carry none, and applying the window twice changes
nothing. Without either, the call is transformers' SDPA unchanged. Decode steps are
sampler.cascade_attention, which applies the same two settings to its shared-prefix scores.
"""

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

# The layer types whose keys the attention can serve: every earlier key, or those fewer than the
# window back. Others (chunked attention, linear attention, recurrent layers) are refused.
SERVED_LAYER_TYPES = {"full_attention", "sliding_attention"}


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


def unsupported(model) -> str:
    """Why cascade decoding cannot serve this model ('' if it can): a model whose layers do not call
    a registered attention function (transformers' attention interface), a multimodal wrapper,
    layers other than full or sliding-window attention, bidirectional attention, or attention
    sinks."""
    cfg = model.config
    if not getattr(model, "_supports_attention_backend", False):
        return ("its layers do not call transformers' attention interface, which cascade decoding "
                "plugs into")
    if cfg.get_text_config() is not cfg:
        return "a multimodal model; load its text-only causal LM instead"
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"]) - SERVED_LAYER_TYPES
    if types:
        return (f"its {', '.join(sorted(types))} layers (cascade decoding serves full and "
                "sliding-window attention)")
    if getattr(cfg, "use_bidirectional_attention", False) or not getattr(cfg, "is_causal", True):
        return "bidirectional attention (an encoder, not a decoder)"
    if any(hasattr(m, "sinks") for m in model.modules()):
        return "attention sinks (cascade decoding has no sink term)"
    return ""
