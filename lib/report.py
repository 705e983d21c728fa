"""
report.py: the run's rows sent to the dashboards people watch (--report_to tensorboard, wandb, or
both), beside metrics.jsonl, which stays the record. Each step's dict, the one metrics.jsonl gets,
goes under grouped names (rollout/, update/, eval/, mass/, time/) with the step as x; the config
once, as hyperparameters; samples.jsonl's records at each step as a table. The run's name is its
directory's; a --resume continues the same run: TensorBoard the same log dir (<out>/tensorboard),
the steps after the checkpoint purged; wandb the run whose id <out>/wandb_id holds. Both packages
are optional: a missing one stops the run with one line before anything is done. Rank 0 alone
reports (Report opens no backend on the others).
"""

import dataclasses
import json
import os
from pathlib import Path

from lib.errors import fail

# The install command named when a backend's package is missing: requirements.txt's pins.
INSTALL = {"tensorboard": "pip install tensorboard==2.21.0", "wandb": "pip install wandb==0.31.0"}
# The per-step keys of steplog.step_metrics that describe the rollouts; the rest of a training row
# is the update's.
ROLLOUT = ("reward_mean", "keep_rate", "groups_kept", "sample_rounds", "samples", "zero_adv_frac",
           "pass@1", "pass@N", "resp_len", "tokens_per_s")
COLUMNS = ("step", "kind", "prompt", "answer", "response", "reward", "length", "truncated",
           "advantage")


def backends(report_to: str) -> list:
    """--report_to's backends: "none" -> [], "tensorboard,wandb" -> both (each once)."""
    return list(dict.fromkeys(b for b in report_to.split(",") if b not in ("none", "")))


def require(report_to: str):
    """Stop with one line naming the package and its install command if a backend's is not
    installed."""
    for name in backends(report_to):
        try:
            __import__(name)
            if name == "tensorboard":
                import torch.utils.tensorboard  # noqa: F401 (torch's writer, on top of the package)
        except ImportError:
            fail(f"--report_to {name}: the {name} package is not installed ({INSTALL[name]})")


def grouped(row: dict) -> dict:
    """The row's numbers under dashboard names: eval_pass@1 -> eval/pass@1, mass_mean -> mass/mean,
    time_rollout -> time/rollout, reward_mean -> rollout/reward_mean, entropy -> update/entropy.
    Lists (eval_correct, per problem) and the step itself stay in metrics.jsonl alone."""
    out = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        prefix = key.split("_")[0]
        if prefix in ("eval", "mass", "time"):
            out[f"{prefix}/{key[len(prefix) + 1:]}"] = value
        else:
            out[f"{'rollout' if key in ROLLOUT else 'update'}/{key}"] = value
    return out


def table_rows(records: list) -> list:
    """samples.jsonl's records (with their step) as rows of COLUMNS; a field a kind lacks is
    empty."""
    return [[r.get(c, "") for c in COLUMNS] for r in records]


# ----------------------------------------------------------------------------
# The backends: each logs a row, a step's sample records, and closes


class TensorBoard:
    """Event files in <out>/tensorboard, scalars in float64 (exactly metrics.jsonl's), the samples
    as a markdown table (text). purge_step: what an earlier segment of the run logged from this
    segment's first step on is not drawn (a resumed run's steps after its checkpoint; everything,
    for a fresh start in the same directory)."""

    def __init__(self, cfg, out: Path, start: int):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start + 1 if start else 0)
        if not start:  # the config once, as the HPARAMS tab's hyperparameters and as readable text
            config = dataclasses.asdict(cfg)
            for summary in hparams(config, {}):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, row: dict):
        for name, value in grouped(row).items():
            self.writer.add_scalar(name, value, row["step"], new_style=True, double_precision=True)

    def samples(self, step: int, records: list):
        # A cell is one line, its quotes escaped.
        cell = lambda v: json.dumps(v)[1:-1] if isinstance(v, str) else str(v)
        lines = ["| " + " | ".join(COLUMNS[1:]) + " |", "|" + "---|" * (len(COLUMNS) - 1)]
        lines += ["| " + " | ".join(cell(v).replace("|", "\\|") for v in row[1:]) + " |"
                  for row in table_rows(records)]
        self.writer.add_text(f"samples/{records[0]['kind']}", "\n".join(lines), step)

    def close(self):
        self.writer.close()


class Wandb:
    """A wandb run named after the run directory, its id kept in <out>/wandb_id so that --resume
    continues it; WANDB_MODE=offline, WANDB_PROJECT (default brorl), WANDB_RUN_GROUP
    (tools/ablate.py sets it) and WANDB_DIR (default: the run directory) as wandb reads them. The
    samples as a wandb.Table."""

    def __init__(self, cfg, out: Path, start: int):
        import wandb
        self.wandb = wandb
        id_file = out / "wandb_id"
        # The id of the run to continue; None makes wandb make one.
        run_id = id_file.read_text().strip() if start and id_file.is_file() else None
        # allow_val_change: a resume may change flags.
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "brorl"), id=run_id,
                              resume="allow", name=os.environ.get("WANDB_NAME", out.name),
                              dir=os.environ.get("WANDB_DIR", str(out)),
                              config=dataclasses.asdict(cfg), allow_val_change=True)
        id_file.write_text(self.run.id)

    def log(self, row: dict):
        self.run.log(grouped(row), step=row["step"])

    def samples(self, step: int, records: list):
        table = self.wandb.Table(columns=list(COLUMNS), data=table_rows(records))
        self.run.log({f"samples/{records[0]['kind']}": table}, step=step)

    def close(self):
        self.run.finish()


class Report:
    """The backends of --report_to, opened (none on ranks other than 0). start: the step the run
    starts after (0, or a --resume's checkpoint)."""

    def __init__(self, cfg, out: Path, start: int, main: bool):
        kinds = dict(tensorboard=TensorBoard, wandb=Wandb)
        self.backends = ([kinds[name](cfg, out, start) for name in backends(cfg.report_to)]
                         if main else [])

    def log(self, row: dict, records: list):
        """A row of metrics.jsonl and its step's samples.jsonl records."""
        for b in self.backends:
            b.log(row)
            for kind in ("eval", "train"):
                if mine := [r for r in records if r["kind"] == kind]:
                    b.samples(row["step"], [{"step": row["step"], **r} for r in mine])

    def close(self):
        for b in self.backends:
            b.close()
