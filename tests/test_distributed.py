"""torchrun brorl.py: K processes train exactly as one. Each run here is a real `torchrun` (gloo, on
this CPU) or a plain `python` of the same script, with tiny settings; a recording wrapper (RUNNER)
notes what each rank sampled and each mini-batch's gradient norm, without touching brorl's code."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import brorl
from lib import distributed, policy
import sampler

HERE = Path(__file__).resolve().parent.parent  # the repository root

# Runs brorl.train as `python brorl.py` would, recording per rank: every lib/step.sample_share call (this rank's
# prompts and texts, and the rewards of all ranks), every clipped mini-batch's gradient norm and this
# rank's rows of each of its micro-batches (loss_weights' calls; every rank runs as many), the kept groups it
# trained each step, the micro-batches it ran with no row, and which
# log-prob kernel the update called (from hidden states, or from logits). CRASH_AT_UPDATE=<rank>:<n>
# makes that rank raise in its n-th update.
RUNNER = textwrap.dedent('''
    import json, os, sys, torch
    import brorl
    from lib import diagnostics, distributed, logprobs, policy, step
    calls, norms, rows, idle, packed, kernel = [], [], [], [0], [], {"linear": 0, "logits": 0}
    weights = brorl.loss_weights
    def recording_weights(mask, *a, **k):
        rows.append(mask.shape[0])
        return weights(mask, *a, **k)
    brorl.loss_weights = recording_weights
    linear, from_logits = logprobs.linear_logprobs, logprobs.token_logprobs
    def counting_linear(*a, **k):
        kernel["linear"] += 1
        kernel.setdefault("head_dtypes", [])  # the head's weight as each pass sees it (FSDP: as gathered)
        if str(a[1].dtype) not in kernel["head_dtypes"]:
            kernel["head_dtypes"].append(str(a[1].dtype))
        return linear(*a, **k)
    def counting_logits(*a, **k):
        kernel["logits"] += 1
        return from_logits(*a, **k)
    logprobs.linear_logprobs, logprobs.token_logprobs = counting_linear, counting_logits
    pack = brorl.pack_groups
    def counting_pack(kept, *a):
        packed.append(len(kept))
        return pack(kept, *a)
    brorl.pack_groups = counting_pack
    share = step.sample_share
    def recording_share(model, tok, examples, n, *a, **k):
        ro, mine, r, *scores = share(model, tok, examples, n, *a, **k)
        calls.append(dict(prompts=[examples[i]["prompt"] for i in mine], texts=ro.texts if ro else [],
                          rewards=r.tolist() if torch.is_tensor(r) else [x.tolist() for x in r]))
        return ro, mine, r, *scores
    # every caller's name for it: the rollouts', the evaluation's, the probe's
    step.sample_share = brorl.sample_share = diagnostics.sample_share = recording_share
    clip = torch.nn.utils.clip_grad_norm_
    def recording_clip(*a, **k):
        norm = clip(*a, **k)
        norms.append(distributed.full(norm).item())
        return norm
    torch.nn.utils.clip_grad_norm_ = recording_clip
    logprobs = brorl.response_logprobs
    def counting_logprobs(model, batch, rows, *a, **k):
        idle[0] += len(rows) == 0
        return logprobs(model, batch, rows, *a, **k)
    brorl.response_logprobs = counting_logprobs
    crash = os.environ.get("CRASH_AT_UPDATE", "")
    if crash and crash.split(":")[0] == os.environ.get("RANK", "0"):
        update, count = brorl.update_policy, [0]
        def crashing_update(*a, **k):
            count[0] += 1
            if count[0] == int(crash.split(":")[1]):
                raise RuntimeError(f"planted failure on rank {os.environ['RANK']}")
            return update(*a, **k)
        brorl.update_policy = crashing_update
    cfg = brorl.parse_config(sys.argv[1:])
    brorl.train(cfg)
    record = dict(calls=calls, norms=norms, rows=rows, idle=idle[0], packed=packed, kernel=kernel)
    (__import__("pathlib").Path(cfg.out) / f"record-{distributed.rank()}.json").write_text(json.dumps(record))
''')

# 3 steps, dynamic sampling on (the default): N = 8 rollouts, B = 2 kept groups, 2 mini-batches
TINY = ["--n_rollouts", "8", "--prompts_per_step", "2", "--steps", "3", "--eval_every", "2", "--eval_prompts", "3",
        "--eval_samples", "2", "--probe_prompts", "2", "--probe_samples", "32", "--micro_batch", "3", "--seed", "1"]

BF16 = ["--dtype", "bfloat16", "--steps", "1", "--eval_every", "1", "--save", "0"]


def start(tmp_path, out, args, procs=1, threads=1, env=None):
    """brorl.py through RUNNER, started: plain python for procs = 0, else torchrun with `procs` processes.
    The runner script is written once per directory, whole (renamed into place): a run started while
    another is starting must never read a half-written script."""
    runner = tmp_path / "runner.py"
    if not runner.exists():
        part = tmp_path / f"runner.py.{os.getpid()}.part"
        part.write_text(RUNNER)
        os.replace(part, runner)
    # CUDA_VISIBLE_DEVICES empty: the ranks run on the CPU (gloo) whatever the machine has (on one GPU,
    # rank 1 would ask for cuda:1), and the comparisons with one process are bitwise
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": str(HERE), "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
                if procs else [sys.executable])
    log = open(tmp_path / f"{out.name}-{len(list(tmp_path.glob('*.log')))}.log", "w")  # a file: no pipe to fill
    p = subprocess.Popen([*launcher, str(runner), "--out", str(out), *args], cwd=tmp_path, env=env,
                         stdout=log, stderr=subprocess.STDOUT)
    p.log = log
    return p


def finish(p, timeout=900):
    """(exit status, output) of a started run; a run still going after `timeout` s is killed and fails.
    The limit only stops a hang: a loaded CI machine runs the fixture's six runs side by side for minutes."""
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"still running after {timeout} s: {p.args}")
    p.log.close()
    return p.returncode, Path(p.log.name).read_text()


