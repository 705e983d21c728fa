"""
harness.py: a training run as one object around the algorithm in brorl.py. start() sets it up
(lib/setup.py, the LoRA adapter, --grad_ckpt, the memory plan, the run directory, FSDP) and returns
a Run, which restores a checkpoint (--resume, --init_from), yields the steps, keeps the training
clock and --time_budget, and logs each step's row (lib/steplog.py, lib/rundir.py) and checkpoint
(lib/checkpoint.py). The command line itself is lib/config.py.
"""

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import data
from lib import distributed, report, samples
from lib.checkpoint import checkpoint_dir, load_optimizer, read_trainer_state, save_atomic
from lib.diagnostics import first_references
from lib.errors import fail
from lib.lora import add_lora, is_lora, trainable
from lib.objectives import OBJECTIVES, aggregation
from lib.policy import autocast, compute_dtype, enable_grad_ckpt
from lib.rundir import (check_writable, make_run_dir, open_metrics, read_metrics, record_changes,
                        surviving_checkpoint, write_atomic, writes_are_one_line)
from lib.plan import plan_memory
from lib.setup import setup, stop_on_ctrl_c
from lib.steplog import log_line, plot_metrics


# The files a run writes into its directory besides ckpt/ and answers/.
RUN_WRITES = ("config.json", "config_history.jsonl", "metrics.jsonl", "metrics.png",
              "samples.jsonl")


class Clock:
    """Training time so far, evaluations and checkpoints excluded (their cost must favour no
    config): wall seconds, and this process's CPU seconds (all its threads), which other processes
    cannot inflate. `with clock:` around a step's training; then `spent`: --time_budget is used up
    (rank 0 decides, so that every rank stops after the same step)."""

    def __init__(self, cfg, last_row: dict):
        self.cfg, self.spent = cfg, False
        self.total = {k: last_row.get(k, 0.0) for k in ("time_train_wall", "time_train_cpu")}

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, error, *_):
        # no collective on the way out of a failure: the other ranks may be inside one
        if error is not None:
            return
        self.total["time_train_wall"] += time.perf_counter() - self.wall
        self.total["time_train_cpu"] += time.process_time() - self.cpu
        used = self.total[f"time_train_{self.cfg.budget_clock}"]
        self.spent = distributed.broadcast(0 < self.cfg.time_budget <= used)


