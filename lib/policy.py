"""
policy.py: the policy as a Hugging Face model. Loading it (fp32 master weights, the "brorl"
attention of sampler.py), the dtype its matmuls run in and the autocast region that must wrap
forwards only, and the update's forward plumbing: the step's rollouts as one batch (pack_groups),
their log-probs with each prompt run once (response_logprobs), the output layer that log-probs can
skip (plain_head), a KV cache that stays right when activation checkpointing replays a layer
(ReplayCache), the checkpointing, and the gradient norm over every process's shards
(clip_gradients). LoRA (--lora_rank, through peft, imported only then): the adapter (add_lora,
load_policy of an adapter dir), what the optimizer trains (trainable), and the KL's reference
sharing the base weights (make_reference, LoraReference, as_reference).
"""

import contextlib
import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kernels import linear_logprobs, token_logprobs
from lib import distributed, pretrained
from lib.attention import unsupported
from lib.errors import fail
from sampler import cache_kwarg  # importing sampler registers attn_implementation="brorl"


def load_policy(name: str, device, flag="--model"):
    """Model and tokenizer from a hub id or a local dir (a run's dir: its checkpoint; a LoRA adapter
    dir in peft's format: its base model with the adapter on it); one clear line if that is
    impossible."""
    if any((Path(name) / "ckpt" / f).is_file() for f in ("config.json", "adapter_config.json")):
        name = str(Path(name) / "ckpt")
    if (Path(name) / "adapter_config.json").is_file():
        adapter = json.loads((Path(name) / "adapter_config.json").read_text())
        base = adapter["base_model_name_or_path"]
        model, tok = load_policy(base, device, f"{flag} {name}: its base model")
        try:
            model = _peft(flag).PeftModel.from_pretrained(model, name, is_trainable=True)
        except (OSError, ValueError) as e:
            fail(f"{flag} {name}: could not load the adapter ({str(e).splitlines()[0]})")
        return (model.to(device), AutoTokenizer.from_pretrained(name)
                if (Path(name) / "tokenizer_config.json").is_file() else tok)
    name, revision = split_revision(pretrained.resolve(name, flag))  # an alias: its folder
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1  # not "org/name"
    if looks_local and not Path(name).expanduser().is_dir():
        fail(f"{flag} {name}: no such directory")
    check_model_config(Path(name).expanduser(), flag)
    from huggingface_hub.errors import StrictDataclassError  # (transformers' config validation)
    try:
        check_embedding_shape(Path(name).expanduser(), flag)
        tok = AutoTokenizer.from_pretrained(name, revision=revision)
        model = AutoModelForCausalLM.from_pretrained(name, revision=revision, dtype=torch.float32,
                                                     attn_implementation="brorl")
    except SafetensorError as e:  # a weights file cut short or corrupt
        files = (", ".join(f.name for f in sorted(Path(name).expanduser().glob("*.safetensors")))
                 or "its .safetensors")
        fail(f"{flag} {name}: {files} unreadable ({str(e).splitlines()[0]})")
    except StrictDataclassError as e:  # a field of config.json that transformers' checks refuse
        fail(f"{flag} {name}: its config.json is refused by transformers ({config_refusal(e)})")
    except (OSError, ValueError) as e:
        fail(f"{flag} {name}: could not load ({str(e).splitlines()[0]})")
    except RuntimeError as e:  # a weight's shape is not its config's (transformers' own check)
        if "mismatch" not in str(e):
            raise
        fail(f"{flag} {name}: its weights' shapes disagree with its config.json")
    why = unsupported(model)
    if why:
        fail(f"{flag} {name}: {model.config.model_type} cannot be trained here: {why}")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    check_tokenizer(tok, model, name, flag)
    return model.to(device), tok


