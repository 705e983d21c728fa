"""
memcheck.py: the memory planner (lib/planner.py) against a measured run. Loads the configuration the
flags describe (any brorl.py flag), creates the AdamW state (one step on zero gradients), then measures the
rollout (the largest chunk the plan assumes: 4B prompts x N rollouts, and the eval's chunk) and
one update, and prints each phase's estimate beside its measured peak.

Measured: on CUDA torch.cuda.max_memory_allocated; on a CPU the peak of live tensor bytes
(planner.measure_peak counts every tensor storage from its creation to its release), plus the
tensors that exist before the phase (weights, AdamW state, reference policy).

  python -m tools.memcheck                                 # the embedded model, default run
  python data.py rehearsal --out /tmp/rehearsal
  python -m tools.memcheck --model /tmp/rehearsal --task math:assets/math_sample.jsonl --dtype bfloat16 \\
      --grad_ckpt 1 --n_rollouts 8 --prompts_per_step 1 --max_new_tokens 64 --eval_prompts 2 --eval_samples 4
"""

import dataclasses
import json
import random
import sys

import torch

import brorl
import data
import sampler
from lib import distributed, planner, policy, setup


def existing_bytes(model, ref_model, opt) -> int:
    """Bytes of the tensors that live across phases: weights, AdamW state, the reference policy."""
    seen, total = set(), 0
    tensors = [*model.parameters(), *(ref_model.parameters() if ref_model is not None else []),
               *(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))]
    for t in tensors:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def peak(fn, device, base):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated()
    out, p = planner.measure_peak(fn)
    return out, p + base


def check(cfg) -> dict:
    """{phase: (estimated bytes, measured bytes)} for one rollout and one update of cfg."""
    device = distributed.pick_device(cfg.device)
    torch.manual_seed(cfg.seed)
    train_set = data.load_task(cfg.task, "train", seed=cfg.seed, digits=cfg.digits)
    model, tok = policy.load_policy(cfg.model, device)
    if cfg.grad_ckpt:
        policy.enable_grad_ckpt(model)
    cfg = planner.plan_memory(cfg, model.config, tok, train_set, device)
    cfg = dataclasses.replace(cfg, verifier=setup.pick_verifier(cfg))
    prompt_tokens = max(len(sampler.encode_prompt(tok, e["prompt"]))
                        for e in random.Random(cfg.seed).sample(train_set, min(256, len(train_set))))
    est = planner.peaks(planner.plan(model.config, cfg, prompt_tokens))
    ref = policy.make_reference(model) if cfg.kl_coef > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    gen, gen_cpu = torch.Generator(device=device).manual_seed(0), torch.Generator().manual_seed(0)
    rng = random.Random(cfg.seed)
    for p in model.parameters():  # one step on zero gradients: the AdamW state, as from step 2 on
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    base = existing_bytes(model, ref, opt)
    prompts = [e["prompt"] for e in rng.sample(train_set, 4 * cfg.prompts_per_step)]
    model.eval()

    def rollout():
        with policy.autocast(cfg, device):
            ro = sampler.generate(model, tok, prompts, cfg.n_rollouts, cfg.max_new_tokens, cfg.temperature,
                                cfg.top_p, cfg.max_rows, gen)
            sampler.generate(model, tok, prompts[: cfg.eval_prompts], cfg.eval_samples, cfg.max_new_tokens, 0.6, 0.95,
                           cfg.max_rows, gen)
        return ro
    ro, roll = peak(rollout, device, base)
    batch = policy.pack_groups([ro.group(g) for g in range(cfg.prompts_per_step)], device)
    adv = torch.randn(batch["resp"].shape[0], generator=gen_cpu).to(device)
    model.train()
    del ro
    _, upd = peak(lambda: brorl.update_policy(model, ref, opt, batch, adv, cfg, gen_cpu), device, base)
    return {"rollout": (est["rollout"], roll), "update": (est["update"], upd)}


if __name__ == "__main__":
    sys.argv[0] = "python -m tools.memcheck"  # the name --help's usage line gives the program
    cfg = brorl.parse_config()
    result = check(cfg)
    for phase, (e, m) in result.items():
        print(f"{phase:8s} planner {e / 2**20:10.1f} MiB   measured {m / 2**20:10.1f} MiB   "
              f"estimate/measured {e / m:.2f}")
    print("RESULT " + json.dumps({k: dict(estimate=e, measured=m) for k, (e, m) in result.items()}))
