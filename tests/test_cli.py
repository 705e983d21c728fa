"""brorl.py's command line: --resume continues a run exactly and refuses what the checkpoint fixes,
--init_from branches a run, --eval_seed alone draws the held-out problems, bad flags fail with one clear
line and write nothing, --help documents every flag."""

import dataclasses
import json
import random
import re

import pytest
import torch

import brorl
from lib import config, errors, setup
import data
from test_brorl import SMALL, run_in_process


@pytest.mark.slow
def test_a_run_started_with_init_from_resumes_exactly(tmp_path):
    """A branch (--init_from, config.json keeps it) resumed from its own checkpoint equals the branch
    run in one go: --resume takes the branch's weights and AdamW state, not the run it began from."""
    base, one, two = tmp_path / "base", tmp_path / "one", tmp_path / "two"
    common = ["--eval_every", "1", "--device", "cpu", *SMALL]
    brorl.train(brorl.parse_config(["--steps", "1", "--out", str(base), *common]))
    branch = ["--init_from", str(base), "--init_optimizer", "1", *common]
    rows = brorl.train(brorl.parse_config(["--steps", "2", "--out", str(one), *branch]))
    brorl.train(brorl.parse_config(["--steps", "1", "--out", str(two), *branch]))
    resumed = brorl.train(brorl.parse_config(["--resume", str(two), "--steps", "2"]))
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time") and k != "tokens_per_s"}
    assert [strip(r) for r in resumed] == [strip(r) for r in rows] and resumed[-1]["step"] == 2


