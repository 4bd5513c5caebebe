"""RL-style weight sync, end to end: 2-way tensor-parallel trainers push their whole state dict,
after every step, into four inference actors laid out differently, in one call, checked bit for bit
against a single-process model.

    python examples/weight_sync.py            # ~80 MiB of float32 weights, 6 steps
    python examples/weight_sync.py --quick    # a tiny model, 2 steps (what tests/dist/test_examples.py runs)

The model: a GPT-style transformer (token embedding, pre-norm blocks of causal multi-head attention
and a GELU MLP, final layer norm, an untied output head), float32. Its weights are what a model has:
one tensor per parameter (``layers.0.attn.qkv.weight``, ``layers.0.ln1.bias``, ... 52 of them at the
default size, most of them small), named as a state dict names them.

Trainers: two Ray actors of the user's own (``Trainer``, mixing in ``reshard.runtime.DeviceRole``)
in a torch.distributed gloo world of their own, Megatron-style: q/k/v and the first MLP linear
column-parallel (split by their output rows: heads, hidden units), the attention output and the
second MLP linear row-parallel (split by their inputs), their outputs all-reduced; embedding, head,
layer norms and the row-parallel biases replicated. Each trainer keeps its parameters in
``reshard_device.empty()`` memory and shares its state dict at once
(``share_state_dict``, with each shard's global shape and placements); the driver ``adopt``s the
tree over a (1, 2) mesh, no copy. They train with Adam on random-walk token sequences.

Inference: four actors (``Inference``) over a (1, 4) mesh and a gloo world of their own, 4-way
tensor-parallel with a vocab-parallel embedding and head: every sharded parameter is split 4 ways
instead of 2, and the embedding and head, replicated on the trainers, are split by vocabulary rows;
layer norms and biases stay replicated. Their state dict is adopted once; after every training step
the whole of it is overwritten in place by ONE call, ``reshard(sources, trainer_mesh, layouts,
out=targets)`` (staged, then committed all at once, so a failed sync leaves the old weights), and
the four run a forward pass. ``--overlap``: the sync runs while the trainers compute the next step's
gradients (``async_op=True``), and is waited for before the optimizer writes the weights.

Checks, every step:
- every inference actor's parameters equal, bit for bit, the slices of the reference model's
  weights (the driver trains a single-process copy with the same data and seed; it computes both TP
  ranks with the same split, shapes and summation order, so its weights and loss are bit-identical
  to the trainers': the 2-way all-reduce is one addition, and addition commutes). Each sync path
  starts from inference weights filled with NaN, so an element a path does not write is caught;
- the weights the naive path gathers from the trainers equal the reference's, bit for bit, and so
  do the trainers' losses;
- the inference forward (4-way: partial sums added in another order than the 2-way reference's)
  agrees with the reference's logits within ``LOGITS_RTOL``/``LOGITS_ATOL`` (float32 rounding).

The weight sync is timed along five paths in the same run (median over the steps; the paths take
turns going first): ``reshard`` into the inference actors' tensors (pulls through shared memory,
the default on one machine; staged, then committed); the same with ``direct=True`` (written in
place, no second copy; a failure leaves them partly written); the same through gloo only
(``shared_memory=False``, the path between machines); the naive path (every parameter gathered to
the driver with ``to_numpy()``, ``ray.put``, each inference actor ``ray.get``s them and copies its
slices); and Ray's object store as a user writes it (each trainer ``ray.put``s its shards, the
replicated ones from rank 0 only, and each inference actor ``ray.get``s the shards that overlap its
own and copies the overlap).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import enum
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, replace

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from reshard import DeviceMesh, Layout, Replicate, Shard, reshard  # noqa: E402
from reshard.runtime import DeviceRole, adopt  # noqa: E402

TRAIN_TP = 2
INFER_TP = 4
LOGITS_RTOL = 1e-4  # inference logits (4-way sums) against the reference's (2-way sums)
LOGITS_ATOL = 1e-5
TIMEOUT_S = 300.0  # any single wait of the example


@dataclass(frozen=True, slots=True)
class Config:
    """Model, data and run sizes."""

    vocab: int = 8192
    d_model: int = 512
    heads: int = 8
    ffn: int = 2048
    layers: int = 4
    seq: int = 64
    batch: int = 4
    steps: int = 6
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        for name in ("vocab", "d_model", "heads", "ffn", "layers", "seq", "batch", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} must be a multiple of heads {self.heads}")
        for name in ("heads", "ffn", "vocab"):
            if getattr(self, name) % INFER_TP:
                raise ValueError(f"Config.{name} must split {INFER_TP} ways (the inference TP size)")


QUICK = Config(vocab=64, d_model=32, heads=4, ffn=64, layers=2, seq=8, batch=2, steps=2)


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a block (``layered``: ``layers.<i>.<name>``) or of the model, the tensor
    dim each side splits (None: every actor holds all of it) and its shape."""

    name: str
    train_dim: int | None
    infer_dim: int | None
    layered: bool

    def __post_init__(self):
        if self.train_dim is not None and self.infer_dim not in (None, self.train_dim):
            raise ValueError(f"parameter {self.name}: both sides must split the same dim (or one none)")


