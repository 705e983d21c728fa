"""
policy.py: the policy as a Hugging Face model. Loading it (fp32 master weights, the "brorl" attention
of sampler.py), the dtype its matmuls run in and the autocast region that must wrap forwards only,
and the update's forward plumbing: the output layer that log-probs can skip (plain_head), a KV cache
that stays right when activation checkpointing replays a layer (ReplayCache), and the checkpointing.
"""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import sampler  # noqa: F401  (importing it registers attn_implementation="brorl")
from harness import fail


def load_policy(name: str, device, flag="--model"):
    """Model and tokenizer from a hub id or a local dir (a run's dir: its checkpoint); one clear
    line if that is impossible."""
    if (Path(name) / "ckpt" / "config.json").is_file():
        name = str(Path(name) / "ckpt")
    name, revision = split_revision(name)
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1  # not "org/name"
    if looks_local and not Path(name).expanduser().is_dir():
        fail(f"{flag} {name}: no such directory")
    try:
        tok = AutoTokenizer.from_pretrained(name, revision=revision)
        model = AutoModelForCausalLM.from_pretrained(name, revision=revision, dtype=torch.float32,
                                                     attn_implementation="brorl")
    except (OSError, ValueError) as e:
        fail(f"{flag} {name}: could not load ({str(e).splitlines()[0]})")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.to(device), tok


def split_revision(name: str) -> tuple:
    """--model org/name@revision -> (org/name, revision); no @ (or a local path that has one): revision None."""
    if "@" not in name or Path(name).expanduser().exists():
        return name, None
    name, revision = name.rsplit("@", 1)
    return name, revision


def compute_dtype(cfg, device) -> torch.dtype:
    """--dtype as a torch dtype: auto is bf16 on CUDA, fp32 elsewhere."""
    return {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
            "bfloat16": torch.bfloat16}[cfg.dtype]


def autocast(cfg, device):
    """Matmuls in the compute dtype, weights and AdamW state fp32 (a bf16 weight would round away
    lr ~1e-6 updates). Wrap FORWARDS only: an autocast region caches the bf16 copy of each weight
    for its whole life and does not see in-place optimizer updates, so a region spanning
    opt.step() runs every later forward with the weights from before the step (PyTorch's AMP
    recipe: autocast the forward and the loss, never the backward or the step)."""
    dtype = compute_dtype(cfg, device)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


# Config fields with which a transformers model changes its logits after the output layer
# (logits = f(hidden @ W.T)): soft-capping (Gemma 2/3), a scale (Cohere), a divisor (Granite), a
# multiplier (Falcon-H1). Such a model's log-probs are taken from its full logits instead.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


def plain_head(model):
    """The output embedding's weight (V, H) when logits = hidden @ weight.T exactly (a bias-free
    linear head, no transform in the config), so log-probs can skip the logits; else None. Sharded
    (K > 1), the weight is whole only inside the root's forward (distributed.in_forward): call it there."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or not plain_logits(model.config):
        return None
    return head.weight


def plain_logits(model_config) -> bool:
    """Whether the config applies nothing to hidden @ W.T (the planner's test of the path that runs)."""
    return not [k for k in LOGIT_TRANSFORMS if getattr(model_config, k, None) not in (None, 1, 1.0)]


class ReplayCache(DynamicCache):
    """The update's KV cache, safe under --grad_ckpt: activation checkpointing replays each decoder
    layer's forward in the backward, and a DynamicCache would append that layer's keys a second
    time (a (.., P+2T, D) cache: wrong shapes). Here update() appends to what the layer held when
    the cache was made (`prefix`: per layer (k, v), or nothing), however often a layer runs."""

    def __init__(self, config, prefix=()):
        super().__init__(config=config)
        for i, (k, v) in enumerate(prefix):
            super().update(k, v, i)
        self.base = [k.shape[-2] for k, _ in prefix]  # per layer: the prefix's length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx < len(self.layers) and self.layers[layer_idx].is_initialized:  # a replay, or the prefix
            n, layer = self.base[layer_idx] if layer_idx < len(self.base) else 0, self.layers[layer_idx]
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def enable_grad_ckpt(model):
    """--grad_ckpt: keep only each decoder layer's input in the update and recompute the layer in the
    backward (transformers' per-layer checkpointing, non-reentrant). Its layers drop the KV cache
    under checkpointing unless told the cache is replay-safe: ReplayCache is."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its name in transformers 5.24
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 5.17-5.23: the same call under its older name (a deprecated alias in 5.24)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for layer in model.modules():
        if hasattr(layer, "_can_checkpoint_with_cache"):
            layer._can_checkpoint_with_cache = True
