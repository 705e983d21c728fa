"""
policy.py: the policy as a Hugging Face model. Loading it (fp32 master weights, the "brorl"
attention of sampler.py; a LoRA adapter dir through lib/lora.py), each refusal one line before any
work; the dtype its matmuls run in and the autocast region that must wrap forwards only; activation
checkpointing (--grad_ckpt); and the gradient norm over every process's shards (clip_gradients).
The update's log-probs are lib/logprobs.py's, LoRA's adapter and reference lib/lora.py's.
"""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from lib import distributed, pretrained
from lib.attention import unsupported
from lib.errors import fail
from lib.lora import peft_module
import sampler  # noqa: F401  (importing sampler registers attn_implementation="brorl")


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
            model = peft_module(flag).PeftModel.from_pretrained(model, name, is_trainable=True)
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
        fail(config_refusal(flag, name, e))
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


def config_refusal(flag: str, name: str, e: Exception) -> str:
    """The line for a config.json that transformers' validation refuses, with the reason in its
    error, which names the field: its last line, without the inner error's type ("Validation error
    for field 'x':", then "TypeError: Field 'x' expected int, got str")."""
    last = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()
    kind, sep, rest = last.partition(": ")
    reason = (rest if sep and kind.isidentifier() and kind.endswith("Error") else last)[:200]
    return f"{flag} {name}: its config.json is refused by transformers ({reason})"


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


def recorded_dtype(path: str) -> str:
    """The dtype a brorl run computed in, as the checkpoint at path (or path/ckpt) records it in
    brorl_config.json; "" for anything else (a hub id, a model's folder, an unreadable record)."""
    for folder in (Path(path).expanduser(), Path(path).expanduser() / "ckpt"):
        try:
            dtype = json.loads((folder / "brorl_config.json").read_text()).get("dtype")
        except (OSError, ValueError, AttributeError):
            continue
        if dtype in ("float32", "bfloat16"):
            return dtype
    return ""


def pick_dtype(cfg, device, model_config, source: str = "") -> tuple:
    """(--dtype made concrete, why): auto is the dtype a brorl checkpoint's run computed in when
    the policy (source) is one, as a resumed run keeps its own; else bf16 autocast on CUDA, and on
    a CPU that computes bf16 natively for a model of hidden size >= BF16_MIN_HIDDEN; fp32 elsewhere.
    A run records its choice in config.json, so that a resumed run keeps it on any machine."""
    if cfg.dtype != "auto":
        return cfg.dtype, "given"
    if source and (recorded := recorded_dtype(source)):
        return recorded, f"the dtype the run that wrote {source} computed in"
    if device.type != "cpu":
        return distributed.device_default_dtype(device.type), f"on {device.type}"
    hidden = getattr(model_config.get_text_config(), "hidden_size", 0) or 0
    if not (isa := cpu_bf16()):
        return "float32", "this CPU has neither AVX512_BF16 nor AMX: bf16 would be emulated"
    if hidden < BF16_MIN_HIDDEN:
        return "float32", (f"this CPU computes bf16 natively ({isa}), but at hidden size {hidden} "
                           f"(< {BF16_MIN_HIDDEN}) no faster than fp32")
    return "bfloat16", f"this CPU computes bf16 natively ({isa}); hidden size {hidden}"


def compute_dtype(cfg, device) -> torch.dtype:
    """--dtype as a torch dtype, once setup (pick_dtype) has made auto concrete; auto before that
    is distributed.device_default_dtype's."""
    dtype = distributed.device_default_dtype(device.type) if cfg.dtype == "auto" else cfg.dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def autocast(cfg, device):
    """Matmuls in the compute dtype, weights and AdamW state fp32 (a bf16 weight would round away
    lr ~1e-6 updates). Wrap FORWARDS only: an autocast region caches the bf16 copy of each weight
    for its whole life and does not see in-place optimizer updates, so a region spanning
    opt.step() runs every later forward with the weights from before the step (PyTorch's AMP
    recipe: autocast the forward and the loss, never the backward or the step)."""
    dtype = compute_dtype(cfg, device)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


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


def clip_gradients(model, max_norm: float) -> float:
    """Clip the global gradient norm to max_norm; return the norm before clipping, over every
    process's shards."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if distributed.world_size() > 1:  # FSDP's gradients are DTensors: their norm is gathered whole.
        norm = distributed.full(norm)
    return norm.item()