PARAMS = (
    Param("attn.qkv.weight", 1, 1, True),  # (3, d, d): q, k, v weights, split by output rows (heads)
    Param("attn.qkv.bias", 1, 1, True),  # (3, d)
    Param("attn.proj.weight", 1, 1, True),  # (d, d): attention output, split by its inputs (heads)
    Param("attn.proj.bias", None, None, True),  # (d,)
    Param("mlp.fc1.weight", 0, 0, True),  # (ffn, d)
    Param("mlp.fc1.bias", 0, 0, True),  # (ffn,)
    Param("mlp.fc2.weight", 1, 1, True),  # (d, ffn): split by its inputs
    Param("mlp.fc2.bias", None, None, True),  # (d,)
    Param("ln1.weight", None, None, True),  # (d,)
    Param("ln1.bias", None, None, True),
    Param("ln2.weight", None, None, True),
    Param("ln2.bias", None, None, True),
    Param("final_norm.weight", None, None, False),  # (d,)
    Param("final_norm.bias", None, None, False),
    Param("embed.weight", None, 0, False),  # (vocab, d): vocab-parallel on the inference side
    Param("head.weight", None, 0, False),  # (vocab, d)
)


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    d, f, v = cfg.d_model, cfg.ffn, cfg.vocab
    return {
        "attn.qkv.weight": (3, d, d),
        "attn.qkv.bias": (3, d),
        "attn.proj.weight": (d, d),
        "attn.proj.bias": (d,),
        "mlp.fc1.weight": (f, d),
        "mlp.fc1.bias": (f,),
        "mlp.fc2.weight": (d, f),
        "mlp.fc2.bias": (d,),
        "ln1.weight": (d,),
        "ln1.bias": (d,),
        "ln2.weight": (d,),
        "ln2.bias": (d,),
        "final_norm.weight": (d,),
        "final_norm.bias": (d,),
        "embed.weight": (v, d),
        "head.weight": (v, d),
    }


def state_dict_names(cfg: Config) -> dict[str, Param]:
    """Every parameter of the model by its state-dict name, in order."""
    out = {}
    for p in PARAMS:
        if p.layered:
            out.update({f"layers.{i}.{p.name}": p for i in range(cfg.layers)})
        else:
            out[p.name] = p
    return out


def shape_of(cfg: Config, name: str) -> tuple[int, ...]:
    return param_shapes(cfg)[name.split(".", 2)[2] if name.startswith("layers.") else name]


def placements(dim: int | None) -> tuple:
    return (Replicate(), Replicate() if dim is None else Shard(dim))


def span(n: int, dim: int | None, parts: int, index: int) -> tuple[int, int]:
    """The range of ``n`` that shard ``index`` of ``parts`` holds along its split dim."""
    if dim is None:
        return 0, n
    size = n // parts
    return index * size, (index + 1) * size


def along(dim: int, lo: int, hi: int) -> tuple:
    return (slice(None),) * dim + (slice(lo, hi),)


def split(a: np.ndarray, dim: int | None, parts: int, index: int) -> np.ndarray:
    """Shard ``index`` of ``parts`` of ``a`` along ``dim`` (all of it for None); a view."""
    if dim is None:
        return a
    return a[along(dim, *span(a.shape[dim], dim, parts, index))]