def config_refusal(e: Exception) -> str:
    """The reason in a config validation error, which names the field: its last line, without the
    inner error's type ("Validation error for field 'x':", then "TypeError: Field 'x' expected
    int, got str")."""
    last = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()
    kind, sep, rest = last.partition(": ")
    return (rest if sep and kind.isidentifier() and kind.endswith("Error") else last)[:200]


def check_model_config(path: Path, flag: str):
    """A local directory's config.json must be a model's (it names its model_type): one that is
    neither a model's nor a whole run's (a run's with a field removed: lib/checkpoint.is_run_dir)
    would reach transformers, which reads a run's "dtype": "auto" as a torch dtype. A missing or
    unreadable one is left to the load, which names it."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(config, dict) and "model_type" not in config:
        fail(f"{flag} {path}: its config.json is neither a model's (it lacks model_type) nor a "
             "whole run's (it lacks n_rollouts)" if "task" in config else
             f"{flag} {path}: its config.json is not a model's (it lacks model_type)")


def check_embedding_shape(path: Path, flag: str):
    """A local model's config.json against its weights' embedding (read from the safetensors
    header alone): a vocab_size or hidden_size that disagrees is one line naming both, before
    transformers' own report."""
    config, weights = path / "config.json", path / "model.safetensors"
    if not (config.is_file() and weights.is_file()):
        return
    try:
        cfg = json.loads(config.read_text())
        from safetensors import safe_open
        with safe_open(str(weights), "pt") as f:
            key = next((k for k in f.keys() if k.endswith("embed_tokens.weight")), None)
            shape = tuple(f.get_slice(key).get_shape()) if key else None
    except (OSError, ValueError):  # unreadable: the load names it
        return
    want = (cfg.get("vocab_size"), cfg.get("hidden_size"))
    if shape and None not in want and shape != want:
        fail(f"{flag} {path}: its config.json says vocab_size {want[0]}, hidden_size {want[1]}; "
             f"its model.safetensors' {key} is {list(shape)}: not this config's weights")


def check_tokenizer(tok, model, name: str, flag: str):
    """A tokenizer that encodes text to nothing (its tokenizer.json missing beside its
    tokenizer_config.json), to ids past the model's embedding rows, or has no EOS: one line naming
    the model, before any prompt is measured."""
    ids = tok("12 + 345 = 357, yes", add_special_tokens=False)["input_ids"]
    rows = model.get_input_embeddings().num_embeddings
    if not ids:
        fail(f"{flag} {name}: its tokenizer encodes text to no tokens (its tokenizer.json "
             "missing or empty?)")
    if max(ids) >= rows or tok.eos_token_id is None or tok.eos_token_id >= rows:
        fail(f"{flag} {name}: its tokenizer's ids (up to {max(ids)}, EOS {tok.eos_token_id}) do "
             f"not fit the model's {rows} embedding rows: not this model's tokenizer")


def split_revision(name: str) -> tuple:
    """--model org/name@revision -> (org/name, revision); no @ (or a local path that has one):
    revision None."""
    if "@" not in name or Path(name).expanduser().exists():
        return name, None
    name, revision = name.rsplit("@", 1)
    return name, revision


# --dtype auto on a CPU: bf16 only where the CPU computes it natively (AMX tiles or AVX512_BF16;
# elsewhere bf16 is emulated, slower than fp32) and the model is wide enough to gain from it. At
# hidden size 128 (the embedded models) 8 steps of the default job took 13.7 user CPU s in bf16
# against 14.4 in fp32 (assets/bench/tiny-dtype-cpu.txt), no gain for inexact sampler log-probs;
# at SmolLM2-135M's 576 a step costs less CPU in bf16 (docs/results/smollm2.md). The bound lies
# between the two.
BF16_MIN_HIDDEN = 512


def cpu_bf16() -> str:
    """The instructions with which this CPU computes bf16 natively, as torch reports them ('AMX',
    'AVX512_BF16'), or '' where it has neither."""
    return ("AMX" if torch.cpu._is_amx_tile_supported()
            else "AVX512_BF16" if torch.cpu._is_avx512_bf16_supported() else "")


