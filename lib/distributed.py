"""
distributed.py: brorl on K processes, launched by torchrun. One process (`python brorl.py`) runs
the same code with K = 1, where nothing moves between ranks: the callers skip the helpers that
would do nothing then (a gather of one part, a sum of one term, a move to itself: each call site
says `if world_size() > 1`), and the rest reduce to the one process's case (all rows its share).

    torchrun --standalone --nproc_per_node=K brorl.py [flags]

What is split and what is gathered (brorl.py calls these at each point):
  - rollouts: each round's prompts are chosen identically on every rank, and each rank samples and
    scores its share() of them; the rewards and lengths of all prompts are gather()ed, so that every
    rank takes the same dynamic-sampling decisions and computes the same advantages and loss
    normalisers. Each prompt's rollouts come from its own seed, so they do not depend on which rank
    drew them. The kept groups are then balance()d: rank k holds the groups in share(G, k),
    whichever ranks' prompts survived.
  - the update: every rank knows every row's advantage and length, and holds the rows of its groups.
    micro_batches() gives each rank its rows of a mini-batch, in as many micro-batches as the
    busiest rank needs. FSDP2 shards the parameters, gradients and AdamW state (shard()); each
    rank's loss is weighted by the mini-batch's normaliser, which every rank computes alike, and the
    gradients are SUMMED over ranks (FSDP averages by default): the gradient is one process's up to
    float rounding. The update's metrics are summed (or maxed) over ranks once, at its end
    (reduce()). With a bf16 compute dtype FSDP all-gathers bf16 copies of the parameters (half the
    traffic and the gathered bytes) and reduces the gradients in fp32 into the fp32 shards AdamW
    steps (MixedPrecisionPolicy).
  - log-probs without logits: brorl's log-prob pass calls the decoder for hidden states and applies
    the head's weight itself (kernels.linear_logprobs: never the (rows, T, V) logits). Under FSDP
    the decoder layers gather their own shards, but the root's parameters (embeddings, final norm,
    head: one unit, the head tied to the embeddings or not) are gathered only in the root's forward.
    So the whole pass runs as a forward of the root (in_forward(): FSDP's
    register_fsdp_forward_method): the root's parameters are whole for all of it, the head's weight
    included, and their gradients are reduce-scattered after the backward exactly as after
    model(...).
  - full weights: rollouts, evaluation and checkpoints use a full replica of the policy, refreshed
    from the shards once per step (refresh()); the reference policy (--kl_coef) is a full frozen
    copy.
  - output: rank 0 alone prints and writes (is_main()); the checkpoint's AdamW state is gathered
    from the shards onto rank 0 (optimizer_state()).

Backend: nccl for CUDA tensors (gloo for the few small CPU reductions), gloo on a CPU. A rank that
raises exits non-zero, and torchrun then stops the others.
"""

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import (FSDPModule, MixedPrecisionPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import DTensor


def world_size() -> int:
    """K, the number of processes (torchrun sets WORLD_SIZE; 1 under plain python)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0 alone prints, writes metrics and plots, and checkpoints."""
    return rank() == 0


def pick_device(device: str) -> torch.device:
    """The --device flag as a device: auto = this rank's GPU (LOCAL_RANK) if there is one, else the
    CPU; cuda without an index = this rank's GPU too (a CUDA device needs its index to be set)."""
    gpu = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    if device == "auto":
        device = gpu if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        device = gpu
    return torch.device(device)


def device_default_dtype(device_type: str) -> str:
    """What --dtype auto stands for on a device where no model is at hand to choose by (before
    setup's pick_dtype, lib/policy.py, or in a run's config.json written before auto's choice was
    recorded): bf16 on CUDA, fp32 elsewhere."""
    return "bfloat16" if device_type == "cuda" else "float32"


def setup(device: str) -> torch.device:
    """Join the process group when launched by torchrun; return this rank's device (pick_device)."""
    device = pick_device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ and not dist.is_initialized():  # torchrun's environment, even for K = 1
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return device


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------
# Who holds what: shares of prompts and of kept groups, micro-batches of a rank's rows, and the
# reductions (their tensors moved to the CPU: they are a few numbers).


def share(n: int, r: int | None = None) -> range:
    """This rank's (or rank r's) contiguous share of n items (sizes differ by at most one; empty if
    n < K)."""
    K, r = world_size(), rank() if r is None else r
    return range(r * n // K, (r + 1) * n // K)


def move(items: list, owner: list) -> list:
    """items[j], held by rank owner[j] (None on the others), moved to the rank whose share() of the
    len(items) holds j: returns this rank's list, items[j] for j in share(len(items)), None
    elsewhere. Only the items whose owner is not their destination travel, one send and one receive
    each, in the order of j on every rank (no cycle of waits). K = 1: items."""
    if not dist.is_initialized():
        return items
    n, r = len(items), rank()
    dest = [k for k in range(world_size()) for _ in share(n, k)]  # (n,) the rank each item goes to
    out = [items[j] if dest[j] == r else None for j in range(n)]
    for j in range(n):
        if owner[j] == dest[j]:
            continue
        if r == owner[j]:
            dist.send_object_list([items[j]], dst=dest[j])
        elif r == dest[j]:
            box = [None]
            dist.recv_object_list(box, src=owner[j])
            out[j] = box[0]
    return out


def balance(groups: list) -> list:
    """The kept groups, each on the rank that trains it: groups[j] (a one-group Rollouts on the rank
    that sampled it, None on the others) moved to the rank whose share() of len(groups) holds j, an
    even share per rank whatever dynamic sampling kept where. Returns this rank's list: its groups,
    None elsewhere."""
    if not dist.is_initialized():
        return groups
    # (G,)
    owner = all_sum(torch.tensor([rank() * (x is not None) for x in groups])).long().tolist()
    return move(groups, owner)


def micro_batches(rows: torch.Tensor, n_groups: int, n, size: int) -> list:
    """This rank's part of `rows` (indices among all ranks' n_groups * n rows, group-major, rank k
    holding the groups in share(n_groups, k)) as indices into its own batch, in micro-batches of
    `size`, in the order of `rows`. Every rank gets as many micro-batches as the busiest rank needs
    (a rank with fewer runs empty ones: every rank joins each of FSDP's collectives). K = 1: rows,
    in micro-batches. n: rows per group, or a list of each group's (what training passes, through
    RowLayout, whatever the groups' sizes)."""
    K, mine = world_size(), share(n_groups)
    ends = ([0] + torch.tensor(n, dtype=torch.long).cumsum(0).tolist()
            if isinstance(n, list) else None)
    # the first row of group j (j = n_groups: all rows)
    first = lambda j: ends[j] if ends else j * n
    # (K,) each rank's rows' end
    stops = torch.tensor([first(share(n_groups, k).stop) for k in range(K)])
    owner = torch.bucketize(rows.cpu(), stops, right=True)  # (len(rows),) the rank holding each row
    local = rows[(owner == rank()).to(rows.device)] - first(mine.start)  # (this rank's rows,)
    # Every rank runs as many micro-batches as the busiest rank's rows need.
    count = -(-int(torch.bincount(owner, minlength=K).max()) // size) if len(rows) else 0
    return [local[i * size: (i + 1) * size] for i in range(count)]


class RowLayout:
    """The update's R rows over all ranks, group-major (each group's responses in turn, rank k
    holding the groups in share(G, k)). lengths: G tensors (m_j,), each response's valid tokens,
    as training passes them (brorl.pack_rows), whatever the groups' sizes; a (G, m) tensor
    (step.pack_groups' for equal groups) is read as its G rows, so that every caller takes
    training's one path. Every rank knows every row's length, so the loss's normalisers are alike
    on every rank; each rank computes only the rows it holds."""

    def __init__(self, lengths, micro_batch: int, device):
        lengths = list(lengths)  # G tensors (m_j,)
        self.n_groups = len(lengths)
        self.per_group = [len(x) for x in lengths]  # each m_j
        self.tokens = torch.cat(lengths)  # (R,) every rank's rows
        self.micro_batch, self.device = micro_batch, device

    def __len__(self) -> int:
        return len(self.tokens)

    def mine(self, rows: torch.Tensor) -> list:
        """This rank's rows among `rows` (indices among all ranks' rows), as micro-batches of
        indices into its own batch: K = 1, rows itself, split; K > 1, micro_batches' (as many on
        every rank)."""
        size = self.micro_batch
        parts = (micro_batches(rows, self.n_groups, self.per_group, size) if world_size() > 1
                 else [rows[i: i + size] for i in range(0, len(rows), size)])
        return [x.to(self.device) for x in parts]

    def counts(self, rows: torch.Tensor) -> tuple:
        """(valid tokens, rows) of `rows` over all ranks: a mini-batch's loss normalisers."""
        return self.tokens[rows].sum(), len(rows)


def reduce(metrics: dict, maxes=()) -> dict:
    """Metrics summed over ranks (those named in maxes: their max over ranks), one all-reduce for
    each kind."""
    sums = [k for k in metrics if k not in maxes]
    total, top = all_sum([metrics[k] for k in sums]), all_max([metrics[k] for k in maxes])
    return {**dict(zip(sums, total.tolist())), **dict(zip(maxes, top.tolist()))}


def gather(x: torch.Tensor) -> torch.Tensor:
    """Each rank's x (its share's rows) concatenated in rank order: the rows of all n items."""
    if not dist.is_initialized():
        return x
    parts = [None] * world_size()
    # shares differ in size: objects, not a tensor collective
    dist.all_gather_object(parts, x.cpu())
    return torch.cat(parts).to(x.device)


def gather_list(items: list) -> list:
    """Each rank's list (of any picklable items) concatenated in rank order, on every rank."""
    if not dist.is_initialized():
        return items
    parts = [None] * world_size()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def all_sum(x) -> torch.Tensor:
    """Sum over ranks of a number or a tensor of numbers (float64: counts and sums of losses)."""
    t = torch.as_tensor(x, dtype=torch.float64).cpu().clone()
    if dist.is_initialized():
        dist.all_reduce(t, dist.ReduceOp.SUM)
    return t


def all_max(x) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64).cpu().clone()
    if dist.is_initialized():
        dist.all_reduce(t, dist.ReduceOp.MAX)
    return t


def broadcast(obj):
    """Rank 0's obj on every rank (e.g. the run directory, whose default name holds the time)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def full(x: torch.Tensor) -> torch.Tensor:
    """A DTensor (e.g. clip_grad_norm_'s norm of sharded gradients) as the whole tensor."""
    return x.full_tensor() if isinstance(x, DTensor) else x


# ----------------------------------------------------------------------------
# FSDP2: sharded parameters, gradients and AdamW state; a full replica for everything but the update


def shard(model, dtype=torch.float32):
    """(model, replica). K = 1: the model itself twice. K > 1: a full replica of the model is kept
    (rollouts, evaluation, checkpoints), then the model is sharded with FSDP2, each decoder layer a
    unit (Hugging Face names its classes in _no_split_modules) and the root holding the rest. dtype:
    the compute dtype; bf16 gathers bf16 parameters and reduces fp32 gradients (the shards, AdamW's
    master weights, stay fp32). Inputs are not cast: the residual stream stays fp32, as under
    autocast."""
    if world_size() == 1:
        return model, model
    replica = copy.deepcopy(model)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    layers = set(getattr(model, "_no_split_modules", None) or [])
    for m in model.modules():
        if type(m).__name__ in layers:
            fully_shard(m, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # SUM the gradients over ranks: each rank's loss is already weighted by the global
            # normaliser (the default averages).
            m.set_gradient_divide_factor(1.0)
            # A plain SUM (gloo has no pre-multiplied sum).
            m.set_force_sum_reduction_for_comms(True)
    # in_forward's entry: FSDP's pre/post-forward hooks around fn
    model.run_forward = lambda fn: fn()
    register_fsdp_forward_method(model, "run_forward")
    return model, replica


def in_forward(model, fn):
    """fn() (which calls parts of `model`) run as one forward of the model: under FSDP, the root's
    parameters are gathered before it and its gradients reduced after the backward, as for
    model(...). K = 1: fn()."""
    return model.run_forward(fn) if isinstance(model, FSDPModule) else fn()


@torch.no_grad()
def refresh(model, replica):
    """Copy the sharded model's weights into the replica: one all-gather per parameter."""
    if model is replica:
        return
    for p_full, p in zip(replica.parameters(), model.parameters(), strict=True):
        p_full.copy_(full(p))


def optimizer_state(model, opt) -> dict:
    """AdamW's state for a checkpoint. K > 1: gathered from the shards onto rank 0's CPU (the other
    ranks get {}), keyed by parameter name; --resume must use the same K."""
    if world_size() == 1:
        return opt.state_dict()
    return get_optimizer_state_dict(model, opt,
                                    options=StateDictOptions(full_state_dict=True,
                                                             cpu_offload=True))


def load_optimizer_state(model, opt, state: dict):
    """The inverse of optimizer_state: every rank reads the full state and keeps its shard."""
    if world_size() == 1:
        opt.load_state_dict(state)
    else:
        set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))
