"""
evalonly.py: --eval_only, the held-out evaluation of --model drawn exactly as a run's step-0
evaluation, written as <out>/eval.json and printed as a table. Nothing is trained. brorl.eval_only
reads as start, brorl.evaluate, finish.
"""

import dataclasses
import json
import re
import time
from pathlib import Path

import torch

from lib import answers, distributed, mass
from lib.policy import autocast
from lib.rundir import make_run_dir, write_atomic
from lib.setup import eval_generator, setup, stop_on_ctrl_c


@dataclasses.dataclass
class EvalOnly:
    """What --eval_only evaluates (start makes it): the resolved config, the device, --model and
    its tokenizer, the held-out set and the random stream of a run's step-0 evaluation, the
    folder of eval.json with its lock, and when it began."""
    cfg: object
    device: torch.device
    model: torch.nn.Module
    tok: object
    eval_set: list
    gen: torch.Generator
    out: Path
    lock: object
    t0: float


def start(cfg) -> EvalOnly:
    """--eval_only's setup: --model loaded (no optimizer, no reference) and its held-out set,
    drawn exactly as a run's step-0 evaluation (same eval set, same random stream); eval.json's
    folder made. With K processes each samples its share of the prompts and rank 0 writes."""
    stop_on_ctrl_c("interrupted: no eval.json written")
    cfg, device, _, eval_set, model, tok, _ = setup(cfg, cfg.model, "--model", with_train_set=False)
    out, lock = make_run_dir(cfg, fresh=False)  # eval.json may go beside a run's files
    return EvalOnly(cfg, device, model.eval(), tok, eval_set, eval_generator(device, cfg.seed, 0),
                    out, lock, time.perf_counter())


def finish(ev: EvalOnly, m: dict) -> dict:
    """--eval_only's report from brorl.evaluate's metrics m of ev.model, with the exact correct
    mass of each prompt (the testbed's zones) and, on the sets task, every answer's probability:
    eval.json written and printed as a table; the report returned."""
    cfg = ev.cfg
    with torch.no_grad(), autocast(cfg, ev.device):
        m.update(mass.exact_mass(ev.model, ev.tok, mass.prompt_set(cfg, ev.eval_set), cfg))
        if cfg.answer_prompts:  # the sets task: every answer of its first prompts (lib/answers.py)
            answer_set, space = ev.eval_set[: cfg.answer_prompts], answers.space(cfg.task)
            logp = answers.distribution(ev.model, ev.tok, answer_set, space, cfg.temperature,
                                        cfg.system_prompt)  # (P, A)
            m.update(answers.eval_metrics(logp, answers.right_mask(answer_set, space)))
    report = eval_report(cfg, {cfg.eval_task or cfg.task: m}, len(ev.eval_set),
                         time.perf_counter() - ev.t0)
    if distributed.is_main():
        write_eval(ev.out / "eval.json", report)
        print(eval_table(report))
        if "mass_exact_mean" in m:
            print(f"exact correct mass at T = {cfg.temperature} (lib/mass.py), "
                  f"{len(m['mass_exact_log10'])} prompts: mean Q "
                  f"{m['mass_exact_mean']:.4g}, median log10 Q {m['mass_exact_log10_median']:.2f}; "
                  f"Q >= 1/{cfg.gate_small_n}: "
                  f"{m['mass_exact_high']}, gate: {m['mass_exact_gate']}, Q < "
                  f"1/{cfg.gate_large_n}: {m['mass_exact_low']}")
        if "answers_q" in m:
            print(f"every answer of {cfg.answer_prompts} prompts (lib/answers.py): mean Q "
                  f"{m['answers_q']:.4g}, mass outside the answers {m['answers_outside']:.2g}, "
                  f"entropy {m['answers_entropy']:.3g} nats, exact pass@1024 "
                  f"{m['answers_pass@1024']:.3f}")
        ev.lock.release()
    stop_on_ctrl_c("")
    distributed.teardown()
    return report


def eval_report(cfg, metrics: dict, prompts: int, seconds: float) -> dict:
    """The eval.json of --eval_only. metrics: {benchmark: evaluate()'s dict}; the report keeps, per
    benchmark, the prompts and samples it rests on, pass@k by k, greedy pass@1, the sampled
    responses' mean length (tokens) and the share that hit the length cap; and the same responses'
    lenient reading (verify.py: the rules' verdict or the last number's): pass@1 and greedy pass@1
    under "lenient"."""
    benchmarks = {}
    for name, m in metrics.items():
        ks = sorted(int(k[len("eval_pass@"):]) for k in m if re.fullmatch(r"eval_pass@[0-9]+", k))
        benchmarks[name] = {"prompts": prompts, "samples": cfg.eval_samples,
                            "pass@k": {str(k): m[f"eval_pass@{k}"] for k in ks},
                            "greedy_pass@1": m["eval_greedy_pass@1"],
                            "mean_response_tokens": m["eval_resp_len"],
                            "truncation_rate": m["eval_truncated"]}
        if "eval_lenient_pass@1" in m:  # the same responses read leniently
            benchmarks[name]["lenient"] = {"pass@1": m["eval_lenient_pass@1"],
                                           "greedy_pass@1": m["eval_greedy_lenient_pass@1"]}
        if "mass_exact_mean" in m:  # lib/mass.py: per prompt, and its summary
            benchmarks[name]["exact_mass"] = {k[len("mass_exact_"):]: v for k, v in m.items()
                                              if k.startswith("mass_exact_")}
        if "answers_q" in m:  # lib/answers.py: every answer of --answer_prompts prompts
            benchmarks[name]["answers"] = {k[len("answers_"):]: v for k, v in m.items()
                                           if k.startswith("answers_")}
    sampling = dict(temperature=0.6, top_p=0.95, samples=cfg.eval_samples,
                    max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens, seed=cfg.seed)
    return dict(model=cfg.model, sampling=sampling, seconds=round(seconds, 2),
                benchmarks=benchmarks, config=dataclasses.asdict(cfg))


def write_eval(path: Path, report: dict):
    write_atomic(path, json.dumps(report, indent=1) + "\n")


def eval_table(report: dict) -> str:
    """One row per benchmark: pass@k for every k, greedy, mean response length, truncation rate;
    the lenient reading's pass@1 and greedy ('-' where a report lacks it)."""
    ks = sorted({int(k) for b in report["benchmarks"].values() for k in b["pass@k"]})
    s = report["sampling"]
    head = (f"{report['model']}: pass@k of {s['samples']} samples at T={s['temperature']}, "
            f"top_p={s['top_p']}, <= {s['max_new_tokens']} new tokens; greedy; "
            f"{report['seconds']:.1f}s")
    cols = ["benchmark", "prompts", *[f"pass@{k}" for k in ks], "greedy", "len", "trunc",
            "lenient pass@1", "lenient greedy"]
    lenient = lambda b, k: f"{b['lenient'][k]:.3f}" if "lenient" in b else "-"
    rows = [[name, str(b["prompts"]), *[f"{b['pass@k'].get(str(k), float('nan')):.3f}" for k in ks],
             f"{b['greedy_pass@1']:.3f}", f"{b['mean_response_tokens']:.1f}",
             f"{b['truncation_rate']:.3f}", lenient(b, "pass@1"), lenient(b, "greedy_pass@1")]
            for name, b in report["benchmarks"].items()]
    width = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i,
                               (c, w) in enumerate(zip(r, width)))
    return "\n".join([head, line(cols), *map(line, rows)])
