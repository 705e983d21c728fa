"""LoRA through peft (lib/lora.py): a run trains the adapter alone, saves it in peft's format, resumes it
exactly, --eval_only reads it; the KL's reference shares the base weights; the planner counts it."""

import json
import sys
from pathlib import Path

import pytest
import torch

import brorl
import data
from lib import logprobs, lora, plan, planner, policy

SMALL = ["--n_rollouts", "16", "--prompts_per_step", "2", "--eval_prompts", "2", "--eval_samples", "2",
         "--probe_prompts", "2", "--probe_samples", "16", "--max_rows", "256", "--lora_rank", "4", "--lr", "2e-3"]


@pytest.mark.slow
def test_lora_run_resumes_exactly_and_saves_the_adapter_alone(tmp_path):
    """4 steps in one go == 2 steps, then --resume to 4, with the KL on and its reference reset at step 3
    (the adapter off before, a frozen copy of it after): the adapter, AdamW and the reference continue."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--eval_every", "2", "--kl_coef", "1e-2", "--ref_reset_every", "3", *SMALL]
    rows_a = brorl.train(brorl.parse_config(["--steps", "4", "--out", str(a), *common]))
    brorl.train(brorl.parse_config(["--steps", "2", "--out", str(b), *common]))
    rows_b = brorl.train(brorl.parse_config(["--resume", str(b), "--steps", "4"]))
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time") and k != "tokens_per_s"}
    assert [strip(r) for r in rows_b] == [strip(r) for r in rows_a] and len(rows_a) == 5
    assert all(r["kl"] > 0 for r in rows_a[2:])  # the reference is not the policy: the KL term is live
    # the sampler decodes with the adapter: its log-probs are the trainer's (fp32 rounding, as without LoRA)
    assert all(r["max_ratio_dev"] < 3e-5 for r in rows_a[1:] if r["groups_kept"])
    ckpt = a / "ckpt"
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "model.safetensors").exists()  # peft's format
    from safetensors.torch import load_file
    wa, wb = load_file(ckpt / "adapter_model.safetensors"), load_file(b / "ckpt" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all("lora_" in k for k in wa) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(w.abs().sum() > 0 for k, w in wa.items() if "lora_B" in k)  # trained (B starts at 0)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    n_adapter = sum(w.numel() for w in wa.values())
    n_opt = sum(s["exp_avg"].numel() for s in state["opt"]["state"].values())
    assert n_opt == n_adapter  # AdamW holds the adapter alone
    assert {k.replace(".default", "") for k in state["ref"]} == wa.keys()  # after the reset at 3: the adapter, copied


def test_lora_reference_is_the_base_then_a_frozen_adapter(tmp_path):
    model, _ = policy.load_policy(str(data.EMBEDDED_MODEL), torch.device("cpu"))
    x = torch.tensor([[5, 6, 7, 8]])
    base = model(x).logits.detach()  # (1, 4, V)
    model = lora.add_lora(model, 4, 0, "q_proj,v_proj,down_proj")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # an adapter that changes the output
    trained = model(x).logits.detach()
    ref = lora.make_reference(model)
    assert sum(p.numel() for p in lora.trainable(model)) < sum(p.numel() for p in model.parameters()) // 10
    with lora.as_reference(ref) as m:
        torch.testing.assert_close(m(x).logits, base)  # before a reset: the adapter disabled
    ref.load_state_dict(model.state_dict())  # a reset (ProRL): the reference is now the current policy
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(1.0)  # the policy moves on
    moved = model(x).logits.detach()
    with lora.as_reference(ref) as m:
        torch.testing.assert_close(m(x).logits, trained)  # the frozen copy, not the moved adapter
    torch.testing.assert_close(model(x).logits, moved)  # and the policy's own adapter is back
    assert logprobs.plain_head(model) is not None  # the LM head is not a target: the fused log-prob path stays


@pytest.mark.slow
def test_eval_only_reads_an_adapter_dir(tmp_path):
    out = tmp_path / "run"
    brorl.train(brorl.parse_config(["--steps", "1", "--eval_every", "1", "--out", str(out), *SMALL]))
    model, _ = policy.load_policy(str(out / "ckpt"), torch.device("cpu"))  # its base, with the adapter on it
    from safetensors.torch import load_file
    saved = load_file(out / "ckpt" / "adapter_model.safetensors")
    params = {k.replace(".default", ""): p for k, p in model.named_parameters() if "lora_" in k}
    assert lora.is_lora(model) and params.keys() == saved.keys()
    assert all(torch.equal(params[k], saved[k]) for k in saved)
    report = brorl.eval_only(brorl.parse_config(["--eval_only", "--model", str(out / "ckpt"), "--eval_prompts", "4",
                                                 "--eval_samples", "4", "--out", str(tmp_path / "eval")]))
    assert (tmp_path / "eval" / "eval.json").is_file() and 0 <= report["benchmarks"]["arith"]["pass@k"]["1"] <= 1


def test_lora_without_peft_names_the_package(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed: `import peft` raises ImportError
    model, _ = policy.load_policy(str(data.EMBEDDED_MODEL), torch.device("cpu"))
    with pytest.raises(SystemExit):
        lora.add_lora(model, 4, 0, "q_proj")
    assert "--lora_rank: LoRA needs the peft package (pip install peft)" in capsys.readouterr().err


def qwen_7b_dir(tmp_path) -> Path:
    """A config-only model dir shaped as Qwen2.5-7B (its published config.json), with the embedded tokenizer."""
    from transformers import Qwen2Config
    Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                tie_word_embeddings=False).save_pretrained(tmp_path)
    data.build_tokenizer().save_pretrained(tmp_path)
    return tmp_path


def test_plan_7b_fits_80gb_with_lora_and_not_without(tmp_path, capsys):
    """--plan on one 80 GB GPU for a 7B-class model: full fine-tuning needs ~16 bytes a parameter before
    activations (weights, gradients, AdamW's m and v: ~122 GB), LoRA the frozen weights and a small adapter."""
    model = qwen_7b_dir(tmp_path)
    args = ["--plan", "--model", str(model), "--memory_gb", "80", "--n_rollouts", "64", "--prompts_per_step", "4",
            "--max_new_tokens", "1024", "--grad_ckpt", "1", "--dtype", "bfloat16", "--device", "cpu"]
    one_gpu = lambda out: out.split("memory plan per rank (8 process(es)")[0]  # --plan: one GPU, then 8 ranks
    plan.plan(brorl.parse_config(args))
    printed = one_gpu(capsys.readouterr().out)
    assert "does not fit on 1 device(s)" in printed and "needs" in printed  # the line names what is short
    plan.plan(brorl.parse_config([*args, "--lora_rank", "16"]))
    printed = one_gpu(capsys.readouterr().out)
    assert "does not fit" not in printed and "LoRA adapter" in printed and "update peak" in printed
    mc = json.loads((model / "config.json").read_text())
    from transformers import Qwen2Config
    cfg = brorl.Config(lora_rank=16)
    n = planner.lora_param_count(Qwen2Config(**mc), cfg)
    # by hand: per layer r * (in + out) for q (3584 -> 3584), k, v (3584 -> 512), o, gate, up (3584 -> 18944), down
    assert n == 28 * 16 * (2 * 3584 * 2 + 2 * (3584 + 512) + 3 * (3584 + 18944))