def pick_dtype(cfg, device, model_config) -> tuple:
    """(--dtype made concrete, why): auto is bf16 autocast on CUDA, and on a CPU that computes bf16
    natively for a model of hidden size >= BF16_MIN_HIDDEN; fp32 elsewhere. A run records its
    choice in config.json, so that a resumed run keeps it on any machine."""
    if cfg.dtype != "auto":
        return cfg.dtype, "given"
    if device.type != "cpu":
        return ("bfloat16" if device.type == "cuda" else "float32"), f"on {device.type}"
    hidden = getattr(model_config.get_text_config(), "hidden_size", 0) or 0
    if not (isa := cpu_bf16()):
        return "float32", "this CPU has neither AVX512_BF16 nor AMX: bf16 would be emulated"
    if hidden < BF16_MIN_HIDDEN:
        return "float32", (f"this CPU computes bf16 natively ({isa}), but at hidden size {hidden} "
                           f"(< {BF16_MIN_HIDDEN}) no faster than fp32")
    return "bfloat16", f"this CPU computes bf16 natively ({isa}); hidden size {hidden}"


def compute_dtype(cfg, device) -> torch.dtype:
    """--dtype as a torch dtype, once setup (pick_dtype) has made auto concrete; auto before that
    is the device's default (bf16 on CUDA, fp32 elsewhere)."""
    return {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
            "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


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


def enable_grad_ckpt(model):
    """--grad_ckpt: keep only each decoder layer's input in the update and recompute the layer in
    the backward (transformers' per-layer checkpointing, non-reentrant). Its layers drop the KV
    cache under checkpointing unless told the cache is replay-safe: ReplayCache is."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its name in transformers 5.24
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 5.17-5.23: the same call under its older name (a deprecated alias in 5.24)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for layer in model.modules():
        if hasattr(layer, "_can_checkpoint_with_cache"):
            layer._can_checkpoint_with_cache = True


# ----------------------------------------------------------------------------
# LoRA (peft): an adapter on the frozen weights


def _peft(flag="--lora_rank"):
    """The peft module, or one line naming the package: it is needed only with LoRA."""
    try:
        import peft
    except ImportError:
        fail(f"{flag}: LoRA needs the peft package (pip install peft)")
    return peft


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def add_lora(model, rank: int, alpha: float, targets: str):
    """--lora_rank r: a LoRA adapter (scale alpha / r, no dropout: the loss's log-probs must be the
    sampler's) on the named Linear layers of every decoder layer; everything else frozen. The LM
    head is not a target, so kernels.linear_logprobs still takes it as a plain linear head. The
    sampler decodes with the adapter unmerged (an extra low-rank matmul per target, exact; merged:
    docs/results/objectives.md)."""
    peft = _peft()
    config = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=0.0, bias="none",
                             target_modules=[t for t in targets.split(",") if t],
                             task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:  # e.g. no module of the model matches --lora_targets
        fail(f"--lora_targets {targets}: {str(e).splitlines()[0]}")


def trainable(model) -> list:
    """What the optimizer holds: the adapter alone with LoRA, every parameter otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


class LoraReference:
    """The KL's reference policy of a LoRA run, sharing the policy's base weights (no second copy of
    the model). Until the first reset it is the base model: the adapter disabled. A reset (ProRL:
    the reference becomes the current policy) keeps a frozen copy of the adapter, swapped in for the
    reference's forward. state_dict / load_state_dict as a model's, so brorl.py resets and
    checkpoints it alike; load_state_dict takes a full policy's state dict (a reset) or a saved
    reference (the adapter's tensors, or {})."""

    def __init__(self, model):
        self.model, self.adapter = model, {}  # {}: the adapter disabled

    def state_dict(self) -> dict:
        return self.adapter

    def load_state_dict(self, state: dict):
        self.adapter = {k: v.detach().clone() for k, v in state.items() if "lora_" in k}

    @contextlib.contextmanager
    def policy(self):
        if not self.adapter:
            with self.model.disable_adapter():
                yield self.model
            return
        params = dict(self.model.named_parameters())
        current = {k: params[k].detach().clone() for k in self.adapter}
        with torch.no_grad():
            try:
                for k, v in self.adapter.items():
                    params[k].copy_(v)
                yield self.model
            finally:
                for k, v in current.items():
                    params[k].copy_(v)


def make_reference(model):
    """The KL's reference at the start: a frozen copy of the model; with LoRA the base weights,
    shared."""
    return (LoraReference(model) if is_lora(model)
            else copy.deepcopy(model).eval().requires_grad_(False))


def as_reference(ref):
    """The reference as a model to run (a context): the frozen copy itself, or the LoRA policy with
    the reference's adapter (or none) in place of its own for the duration."""
    return ref.policy() if isinstance(ref, LoraReference) else contextlib.nullcontext(ref)


# ----------------------------------------------------------------------------
# The update's batch and its log-probs


def pack_groups(groups: list, dev="cpu") -> dict:
    """One-group Rollouts (Rollouts.group) -> the update's batch on `dev`: G prompts, left-padded to
    P, and R = G*n responses, right-padded to T (trailing all-padding columns dropped, at least 2
    kept: response_logprobs always makes its two model calls), each row pointing at its prompt
    (`group`), and `lengths` (G, n), each row's valid tokens, float64 on the CPU: these groups',
    which brorl.pack_rows replaces with all ranks' (the normalisers' counts); groups of unequal n:
    R = sum n_j rows and `lengths` a list of G tensors (n_j,). No groups: an empty batch."""
    G = len(groups)
    P = max((len(x.prompt_ids[0]) for x in groups), default=1)
    prompt = torch.zeros(G, P, dtype=torch.long)  # (G, P), pad id irrelevant: masked
    prompt_mask = torch.zeros(G, P, dtype=torch.bool)  # (G, P)
    for i, x in enumerate(groups):
        ids = x.prompt_ids[0]
        prompt[i, P - len(ids):], prompt_mask[i, P - len(ids):] = torch.tensor(ids), True
    empty = dict(tokens=torch.long, mask=torch.bool, logp=torch.float32, entropy=torch.float32)
    # (R, T_max)
    cat = lambda field: torch.cat([getattr(x, field) for x in groups]
                                  or [torch.zeros(0, 1, dtype=empty[field])])
    mask = cat("mask")
    T = max(int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1, 2)
    # (R, T), one padding column if T_max = 1
    rows = lambda field: F.pad(cat(field), (0, 1))[:, :T].to(dev)
    # (R,)
    group = torch.arange(G).repeat_interleave(torch.tensor([x.n for x in groups], dtype=torch.long))
    lengths = mask.sum(1).double()  # (R,) valid tokens per row
    # (G, n); groups of unequal n (--alloc adaptive): a list of G tensors (n_j,)
    lengths = (lengths.reshape(G, groups[0].n if groups else 0) if len({x.n for x in groups}) <= 1
               else list(lengths.split([x.n for x in groups])))
    return dict(prompt=prompt.to(dev), prompt_mask=prompt_mask.to(dev), resp=rows("tokens"),
                resp_mask=rows("mask"), group=group.to(dev), sampler_logp=rows("logp"),
                sampler_entropy=rows("entropy"), lengths=lengths)


# One empty row (a 1-token prompt, 2 padding response tokens): what a rank computes, with no effect,
# when it holds no row of a micro-batch that other ranks hold rows of (response_logprobs)
IDLE_BATCH = dict(prompt=torch.zeros(1, 1, dtype=torch.long),
                  prompt_mask=torch.ones(1, 1, dtype=torch.bool),
                  resp=torch.zeros(1, 2, dtype=torch.long),
                  resp_mask=torch.zeros(1, 2, dtype=torch.bool),
                  group=torch.zeros(1, dtype=torch.long))


def response_logprobs(model, batch, rows, temperature, with_entropy=False):
    """Log-probs (r, T) of the response tokens of batch rows `rows`, through the one log-prob
    kernel. Like the sampler, each prompt is run once (not once per row) and no logits are made
    at prompt positions: the responses attend to their prompt's keys/values, gathered per row,
    so the gradient of all N rows flows back into the one prompt pass. With a plain linear head
    the decoder's hidden states go to kernels.linear_logprobs, which never holds the (r, T, V)
    logits; any other head (plain_head) gives logits, then kernels.token_logprobs."""
    if len(rows) == 0:  # this rank holds none of these rows (K > 1): one empty row makes the same
        # calls to the model as any micro-batch, so that every rank joins each of FSDP's collectives
        dev = batch["resp"].device
        idle = response_logprobs(model, {k: v.to(dev) for k, v in IDLE_BATCH.items()},
                                 # (1, 2)
                                 torch.zeros(1, dtype=torch.long, device=dev), temperature)
        # (0, T), in the graph: backward joins too
        out = batch["sampler_logp"][:0] + 0.0 * idle.sum()
        return (out, out) if with_entropy else out
    # K > 1: the whole pass is one forward of the sharded model (distributed.in_forward), so that
    # FSDP gathers the root's parameters (embeddings, final norm, head) for all of it, head included
    return distributed.in_forward(model,
                                  lambda: logprobs_pass(model, batch, rows, temperature,
                                                        with_entropy))


def logprobs_pass(model, batch, rows, temperature, with_entropy):
    """response_logprobs' forward: the prompts once, then the responses against their prompt's
    keys."""
    head = plain_head(model)
    net = model.get_decoder() if head is not None else model  # hidden states, or logits
    states = lambda out: out.last_hidden_state if head is not None else out.logits
    keep_last = {} if head is not None else dict(logits_to_keep=1)  # no (g, P, V) prompt logits
    groups, row_group = batch["group"][rows].unique(return_inverse=True)  # (g,), (r,)
    pm = batch["prompt_mask"][groups]  # (g, P)
    resp, mask = batch["resp"][rows], batch["resp_mask"][rows]  # (r, T)
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
    first = states(net(batch["prompt"][groups], attention_mask=prompt_attn[:, None],
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


def old_logprobs(model, ref_model, batch, chunks, cfg, dev):
    """Before an update, over this rank's rows (chunks: its micro-batches on `dev`): the old
    policy's log-probs and entropies (r, T), the sampler's (uses_sampler_logp: the same weights, no
    update yet) or a trainer forward's (the paper's setup: sampler and trainer numerics differ), and
    the KL reference's log-probs (r, T) (with LoRA: the policy with the reference's adapter), or
    None."""
    with torch.no_grad(), autocast(cfg, dev):
        if uses_sampler_logp(cfg, model):
            old_logp, ent = batch["sampler_logp"], batch["sampler_entropy"]  # (r, T) each
        else:
            old_logp, ent = (torch.cat(x)
                             for x in zip(*[response_logprobs(model, batch, rows,
                                                              cfg.temperature, True)
                                                          for rows in chunks]))  # (r, T) each
        with as_reference(ref_model) as ref:
            ref_logp = torch.cat([response_logprobs(ref, batch, rows, cfg.temperature)
                                  for rows in chunks]) if cfg.kl_coef > 0 else None  # (r, T)
    return old_logp, ent, ref_logp


def clip_gradients(model, max_norm: float) -> float:
    """Clip the global gradient norm to max_norm; return the norm before clipping, over every
    process's shards (FSDP's gradients are DTensors: their norm is gathered whole)."""
    return distributed.full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)).item()
