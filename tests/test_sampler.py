"""The sampler (sampler.py: sampler.generate): shared-prefix decoding equals a recompute without
cache, chunking changes nothing, its log-probs and entropies are the training forward's, no attention row
is left without a key, top_p keeps the nucleus only."""

import math

import pytest
import torch

from lib import logprobs, step
import sampler
from test_brorl import PROMPTS, random_lm  # noqa: F401  (random_lm is a fixture)


def greedy_recompute(model, tok, prompt, max_new):
    """Greedy decoding the slow way: the whole sequence re-run without any cache, every step."""
    ids = tok(prompt)["input_ids"]
    start = len(ids)
    for _ in range(max_new):
        nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == tok.eos_token_id:
            break
    return ids[start:]


def test_shared_prefix_greedy_equals_full_recompute(random_lm, monkeypatch):
    model, tok = random_lm
    gen = torch.Generator().manual_seed(0)
    drops, keep = [], sampler.SharedPrefixCache.keep
    monkeypatch.setattr(sampler.SharedPrefixCache, "keep", lambda self, rows: drops.append(len(rows)) or keep(self, rows))
    ro = sampler.generate(model, tok, PROMPTS, 8, 8, 0.0, 1.0, 4096, gen)
    assert drops  # finished rows were dropped mid-decode, and the survivors still decode exactly
    lengths = set()
    for b, prompt in enumerate(PROMPTS):
        want = greedy_recompute(model, tok, prompt, 8)
        for row in range(b * 8, b * 8 + 8):  # all N greedy rollouts of a prompt are identical
            got = ro.tokens[row][ro.mask[row]].tolist()
            assert got == want, (prompt, got, want)
        lengths.add(len(want))
    assert len(lengths) > 1  # some stop at EOS early, some do not: both paths covered


def test_chunked_decoding_equals_one_chunk(random_lm):
    model, tok = random_lm
    a = sampler.generate(model, tok, PROMPTS, 2, 6, 0.0, 1.0, 4096, torch.Generator())
    b = sampler.generate(model, tok, PROMPTS, 2, 6, 0.0, 1.0, 2, torch.Generator())  # one prompt per chunk
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask)
    # N > max_rows: a group's rows are split into parts of 2, 2, 1, each re-prefilling its prompt
    c = sampler.generate(model, tok, PROMPTS, 5, 6, 0.0, 1.0, 2, torch.Generator())
    assert torch.equal(c.tokens, a.tokens.view(len(PROMPTS), 2, -1)[:, :1].expand(-1, 5, -1).reshape(-1, 6))
    torch.testing.assert_close(c.logp.view(len(PROMPTS), 5, -1), a.logp.view(len(PROMPTS), 2, -1)[:, :1].expand(-1, 5, -1))


def test_sampler_logprobs_equal_training_forward(random_lm, monkeypatch):
    model, tok = random_lm
    gen = torch.Generator().manual_seed(1)
    left, keep = [], sampler.SharedPrefixCache.keep  # rows left per prompt after each drop
    monkeypatch.setattr(sampler.SharedPrefixCache, "keep", lambda self, rows: keep(self, rows) or left.append(
        torch.bincount(self.row_group, minlength=self.B).tolist()))
    ro = sampler.generate(model, tok, PROMPTS, 5, 8, 1.3, 1.0, 4096, gen)
    assert any(len(set(c)) > 1 for c in left)  # prompts left with unequal rows: the packed grid was used
    batch = step.pack_groups([ro.group(g) for g in range(len(PROMPTS))])
    with torch.no_grad():
        logp, ent = logprobs.response_logprobs(model, batch, torch.arange(len(ro.texts)), 1.3, with_entropy=True)
    assert logp.shape == ro.logp[:, : logp.shape[1]].shape
    torch.testing.assert_close(logp, ro.logp[:, : logp.shape[1]], atol=2e-5, rtol=0)
    torch.testing.assert_close(ent, ro.entropy[:, : ent.shape[1]], atol=2e-5, rtol=0)  # the entropy metric too
    assert (ent[batch.resp_mask] > 0).all() and (ent[~batch.resp_mask] == 0).all()
    assert (logp[batch.resp_mask] < 0).all() and (logp[~batch.resp_mask] == 0).all()


