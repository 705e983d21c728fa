"""The compute dtype: what --dtype auto picks on a CPU (bf16 autocast only where the CPU computes
bf16 natively and the model is wide enough to gain from it), that a run records the choice and a
resumed run keeps it, and that bf16 autocast keeps fp32 master weights, so that an update of
lr 1e-5 is not rounded away."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2Config

import brorl
import data
from lib import policy


def _config(hidden: int):
    return Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=300)


@pytest.mark.parametrize("isa, hidden, device, want", [
    ("", 576, "cpu", "float32"),  # no native bf16: emulated bf16 is slower than fp32
    ("AVX512_BF16", 576, "cpu", "bfloat16"),
    ("AMX", 576, "cpu", "bfloat16"),
    ("AVX512_BF16", 128, "cpu", "float32"),  # the embedded models: bf16 no faster there
    ("", 128, "cuda", "bfloat16"),  # CUDA whatever the CPU
])
def test_auto_is_bf16_only_where_the_cpu_computes_it(monkeypatch, isa, hidden, device, want):
    monkeypatch.setattr(policy, "cpu_bf16", lambda: isa)
    cfg = brorl.Config(dtype="auto")
    dtype, why = policy.pick_dtype(cfg, torch.device(device), _config(hidden))
    assert dtype == want, why
    if device == "cpu":  # the reason names what decided it
        assert (isa or "neither AVX512_BF16 nor AMX") in why and (not isa or str(hidden) in why)


def test_a_given_dtype_is_kept_whatever_the_cpu(monkeypatch):
    monkeypatch.setattr(policy, "cpu_bf16", lambda: "")
    for given in ("float32", "bfloat16"):
        cfg = brorl.Config(dtype=given)
        assert policy.pick_dtype(cfg, torch.device("cpu"), _config(576))[0] == given


@pytest.mark.parametrize("record, isa, want", [
    ({"dtype": "float32"}, "AVX512_BF16", "float32"),  # an fp32 run's checkpoint on a bf16 CPU
    ({"dtype": "bfloat16"}, "", "bfloat16"),  # a bf16 run's on a CPU without native bf16
    ({}, "AVX512_BF16", "bfloat16"),  # no record: the CPU's choice
    (None, "", "float32"),  # no brorl_config.json: a model's folder
])
def test_auto_keeps_the_dtype_a_checkpoints_run_computed_in(tmp_path, monkeypatch, record, isa,
                                                            want):
    """--dtype auto with a brorl checkpoint as the policy (--model, --init_from): the dtype its run
    recorded, found in the folder or its ckpt/, on any CPU, as a resumed run keeps its own."""
    monkeypatch.setattr(policy, "cpu_bf16", lambda: isa)
    (tmp_path / "ckpt").mkdir()
    if record is not None:
        (tmp_path / "ckpt" / "brorl_config.json").write_text(json.dumps(record))
    for source in (tmp_path, tmp_path / "ckpt"):
        dtype, why = policy.pick_dtype(brorl.Config(dtype="auto"), torch.device("cpu"),
                                       _config(576), str(source))
        assert dtype == want, why
        assert (str(source) in why) == ("dtype" in (record or {})), why
    given = policy.pick_dtype(brorl.Config(dtype="bfloat16"), torch.device("cpu"), _config(576),
                              str(tmp_path))
    assert given[0] == "bfloat16"


def test_eval_only_of_an_fp32_run_on_a_bf16_cpu_computes_in_fp32(tmp_path, monkeypatch):
    """setup() hands the policy's path to pick_dtype: --eval_only --model <an fp32 run> on a CPU
    that computes bf16 natively evaluates in fp32, as the run computed."""
    brorl.train(_run(tmp_path, "fp32", dtype="float32"))
    monkeypatch.setattr(policy, "BF16_MIN_HIDDEN", 0)  # the embedded model counts as wide
    monkeypatch.setattr(policy, "cpu_bf16", lambda: "AVX512_BF16")
    from lib import setup
    cfg = brorl.parse_config(["--eval_only", "--model", str(tmp_path / "fp32"), "--eval_prompts",
                              "2", "--eval_samples", "2", "--device", "cpu"])
    assert setup.setup(cfg, cfg.model, "--model", with_train_set=False)[0].dtype == "float32"
    fresh = brorl.parse_config(["--eval_only", "--eval_prompts", "2", "--device", "cpu"])
    assert setup.setup(fresh, fresh.model, "--model", with_train_set=False)[0].dtype == "bfloat16"


@pytest.mark.parametrize("amx, avx512_bf16, want", [
    (True, True, "AMX"), (False, True, "AVX512_BF16"), (False, False, "")])
def test_cpu_bf16_reads_torchs_own_checks(monkeypatch, amx, avx512_bf16, want):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert policy.cpu_bf16() == want


def _run(tmp_path, name, **kw):
    """A one-step run of the embedded model, checkpointed."""
    base = dict(n_rollouts=8, prompts_per_step=2, steps=1, eval_every=1, eval_prompts=2,
                eval_samples=2, probe_prompts=1, dynamic_sampling=False, out=str(tmp_path / name))
    return brorl.Config(**{**base, **kw})


@pytest.mark.slow
def test_a_run_records_autos_choice_and_a_resume_keeps_it(tmp_path, monkeypatch):
    """auto's choice is written to config.json; resumed on a CPU that would choose otherwise, the
    run keeps it; a config.json written before auto was recorded ("auto") keeps what auto then
    chose on a CPU, fp32."""
    monkeypatch.setattr(policy, "BF16_MIN_HIDDEN", 0)  # the embedded model counts as wide
    monkeypatch.setattr(policy, "cpu_bf16", lambda: "AVX512_BF16")
    brorl.train(_run(tmp_path, "bf16"))
    recorded = lambda name: json.loads((tmp_path / name / "config.json").read_text())["dtype"]
    assert recorded("bf16") == "bfloat16"
    monkeypatch.setattr(policy, "cpu_bf16", lambda: "")  # resumed on a CPU without native bf16
    brorl.train(brorl.parse_config(["--resume", str(tmp_path / "bf16"), "--steps", "2"]))
    assert recorded("bf16") == "bfloat16"
    # --dtype auto given on resume is the run's own choice, not a new one
    cfg = brorl.parse_config(["--resume", str(tmp_path / "bf16"), "--steps", "3",
                              "--dtype", "auto"])
    assert cfg.dtype == "bfloat16"

    monkeypatch.setattr(policy, "cpu_bf16", lambda: "AMX")
    brorl.train(_run(tmp_path, "old", dtype="float32"))
    path = tmp_path / "old" / "config.json"
    path.write_text(path.read_text().replace('"dtype": "float32"', '"dtype": "auto"'))
    brorl.train(brorl.parse_config(["--resume", str(tmp_path / "old"), "--steps", "2"]))
    assert recorded("old") == "float32"
    # an old run resumed with --device named: what auto chose on that device (a CPU: fp32)
    path.write_text(path.read_text().replace('"dtype": "float32"', '"dtype": "auto"'))
    cfg = brorl.parse_config(["--resume", str(tmp_path / "old"), "--device", "cpu", "--steps", "3"])
    assert cfg.dtype == "float32"


@pytest.mark.slow
def test_bf16_autocast_keeps_fp32_master_weights_that_an_lr_1e5_update_moves(tmp_path):
    """One AdamW step of lr 1e-5 under bf16 autocast moves the weights by about lr: they stay
    fp32. In bf16 an update that small vanishes (bf16's spacing near a weight of 0.02 is 1.2e-4,
    near a norm's 1.0 it is 7.8e-3): a model kept in bf16 would leave nearly all of them as
    they were."""
    brorl.train(_run(tmp_path, "run", dtype="bfloat16", lr=1e-5))
    before = load_file(str(data.EMBEDDED_MODEL / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "ckpt" / "model.safetensors"))
    moved = total = 0
    for name, w in before.items():
        assert after[name].dtype == torch.float32, name
        moved += (after[name] != w).sum().item()
        total += w.numel()
    step = max((after[n] - w).abs().max().item() for n, w in before.items())
    assert moved > 0.5 * total, f"{moved} of {total} weights moved by an lr 1e-5 step"
    assert 2e-6 < step < 1e-4, step  # AdamW's first step: about lr a weight


def test_dtype_checks_gaps_are_the_runs_measures():
    """tools.dtype_check's drift_max is the run's (brorl.update_policy: max |exp(old - sampler) -
    1| over valid tokens), its clip share counts ratios outside [1 - clip_low, 1 + clip_high], its
    TIS share those above the cap; padding is never counted."""
    from tools.dtype_check import logprob_gaps
    g = torch.Generator().manual_seed(0)
    s = -torch.rand(3, 5, generator=g) * 3  # (R, T) sampler log-probs
    gap = torch.tensor([[0.0, 0.1, -0.3, 0.25, 9.0], [0.05, -0.05, 0.8, 0.0, 0.0],
                        [0.01, 0.02, 0.03, 0.04, 0.05]])  # trainer - sampler
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 4] = False  # a padding token whose gap would dominate
    out = logprob_gaps(s, s + gap, s, mask, 0.2, 0.28, 2.0)
    ratio = gap[mask].exp()
    assert out["tokens"] == 14
    assert out["drift_max"] == pytest.approx((ratio - 1).abs().max().item())  # exp(0.8) - 1
    assert out["outside_clip_share"] == pytest.approx(3 / 14)  # -0.3, 0.8 and 0.25 (1.284)
    assert out["tis_capped_share"] == pytest.approx(1 / 14)  # exp(0.8) = 2.23 > 2
    assert out["trainer_bf16_vs_fp32"][-1] == pytest.approx(0.8)


@pytest.mark.slow
def test_dtype_check_runs_on_the_embedded_model(capsys):
    from tools import dtype_check
    res = dtype_check.main(["--prompts", "2", "--n", "4", "--", "--eval_prompts", "6"])
    assert res["tokens"] > 0 and res["greedy"]["prompts"] == 6
    for k in ("sampler_bf16_vs_fp32", "trainer_bf16_vs_fp32", "trainer_vs_sampler_bf16"):
        assert res[k] == sorted(res[k]) and res[k][-1] < 1, (k, res[k])  # rounding, not a bug
    assert "greedy, 6 held-out prompts" in capsys.readouterr().out