def init_weights(cfg: Config) -> dict[str, np.ndarray]:
    """The model's state dict: weights random, biases zero, norm weights one."""
    rng = np.random.default_rng(cfg.seed)
    out = {}
    for name in state_dict_names(cfg):
        shape = shape_of(cfg, name)
        if name.endswith(".bias"):
            out[name] = np.zeros(shape, np.float32)
        elif "norm" in name or name.split(".")[-2] in ("ln1", "ln2"):
            out[name] = np.ones(shape, np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    return out


def tokens_for(cfg: Config, step: int) -> np.ndarray:
    """A batch of random walks over the vocabulary (each token 1 to 3 after the previous one),
    (batch, seq + 1) int64: inputs and next-token targets."""
    rng = np.random.default_rng((cfg.seed, step + 1))
    start = rng.integers(0, cfg.vocab, size=(cfg.batch, 1))
    walk = np.cumsum(rng.integers(1, 4, size=(cfg.batch, cfg.seq)), axis=1)
    return np.concatenate([start, start + walk], axis=1) % cfg.vocab


@contextlib.contextmanager
def one_thread():
    """Run torch on one thread (as the actors do): kernels then split and sum alike everywhere."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- the model


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        out = x.contiguous().clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class Local:
    """Every TP rank computed in this process (the reference): fan-out is reuse (autograd sums the
    ranks' input gradients), the reduction a sum in rank order."""

    rank = 0

    @staticmethod
    def enter(h):
        return h

    @staticmethod
    def reduce(parts):
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out


class World:
    """One rank of this process's torch.distributed world."""

    def __init__(self):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def enter(self, h):
        return _CopyToTP.apply(h)

    def reduce(self, parts):
        (part,) = parts
        return _ReduceFromTP.apply(part)

    def gather_last(self, t):
        pieces = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(pieces, t.contiguous())
        return torch.cat(pieces, dim=-1)


class TPModel:
    """The transformer over the TP shards of the ranks this process computes: ``ranks`` holds one
    state dict (name -> tensor) per rank, a replicated parameter the same tensor in each."""

    def __init__(self, cfg: Config, ranks, comm, *, vocab_parallel: bool = False, trainable: bool = True):
        self.cfg, self.comm, self.vocab_parallel = cfg, comm, vocab_parallel
        self.ranks = list(ranks)
        unique = {id(t): t for r in self.ranks for t in r.values()}
        for t in unique.values():
            t.requires_grad_(trainable)
        self.params = list(unique.values())

    def loss(self, tokens):
        logits = self.logits(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()), logits

    def logits(self, tokens):
        d, rep, comm = self.cfg.d_model, self.ranks[0], self.comm
        x = self.embed(tokens)
        causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)
        for i in range(self.cfg.layers):
            lay = f"layers.{i}."
            h = F.layer_norm(x, (d,), rep[lay + "ln1.weight"], rep[lay + "ln1.bias"])
            attn = comm.reduce([self.attention(comm.enter(h), r, lay, causal) for r in self.ranks])
            x = x + (attn + rep[lay + "attn.proj.bias"])
            h = F.layer_norm(x, (d,), rep[lay + "ln2.weight"], rep[lay + "ln2.bias"])
            x = x + (comm.reduce([self.mlp(comm.enter(h), r, lay) for r in self.ranks]) + rep[lay + "mlp.fc2.bias"])
        x = F.layer_norm(x, (d,), rep["final_norm.weight"], rep["final_norm.bias"])
        logits = F.linear(x, rep["head.weight"])
        return self.comm.gather_last(logits) if self.vocab_parallel else logits

    def embed(self, tokens):
        w = self.ranks[0]["embed.weight"]
        if not self.vocab_parallel:
            return F.embedding(tokens, w)
        local = tokens - self.comm.rank * w.shape[0]
        outside = (local < 0) | (local >= w.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), w).masked_fill(outside[..., None], 0.0)
        return self.comm.reduce([rows])

    def attention(self, h, r, lay, causal):
        batch, seq, _ = h.shape
        head_dim = self.cfg.d_model // self.cfg.heads
        qkv = F.linear(h, r[lay + "attn.qkv.weight"].flatten(0, 1), r[lay + "attn.qkv.bias"].flatten())
        q, k, v = qkv.view(batch, seq, 3, -1, head_dim).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * head_dim**-0.5
        out = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return F.linear(out.transpose(1, 2).reshape(batch, seq, -1), r[lay + "attn.proj.weight"])

    def mlp(self, h, r, lay):
        hidden = F.gelu(F.linear(h, r[lay + "mlp.fc1.weight"], r[lay + "mlp.fc1.bias"]))
        return F.linear(hidden, r[lay + "mlp.fc2.weight"])