@pytest.mark.slow
def test_resume_continues_the_run_exactly(tmp_path):
    """4 steps in one go == 2 steps, then --resume to 4 (weights, AdamW, random streams, reference,
    metrics): a crashed or extended run loses nothing. Exact, as the training is bitwise reproducible."""
    a, b = tmp_path / "a", tmp_path / "b"
    # on the CPU: CUDA's index_add_ (an embedding's backward) is not bitwise reproducible
    common = ["--eval_every", "2", "--kl_coef", "1e-3", "--ref_reset_every", "3", "--device", "cpu", *SMALL]
    rows_a = brorl.train(brorl.parse_config(["--steps", "4", "--out", str(a), *common]))
    brorl.train(brorl.parse_config(["--steps", "2", "--out", str(b), *common]))
    assert (b / "ckpt" / "trainer_state.pt").exists() and not (b / "ckpt.old").exists()
    rows_b = brorl.train(brorl.parse_config(["--resume", str(b), "--steps", "4"]))  # the rest from b's config.json
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time") and k != "tokens_per_s"}
    assert [strip(r) for r in rows_b] == [strip(r) for r in rows_a] and len(rows_a) == 5
    on_disk = [json.loads(line)["step"] for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == [0, 1, 2, 3, 4]
    from safetensors.torch import load_file
    wa, wb = load_file(a / "ckpt" / "model.safetensors"), load_file(b / "ckpt" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_resume_takes_a_changed_lr_and_refuses_what_the_checkpoint_fixes(tmp_path, capsys):
    """AdamW's saved param groups would restore the old lr and weight decay over the new flags: the new ones
    take effect. A flag the restored state decides (the random streams of --seed, the held-out problems)
    cannot: changing it is refused with one line."""
    run = tmp_path / "run"
    brorl.train(brorl.parse_config(["--steps", "1", "--eval_every", "1", "--lr", "2e-4", "--out", str(run), *SMALL]))
    brorl.train(brorl.parse_config(["--resume", str(run), "--steps", "2", "--lr", "5e-5", "--weight_decay", "0.01"]))
    groups = torch.load(run / "ckpt" / "trainer_state.pt", weights_only=True)["opt"]["param_groups"]
    assert {(g["lr"], g["weight_decay"]) for g in groups} == {(5e-5, 0.01)}
    assert json.loads((run / "config.json").read_text())["lr"] == 5e-5
    for flag, value in [("--seed", "3"), ("--eval_seed", "2"), ("--probe_prompts", "3")]:
        code, err = run_in_process(capsys, "--resume", str(run), "--steps", "3", flag, value)
        assert code == 2 and f"{flag} {value} with --resume {run}: the checkpoint fixes it" in err, err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]  # untouched


@pytest.mark.slow
def test_init_from_starts_a_new_run_on_the_checkpoints_weights(tmp_path):
    """--init_from: the policy of a run's checkpoint, step 0, a new run directory; AdamW fresh, or the
    checkpoint's moments with --init_optimizer (at this run's lr). lr 1e-12 leaves the weights as loaded,
    to 1e-9 (AdamW moves each weight by about lr a step; training moved them by ~1e-4)."""
    from safetensors.torch import load_file
    src = tmp_path / "src"
    brorl.train(brorl.parse_config(["--steps", "2", "--eval_every", "2", "--out", str(src), *SMALL]))
    for init_optimizer in (False, True):
        out = tmp_path / f"branch-{init_optimizer}"
        rows = brorl.train(brorl.parse_config(["--init_from", str(src), "--init_optimizer", str(init_optimizer),
                                               "--lr", "1e-12", "--steps", "1", "--eval_every", "1", "--out", str(out), *SMALL]))
        assert [r["step"] for r in rows] == [0, 1]
        w_src, w_out = load_file(src / "ckpt" / "model.safetensors"), load_file(out / "ckpt" / "model.safetensors")
        assert all(torch.allclose(w_src[k], w_out[k], rtol=0, atol=1e-9) for k in w_src)
        opt = torch.load(out / "ckpt" / "trainer_state.pt", weights_only=True)["opt"]
        steps = {float(v["step"]) for v in opt["state"].values()}  # AdamW updates each parameter has had
        assert steps == {2.0 + 4.0 * init_optimizer}  # 2 mini-batches a step; the source made 2 steps
        assert {g["lr"] for g in opt["param_groups"]} == {1e-12}  # this run's lr, not the checkpoint's
        assert json.loads((out / "config.json").read_text())["model"] == str(src / "ckpt")  # the weights it began from


def test_eval_set_is_drawn_by_eval_seed_alone():
    """Runs of every --seed score the same held-out problems (--eval_seed); a seed-0 run's are those
    that --seed 0 drew before --eval_seed existed."""
    draw = lambda *a: [e["prompt"] for e in setup.setup(brorl.parse_config([*a, "--eval_prompts", "8"]),
                                                         str(data.EMBEDDED_MODEL), "--model", with_train_set=False)[3]]
    before = [e["prompt"] for e in random.Random(1).sample(data.load_task("arith", "test", seed=0), 8)]
    assert draw("--seed", "0") == draw("--seed", "1") == before
    assert draw("--seed", "1", "--eval_seed", "1") != before


@pytest.mark.parametrize("args, needle", [
    (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
    (["--n_rollouts", "1"], "--n_rollouts 1: need N >= 2"),
    (["--model", "./does/not/exist"], "--model ./does/not/exist: no such directory"),
    (["--adv_norm", "median"], "--adv_norm 'median'"),
    (["--old_logp", "trainer"], "--old_logp 'trainer': choose auto, sampler, recompute"),
    (["--preset", "nope"], "--preset 'nope': unknown"),
    (["--save", "flase"], "argument --save: 'flase' is not a boolean"),
    (["--resume", "/nonexistent/run"], "--resume /nonexistent/run: no checkpoint to resume"),
    (["--init_from", "/nonexistent/run"], "--init_from /nonexistent/run: no such directory"),
    (["--init_optimizer"], "--init_optimizer loads the AdamW state of --init_from: name one"),
    (["--task", "math:/nonexistent.jsonl"], "--task math:/nonexistent.jsonl"),
])
def test_bad_flags_fail_with_one_clear_line_and_write_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "run"
    code, err = run_in_process(capsys, *args, "--out", str(out), "--steps", "1")
    assert code != 0 and needle in err, err[-1500:]
    assert not out.exists()


def test_fail_is_one_line_and_exit_status_2(capsys):
    """lib/errors.fail: "error: <what>" alone on stderr, then a BadInput, which is a SystemExit of
    status 2 (the interpreter exits with it, no traceback) that a caller can tell from another."""
    with pytest.raises(errors.BadInput) as stop:
        errors.fail("--lr -1.0: need lr > 0 (0 trains nothing)")
    assert isinstance(stop.value, SystemExit) and stop.value.code == 2
    assert stop.value.line == "--lr -1.0: need lr > 0 (0 trains nothing)"
    assert capsys.readouterr().err == "error: --lr -1.0: need lr > 0 (0 trains nothing)\n"


def test_unwritable_out_fails_cleanly(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the run directory's parent should be
    code, err = run_in_process(capsys, "--out", str(blocker / "run"), "--steps", "1", *SMALL)
    assert code != 0 and f"--out {blocker / 'run'}: cannot write there" in err


FLOATS = [f.name for f in dataclasses.fields(brorl.Config) if f.type is float]
EXTREMES = ["0", "1e-40", "-1e-40", "1e39", "-1e39", "nan", "inf", "-inf", "-1"]
# What a flag needs beside it to count (else it is refused as changing nothing).
BESIDE = {"alloc_decay": ["--alloc", "adaptive"], "lora_alpha": ["--lora_rank", "4"],
          "gspo_clip_low": ["--loss", "gspo"], "gspo_clip_high": ["--loss", "gspo"],
          "sapo_tau_pos": ["--loss", "sapo"], "sapo_tau_neg": ["--loss", "sapo"]}


def holds(x: float, dtype) -> bool:
    """Whether a tensor of dtype holds x as what it is: finite, and 0 or a normal number (a
    subnormal has lost digits, and bf16 hardware may flush it to 0)."""
    t = torch.tensor(x, dtype=torch.float64).to(dtype)
    return bool(t.isfinite()) and (x == 0 or t.abs().item() >= torch.finfo(dtype).tiny)


def computable(name: str, x: float) -> bool:
    """Whether a run computes with --name x: the dtypes that read it hold it (float64 for the flags
    only Python reads: the planner's memory, the clock, the allocation's counts; float32 and
    bfloat16 for the rest), and SAPO's 4 / tau and the logits' 1 / T too."""
    dtypes = ([torch.float64] if name in ("memory_gb", "time_budget", "alloc_decay")
              else [torch.float32, torch.bfloat16])
    derived = {"sapo_tau_pos": 4, "sapo_tau_neg": 4, "temperature": 1}
    values = [x] + ([derived[name] / x] if name in derived and x else [])
    return all(holds(v, dt) for v in values for dt in dtypes)


@pytest.mark.parametrize("name", FLOATS)
def test_every_float_flag_at_its_extremes_is_one_line_or_computable(capsys, name):
    """Each float flag of the Config at 0, a subnormal, past float32's range, nan, inf and
    negative: either one line naming the flag (exit status 2, at parse time, before any work) or a
    config whose value the run's dtypes hold (--sapo_tau_pos 1e39 once overflowed float32 at step 1,
    1e-40 stopped on a NaN gradient, both after the step-0 evaluation)."""
    for value in EXTREMES:
        try:
            cfg = brorl.parse_config([f"--{name}", value, *BESIDE.get(name, [])])
        except SystemExit as stop:
            err = capsys.readouterr().err
            assert stop.code == 2 and len(err.strip().splitlines()) == 1, (value, err)
            assert f"--{name}" in err and "Traceback" not in err, (value, err)
            continue
        assert computable(name, getattr(cfg, name)), (name, value)


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        brorl.parse_config(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(brorl.Config):
        assert f"--{f.name}" in text
    assert set(config.field_help(brorl.Config)) == {f.name for f in dataclasses.fields(brorl.Config)}
    flat = " ".join(text.split())  # argparse wraps lines
    assert "(default: 512)" in flat and "(default: the embedded tiny model)" in flat  # the real defaults


# Abbreviations in flag names, and the word a help that names its flag spells them with
SPELLED = {"lr": "learning", "kl": "kl", "tis": "importance", "adv": "advantage",
           "agg": "aggregation", "gb": "memory"}
# Words of flag names that name nothing on their own
GENERIC = {"max", "min", "new", "per", "every", "from", "only"}


def test_every_flags_help_says_what_it_is():
    """Each flag's --help says what the flag is on its own, since --help shows no block comment
    above a field: outside its parentheses at least four words, one of them a word of the flag's
    own name (or its abbreviation's spelling), so that no help is only a range, a default or a
    list of choices ("n prompts; 0: off" for --answer_prompts named nothing)."""
    bare = []
    for name, text in config.field_help(brorl.Config).items():
        prose = text
        while re.search(r"\([^()]*\)", prose):  # parentheses out, the inner first
            prose = re.sub(r"\([^()]*\)", " ", prose)
        tokens = re.findall(r"[a-z][a-z-]*", prose.lower())
        words = {w for t in tokens for w in (t.replace("-", ""), *t.split("-"))}
        named = [SPELLED.get(w, w) for w in name.split("_")
                 if w in SPELLED or (len(w) > 2 and w not in GENERIC)]
        if len(tokens) < 4 or not any(w.startswith(n[:5]) for n in named for w in words):
            bare.append(f"--{name}: {text}")
    assert bare == []


# Each Config field that COUNTS_ONLY_WITH does not hold, and why: one every run reads, one whose
# own entry of check_config refuses it out of place, or one that counts with the task, or with two
# settings at once (which COUNTS_ONLY_WITH, one other flag a field, does not say).
EVERY_RUN = {"eval_task", "eval_seed", "system_prompt", "long_prompts", "device", "max_rows",
             "micro_batch", "grad_ckpt", "memory_gb", "plan", "time_budget", "probe_prompts",
             "probe_samples", "sample_prompts", "sample_responses", "sample_groups", "out", "save",
             "report_to", "resume", "init_from", "preset", "eval_only", "model", "task", "seed",
             "dtype", "n_rollouts", "prompts_per_step", "max_new_tokens", "temperature", "top_p",
             "dynamic_sampling", "alloc", "adv_norm", "focal_gamma", "train_rollouts", "lr",
             "weight_decay", "n_minibatches", "grad_clip", "old_logp", "lora_rank", "loss",
             "tis_cap", "loss_agg", "kl_coef", "steps", "eval_every", "eval_prompts", "eval_samples",
             "eval_max_new_tokens"}
OWN_CHECK = {"train_prompts", "answer_prompts", "mass_balance", "init_optimizer"}
WITH_THE_TASK = {"digits", "verifier", "mass_prompts", "gate_small_n", "gate_large_n"}
WITH_TWO = {"max_rounds"}  # dynamic sampling's rounds: --dynamic_sampling and --alloc uniform


def test_every_field_that_counts_only_with_another_is_refused_alone(capsys):
    """Every Config field is classified: COUNTS_ONLY_WITH, or a list above; a new field fails here
    until it is. Each COUNTS_ONLY_WITH flag typed where its other flag does not make it count is one
    line naming that flag (exit 2); a preset's values are never refused."""
    from lib import checks
    from lib.objectives import OBJECTIVES
    fields = {f.name: f for f in dataclasses.fields(brorl.Config)}
    lists = [set(checks.COUNTS_ONLY_WITH), EVERY_RUN, OWN_CHECK, WITH_THE_TASK, WITH_TWO]
    assert sum(map(len, lists)) == len(set().union(*lists)), "a field in two lists"
    assert set(fields) == set().union(*lists), set(fields) ^ set().union(*lists)
    typed = {float: "1.5", int: "3", bool: "true", str: "q_proj"}  # values the checks accept
    own = {"budget_clock": "cpu", "alloc_decay": "0.5", "clip_low": "0.5", "gspo_clip_low": "0.5"}
    for name, (other, values) in checks.COUNTS_ONLY_WITH.items():
        value = own.get(name, typed[fields[name].type])
        # The other flag at its default, or where that makes it count, another loss.
        beside = [] if values is None or fields[other].default not in values else [
            f"--{other}", next(x for x in OBJECTIVES if x not in values)]
        with pytest.raises(SystemExit) as stop:
            brorl.parse_config([f"--{name}", value, *beside])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, (name, err)
        assert f"--{name} " in err and f"counts only with --{other}" in err, (name, err)
        preset = {name: True if fields[name].type is bool else fields[name].type(value)}
        assert config.parse_config(brorl.Config, "", ["--preset", "x"], {"x": preset})


def test_a_loss_flag_with_another_loss_and_lora_alpha_without_lora_are_one_line(capsys):
    """The issue's three: --sapo_tau_pos with --loss ppo, --gspo_clip_low with ppo, --lora_alpha
    without LoRA, each refused in one line; with their loss (and LoRA) they parse."""
    for flags, line in [
            (["--sapo_tau_pos", "2"], "--sapo_tau_pos 2.0: counts only with --loss sapo (this run's "
             "--loss is ppo); drop it, or add --loss sapo"),
            (["--gspo_clip_low", "0.1"], "--gspo_clip_low 0.1: counts only with --loss gspo"),
            (["--lora_alpha", "16"], "--lora_alpha 16.0: counts only with --lora_rank (this run has "
             "none); drop it, or set --lora_rank"),
            (["--loss", "gspo", "--clip_high", "0.3"], "--clip_high 0.3: counts only with --loss ppo "
             "or cispo (this run's --loss is gspo)")]:
        with pytest.raises(SystemExit) as stop:
            brorl.parse_config(flags)
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and line in err and len(err.splitlines()) == 1, err
    assert brorl.parse_config(["--loss", "sapo", "--sapo_tau_pos", "2"]).sapo_tau_pos == 2
    assert brorl.parse_config(["--loss", "cispo", "--clip_high", "0.3"]).clip_high == 0.3
    assert brorl.parse_config(["--lora_rank", "4", "--lora_alpha", "16"]).lora_alpha == 16
