"""
attention.py: the model families the attention "brorl" (sampler.py: the cascade in decode steps,
sampler.attend everywhere else) cannot serve, refused with one line before any work
(lib/policy.py).
"""

# The layer types whose keys the attention can serve: every earlier key, or those fewer than the
# window back. Others (chunked attention, linear attention, recurrent layers) are refused.
SERVED_LAYER_TYPES = {"full_attention", "sliding_attention"}


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
