"""
lora.py: LoRA (--lora_rank, through peft, imported only then): the adapter on the frozen weights
(add_lora; lib/policy.load_policy loads an adapter dir with it), what the optimizer trains
(trainable), and the KL's reference sharing the base weights (make_reference, LoraReference,
as_reference).
"""

import contextlib
import copy

import torch

from lib.errors import fail


def peft_module(flag="--lora_rank"):
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
    peft = peft_module()
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

