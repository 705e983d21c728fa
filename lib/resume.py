"""
resume.py: what --resume takes from a run's directory: the run's own config.json, checked (a
checkpoint to continue, the same directory as --out, no field this Config lacks), then the flags
given; which fields an older config.json may lack and what they stand for (FIELDS_SINCE_RESUME,
ADDED_FIELDS), and which flags the checkpoint fixes (FIXED_ON_RESUME). Each refusal is one line.
"""

import dataclasses
import json
from pathlib import Path

from lib import distributed
from lib.errors import fail
from lib.rundir import evaluated_step, surviving_checkpoint



def resumed_config(config_cls, overrides: dict, preset: str) -> dict:
    """--resume: the run's own config.json, checked: a checkpoint to continue (ckpt/, or the whole
    one a crash inside its save left), the same directory as --out, no --preset, no field this
    Config lacks, no flag changed that the checkpoint fixes."""
    run = Path(overrides["resume"])
    if overrides.get("init_from"):
        fail("--init_from starts a new run from a checkpoint; --resume continues one: not both")
    if (run / "trainer_state.pt").is_file() or (run.name in ("ckpt", "ckpt.tmp", "ckpt.old")
                                                 and (run.parent / "metrics.jsonl").is_file()):
        fail(f"--resume {run}: a run's checkpoint folder; give the run directory: "
             f"--resume {run.parent}")
    if not (run / "config.json").is_file():
        fail(f"--resume {run}: no checkpoint to resume ({run / 'config.json'} is missing)")
    if surviving_checkpoint(run) is None and (step := evaluated_step(run)):  # it was deleted
        fail(f"--resume {run}: no checkpoint to resume ({run / 'ckpt' / 'trainer_state.pt'}"
             f" is missing, though step {step} was evaluated); start over in another --out")
    # One directory may be spelled two ways, so the resolved paths are compared.
    if Path(overrides.get("out", run)).resolve() != run.resolve():
        fail(f"--out {overrides['out']} and --resume {run} name different runs")
    if preset:
        fail(f"--preset {preset} with --resume: a resumed run keeps its config; "
             "change single flags")
    base = read_json(run / "config.json", f"--resume {run}")
    notes = []  # said once every check has passed: the run's first lines
    if surviving_checkpoint(run) is None:  # stopped before its first checkpoint: nothing is lost
        notes.append(f"--resume {run}: no checkpoint yet (stopped before its first, or --steps 0); "
                     "starting it over from step 0 with its config.json")
    if unknown := set(base) - {f.name for f in dataclasses.fields(config_cls)}:
        fail(f"--resume {run}: its config.json has fields this brorl.py does not know: "
             f"{sorted(unknown)}")
    # Each value typed as the command line types it: JSON's true is an int to Python, so a bool is
    # refused where a number belongs ("lr": true would train at lr 1.0); an int for a float is one.
    kinds = {f.name: (int, float) if f.type is float else f.type
             for f in dataclasses.fields(config_cls)}
    if bad := [k for k, v in base.items() if not isinstance(v, kinds[k])
               or (kinds[k] is not bool and isinstance(v, bool))]:
        kind = {int: "an integer", bool: "a boolean (true or false)", str: "a string"}.get(
            kinds[bad[0]], "a number")
        fail(f"--resume {run}: its config.json holds {bad[0]} = {base[bad[0]]!r}, not {kind}")
    base = {k: float(v) if kinds[k] == (int, float) else v for k, v in base.items()}
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    base.update(missing_fields(run, base, overrides, defaults, notes))
    if overrides.get("dtype") == "auto":  # auto on resume: the dtype the run recorded
        del overrides["dtype"]
    if base["dtype"] == "auto" and "dtype" not in overrides:  # written before auto was recorded
        device = distributed.pick_device(overrides.get("device", base["device"]))
        base["dtype"] = distributed.device_default_dtype(device.type)
        notes.append(f"--resume {run}: its config.json says --dtype auto, which then chose "
                     f"{base['dtype']} on this device; it keeps {base['dtype']}")
    changed = [k for k, v in overrides.items() if k not in ("resume", "out") and base[k] != v]
    if changed:  # each flag that changes the run: said first, recorded by record_changes
        notes.append(f"--resume {run}: " + ", ".join(f"--{k} {base[k]!r} -> {overrides[k]!r}"
                                                    for k in changed)
                     + " from its checkpoint on (config_history.jsonl records it as the run "
                       "starts)")
    for name in FIXED_ON_RESUME:
        if name in overrides and overrides[name] != base[name]:
            fail(f"--{name} {overrides[name]} with --resume {run}: the checkpoint fixes it "
                 f"({base[name]!r}); start a new run from it with --init_from")
    for line in notes if distributed.is_main() else ():
        print(line)
    return base


