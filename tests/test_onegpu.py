"""One GPU for real, rehearsed on a CPU: bf16 autocast that never sees stale weights, the memory
changes of the sampler and the update, the memory planner, and the real job's shapes."""

import pytest
import torch
import torch.nn.functional as F

import brorl
from lib import logprobs, policy, step
import data


def _tiny_run_cfg(tmp_path, **kw):
    """A one-step run of the embedded model, small enough for a test."""
    base = dict(n_rollouts=8, prompts_per_step=2, steps=1, eval_every=1, eval_prompts=2, eval_samples=2,
                probe_prompts=1, save=False, out=str(tmp_path / "run"))
    return brorl.Config(**{**base, **kw})


@pytest.mark.slow
def test_bf16_forwards_never_see_weights_older_than_the_last_step(tmp_path, monkeypatch):
    """Under bf16 autocast every Linear of every update forward must use the CURRENT weights. An
    autocast region caches each weight's bf16 copy for its life and misses in-place updates: a
    region spanning opt.step() ran mini-batches 2..n against the weights before the step. The
    reference recomputes each Linear from its fp32 weight, cast now, outside any region."""
    worst = []

    def check(module, args, out):
        with torch.autocast("cpu", enabled=False):
            bf = lambda t: None if t is None else t.detach().to(torch.bfloat16)
            ref = F.linear(bf(args[0]), bf(module.weight), bf(module.bias))
        worst.append((out.detach().float() - ref.float()).abs().max().item())

    real_update = brorl.update_policy

    def spied_update(model, *args, **kw):
        hooks = [m.register_forward_hook(check) for m in model.modules() if isinstance(m, torch.nn.Linear)]
        try:
            return real_update(model, *args, **kw)
        finally:
            for h in hooks:
                h.remove()

    monkeypatch.setattr(brorl, "update_policy", spied_update)
    # lr 1e-2: a step that moves the weights by more than bf16's rounding, so staleness shows
    brorl.train(_tiny_run_cfg(tmp_path, dtype="bfloat16", n_minibatches=4, lr=1e-2, dynamic_sampling=False))
    assert worst and max(worst) == 0.0, f"a forward used stale weights: max |out - fresh| = {max(worst)}"


def _embedded_batch(n=16, prompts=3, seed=0):
    """Rollouts of the embedded model packed as a training batch, and the model (train mode)."""
    model, tok = policy.load_policy(str(data.EMBEDDED_MODEL), torch.device("cpu"))
    examples = data.load_task("arith", "train", n=prompts, seed=seed)
    ro = sampler.generate(model, tok, [e["prompt"] for e in examples], n, 6, 1.0, 1.0, 4096,
                          torch.Generator().manual_seed(seed))
    return model.train(), step.pack_groups([ro.group(g) for g in range(prompts)])


def test_grad_ckpt_gives_the_same_gradient_and_replays_every_layer():
    """--grad_ckpt recomputes each decoder layer in the backward: the same gradient as storing every
    activation, and the layers really run twice (the cache must survive the replay)."""
    model, batch = _embedded_batch()
    rows = torch.randperm(batch.resp.shape[0], generator=torch.Generator().manual_seed(1))[:37]
    weights = torch.rand(batch.resp.shape, generator=torch.Generator().manual_seed(2))[rows]  # ugly upstream grad
    calls = [0]
    attn = model.model.layers[0].self_attn
    attn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    def grads():
        model.zero_grad(set_to_none=True)
        calls[0] = 0
        (logprobs.response_logprobs(model, batch, rows, 0.8) * weights).sum().backward()
        return [p.grad.clone() for p in model.parameters()], calls[0]

    plain, plain_calls = grads()
    policy.enable_grad_ckpt(model)
    ckpt, ckpt_calls = grads()
    assert ckpt_calls == 2 * plain_calls  # prompt pass + response pass, each replayed once
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------
# sampler.py memory: the KV cache in the compute dtype, drops without a second copy, one sync a token


from tools.memcheck import measure_peak  # noqa: E402
import sampler  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_is_stored_in_the_compute_dtype(monkeypatch, dtype):
    """Under bf16 autocast rotary promotes keys to fp32 (fp32 cos/sin): the cache must still hold
    bf16 keys and values, prefix and generated alike."""
    seen = set()
    real = sampler.SharedPrefixCache.update

    def spy(self, k, v, layer_idx, *a, **kw):
        out = real(self, k, v, layer_idx, *a, **kw)
        seen.update({self.k[layer_idx].dtype, self.v[layer_idx].dtype, *(x.dtype for x in self.prefix_kv[layer_idx])})
        return out

    monkeypatch.setattr(sampler.SharedPrefixCache, "update", spy)
    model, tok = policy.load_policy(str(data.EMBEDDED_MODEL), torch.device("cpu"))
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        ro = sampler.generate(model, tok, ["12+34=", "5+6="], 4, 6, 1.0, 1.0, 64, torch.Generator().manual_seed(0))
    assert seen == {dtype} and ro.tokens.device.type == "cpu"


