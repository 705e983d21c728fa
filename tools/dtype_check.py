"""
dtype_check.py: bf16 autocast against fp32 on one model, for the same tokens (the SmolLM2 page's
"bf16 on a CPU" section reads its output).

A run in bf16 meets rounding in two places: the sampler's log-probs (one token at a time against
its KV cache) and the trainer's recompute of the same tokens (the prompt once, the responses in
one forward) round differently, and the run logs their gap as drift_max = max |exp(trainer -
sampler) - 1|. This program measures, on rollouts sampled in bf16 from the training prompts:

  1. each bf16 log-prob's gap to fp32's (the trainer's forward without autocast) and the two bf16
     forwards' gap to each other, as quantiles over the response tokens, and drift_max by the
     token's fp32 probability (the largest gaps are on unlikely tokens);
  2. what TIS does with the gap (its weight min(exp(trainer - sampler), --tis_cap): how many
     tokens it caps) and what --old_logp sampler would do: the share of tokens whose first
     mini-batch ratio exp(trainer - sampler) already lies outside the clip range from rounding
     alone (the recompute, --old_logp auto in bf16, makes that ratio exactly 1);
  3. greedy decoding of the held-out prompts in bf16 against fp32: identical responses, the first
     token where they part, and answers scored alike.

The model, task, sampling and prompts are brorl's own, from the brorl flags given after `--`:

  OMP_NUM_THREADS=1 python -m tools.dtype_check --prompts 8 --n 16 -- --preset smollm2
"""

import argparse
import dataclasses
import sys

import torch

import brorl
from lib import setup, step
from lib.logprobs import response_logprobs
from lib.policy import autocast
from lib.step import pack_groups
from sampler import generate

QUANTILES = (0.5, 0.9, 0.99, 1.0)


def logprob_gaps(sampler_logp, trainer_logp, fp32_logp, mask, clip_low, clip_high, tis_cap):
    """The figures of parts 1 and 2 over the valid tokens (mask) of (R, T) log-probs."""
    s, t, f = (x[mask].double() for x in (sampler_logp, trainer_logp, fp32_logp))  # (tokens,)
    q = torch.tensor(QUANTILES, dtype=torch.float64)
    quant = lambda d: [round(v, 5) for v in d.abs().quantile(q).tolist()]
    drift = (torch.exp(t - s) - 1).abs()  # the run's drift_max, per token
    p = f.exp()  # the token's fp32 probability at the sampling temperature
    bands = {"p >= 0.5": p >= 0.5, "0.01 <= p < 0.5": (p >= 0.01) & (p < 0.5),
             "p < 0.01": p < 0.01}
    ratio = torch.exp(t - s)  # the first mini-batch's ratio under --old_logp sampler
    return {
        "tokens": int(mask.sum()),
        "quantiles": list(QUANTILES),
        "sampler_bf16_vs_fp32": quant(s - f),
        "trainer_bf16_vs_fp32": quant(t - f),
        "trainer_vs_sampler_bf16": quant(t - s),
        "drift_max": drift.max().item(),
        "drift_max_by_p": {k: (drift[m].max().item() if m.any() else None, int(m.sum()))
                           for k, m in bands.items()},
        "tis_capped_share": (torch.exp(t - s) > tis_cap).double().mean().item(),
        "tis_mean_weight": torch.exp(t - s).clamp(max=tis_cap).mean().item(),
        "outside_clip_share": ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).double()
                              .mean().item(),
    }


def greedy_agreement(model, tok, cfg, examples, device) -> dict:
    """Part 3: each held-out prompt decoded greedily in bf16 and in fp32."""
    seeds = list(range(len(examples)))
    outs = {}
    for dtype in ("bfloat16", "float32"):
        c = dataclasses.replace(cfg, dtype=dtype)
        with torch.no_grad(), autocast(c, device):
            outs[dtype] = step.sample_share(model, tok, examples, 1, 0.0, 1.0, c, seeds,
                                            cfg.eval_max_new_tokens or cfg.max_new_tokens)
    a, b = outs["bfloat16"][0], outs["float32"][0]
    parted = []
    for i in range(len(examples)):
        ta, tb = a.tokens[i][a.mask[i]].tolist(), b.tokens[i][b.mask[i]].tolist()
        if ta != tb:
            parted.append(next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y),
                               min(len(ta), len(tb))))
    ra, rb = outs["bfloat16"][2].flatten(), outs["float32"][2].flatten()  # (P,) rewards
    return {"prompts": len(examples), "identical": len(examples) - len(parted),
            "parted_at": sorted(parted), "scored_alike": int((ra == rb).sum()),
            "right_bf16": int(ra.sum()), "right_fp32": int(rb.sum())}


def check(cfg, prompts: int, n: int) -> dict:
    """Parts 1-3 for the run that cfg describes."""
    cfg = dataclasses.replace(cfg, dtype="bfloat16")
    cfg, device, train_set, eval_set, model, tok, _ = setup.setup(cfg, cfg.model, "--model")
    model.eval()
    examples = train_set[:prompts]
    with torch.no_grad():
        with autocast(cfg, device):
            ro = generate(model, tok, [e["prompt"] for e in examples], n, cfg.max_new_tokens,
                          cfg.temperature, cfg.top_p, cfg.max_rows, list(range(prompts)),
                          cfg.system_prompt)
        batch = pack_groups([ro.group(g) for g in range(prompts)], device)
        rows = torch.arange(len(batch.resp), device=device)
        with autocast(cfg, device):
            trainer = response_logprobs(model, batch, rows, cfg.temperature)  # (R, T)
        fp32 = response_logprobs(model, batch, rows, cfg.temperature)  # (R, T), no autocast
    out = logprob_gaps(batch.sampler_logp, trainer, fp32, batch.resp_mask, cfg.clip_low,
                       cfg.clip_high, cfg.tis_cap)
    out["greedy"] = greedy_agreement(model, tok, cfg, eval_set, device)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (
        argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="training prompts sampled")
    ap.add_argument("--n", type=int, default=16, help="rollouts of each, in bf16")
    args = ap.parse_args(own)
    if args.prompts < 1 or args.n < 1:
        ap.error(f"--prompts {args.prompts} --n {args.n}: each at least 1")
    cfg = brorl.parse_config(rest)
    res = check(cfg, args.prompts, args.n)
    print(f"{res['tokens']} response tokens of {args.prompts} prompts x {args.n} rollouts "
          f"sampled in bf16; |log-prob gap| at quantiles {res['quantiles']}:")
    for k in ("sampler_bf16_vs_fp32", "trainer_bf16_vs_fp32", "trainer_vs_sampler_bf16"):
        print(f"  {k:26s} {res[k]}")
    print(f"drift_max {res['drift_max']:.3f}; by the token's fp32 probability (max, tokens): "
          f"{res['drift_max_by_p']}")
    print(f"TIS (cap {cfg.tis_cap}): {res['tis_capped_share']:.2e} of tokens capped, mean weight "
          f"{res['tis_mean_weight']:.4f}; --old_logp sampler: {res['outside_clip_share']:.2e} of "
          f"tokens outside the clip range at the first mini-batch (recompute: 0)")
    g = res["greedy"]
    print(f"greedy, {g['prompts']} held-out prompts: {g['identical']} identical in bf16 and fp32, "
          f"the rest parted at tokens {g['parted_at']}; scored alike {g['scored_alike']} "
          f"(right: bf16 {g['right_bf16']}, fp32 {g['right_fp32']})")
    return res


if __name__ == "__main__":
    main()
