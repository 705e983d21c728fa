"""
bench_trl.py: TRL's GRPOTrainer on the bench model, for the side-by-side figure in docs/results/speed.md.
Runs inside TRL's own venv (tools/bench_trl.sh makes it); imports nothing from brorl.

One brorl step = 2 prompts x N rollouts, 32 new tokens, 2 optimizer steps (n_minibatches=2),
micro-batch 64, old log-probs computed once before the update. The TRL equivalent: a generation
batch of 2N completions (steps_per_generation = 2N / 64 micro-batches of 64), gradient
accumulation over half of them (2 optimizer steps per generation batch), num_iterations=1 (TRL
then also computes old log-probs with a separate forward), beta=0 (no reference model),
token-level loss (loss_type "dapo", the default), min_new_tokens=32 so every completion is full
length. One "step" below is one generation batch, timed from optimizer step to optimizer step.

A real model (`--model_dir` its folder, `--prompts` the prompts.json that `python -m tools.bench
--save DIR --model NAME` writes): a model with a chat template gets each prompt as the user's
message, which TRL renders with that template, as brorl's sampler does (sampler.encode_prompt).
`--dtype bfloat16` is GRPOConfig(bf16=True): accelerate's autocast around the model's forward
(generation's included), the weights and AdamW fp32, as brorl's --dtype bfloat16.

  bash tools/bench_trl.sh                         # N=512, then N=64
  bash tools/bench_trl.sh --model smollm2-135m-instruct 64 --new 16 --micro_batch 32
  bash tools/bench_trl.sh --model smollm2-135m-instruct 64 --new 16 --dtype bfloat16
  /tmp/trl-venv/bin/python tools/bench_trl.py --model_dir DIR --n 512 --steps 3
"""

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

# Run as a script (python tools/bench_trl.py), never with the repository root on the import path: brorl's
# kernels.py would shadow the optional `kernels` package that transformers probes for. TRL, datasets
# and transformers are imported in main(): the arguments are read (and tested) without them.
import torch


def peak_rss_mb() -> float:
    """Peak RSS of this process: VmHWM (ru_maxrss would include a big parent's peak, see bench.py)."""
    status = Path("/proc/self/status")
    if status.exists():
        return next(int(ln.split()[1]) for ln in status.read_text().splitlines() if ln.startswith("VmHWM")) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def trivial_reward(completions, **kwargs):
    """1 if the completion has an even number of characters '7', else 0: cheap, not constant."""
    return [float(c.count("7") % 2 == 0) for c in completions]


def step_timer(per: int):
    """A TrainerCallback recording the wall time of each generation batch (`per` optimizer steps)
    and the logged lengths; built here, as transformers is imported only when TRL runs."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.marks, self.lengths = [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % per == 0:
                self.marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])
    return StepTimer()


class OneLineParser(argparse.ArgumentParser):
    """Refusals in one line, exit status 2 (brorl's lib.config has its own; this file imports
    nothing from brorl)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}\n")


def parse_args(argv=None):
    """The flags, and the prompts file resolved: --prompts, else prompts.json in --model_dir."""
    ap = OneLineParser(prog="python tools/bench_trl.py")  # with TRL's venv's python
    ap.add_argument("--model_dir", required=True,
                    help="the model's folder: one written by `python -m tools.bench --save DIR`, "
                         "or a real model's with --prompts")
    ap.add_argument("--prompts", default="",
                    help="the step's prompts (a JSON list of {prompt, answer}); default "
                         "MODEL_DIR/prompts.json")
    ap.add_argument("--n", type=int, default=512, help="rollouts per prompt (num_generations)")
    ap.add_argument("--new", type=int, default=32, help="new tokens per completion, forced")
    ap.add_argument("--micro_batch", type=int, default=64, help="per_device_train_batch_size")
    ap.add_argument("--minibatches", type=int, default=2, help="optimizer steps per generation batch")
    ap.add_argument("--steps", type=int, default=3, help="timed generation batches (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gradient_checkpointing", type=int, default=0, help="TRL's default is 1 (slower)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: GRPOConfig(bf16=True), TRL's mixed precision (accelerate's "
                         "autocast; the weights and AdamW stay fp32, as brorl's --dtype bfloat16)")
    args = ap.parse_args(argv)
    args.prompts = Path(args.prompts or Path(args.model_dir) / "prompts.json")
    if not args.prompts.is_file():
        ap.error(f"--prompts {args.prompts}: no such file (write it with `python -m tools.bench "
                 "--save DIR`, with --model for a real model)")
    return args


def load_prompts(file: Path, chat: bool) -> list:
    """The saved prompts as TRL takes them: the user's message of a conversation where the model
    has a chat template (TRL applies it, with the generation prompt), else the plain text."""
    texts = [p["prompt"] for p in json.loads(file.read_text())]
    return [[{"role": "user", "content": t}] for t in texts] if chat else texts


def main():
    args = parse_args()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    prompts = load_prompts(args.prompts, bool(tok.chat_template))
    gen_batch = len(prompts) * args.n  # completions per step
    micro_steps = gen_batch // args.micro_batch  # steps_per_generation
    assert gen_batch % (args.micro_batch * args.minibatches) == 0, "2N must split into micro-batches"
    runs = 1 + args.steps  # warm-up + timed generation batches
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)  # default attention: sdpa
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=args.dtype == "bfloat16", report_to="none",
            save_strategy="no",
            logging_steps=1, disable_tqdm=True, seed=0, shuffle_dataset=False,
            num_generations=args.n, per_device_train_batch_size=args.micro_batch,
            steps_per_generation=micro_steps, gradient_accumulation_steps=micro_steps // args.minibatches,
            max_steps=runs * args.minibatches, num_iterations=1, beta=0.0, learning_rate=5e-4,
            max_grad_norm=1.0, max_completion_length=args.new, temperature=1.0, top_p=1.0, top_k=0,
            generation_kwargs={"min_new_tokens": args.new}, gradient_checkpointing=bool(args.gradient_checkpointing),
        )
        timer = step_timer(per=args.minibatches)
        trainer = GRPOTrainer(model=model, reward_funcs=trivial_reward, args=cfg, processing_class=tok,
                              train_dataset=Dataset.from_list([{"prompt": p} for p in prompts] * runs),
                              callbacks=[timer])
        trainer.train()
    step_s = [b - a for a, b in zip(timer.marks, timer.marks[1:])][1:]  # drop the warm-up batch
    assert all(abs(x - args.new) < 1e-6 for x in timer.lengths), f"lengths not forced: {timer.lengths}"
    med = statistics.median(step_s)
    res = dict(n=args.n, step_s=med, completions_s=gen_batch / med,
               peak_rss_mb=peak_rss_mb(),
               steps=[round(x, 2) for x in step_s], gradient_checkpointing=args.gradient_checkpointing,
               threads=torch.get_num_threads(),  # as TRL left it (accelerate may change it)
               dtype=args.dtype)
    print(f"TRL GRPOTrainer N={args.n}, {args.dtype}: {res['completions_s']:.0f} completions/s, "
          f"{med:.2f} s per step "
          f"({gen_batch} completions), peak RSS {res['peak_rss_mb']:.0f} MB; steps {res['steps']}")
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
