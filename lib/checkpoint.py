"""
checkpoint.py: <out>/ckpt/, the policy and what --resume needs besides it (the step, AdamW's
state, every random stream, the reference policy). Saved so that a crash never leaves a half-written
checkpoint; read back with one line for each way it can be unusable; --init_from's and --model's
checkpoint found in a run directory.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from lib import distributed
from lib.errors import fail
from lib.rundir import is_io_error, one_line_reason, surviving_checkpoint, writes_are_one_line


def save_atomic(model, tok, cfg, state: dict, path: Path):
    """Write the checkpoint into a temp dir, then swap it in: never a half-written checkpoint, and
    the previous one stays whole until the new one is. `state` is what --resume needs besides the
    policy: step, AdamW state, every random generator, the reference policy, the step-0 probe mass.
    A crash before or between the two renames leaves a whole ckpt.tmp (its trainer_state.pt is
    written last) and ckpt.old or ckpt/ (rundir.surviving_checkpoint); a full disk leaves the
    previous checkpoint as it was and no temp dir."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    not_written = f"the checkpoint of step {state['step']} was not written"
    kept = (f"{path.name}/ keeps the last one (--resume continues from it)" if path.exists() else
            f"there is no earlier one (--resume {path.parent} starts the run over from step 0)")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writes_are_one_line(path.parent, f"{not_written}; {kept}"):
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "brorl_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
            # The trainer state is written last and renamed: its name marks the temp dir whole.
            torch.save(state, tmp / "trainer_state.part")
            os.replace(tmp / "trainer_state.part", tmp / "trainer_state.pt")
    except BaseException as e:  # a full disk (one line), Ctrl-C, any error: no half-written temp
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and is_io_error(e):  # permission, read-only: one line too
            fail(f"cannot write in {path.parent} ({one_line_reason(e)}): {not_written}; {kept}")
        raise
    shutil.rmtree(old, ignore_errors=True)
    try:  # the swap: ckpt -> ckpt.old, ckpt.tmp -> ckpt
        if path.exists():
            os.replace(path, old)
        try:
            os.replace(tmp, path)
        except OSError:
            if old.exists() and not path.exists():
                os.replace(old, path)  # the previous one back in place
            raise
    except OSError as e:  # e.g. ckpt/ immutable, a name in the way: the previous checkpoint stays
        if path.exists():  # (else the rollback failed too: the whole tmp and old are what is left)
            shutil.rmtree(tmp, ignore_errors=True)
        fail(f"cannot swap the new checkpoint in ({one_line_reason(e)}): {not_written}; "
             + (kept if path.exists() else f"--resume {path.parent} continues from what is left"))
    shutil.rmtree(old, ignore_errors=True)


def read_trainer_state(ckpt: Path, cfg) -> dict:
    """A checkpoint's trainer_state.pt (CPU tensors: generator states must be; the optimizer and the
    reference move theirs to the device), read before anything else: an unreadable one, or a --steps
    below its step (nothing to train; the run would only rewrite its config), stops with one
    line."""
    path = ckpt / "trainer_state.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        step = state["step"]
        if missing := {"keep_est", "q_start", "opt", "rng", "gen_cpu"} - set(state):
            raise ValueError(f"it lacks {sorted(missing)}")
    except Exception as e:
        # a cut-short zip, a pickle error, another file renamed: the message is what matters
        fail(f"--resume {cfg.resume}: {path} is unreadable "
             f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})")
    if cfg.steps <= step:
        fail(f"--steps {cfg.steps} with --resume {cfg.resume}: "
             f"its checkpoint is at step {step} already "
             f"(--steps counts from the run's start: give more than {step} to continue it)")
    return state


def load_optimizer(model, opt, state: dict, cfg, source: str):
    """AdamW's moments and step counts from a checkpoint's state. Its learning rate and weight decay
    are this run's: the saved param groups hold the values of the run that wrote them, which would
    otherwise override --lr and --weight_decay silently."""
    if state.get("world_size", 1) != distributed.world_size():  # AdamW's state is laid out per K
        fail(f"{source}: its checkpoint was written by {state.get('world_size', 1)} process(es), "
             f"this run has {distributed.world_size()}: use the same number")
    distributed.load_optimizer_state(model, opt, state["opt"])
    for group in opt.param_groups:
        group.update(lr=cfg.lr, weight_decay=cfg.weight_decay)


def checkpoint_dir(path: str, flag: str = "--init_from") -> Path:
    """--init_from's (or --model's) checkpoint: a run directory's ckpt/, or the checkpoint directory
    itself."""
    run = Path(path)
    if (run / "ckpt" / "config.json").is_file() or (run / "ckpt" / "adapter_config.json").is_file():
        return run / "ckpt"
    # A run directory: its config.json is brorl's, not a model's.
    if is_run_dir(run):
        left = surviving_checkpoint(run)  # what a crash inside a save left, if anything
        fail(f"{flag} {path}: the run holds no ckpt/" + (
            f" (a crash inside its save left {left.name}/: --resume {path} takes it back)" if left
            else " (--save 0, or stopped before its first eval)"))
    if (run.is_dir() and not any((run / f).is_file()
                                 for f in ("config.json", "adapter_config.json"))):
        fail(f"{flag} {path}: holds no checkpoint (no ckpt/, and no model's config.json)")
    return run


def is_run_dir(path: Path) -> bool:
    """A brorl run's directory (its metrics.jsonl, or a config.json that is a run's, not a
    model's: what is left of a run copied without its checkpoint), not a model's."""
    if (path / "metrics.jsonl").is_file():
        return True
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "n_rollouts" in config and "model_type" not in config