def records(out, procs):
    """Each rank's record of the run in `out`; a missing one fails naming the run and showing its log."""
    found = []
    for r in range(max(procs, 1)):
        path = out / f"record-{r}.json"
        if not path.exists():
            logs = "\n".join(f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in sorted(out.parent.glob(f"{out.name}-*.log")))
            pytest.fail(f"run {out.name}: rank {r} wrote no record ({path})\n{logs or '(no log)'}")
        found.append(json.loads(path.read_text()))
    return found


def weights(out):
    return load_file(out / "ckpt" / "model.safetensors")


def rel_diff(a, b):
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a)
    return (num / sum((a[k].double() ** 2).sum() for k in a)).sqrt().item()


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (1 and 2 threads), two processes, two processes stopped at step 2 then resumed, and
    one step in bf16 on one process and on two."""
    tmp = tmp_path_factory.mktemp("dist")
    out = {name: tmp / name for name in ("one", "one_2threads", "two", "two_part", "one_bf16", "two_bf16")}
    started = {  # independent runs, side by side
        "one": start(tmp, out["one"], TINY, procs=0),
        "one_2threads": start(tmp, out["one_2threads"], TINY, procs=0, threads=2),
        # the 2-process run decodes in other chunks: 4 rows at a time splits each group of 8 in two
        "two": start(tmp, out["two"], [*TINY, "--max_rows", "4"], procs=2),
        "two_part": start(tmp, out["two_part"], [*TINY, "--max_rows", "4", "--steps", "2"], procs=2),
        "one_bf16": start(tmp, out["one_bf16"], [*TINY, *BF16], procs=0),
        "two_bf16": start(tmp, out["two_bf16"], [*TINY, *BF16], procs=2),
    }
    done = {name: finish(p) for name, p in started.items()}
    done["two_resumed"] = finish(start(tmp, out["two_part"], ["--resume", str(out["two_part"]), "--steps", "3"], procs=2))
    out["two_resumed"] = out["two_part"]
    for name, (code, err) in done.items():
        assert code == 0, f"{name}:\n{err[-3000:]}"
    return out


@pytest.mark.parametrize("K", [1, 2, 3, 5])
def test_micro_batches_give_each_rank_its_rows_in_as_many_micro_batches(monkeypatch, K):
    """distributed.micro_batches for every rank of K (no process group: WORLD_SIZE and RANK alone), G groups
    of n rows with G < K too, a mini-batch a shuffled part of the rows: each rank gets the rows of the groups
    balance() gives it (share(G)), in the mini-batch's order, as indices into its own batch, in full
    micro-batches but the last; every rank as many as the busiest needs."""
    gen = torch.Generator().manual_seed(K)
    for G, n, size in [(g, n, size) for g in range(7) for n in (1, 3) for size in (1, 2, 100)]:
        rows = torch.randperm(G * n, generator=gen)[: max(G * n - 2, 1) if G else 0]  # (rows of the mini-batch,)
        got = {}
        for r in range(K):
            monkeypatch.setenv("WORLD_SIZE", str(K))
            monkeypatch.setenv("RANK", str(r))
            got[r] = distributed.micro_batches(rows, G, n, size)
        held = {r: range(distributed.share(G, r).start * n, distributed.share(G, r).stop * n) for r in range(K)}
        busiest = max(sum(int(x) in held[r] for x in rows) for r in range(K))
        for r, mbs in got.items():
            assert len(mbs) == -(-busiest // size)  # the same count on every rank
            mine = torch.cat(mbs).tolist() if mbs else []
            assert [x + held[r].start for x in mine] == [int(x) for x in rows if int(x) in held[r]]
            sizes = [len(mb) for mb in mbs if len(mb)]
            assert all(k == size for k in sizes[:-1]) and all(len(mb) == 0 for mb in mbs[len(sizes):])


@pytest.mark.slow
def test_two_processes_sample_the_same_rollouts_each_only_its_share(runs):
    one, two = records(runs["one"], 0)[0], records(runs["two"], 2)
    assert len(one["calls"]) == len(two[0]["calls"]) == len(two[1]["calls"])  # rounds, evals, probes
    for i, call in enumerate(one["calls"]):
        parts = [rank["calls"][i] for rank in two]
        assert parts[0]["prompts"] + parts[1]["prompts"] == call["prompts"]  # rank 0 then rank 1's share
        assert parts[0]["texts"] + parts[1]["texts"] == call["texts"]  # the same rollouts...
        assert all(p["rewards"] == call["rewards"] for p in parts)  # ...and every rank sees all rewards
        assert all(len(p["prompts"]) <= (len(call["prompts"]) + 1) // 2 for p in parts)  # only its share
    assert sum(rank["idle"] for rank in two) > 0  # a rank held no row of some micro-batch (the idle path ran)
    # each step's kept groups are trained by the ranks in even shares, whichever rank sampled them
    kept = [m["groups_kept"] for m in metrics(runs["two"]) if m.get("groups_kept")]
    assert len(two[0]["packed"]) == len(two[1]["packed"]) == len(kept) > 0
    for a, b, g in zip(two[0]["packed"], two[1]["packed"], kept):
        assert a + b == g and abs(a - b) <= 1, (a, b, g)


@pytest.mark.slow
def test_two_processes_train_as_one(runs):
    one, two = records(runs["one"], 0)[0], records(runs["two"], 2)
    # every mini-batch of every step: the same gradient norm up to float summation order. Where both
    # ranks hold rows of a mini-batch, each rank's loss must be weighted by the normaliser of ALL its
    # rows and the ranks' gradients summed: a rank-local normaliser or an average would move the norm
    assert two[0]["norms"] == two[1]["norms"]  # one clipped norm, the whole gradient's, on every rank
    assert len(one["norms"]) == len(two[0]["norms"]) > 0
    shared = [i for i, (a, b) in enumerate(zip(two[0]["rows"], two[1]["rows"])) if a and b]
    assert len(shared) >= 2, (two[0]["rows"], two[1]["rows"])  # the comparison below can see those bugs
    for i, (a, b) in enumerate(zip(one["norms"], two[0]["norms"])):
        assert b == pytest.approx(a, rel=1e-4), f"mini-batch {i}: 2 processes {b}, 1 process {a}"
    # the update's log-probs come from hidden states on both (kernels.linear_logprobs): never the logits
    assert one["kernel"]["linear"] > 0 and one["kernel"]["logits"] == 0
    assert all(rank["kernel"]["linear"] > 0 and rank["kernel"]["logits"] == 0 for rank in two)
    m1, m2 = metrics(runs["one"]), metrics(runs["two"])
    for a, b in zip(m1, m2):  # every batch statistic over all ranks: the same kept groups and rewards
        for k in ("reward_mean", "keep_rate", "groups_kept", "sample_rounds", "zero_adv_frac", "pass@N", "resp_len"):
            assert a.get(k) == b.get(k), (a["step"], k)
        for k in ("entropy", "clip_frac"):
            assert a.get(k, 0) == pytest.approx(b.get(k, 0), rel=1e-4, abs=1e-6), (a["step"], k)
    # final weights: as close as float reduction order allows. The floor is one process at 1 thread
    # against 2 threads, same flags: AdamW turns rounding noise in near-zero gradients into full steps
    floor = rel_diff(weights(runs["one"]), weights(runs["one_2threads"]))
    diff = rel_diff(weights(runs["one"]), weights(runs["two"]))
    print(f"\nfinal weights, relative L2 difference: 2 processes vs 1: {diff:.2e}; "
          f"1 process at 2 threads vs 1 thread (the floor): {floor:.2e}")
    assert diff <= max(10 * floor, 1e-4)


@pytest.mark.slow
def test_bf16_two_processes_gather_bf16_weights_and_train_as_one(runs):
    """--dtype bfloat16: FSDP gathers bf16 parameters (the head's weight reaches the log-prob kernel in
    bf16) and reduces in fp32 into fp32 shards; step 1's first gradient is one process's up to the
    rounding of the weights that autocast leaves fp32 on one process (norms, embeddings) to bf16."""
    one, two = records(runs["one_bf16"], 0)[0], records(runs["two_bf16"], 2)
    assert one["kernel"]["head_dtypes"] == ["torch.float32"]  # one process: fp32 weights, autocast casts per matmul
    # two: the sharded update's passes see the gathered bf16 head (the evaluation's exact Q runs on the fp32 replica)
    assert all("torch.bfloat16" in rank["kernel"]["head_dtypes"] for rank in two)
    assert two[0]["norms"][0] == pytest.approx(one["norms"][0], rel=3e-2)
    assert all(torch.isfinite(torch.tensor(rank["norms"])).all() for rank in two)


@pytest.mark.slow
def test_resumed_two_process_run_equals_the_straight_one(runs):
    a, b = weights(runs["two"]), weights(runs["two_resumed"])
    assert rel_diff(a, b) == 0.0, rel_diff(a, b)
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time") and k != "tokens_per_s"}
    assert [strip(r) for r in metrics(runs["two_resumed"])] == [strip(r) for r in metrics(runs["two"])]


@pytest.mark.slow
def test_rank_0_writes_every_ranks_samples(runs):
    """samples.jsonl under K = 2 is one process's: rank 0 writes the held-out prompts of rank 1's share too."""
    read = lambda out: [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    step0 = lambda out: [r for r in read(out) if r["step"] == 0]  # the same weights: the same responses
    assert step0(runs["two"]) == step0(runs["one"]) and len(step0(runs["one"])) == 3 * 2  # 3 prompts x 2 samples


@pytest.mark.slow
def test_resume_needs_the_same_number_of_processes(runs, tmp_path, capsys):
    import shutil
    run = shutil.copytree(runs["two"], tmp_path / "two")  # a 2-process run, resumed by one process
    with pytest.raises(SystemExit):
        brorl.train(brorl.parse_config(["--resume", str(run), "--steps", "4"]))
    assert "written by 2 process(es), this run has 1: use the same number" in capsys.readouterr().err


@pytest.mark.slow
def test_a_crashing_rank_stops_the_job(tmp_path):
    """Rank 1 raises in its second update while rank 0 waits for it in a collective: torchrun
    stops rank 0 and the job exits non-zero with rank 1's error (a hang fails by the timeout)."""
    code, err = finish(start(tmp_path, tmp_path / "run", TINY, procs=2, env={"CRASH_AT_UPDATE": "1:2"}))
    assert code != 0
    assert "planted failure on rank 1" in err
    assert not (tmp_path / "run" / "record-0.json").exists()  # rank 0 did not finish