def test_dropping_rows_copies_one_layer_at_a_time():
    """keep() must not build a second copy of the whole cache before freeing the first: its
    transient is one layer's survivors (measured as live tensor bytes)."""
    L, R, Hkv, D = 6, 64, 2, 16
    prefix = [(torch.randn(2, Hkv, 5, D), torch.randn(2, Hkv, 5, D)) for _ in range(L)]
    cache = sampler.SharedPrefixCache(prefix, torch.tensor([5, 3]), R // 2)
    layer = cache.k[0].nbytes + cache.v[0].nbytes  # one layer's keys and values, all rows
    live = torch.arange(0, R, 2)  # half the rows survive
    _, peak = measure_peak(lambda: cache.keep(live), existing=lambda: cache.k + cache.v)
    assert peak <= layer / 2 + 4096  # one layer's survivors (+ small index tensors), not L of them
    assert all(k.shape[0] == R // 2 for k in cache.k)


def test_decode_loop_syncs_with_the_host_once_per_token(monkeypatch):
    """Every host read of device data (item, tolist, bool, int, float, nonzero) in the decode loop is
    counted: at most one per decoded token, plus what each row drop needs."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = data.build_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.config._attn_implementation = "brorl"
    with torch.no_grad():  # EOS about as likely as a digit, so that rows finish at different steps
        model.lm_head.weight[tok.eos_token_id] = model.lm_head.weight[tok.convert_tokens_to_ids("7")]
    counts = {"sync": 0, "drops": 0}
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **kw):
            counts["sync"] += 1
            return _real(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)
    real_keep = sampler.SharedPrefixCache.keep
    monkeypatch.setattr(sampler.SharedPrefixCache, "keep",
                        lambda self, rows: (counts.__setitem__("drops", counts["drops"] + 1), real_keep(self, rows)))
    prompt_ids = [tok("12+34=")["input_ids"], tok("5+6=")["input_ids"]]
    # Groups of 16 (rows dropped as they finish, down to sampler.MIN_ROWS), 8 and 4 (a chunk of 16
    # and one of 8 rows with filler: nothing to drop, so nothing to sync beyond a token's one).
    for n, dropping in ((16, True), (8, False), (4, False)):
        run = lambda max_new: sampler.generate_group_chunk(
            model.eval(), prompt_ids, [1, 2], [(n, 0, n)] * 2, max_new, 1.0, 1.0,
            [tok.eos_token_id], tok.pad_token_id)
        run(1)  # the prefill and setup alone, once per chunk
        setup, counts["sync"], counts["drops"] = counts["sync"], 0, 0
        out = run(40)
        steps = int(out[1].any(0).sum())  # decoded tokens (loop iterations)
        assert (counts["drops"] >= 1) == dropping and steps > 8, (n, counts)
        # One per token, plus the setup's and each drop's one (the grid's size).
        assert counts["sync"] - setup <= steps + counts["drops"], (n, counts, setup, steps)
        counts["sync"] = 0


def test_texts_are_each_rows_real_tokens():
    """Only each row's real tokens are decoded: the same texts as decoding the padded matrix."""
    model, tok = policy.load_policy(str(data.EMBEDDED_MODEL), torch.device("cpu"))
    ro = sampler.generate(model, tok, ["123+456=", "7+8="], 32, 6, 1.0, 1.0, 4096, torch.Generator().manual_seed(2))
    padded = tok.batch_decode(ro.tokens.masked_fill(~ro.mask, tok.pad_token_id), skip_special_tokens=True)
    assert ro.texts == padded and len(set(ro.texts)) > 1


# ----------------------------------------------------------------------------
# tools/memcheck.py: the measured peak counts each tensor once


def test_memcheck_counts_once_what_exists_before_the_phase():
    """memcheck's base holds what lives through a phase (weights, AdamW state, the step's batch);
    an op that returns one of those tensors (an fp32 Linear's transposed view of its weight, an
    in-place update of a weight or a moment, an index view of the batch) must not count its storage
    a second time. The reference: the base plus the one tensor the phase makes."""
    from tools import memcheck
    model, tok = policy.load_policy(str(data.EMBEDDED_MODEL), torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # the AdamW state (m, v) exists before the phase, as from step 2 on
    opt.zero_grad(set_to_none=True)
    batch = {"resp": torch.randint(0, 9, (3, 5)), "lengths": [torch.tensor([5, 4, 3])]}
    existing = lambda: memcheck.existing_tensors(model, None, opt, batch)
    base = memcheck.existing_bytes(existing())
    weights = sum(p.nbytes for p in model.parameters())
    assert base >= 3 * weights  # weights, m and v

    def phase():
        views = [p.t() for p in model.parameters() if p.dim() == 2] + [batch["resp"][:, :2]]
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0)  # in place: aten returns the weight's own storage
                opt.state[p]["exp_avg_sq"].add_(0.0)
        return views, torch.empty(1000, 7)  # (1000, 7) fp32: the phase's one new tensor
    _, measured = memcheck.peak(phase, torch.device("cpu"), existing)
    assert measured == base + 28_000, (measured - base, weights)
    # A real forward in fp32: each Linear reads its weight through aten.t, a view. Its activations
    # (one 4-token row) are far below the weights the double count would add.
    ids = torch.tensor([tok("12+34=")["input_ids"][:4]])  # (1, 4)
    with torch.no_grad():
        _, measured = memcheck.peak(lambda: model(ids).logits, torch.device("cpu"), existing)
    assert base < measured < base + weights / 4, (measured - base, weights)