def test_every_attention_row_has_a_key(random_lm):
    """No query row of any mask the sampler (prefill, decode) or the update builds allows no key: CUDA
    SDPA kernels have returned NaN for such rows (a CPU returns 0). Prompts of unequal lengths, so
    that the update's prompt pass is left-padded. Every call's mask is captured at the attention."""
    from transformers import AttentionInterface
    model, tok = random_lm
    seen = []

    def capture(module, query, key, value, attention_mask, **kw):
        seen.append((attention_mask, key.shape[-2], kw.get("shared_prefix")))
        return sampler.cascade_attention(module, query, key, value, attention_mask, **kw)
    AttentionInterface.register("brorl", capture)
    try:
        ro = sampler.generate(model, tok, PROMPTS, 4, 8, 1.3, 1.0, 4096, torch.Generator().manual_seed(2))
        n_sampler = len(seen)
        batch = step.pack_groups([ro.group(g) for g in range(len(PROMPTS))])
        assert not batch.prompt_mask.all()  # left-padding is there
        logp = logprobs.response_logprobs(model, batch, torch.arange(len(ro.texts)), 1.3)
        logp.sum().backward()
    finally:
        AttentionInterface.register("brorl", sampler.cascade_attention)
    assert 0 < n_sampler < len(seen)
    kinds = set()
    for mask, n_keys, prefix in seen:
        if prefix is not None:  # decode: the prompt's keys (mask (r, 1, 1, P)), then the row's own
            assert n_keys >= 1 and mask.shape[-1] == prefix.P  # the row's own token: never masked
            kinds.add("decode")
        elif mask is None:  # plain causal (a prompt alone): every row sees itself
            kinds.add("causal")
        else:
            mask = mask[..., :n_keys]  # (b, 1, q, k), as SDPA slices it
            allowed = mask if mask.dtype == torch.bool else mask > -math.inf
            assert allowed.any(-1).all(), "a query row with no allowed key"
            kinds.add("mask")
    assert kinds == {"decode", "causal", "mask"}
    assert torch.isfinite(logp).all() and model.lm_head.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_top_p_samples_only_from_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    u = torch.rand(len(logits), generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # (R,)
    toks = sampler.pick_tokens(logits, 1.0, 0.7, u)
    counts = torch.bincount(toks, minlength=4).float() / 4000
    assert counts[2] == 0 and counts[3] == 0  # 0.5 + 0.3 reaches 0.7: tokens 2, 3 are cut
    assert abs(counts[0] - 0.5 / 0.8) < 0.03  # renormalised within the nucleus


def test_chunks_of_one_n_are_whole_groups_and_parts():
    """chunk_rows: with one n for all, max_rows // n whole groups a chunk, or a group of more than
    max_rows rows split into parts of max_rows; groups of unequal n packed in order while they
    fit."""
    assert sampler.chunk_rows([3] * 5, 7) == [{0: (0, 3), 1: (0, 3)}, {2: (0, 3), 3: (0, 3)},
                                              {4: (0, 3)}]
    assert sampler.chunk_rows([5] * 2, 2) == [{0: (0, 2)}, {0: (2, 4)}, {0: (4, 5)},
                                              {1: (0, 2)}, {1: (2, 4)}, {1: (4, 5)}]
    assert sampler.chunk_rows([3, 1, 5, 2, 2], 4) == [{0: (0, 3), 1: (0, 1)}, {2: (0, 4)},
                                                      {2: (4, 5)}, {3: (0, 2), 4: (0, 2)}]


def calls_per_n(model, tok, prompts, sizes, seeds, max_rows) -> list:
    """Each prompt's Rollouts from one sampler call per distinct n (as --alloc adaptive sampled
    before its one call), in prompt order."""
    out = [None] * len(prompts)
    for size in set(sizes):
        js = [j for j, n in enumerate(sizes) if n == size]
        alone = sampler.generate(model, tok, [prompts[j] for j in js], size, 8, 1.3, 1.0, max_rows,
                               [seeds[j] for j in js])
        for k, j in enumerate(js):
            out[j] = alone.group(k)
    return out


# Two threads on a busy 2-core machine wait on each other: a minute, so slow.
@pytest.mark.parametrize("threads", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_each_prompts_own_n_in_one_call_equals_one_call_per_n(random_lm, threads):
    """--alloc adaptive's one call: prompts of unequal lengths and unequal n (groups of 1 to 40; in
    one chunk, and in chunks of 5 rows, a group split into parts) give each prompt exactly the
    rollouts that a call with its n alone gives it: tokens, masks, log-probs, entropies and
    truncation flags to the bit, on one thread and on two. A rollout is a function of its
    prompt's seed and its place in the group, and its arithmetic is not the chunk's: prompts are
    padded to a multiple of sampler.PAD_TO and a step decodes >= sampler.MIN_ROWS rows (with
    either set to 1 this fails: a softmax over other padding, a product of a few rows, round
    differently)."""
    model, tok = random_lm
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # Prompts of 1 to 33 tokens: padded to 16, 32 or 48 by the chunk's longest.
        prompts = PROMPTS * 2 + ["1234567890+1234567890=", "9" * 33, "5", "77+1="]
        seeds = list(range(100, 112))
        sizes_of = ([1, 2, 7, 1, 3, 1, 9, 2, 4, 1, 1, 2], [16, 5, 30, 4, 4, 12, 17, 40, 4, 5, 6, 6])
        for sizes in sizes_of:
            runs = {}
            for max_rows in (4096, 5):
                one = runs[max_rows] = sampler.generate(model, tok, prompts, sizes, 8, 1.3, 1.0,
                                                      max_rows, seeds)
                assert one.tokens.shape[0] == sum(sizes) and one.n == sizes
                for j, b in enumerate(calls_per_n(model, tok, prompts, sizes, seeds, max_rows)):
                    a = one.group(j)
                    assert a.n == b.n == sizes[j] and a.prompt_ids == b.prompt_ids
                    assert a.texts == b.texts
                    for field in ("tokens", "mask", "logp", "entropy", "truncated"):
                        assert torch.equal(getattr(a, field), getattr(b, field)), (j, field)
            # Chunks of 5 rows (a group of more split into parts of 5, each drawing its own
            # places' uniforms) against one chunk: the same rollouts, to the bit.
            for field in ("tokens", "mask", "logp", "entropy", "truncated"):
                assert torch.equal(getattr(runs[5], field), getattr(runs[4096], field)), field
    finally:
        torch.set_num_threads(before)


def test_static_decode_step_equals_the_sampler(random_lm):
    """tools/bench.py's static decode step (its compiled contender), traced eagerly (the graph
    torch.compile gets): the static cache (written at a tensor t, read under a mask) and static
    rows give the sampler's greedy tokens and, sampled at T = 1.3 from the same seeds, its tokens,
    log-probs and entropies to fp32 rounding."""
    from tools import bench
    model, tok = random_lm
    ids = [tok(p)["input_ids"] for p in PROMPTS]  # unequal lengths: the prefix's padding
    eos, pad = [tok.eos_token_id], tok.pad_token_id
    for temperature in (0.0, 1.3):
        ref = sampler.generate_group_chunk(model, ids, [1, 2, 3, 4], [(3, 0, 3)] * 4, 8,
                                           temperature, 1.0, eos, pad)
        got = bench.static_decode_chunk(model, ids, [1, 2, 3, 4], 3, 8, temperature, 1.0, eos,
                                         pad, compiled=False)
        assert ref[1].any(1).all() and not ref[1].all()  # rows stop early and at max_new: both
        for a, b in zip(ref, got):
            assert a.shape == b.shape
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])  # tokens, mask
        torch.testing.assert_close(ref[2], got[2], atol=2e-5, rtol=0)  # log-probs
        torch.testing.assert_close(ref[3], got[3], atol=2e-5, rtol=0)  # entropies
        assert torch.equal(ref[4], got[4])  # truncated


@pytest.mark.slow
def test_compiled_decode_step_equals_the_sampler(random_lm, monkeypatch):
    """The same step compiled (torch.compile, inductor on this CPU) at the smallest shapes (two
    prompts, two rollouts each, three tokens), greedy: the sampler's tokens, and its log-probs to
    fp32 rounding; a second call reuses the compiled step. Compiled in this process (no pool of
    compile workers: for one small graph they cost more than they save, ~50 s against ~100 s)."""
    import torch._inductor.config
    from tools import bench
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    model, tok = random_lm
    ids = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    eos, pad = [tok.eos_token_id], tok.pad_token_id
    ref = sampler.generate_group_chunk(model, ids, [1, 2], [(2, 0, 2)] * 2, 3, 0.0, 1.0, eos, pad)
    for _ in range(2):
        got = bench.static_decode_chunk(model, ids, [1, 2], 2, 3, 0.0, 1.0, eos, pad)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
        torch.testing.assert_close(ref[2], got[2], atol=2e-5, rtol=0)
    assert len([k for k in bench._STEPS if k[0] == id(model)]) == 1  # compiled once
