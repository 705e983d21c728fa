"""
presets.py: the presets, `--preset NAME`: named bundles of overrides of brorl.py's Config, applied
before the flags given (lib/config.parse_config), never a second source of defaults. A task's own
preset (keys, sets) is its entry's in data.TASKS: --task NAME and its overrides. --help lists
their names; docs/running.md's presets table shows each (tests/test_docs.py holds it to this).
"""

import math

import data

PRESETS = {
    # the correct procedure is rare in the warm start (~3% of samples): where breadth should matter
    "hard": dict(model=str(data.EMBEDDED_MODEL_HARD)),
    # each task's own (data.TASKS): keys and sets, each on its warm start
    **{name: dict(task=name, **t.preset) for name, t in data.TASKS.items() if t.preset},
    # A real pretrained model on this CPU (docs/results/smollm2.md): SmolLM2-135M-Instruct (an
    # alias, lib/pretrained.py) on two-digit additions in its chat template, a boxed answer for the
    # math verifier's rules (integers: Math-Verify's worker processes would only cost CPU time).
    # Its base model is right about 1 time in 20 at the eval's temperature 0.6, and at 1 a step's
    # groups are mostly all wrong: rollouts at 0.6 too. 48 new tokens: the answer is short; about
    # 90 CPU seconds a step (fp32, one thread), so 8 steps and three evaluations
    "smollm2": dict(model="smollm2-135m-instruct", task="math:assets/smollm2/add2.jsonl",
                    verifier="rules", n_rollouts=16, prompts_per_step=4, max_new_tokens=48,
                    temperature=0.6, max_rounds=2, lr=1e-5, steps=8, eval_every=4,
                    eval_prompts=32, eval_samples=4, probe_prompts=4, probe_samples=16,
                    sample_groups=1),
    # One-GPU jobs (bf16 autocast on CUDA, --grad_ckpt); the planner lowers max_rows and micro_batch
    # to fit the device (`python brorl.py --preset X --plan`). Learning rates are untuned starting
    # points. A 0.5B instruct model on grade-school math
    "gsm8k-0.5b": dict(model="Qwen/Qwen2.5-0.5B-Instruct", task="gsm8k:openai/gsm8k:main",
                       n_rollouts=256, prompts_per_step=16, max_new_tokens=512, lr=1e-6,
                       n_minibatches=4, grad_ckpt=True, steps=200, eval_every=25, eval_prompts=256,
                       eval_samples=16),
    # A 1.5B reasoning model on DeepScaleR's competition math, 4k-token responses
    "math-1.5b": dict(model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
                      task="math:agentica-org/DeepScaleR-Preview-Dataset", n_rollouts=128,
                      prompts_per_step=8, max_new_tokens=4096, lr=2e-6, n_minibatches=4,
                      grad_ckpt=True, steps=200, eval_every=25, eval_prompts=128, eval_samples=16),
    # The paper's run (docs/paper.md §5): BroRL continues the ProRL v2 checkpoint, the hub
    # repository below at its v2 revision (pin the revision with --model id@revision; BroRL's own
    # result is the revision `brorl`), on DeepScaleR's math, 128 prompts x 512 rollouts a step, up
    # to 16k tokens a response, on 64 GPUs. lr: ProRL v2's 1e-6 (its public verl configs; the paper
    # gives only the rule) x sqrt(65,536 / 8,192 samples a step); 4 mini-batches (ProRL's 256 / 64);
    # k2 KL 1e-4 (ProRL v2's public configs); the reference reset interval is not published: 100 is
    # ours. Evaluation as the paper's: 16 samples at T 0.6, top_p 0.95 (brorl.evaluate), 32k tokens.
    # A multi-GPU job: on one 80 GB GPU even one row's update does not fit (the step's (rows, T)
    # tensors alone are 29 GB); on 8 it fits with --grad_ckpt (--plan)
    "paper": dict(model="nvidia/Nemotron-Research-Reasoning-Qwen-1.5B",
                  task="math:agentica-org/DeepScaleR-Preview-Dataset", n_rollouts=512,
                  prompts_per_step=128, max_new_tokens=16384, lr=1e-6 * math.sqrt(8),
                  n_minibatches=4, kl_coef=1e-4, ref_reset_every=100, grad_ckpt=True, steps=200,
                  eval_every=25, eval_prompts=256, eval_samples=16, eval_max_new_tokens=32768),
}