def test_prompts_per_step_must_be_a_multiple_of_the_processes(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        brorl.parse_config(["--prompts_per_step", "3"])
    assert "--prompts_per_step 3: must be a multiple of the 2 processes" in capsys.readouterr().err
    assert brorl.parse_config(["--prompts_per_step", "4"]).prompts_per_step == 4


@pytest.mark.parametrize("n", [0, 1, 5, 8])
def test_shares_cover_every_item_once(monkeypatch, n):
    monkeypatch.setenv("WORLD_SIZE", "3")
    shares = []
    for r in range(3):
        monkeypatch.setenv("RANK", str(r))
        shares.append(distributed.share(n))
    assert [i for s in shares for i in s] == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_rollouts_depend_on_the_prompt_seed_only(tmp_path):
    """A prompt's rollouts are the same whichever prompts it is sampled with, however the rows are
    chunked (a group split in parts), and whichever rows finish early (rows are dropped mid-decode)."""
    import data
    model, tok = policy.load_policy(str(data.EMBEDDED_MODEL), torch.device("cpu"))
    prompts = ["123+45=", "9+1=", "77+123=", "5+5="]
    seeds = [11, 12, 13, 14]
    whole = sampler.generate(model, tok, prompts, 16, 6, 1.0, 1.0, 4096, seeds)
    assert len(set(whole.texts)) > 4  # really sampled
    for subset, max_rows in (([1, 3], 4096), ([2], 5), ([0, 1, 2, 3], 24)):
        part = sampler.generate(model, tok, [prompts[i] for i in subset], 16, 6, 1.0, 1.0, max_rows,
                                [seeds[i] for i in subset])
        assert part.texts == [t for i in subset for t in whole.texts[16 * i: 16 * (i + 1)]]
        rows = torch.cat([torch.arange(16 * i, 16 * (i + 1)) for i in subset])
        torch.testing.assert_close(part.logp, whole.logp[rows][:, : part.logp.shape[1]], atol=1e-5, rtol=0)
    other = sampler.generate(model, tok, prompts[:1], 16, 6, 1.0, 1.0, 4096, [99])
    assert other.texts != whole.texts[:16]  # another seed, other rollouts