class Run:
    """A training run's machinery (start() makes one): the resolved config, device, data, the policy
    (the model trained, K > 1 sharded by FSDP2) and its full replica (rollouts, evaluation,
    checkpoints), the run directory and its metrics, the clock. Rank 0 alone prints and writes."""

    def __init__(self, cfg, device, train_set, eval_set, model, replica, tok, out,
                 lock, state, rows, first_answers=None):
        self.cfg, self.device, self.train_set, self.eval_set = cfg, device, train_set, eval_set
        self.model, self.replica, self.tok, self.out, self.lock = model, replica, tok, out, lock
        # --resume: the checkpoint's trainer_state.pt (read_trainer_state), else None
        self.state = state
        self.main = distributed.is_main()
        # --resume with --answer_prompts: the first eval's answer distribution (P, A)
        self.first_answers = first_answers
        # rows: --resume's, up to its checkpoint
        self.rows, self.metrics_file, self.clock = rows, None, Clock(cfg, {})
        # restore() sets them: what checkpoints save
        self.opt = self.ref_model = self.rng = self.gen_cpu = None
        self.estimate = None  # and --alloc adaptive's per-prompt estimate (restore())
        # samples.jsonl holds what the model wrote; restore() opens the dashboards.
        self.samples_path, self.report = out / "samples.jsonl", None
        # what a failed write or a stop leaves: said in its one line
        self.kept = f"--resume {out} continues from its last checkpoint, or from step 0 if none"

    def say(self, line: str):
        if self.main:
            tqdm.write(line)

    def amp(self):
        """The autocast region of the compute dtype, around forwards only (policy.autocast)."""
        return autocast(self.cfg, self.device)

    def restore(self, opt, ref_model, rng, gen_cpu, estimate=None) -> tuple:
        """(first step, keep_est, q_start). --resume: where the checkpoint left off (weights, AdamW,
        the reference, every random stream, the metrics logged up to it); --init_from with
        --init_optimizer: its AdamW moments on a new run; else a fresh start (0, 0.5, None).
        estimate: an object with state_dict() and load_state_dict() (--alloc adaptive's per-prompt
        Q, lib/allocation.py), saved in every checkpoint and restored from one that holds it."""
        self.opt, self.ref_model, self.rng, self.gen_cpu = opt, ref_model, rng, gen_cpu
        self.estimate = estimate
        start, keep_est, q_start, resumed = 0, 0.5, None, bool(self.state)
        if self.state:
            # The state is let go here: its AdamW moments are loaded into opt, not kept twice.
            state, self.state = self.state, None
            start, keep_est, q_start = state["step"], state["keep_est"], state["q_start"]
            load_optimizer(self.model, opt, state, self.cfg, f"--resume {self.cfg.resume}")
            rng.setstate(state["rng"])
            gen_cpu.set_state(state["gen_cpu"])
            # A checkpoint without a reference (a KL switched on only now) starts it here.
            if ref_model is not None and state["ref"] is not None:
                ref_model.load_state_dict(state["ref"])
            # A checkpoint without a per-prompt estimate starts it afresh here.
            if estimate is not None and state.get("estimate") is not None:
                estimate.load_state_dict(state["estimate"])
            self.say(f"resumed {self.out} at step {start}")
        elif self.cfg.init_optimizer:
            # a new run (step 0, its own random streams) on the old run's AdamW moments
            init = checkpoint_dir(self.cfg.init_from)
            load_optimizer(self.model, opt,
                           torch.load(init / "trainer_state.pt", map_location="cpu",
                                      weights_only=True), self.cfg,
                           f"--init_from {self.cfg.init_from}")
        if self.main:  # every file the run writes, checked before the first is written
            with writes_are_one_line(self.out, "the run did not start; nothing was written"):
                check_writable(self.out, files=RUN_WRITES,
                               folders=("answers",) if self.cfg.answer_prompts else ())
        with writes_are_one_line(self.out, f"the run did not start; {self.kept}"):
            if self.main and self.cfg.resume:  # what changed, kept beside config.json (the latest)
                record_changes(self.out, start, self.cfg)
            if self.main:  # the run directory is written once everything has loaded
                write_atomic(self.out / "config.json",
                             json.dumps(dataclasses.asdict(self.cfg), indent=1))
            self.metrics_file = (open_metrics(self.out, self.rows) if self.main
                                 else open(os.devnull, "w"))
            if self.main:  # samples.jsonl as its checkpoint left it (a fresh start: empty)
                samples.rewind(self.samples_path, start if resumed else -1)
                # in case the run stopped between its checkpoint and the thinning
                samples.thin(self.samples_path)
            self.report = report.Report(self.cfg, self.out, start, self.main)
        self.clock = Clock(self.cfg, self.rows[-1] if self.rows else {})
        return start, keep_est, q_start

    def steps(self, start: int):
        """The steps after `start` up to --steps, with a progress bar; none after the one that spent
        --time_budget."""
        for step in tqdm(range(start + 1, self.cfg.steps + 1), desc="brorl", dynamic_ncols=True,
                         file=sys.stderr, initial=start, total=self.cfg.steps,
                         disable=not self.main):
            yield step
            if self.clock.spent:
                self.say(f"time budget spent: "
                         f"{self.clock.total[f'time_train_{self.cfg.budget_clock}']:.1f} s "
                         f"({self.cfg.budget_clock}) >= --time_budget {self.cfg.time_budget:g}; "
                         f"stopped after step {step}")
                return

    def eval_due(self, step: int) -> bool:
        """Evaluate (and checkpoint) after this step: every --eval_every, at the last, or the budget
        is spent."""
        return step % self.cfg.eval_every == 0 or step == self.cfg.steps or self.clock.spent

    def log(self, m: dict, keep_est: float = 0.5, q_start=None):
        """Step m's row, with the training clock, to metrics.jsonl and the log line; at an
        evaluation also (--save) the checkpoint, which holds keep_est, the step-0 probe mass and the
        row itself, then metrics.png. The responses m carries (brorl.evaluate's, rl_step's with
        --sample_groups) go to samples.jsonl instead. An eval row lands after its checkpoint: a
        kill in between leaves the checkpoint and --resume takes the row from it, so a row of an
        evaluated step never outlives a checkpoint that was not written."""
        records = [r for key in ("train_responses", "eval_responses") for r in m.pop(key, [])]
        m.update(self.clock.total)
        self.rows.append(m)
        evaluated = "eval_pass@1" in m and m["step"] > 0
        if self.main and records:  # (records after the checkpoint's step are rewound on --resume)
            with writes_are_one_line(self.out, f"samples.jsonl and metrics.jsonl lack step "
                                               f"{m['step']}; {self.kept}"):
                samples.append(self.samples_path, m["step"], records)
        if evaluated and self.cfg.save:
            self.checkpoint(m["step"], keep_est, q_start, m)
        with writes_are_one_line(self.out, f"metrics.jsonl lacks step {m['step']}'s row; "
                                           f"{self.kept}"):
            self.metrics_file.write(json.dumps(m) + "\n")
            self.metrics_file.flush()
        with writes_are_one_line(self.out, f"metrics.png or the dashboards miss step {m['step']}, "
                                           f"whose row metrics.jsonl holds; {self.kept}"):
            if evaluated and self.main:
                # The plot is refreshed at every eval, not only at the end.
                plot_metrics(self.rows, self.out / "metrics.png")
            self.report.log(m, records)  # --report_to's dashboards
        if evaluated and self.main:  # after the checkpoint: a resumed run's file is then this one
            with writes_are_one_line(self.out, f"samples.jsonl was not thinned; {self.kept}"):
                samples.thin(self.samples_path)
        self.say(log_line(m) if m["step"] > 0 else
                 "eval step 0: " + " ".join(f"{k}={v:.3f}" for k, v in m.items()
                                            if isinstance(v, float)))

    def checkpoint(self, step: int, keep_est: float, q_start, row: dict):
        # K > 1: the shards gathered onto rank 0
        opt_state = distributed.optimizer_state(self.model, self.opt)
        # row: the step's metrics row as JSON, which --resume restores if metrics.jsonl lacks it
        state = dict(step=step, keep_est=keep_est, q_start=q_start, opt=opt_state,
                     rng=self.rng.getstate(), gen_cpu=self.gen_cpu.get_state(),
                     world_size=distributed.world_size(), ref=self.ref_model.state_dict()
                     if self.ref_model is not None else None, row=json.dumps(row))
        if self.estimate is not None:  # --alloc adaptive: the per-prompt estimate of Q
            state["estimate"] = self.estimate.state_dict()
        if self.main:
            save_atomic(self.replica, self.tok, self.cfg, state, self.out / "ckpt")

    def finish(self) -> list:
        self.metrics_file.close()
        self.report.close()
        if self.lock:
            self.lock.release()
        stop_on_ctrl_c("")  # Python's own handling again
        first, last = self.rows[0], self.rows[-1]
        if "eval_pass@1" in last:
            self.say(f"held-out pass@1 {first['eval_pass@1']:.3f} -> {last['eval_pass@1']:.3f}, "
                     f"pass@k {first['eval_pass@k']:.3f} -> {last['eval_pass@k']:.3f}; "
                     f"wrote {self.out}")
        distributed.teardown()
        return self.rows