def train_step(model: TPModel, opt, tokens: np.ndarray) -> float:
    loss, _ = model.loss(torch.from_numpy(tokens))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def adam(model: TPModel, cfg: Config):
    return torch.optim.Adam(model.params, lr=cfg.lr, foreach=False)


def join_world(rank: int, size: int, port: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )


# ---------------------------------------------------------------- the actors


def layouts(mesh, cfg: Config, side: str) -> dict:
    """Every parameter's layout on ``mesh`` (``side``: "train" or "infer"), by state-dict name."""
    return {
        name: Layout(mesh, placements(p.train_dim if side == "train" else p.infer_dim))
        for name, p in state_dict_names(cfg).items()
    }


@ray.remote(num_cpus=0, max_concurrency=32)
class Trainer(DeviceRole):
    """One of the tensor-parallel trainers: its shard of every parameter in shard memory, shared.
    Threaded: a sync it pushes makes calls to its own device role while it waits for them (with
    threads to spare: Ray may deliver a controller's later calls first, and each waits for its
    turn on a thread of its own)."""

    def __init__(self, rank: int, cfg: Config):
        torch.set_num_threads(1)
        self.rank, self.cfg = rank, cfg
        self.params: dict[str, torch.Tensor] = {}
        self.target = None

    def join(self, port: int) -> None:
        join_world(self.rank, TRAIN_TP, port)

    def load(self, full: dict) -> dict:
        """Parameters of the initial weights (this rank's shards); the state dict shared as is."""
        for name, p in state_dict_names(self.cfg).items():
            shard = split(full[name], p.train_dim, TRAIN_TP, self.rank)
            t = self.reshard_device.empty(shard.shape, torch.float32)
            t.numpy()[...] = shard
            self.params[name] = t
        self.model = TPModel(self.cfg, [self.params], World())
        self.opt = adam(self.model, self.cfg)
        return self.reshard_device.share_state_dict(self.params)

    def step(self, tokens: np.ndarray) -> float:
        return train_step(self.model, self.opt, tokens)

    def gradients(self, tokens: np.ndarray) -> float:
        """A forward and backward pass without the optimizer step: the compute a sync overlaps
        (the weights stay as they are; the gradients are dropped)."""
        loss, _ = self.model.loss(torch.from_numpy(tokens))
        loss.backward()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def aim(self, sources, mesh, dst_layouts, targets) -> None:
        """Where this trainer pushes its model: handles and layouts built on the driver."""
        self.target = (sources, mesh, dst_layouts, targets)

    def push(self, path: str) -> float:
        """One weight sync of the whole state dict, in one call from this process; its seconds."""
        sources, mesh, dst_layouts, targets = self.target
        t0 = time.perf_counter()
        reshard(
            sources,
            mesh,
            dst_layouts,
            out=targets,
            direct=path == SyncPath.RESHARD_DIRECT.name,
            shared_memory=path != SyncPath.RESHARD_GLOO.name,
            timeout_s=TIMEOUT_S,
        )
        return time.perf_counter() - t0

    def push_async(self) -> None:
        """Start a sync and return at once (``async_op=True``); ``wait`` ends it."""
        sources, mesh, dst_layouts, targets = self.target
        self.work = reshard(sources, mesh, dst_layouts, out=targets, async_op=True, timeout_s=TIMEOUT_S)

    def wait(self) -> None:
        self.work.wait()

    def put_shards(self) -> dict:
        """The object-store path: this trainer's shards in Ray's object store (replicated
        parameters from rank 0 only)."""
        names = state_dict_names(self.cfg)
        return {
            name: ray.put(t.detach().numpy())
            for name, t in self.params.items()
            if names[name].train_dim is not None or self.rank == 0
        }