def read_json(path: Path, flag: str) -> dict:
    """A JSON object from a file, or one line naming the file (a run's config.json cut short or
    edited)."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"{flag}: {path} is unreadable ({getattr(e, 'msg', None) or e})")
    if not isinstance(obj, dict):
        fail(f"{flag}: {path} is not a JSON object")
    return obj


# The fields of every config.json since --resume began (the commit that added it): one of them
# missing is an edit, named in one line (today's default would change the run in silence).
FIELDS_SINCE_RESUME = (
    "model", "task", "digits", "dtype", "device", "seed", "n_rollouts", "prompts_per_step",
    "max_new_tokens", "temperature", "top_p", "max_rows", "dynamic_sampling", "max_rounds",
    "adv_norm", "lr", "weight_decay", "n_minibatches", "micro_batch", "old_logp", "clip_low",
    "clip_high",
    "loss_agg", "kl_coef", "ref_reset_every", "grad_clip", "steps", "eval_every", "eval_prompts",
    "eval_samples", "probe_prompts", "save")
# A later field missing means a run older than it: it resumes with its default (a new flag's default
# is the code before it), said and recorded; except these, whose value reproducing the code before
# them is another (a function: of the run's own config), or None: no value does (dual-clip has no
# "off"), and the missing field is named as an edited one is.
ADDED_FIELDS = {
    "clip_ratio_c": None, "tis_cap": 0.0, "verifier": "rules",  # before dual-clip, TIS, math-verify
    "sample_prompts": 0,  # before samples.jsonl
    "long_prompts": "allow",  # before prompts were measured against the model's context
    "probe_samples": lambda run: run.get("n_rollouts"),  # the probe drew N rollouts a prompt
    "eval_seed": lambda run: run.get("seed"),  # --seed drew the held-out problems
}


def missing_fields(run: Path, base: dict, overrides: dict, defaults: dict, notes) -> dict:
    """Values for the fields a run's config.json lacks: given on the command line, or (a field newer
    than the code that wrote the run) the value that reproduces that code, noted; any other missing
    field stops with one line naming it: today's default would change the run in silence."""
    missing = [k for k in defaults if k not in base]
    needed = lambda k: k in FIELDS_SINCE_RESUME or (k in ADDED_FIELDS and ADDED_FIELDS[k] is None)
    if lost := [k for k in missing if k not in overrides and needed(k)]:
        fail(f"--resume {run}: its config.json lacks {', '.join(lost)} (edited, or older "
             f"than the field): give the run's value, e.g. --{lost[0]} <value>")
    values = {}
    for k in missing:
        old = ADDED_FIELDS.get(k, defaults[k])
        values[k] = overrides[k] if k in overrides else old(base) if callable(old) else old
    if said := [k for k in missing if k not in ("resume", "out", "preset")]:
        notes.append(f"--resume {run}: its config.json lacks " + ", ".join(
            f"--{k} (taken as {values[k]!r})" for k in said)
            + "; config_history.jsonl records it as the run starts")
    return values


# Flags that --resume cannot change: the checkpoint's restored state decides them (the random
# streams drawn from --seed, the weights rather than --model, the probe's step-0 mass per held-out
# problem, the first eval's answer distributions in answers/). The rest take effect on resume; the
# learning rate and weight decay too (load_optimizer sets them).
FIXED_ON_RESUME = ("seed", "model", "task", "digits", "eval_task", "eval_seed", "eval_prompts",
                   "probe_prompts", "mass_prompts", "answer_prompts", "gate_small_n",
                   "gate_large_n", "init_from", "init_optimizer", "long_prompts")
