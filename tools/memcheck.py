"""
memcheck.py: the memory planner (lib/planner.py) against a measured run. Loads the configuration the
flags describe (any brorl.py flag), creates the AdamW state (one step on zero gradients), then measures the
rollout (the largest chunk the plan assumes: 4B prompts x N rollouts, and the eval's chunk) and
one update, and prints each phase's estimate beside its measured peak.

Measured: on CUDA torch.cuda.max_memory_allocated; on a CPU the peak of live tensor bytes
(measure_peak counts every tensor storage from its creation to its release), plus the
tensors that exist before the phase (weights, AdamW state, the reference policy; the update's
batch). Those are counted once: measure_peak is told of them, so an op that returns one of them (in fp32 a
Linear reads its weight through a transposed view, aten.t; AdamW's step updates weights, m and v in
place) does not count its storage a second time.

  python -m tools.memcheck                                 # the embedded model, default run
  python data.py rehearsal --out /tmp/rehearsal
  python -m tools.memcheck --model /tmp/rehearsal --task math:assets/math_sample.jsonl --dtype bfloat16 \\
      --grad_ckpt 1 --n_rollouts 8 --prompts_per_step 1 --max_new_tokens 64 --eval_prompts 2 --eval_samples 4
"""

import dataclasses
import json
import random
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import brorl
import data
import sampler
from lib import distributed, lora, plan, planner, policy, setup, step


def existing_tensors(model, ref_model, opt, batch=None) -> list:
    """The tensors that exist before a phase and live through it: weights and buffers, AdamW state,
    the reference policy, and the update's batch (the step's (rows, T) tensors)."""
    ref = [*ref_model.parameters(), *ref_model.buffers()] if ref_model is not None else []
    return [*model.parameters(), *model.buffers(), *ref,
            *(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)),
            *(t for t in torch.utils._pytree.tree_leaves(batch) if torch.is_tensor(t))]


def existing_bytes(tensors) -> int:
    """Bytes of the storages under `tensors`, each storage once."""
    seen, total = set(), 0
    for t in tensors:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage created while active, until it is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def _free(self, key, nbytes):
        self.seen.discard(key)
        self.live -= nbytes

    def track(self, t, nbytes_now=True):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key and key not in self.seen:  # a new storage (views share their base's)
            self.seen.add(key)
            self.live += st.nbytes() if nbytes_now else 0
            weakref.finalize(st, self._free, key, st.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.track(t)
        self.peak = max(self.peak, self.live)
        return out


def measure_peak(fn, existing=lambda: ()):
    """(fn's result, peak bytes of tensors allocated while fn runs and alive at once, less those of
    `existing()` it frees meanwhile; a function, so that no reference to them is held here). What
    existed before (weights, AdamW state) is not counted: add it."""
    meter = _LiveBytes()
    for t in existing():
        meter.track(t, nbytes_now=False)  # counts 0 now, -nbytes when freed
    with meter:
        out = fn()
    return out, meter.peak


def peak(fn, device, existing):
    """(fn's result, peak bytes while it runs): on a CPU, the bytes of existing() (the tensors that
    live through the phase) + the peak of the tensors fn makes beside them."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated()
    base = existing_bytes(existing())
    out, p = measure_peak(fn, existing)
    return out, base + p


def check(cfg) -> dict:
    """{phase: (estimated bytes, measured bytes)} for one rollout and one update of cfg."""
    device = distributed.pick_device(cfg.device)
    torch.manual_seed(cfg.seed)
    train_set = data.load_task(cfg.task, "train", seed=cfg.seed, digits=cfg.digits)
    model, tok = policy.load_policy(cfg.model, device)
    if cfg.grad_ckpt:
        policy.enable_grad_ckpt(model)
    cfg = plan.plan_memory(cfg, model.config, tok, train_set, device)
    cfg = dataclasses.replace(cfg, verifier=setup.pick_verifier(cfg))
    prompt_tokens = max(len(sampler.encode_prompt(tok, e["prompt"]))
                        for e in random.Random(cfg.seed).sample(train_set, min(256, len(train_set))))
    est = planner.peaks(planner.plan(model.config, cfg, prompt_tokens))
    ref = lora.make_reference(model) if cfg.kl_coef > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    gen, gen_cpu = torch.Generator(device=device).manual_seed(0), torch.Generator().manual_seed(0)
    rng = random.Random(cfg.seed)
    for p in model.parameters():  # one step on zero gradients: the AdamW state, as from step 2 on
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    prompts = [e["prompt"] for e in rng.sample(train_set, 4 * cfg.prompts_per_step)]
    model.eval()

    def rollout():
        with policy.autocast(cfg, device):
            ro = sampler.generate(model, tok, prompts, cfg.n_rollouts, cfg.max_new_tokens, cfg.temperature,
                                cfg.top_p, cfg.max_rows, gen)
            sampler.generate(model, tok, prompts[: cfg.eval_prompts], cfg.eval_samples, cfg.max_new_tokens, 0.6, 0.95,
                           cfg.max_rows, gen)
        return ro
    ro, roll = peak(rollout, device, lambda: existing_tensors(model, ref, opt))
    batch = step.pack_groups([ro.group(g) for g in range(cfg.prompts_per_step)], device)
    adv = torch.randn(batch.resp.shape[0], generator=gen_cpu).to(device)
    model.train()
    del ro
    _, upd = peak(lambda: brorl.update_policy(model, ref, opt, batch, adv, cfg, gen_cpu), device,
                  lambda: existing_tensors(model, ref, opt, {**vars(batch), "adv": adv}))
    return {"rollout": (est["rollout"], roll), "update": (est["update"], upd)}


if __name__ == "__main__":
    sys.argv[0] = "python -m tools.memcheck"  # the name --help's usage line gives the program
    cfg = brorl.parse_config()
    result = check(cfg)
    for phase, (e, m) in result.items():
        print(f"{phase:8s} planner {e / 2**20:10.1f} MiB   measured {m / 2**20:10.1f} MiB   "
              f"estimate/measured {e / m:.2f}")
    print("RESULT " + json.dumps({k: dict(estimate=e, measured=m) for k, (e, m) in result.items()}))