@ray.remote(num_cpus=0)
class Inference(DeviceRole):
    """One of the tensor-parallel inference actors: parameters in shard memory that syncs write into."""

    def __init__(self, rank: int, cfg: Config):
        torch.set_num_threads(1)
        self.rank, self.cfg = rank, cfg
        self.params: dict[str, torch.Tensor] = {}

    def join(self, port: int) -> None:
        join_world(self.rank, INFER_TP, port)

    def allocate(self) -> dict:
        """This rank's parameters, NaN until the first sync; the state dict shared."""
        for name, p in state_dict_names(self.cfg).items():
            local = list(shape_of(self.cfg, name))
            if p.infer_dim is not None:
                local[p.infer_dim] //= INFER_TP
            t = self.reshard_device.empty(tuple(local), torch.float32)
            t.fill_(float("nan"))
            self.params[name] = t
        self.model = TPModel(self.cfg, [self.params], World(), vocab_parallel=True, trainable=False)
        return self.reshard_device.share_state_dict(self.params)

    def poison(self) -> None:
        for t in self.params.values():
            t.fill_(float("nan"))

    def weights(self) -> dict[str, np.ndarray]:
        return {name: t.numpy().copy() for name, t in self.params.items()}

    def load_full(self, refs: dict) -> None:
        """The naive path: whole tensors from the object store, this actor's shard copied out."""
        names = state_dict_names(self.cfg)
        arrays = ray.get(list(refs.values()), timeout=TIMEOUT_S)
        for name, a in zip(refs, arrays, strict=True):
            self.params[name].numpy()[...] = split(a, names[name].infer_dim, INFER_TP, self.rank)

    def load_from_trainers(self, shards: list[dict]) -> None:
        """The object-store path: get the trainers' shards that overlap this actor's, copy the overlap."""
        for name, p in state_dict_names(self.cfg).items():
            if name not in shards[0]:
                continue
            dst = self.params[name].numpy()
            if p.train_dim is None:
                whole = ray.get(shards[0][name], timeout=TIMEOUT_S)
                dst[...] = split(whole, p.infer_dim, INFER_TP, self.rank)
                continue
            dim, n = p.train_dim, shape_of(self.cfg, name)[p.train_dim]
            mine = span(n, p.infer_dim, INFER_TP, self.rank)
            for t in range(TRAIN_TP):
                theirs = span(n, dim, TRAIN_TP, t)
                lo, hi = max(mine[0], theirs[0]), min(mine[1], theirs[1])
                if lo < hi:
                    src = ray.get(shards[t][name], timeout=TIMEOUT_S)
                    dst[along(dim, lo - mine[0], hi - mine[0])] = src[along(dim, lo - theirs[0], hi - theirs[0])]

    def forward(self, tokens: np.ndarray) -> tuple[float, np.ndarray | None]:
        with torch.no_grad():
            loss, logits = self.model.loss(torch.from_numpy(tokens))
        return loss.item(), logits.numpy() if self.rank == 0 else None


# ---------------------------------------------------------------- the reference


class Reference:
    """The single-process model: both trainer ranks' shards, computed in this process."""

    def __init__(self, cfg: Config, full: dict[str, np.ndarray]):
        self.names = state_dict_names(cfg)
        self.ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(TRAIN_TP)]
        for name, p in self.names.items():
            rep = torch.from_numpy(full[name].copy())
            for r, params in enumerate(self.ranks):
                shard = split(full[name], p.train_dim, TRAIN_TP, r)
                params[name] = rep if p.train_dim is None else torch.from_numpy(np.ascontiguousarray(shard))
        self.model = TPModel(cfg, self.ranks, Local())
        self.opt = adam(self.model, cfg)

    def step(self, tokens: np.ndarray) -> float:
        with one_thread():
            return train_step(self.model, self.opt, tokens)

    def eval(self, tokens: np.ndarray) -> tuple[float, np.ndarray]:
        with one_thread(), torch.no_grad():
            loss, logits = self.model.loss(torch.from_numpy(tokens))
        return loss.item(), logits.numpy()

    def weights(self) -> dict[str, np.ndarray]:
        out = {}
        for name, p in self.names.items():
            parts = [r[name].detach().numpy() for r in self.ranks]
            out[name] = parts[0].copy() if p.train_dim is None else np.concatenate(parts, axis=p.train_dim)
        return out


# ---------------------------------------------------------------- weight sync, five ways