def check_estimate(cfg, estimate: dict, train_set: list):
    """--alloc adaptive's per-prompt estimate, saved by position in the training set, against this
    training set: another size (--train_prompts changed on resume) is one line, before any write."""
    if len(estimate["a"]) != len(train_set):
        fail(f"--resume {cfg.resume}: its checkpoint's --alloc adaptive estimate covers "
             f"{len(estimate['a'])} training prompts, this run's training set holds "
             f"{len(train_set)} (--train_prompts {cfg.train_prompts}): resume with the run's own "
             "training set, or start a new run from it with --init_from")


def start(cfg) -> Run:
    """Set a training run up: seeds, processes, data, the policy (--resume: the checkpoint's;
    --init_from: that run's policy), a LoRA adapter, --grad_ckpt, the memory plan (lowers max_rows
    and micro_batch to fit), the run directory, locked, and K > 1: the model sharded with a full
    replica beside it. Every refusal comes before the run directory is touched; config.json is
    written by Run.restore."""
    report.require(cfg.report_to)  # a missing dashboard package: one line, before any work
    stop_on_ctrl_c("interrupted before the run began: nothing written")
    # This note is said first, before any other output.
    own = OBJECTIVES[cfg.loss].aggregation  # what --loss_agg auto runs with this loss
    if own != "token" and aggregation(cfg.loss, cfg.loss_agg) != own and distributed.is_main():
        print(f"note: --loss {cfg.loss} with --loss_agg {cfg.loss_agg}: not {cfg.loss.upper()}'s "
              f"per-{own} mean (--loss_agg {own}, {cfg.loss}'s default)")
    # The checkpoint is ckpt/, or what a crash in its save left.
    ckpt = surviving_checkpoint(Path(cfg.resume)) if cfg.resume else None
    state = read_trainer_state(ckpt, cfg) if ckpt else None
    say = tqdm.write if distributed.is_main() else (lambda line: None)
    # The rows logged after that checkpoint are redone.
    rows = read_metrics(Path(cfg.resume), state["step"], say) if ckpt else []
    if ckpt and state.get("row") and not (rows and rows[-1]["step"] == state["step"]):
        # Killed between its checkpoint and that step's row: the row the checkpoint holds.
        rows.append(json.loads(state["row"]))
    # --init_from: the weights (and with --init_optimizer AdamW's moments) come from there.
    init = checkpoint_dir(cfg.init_from) if cfg.init_from else None
    if cfg.init_optimizer and not (init / "trainer_state.pt").is_file():
        fail(f"--init_optimizer: {init} holds no trainer_state.pt "
             "(a policy alone has no AdamW state)")
    flag = "--resume" if ckpt else "--init_from" if init else "--model"
    policy = str(ckpt or init or cfg.model)
    cfg, device, train_set, eval_set, model, tok, longest = setup(cfg, policy, flag)
    if state and cfg.alloc == "adaptive" and state.get("estimate") is not None:
        check_estimate(cfg, state["estimate"], train_set)
    if init:  # config.json names the weights the run began from
        cfg = dataclasses.replace(cfg, model=str(init))
    if cfg.lora_rank and not is_lora(model):  # (a LoRA checkpoint is loaded with its adapter)
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    if cfg.grad_ckpt:
        enable_grad_ckpt(model)
    cfg = plan_memory(cfg, model.config, tok, train_set, device, prompt_tokens=longest)
    # What the measures compare with the first eval, checked before anything is written.
    first_answers = first_references(cfg, Path(cfg.resume), eval_set, state) if ckpt else None
    out, lock = make_run_dir(cfg, resume_from=ckpt, fresh=not cfg.resume)  # (no ckpt: from step 0)
    stop_on_ctrl_c(f"interrupted: {out} keeps its last checkpoint, if it has one "
                   f"(--resume {out} continues from it, or from step 0 if none)" if cfg.save else
                   f"interrupted: {out} holds no checkpoint (--save 0): nothing to continue")
    dtype = compute_dtype(cfg, device)
    say(json.dumps(dataclasses.asdict(cfg), indent=1))
    say(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params "
        f"({sum(p.numel() for p in trainable(model)) / 1e6:.3f}M trained), {device}, {dtype}, "
        f"{distributed.world_size()} process(es); train {len(train_set)} prompts, "
        f"eval {len(eval_set)}; verifier {cfg.verifier}; run dir {out}")
    # keys and sets: the held-out set is the training set, by design.
    if data.task_of(cfg.task).train_is_eval:
        say(f"task {cfg.task}: evaluated on {len(eval_set)} of its own training prompts, by design "
            "(Theorem 1 is per prompt; data.py)")
    # K > 1: the model's parameters, gradients and AdamW state are sharded (FSDP2); a full replica
    # samples the rollouts and is what is evaluated and saved. K = 1: the replica is the model.
    model, replica = distributed.shard(model, dtype)
    return Run(cfg, device, train_set, eval_set, model, replica, tok, out, lock, state, rows,
               first_answers)