class SyncPath(enum.Enum):
    RESHARD = "reshard(out=)"
    RESHARD_DIRECT = "reshard(out=, direct=True)"
    RESHARD_GLOO = "reshard(out=, shared_memory=False)"
    NAIVE = "naive: gather to driver, ray.put"
    OBJECT_STORE = "object store: trainers put, inference get"


@dataclass(frozen=True, slots=True)
class Actors:
    """The running example: actors, meshes, and the state dicts adopted on both sides."""

    cfg: Config
    trainers: tuple
    inference: tuple
    t_mesh: DeviceMesh
    i_mesh: DeviceMesh
    sources: dict  # parameter name -> ShardedTensor adopted on the trainers
    targets: dict  # parameter name -> ShardedTensor adopted on the inference actors


def sync(path: SyncPath, a: Actors, names=None) -> dict[str, np.ndarray] | None:
    """One weight sync along ``path`` (of the parameters ``names``, default all); the naive path
    returns what it gathered. The reshard paths: trainer 0 pushes the whole state dict in one call."""
    if names is not None:
        if path not in (SyncPath.RESHARD, SyncPath.RESHARD_DIRECT, SyncPath.RESHARD_GLOO):
            raise ValueError("a partial sync is for the reshard paths")
        part = {n: a.sources[n] for n in names}
        layouts_ = {n: a.targets[n].layout for n in names}
        reshard(
            part,
            a.t_mesh,
            layouts_,
            out={n: a.targets[n] for n in names},
            direct=path is SyncPath.RESHARD_DIRECT,
            shared_memory=path is not SyncPath.RESHARD_GLOO,
            timeout_s=TIMEOUT_S,
        )
        return None
    if path in (SyncPath.RESHARD, SyncPath.RESHARD_DIRECT, SyncPath.RESHARD_GLOO):
        ray.get(a.trainers[0].push.remote(path.name), timeout=TIMEOUT_S)
        return None
    if path is SyncPath.NAIVE:
        full = {name: t.to_numpy(timeout_s=TIMEOUT_S) for name, t in a.sources.items()}
        refs = {name: ray.put(arr) for name, arr in full.items()}
        ray.get([i.load_full.remote(refs) for i in a.inference], timeout=TIMEOUT_S)
        return full
    shards = ray.get([t.put_shards.remote() for t in a.trainers], timeout=TIMEOUT_S)
    ray.get([i.load_from_trainers.remote(shards) for i in a.inference], timeout=TIMEOUT_S)
    return None


def overlapped(a: Actors, tokens: np.ndarray) -> tuple[float, float, float]:
    """Seconds of: the trainers' gradient pass alone, a sync alone, and the two at once (trainer 0
    starts the sync, ``async_op=True``, then both trainers compute; then it waits)."""
    t0 = time.perf_counter()
    ray.get([t.gradients.remote(tokens) for t in a.trainers], timeout=TIMEOUT_S)
    t1 = time.perf_counter()
    ray.get(a.trainers[0].push.remote(SyncPath.RESHARD.name), timeout=TIMEOUT_S)
    t2 = time.perf_counter()
    ray.get(a.trainers[0].push_async.remote(), timeout=TIMEOUT_S)
    ray.get([t.gradients.remote(tokens) for t in a.trainers], timeout=TIMEOUT_S)
    ray.get(a.trainers[0].wait.remote(), timeout=TIMEOUT_S)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def bit_equal(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def inference_bit_exact(a: Actors, want: dict[str, np.ndarray]) -> bool:
    got = ray.get([i.weights.remote() for i in a.inference], timeout=TIMEOUT_S)
    names = state_dict_names(a.cfg)
    return all(
        bit_equal(held[name], split(want[name], p.infer_dim, INFER_TP, rank))
        for rank, held in enumerate(got)
        for name, p in names.items()
    )


# ---------------------------------------------------------------- the run


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    trainer_losses: tuple[float, ...]
    reference_loss: float
    sync_s: tuple[float, ...]  # per SyncPath, in its order
    inference_bit_exact: tuple[bool, ...]  # per SyncPath: every inference actor's parameters equal the reference's
    gathered_bit_exact: bool  # the trainers' weights (gathered by the naive path) equal the reference's
    inference_loss: float
    reference_eval_loss: float
    logits_max_abs_err: float
    logits_close: bool
    overlap_s: tuple[float, float, float] | None = None  # gradients alone, sync alone, both at once (``overlapped``)

    @property
    def ok(self) -> bool:
        same_loss = all(loss == self.reference_loss for loss in self.trainer_losses)
        return same_loss and all(self.inference_bit_exact) and self.gathered_bit_exact and self.logits_close


@dataclass(frozen=True, slots=True)
class Report:
    config: Config
    steps: tuple[StepResult, ...]
    weight_bytes: int  # the whole model
    delivered_bytes: int  # what one sync writes into the inference actors, all four together
    tensors: int  # parameters in the state dict

    @property
    def ok(self) -> bool:
        return len(self.steps) == self.config.steps and all(s.ok for s in self.steps)

    def median_s(self, path: SyncPath) -> float:
        return statistics.median(s.sync_s[list(SyncPath).index(path)] for s in self.steps)

    @property
    def hidden(self) -> float | None:
        """The share of a sync's time that overlapping it with the trainers' compute hid (median)."""
        runs = [s.overlap_s for s in self.steps if s.overlap_s is not None]
        if not runs:
            return None
        return statistics.median((c + y - both) / y for c, y, both in runs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started(cfg: Config):
    """The actors up, in their worlds and meshes, with the initial weights loaded and both state
    dicts adopted (yields ``Actors``); trainer 0 knows where to push. Everything stopped afterwards.
    Uses the running Ray session when there is one, else starts (and then stops) a local one."""
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this file
    trainers = tuple(Trainer.remote(r, cfg) for r in range(TRAIN_TP))
    inference = tuple(Inference.remote(r, cfg) for r in range(INFER_TP))
    meshes: list[DeviceMesh] = []
    try:
        for group in (trainers, inference):
            port = _free_port()
            ray.get([actor.join.remote(port) for actor in group], timeout=TIMEOUT_S)
        meshes.append(DeviceMesh.from_actors(trainers, (1, TRAIN_TP), startup_timeout_s=TIMEOUT_S))
        meshes.append(DeviceMesh.from_actors(inference, (1, INFER_TP), startup_timeout_s=TIMEOUT_S))
        full_ref = ray.put(init_weights(cfg))
        loads = [t.load.remote(full_ref) for t in trainers] + [i.allocate.remote() for i in inference]
        names = ray.get(loads, timeout=TIMEOUT_S)
        del full_ref
        t_mesh, i_mesh = meshes
        sources = adopt(layouts(t_mesh, cfg, "train"), names[0])  # the whole state dict, one call per device
        targets = adopt(layouts(i_mesh, cfg, "infer"), names[TRAIN_TP])
        ray.get(trainers[0].aim.remote(sources, t_mesh, layouts(i_mesh, cfg, "infer"), targets), timeout=TIMEOUT_S)
        yield Actors(cfg, trainers, inference, t_mesh, i_mesh, sources, targets)
    finally:
        for m in meshes:
            m.shutdown()
        for actor in (*trainers, *inference):
            ray.kill(actor)
        if own_ray:
            ray.shutdown()


def run(cfg: Config, log=print, overlap: bool = False) -> Report:
    """Train ``cfg.steps`` steps, syncing along every path and checking after each (module
    docstring); ``overlap``: also time a sync beside the trainers' compute (``overlapped``)."""
    with started(cfg) as a:
        trainers, inference = a.trainers, a.inference
        reference = Reference(cfg, init_weights(cfg))
        eval_tokens = tokens_for(cfg, -1)
        paths = list(SyncPath)
        results = []
        for step in range(cfg.steps):
            tokens = tokens_for(cfg, step)
            losses = ray.get([t.step.remote(tokens) for t in trainers], timeout=TIMEOUT_S)
            ref_loss = reference.step(tokens)
            want = reference.weights()
            times, exact, gathered = [0.0] * len(paths), [False] * len(paths), False
            for k in range(len(paths)):
                path = paths[(step + k) % len(paths)]  # the paths take turns going first
                ray.get([i.poison.remote() for i in inference], timeout=TIMEOUT_S)
                t0 = time.perf_counter()
                full_got = sync(path, a)
                times[paths.index(path)] = time.perf_counter() - t0
                exact[paths.index(path)] = inference_bit_exact(a, want)
                if full_got is not None:
                    gathered = all(bit_equal(full_got[name], w) for name, w in want.items())
            beside = overlapped(a, tokens_for(cfg, step + 1)) if overlap else None
            if beside is not None:
                exact.append(inference_bit_exact(a, want))  # the sync beside the compute is exact too
            outs = ray.get([i.forward.remote(eval_tokens) for i in inference], timeout=TIMEOUT_S)
            ref_eval_loss, ref_logits = reference.eval(eval_tokens)
            logits = outs[0][1]
            result = StepResult(
                step,
                tuple(losses),
                ref_loss,
                tuple(times),
                tuple(exact),
                gathered,
                outs[0][0],
                ref_eval_loss,
                float(np.abs(logits - ref_logits).max()),
                bool(np.allclose(logits, ref_logits, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)),
                beside,
            )
            results.append(result)
            log(
                f"step {step}: train loss {losses[0]:.6f} (reference {ref_loss:.6f}), "
                f"inference weights bit-exact on all paths: {all(exact)}, trainers' weights bit-exact: {gathered}, "
                f"inference loss {outs[0][0]:.6f} (reference {ref_eval_loss:.6f}), "
                f"logits max |diff| {result.logits_max_abs_err:.2e}; "
                + ", ".join(f"{p.name.lower()} {t * 1e3:.0f} ms" for p, t in zip(paths, times, strict=True))
            )
        names = state_dict_names(cfg)
        weight_bytes = sum(w.nbytes for w in want.values())
        delivered = sum(split(w, names[n].infer_dim, INFER_TP, 0).nbytes * INFER_TP for n, w in want.items())
        return Report(cfg, tuple(results), weight_bytes, delivered, len(names))


def print_report(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    base = report.median_s(SyncPath.RESHARD)
    table = Table(
        title=f"Weight sync per step: {report.tensors} tensors, {report.weight_bytes / mib:.1f} MiB of weights, "
        f"trainers (1, {TRAIN_TP}) -> inference (1, {INFER_TP}), {report.delivered_bytes / mib:.1f} MiB written "
        f"per sync, median of {len(report.steps)} steps",
    )
    for col in ("path", "median ms", "first ms", "GB/s written", "x reshard", "bit-exact"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for k, path in enumerate(SyncPath):
        med = report.median_s(path)
        table.add_row(
            path.value,
            f"{med * 1e3:.1f}",
            f"{report.steps[0].sync_s[k] * 1e3:.1f}",
            f"{report.delivered_bytes / med / 1e9:.2f}",
            f"{med / base:.2f}",
            "yes" if all(s.inference_bit_exact[k] for s in report.steps) else "NO",
        )
    Console(width=max(120, Console().width)).print(table)
    if report.hidden is not None:
        print(f"a sync beside the trainers' gradient pass (async_op=True): {report.hidden:.0%} of its time hidden")


def main(argv: list[str] | None = None) -> Report:
    """The command line: run, print the table, return the report (``report.ok``: every check passed)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 steps")
    ap.add_argument("--steps", type=int, help="training steps (each followed by the syncs)")
    ap.add_argument("--layers", type=int, help="transformer blocks")
    ap.add_argument("--overlap", action="store_true", help="also time a sync beside the trainers' compute")
    ap.add_argument("--json", help="also write the medians to this file (with the revision and the command)")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    if args.layers is not None:
        cfg = replace(cfg, layers=args.layers)
    report = run(cfg, overlap=args.overlap)
    print_report(report)
    print("all checks passed" if report.ok else "CHECKS FAILED")
    if args.json:
        write_json(report, args.json, sys.argv[1:] if argv is None else argv)
    return report


def write_json(report: Report, path: str, argv) -> None:
    """The per-path medians and what was moved, under the header every result file carries."""
    import json

    from bench.provenance import header

    data = {
        **header("python examples/weight_sync.py", argv),
        "tensors": report.tensors,
        "weight_bytes": report.weight_bytes,
        "delivered_bytes": report.delivered_bytes,
        "steps": len(report.steps),
        "median_s": {p.value: report.median_s(p) for p in SyncPath},
        "bit_exact": {p.value: all(s.inference_bit_exact[k] for s in report.steps) for k, p in enumerate(SyncPath)},
        "hidden": report.hidden,
        "ok": report.ok,
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    sys.exit(0 if main().ok else 1)
