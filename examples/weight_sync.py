"""RL-style weight sync, end to end: 2-way tensor-parallel trainers, resharded after every step into
four inference actors laid out differently, checked bit for bit against a single-process model.

    python examples/weight_sync.py            # 80 MiB of float32 weights, 6 steps
    python examples/weight_sync.py --quick    # a tiny model, 2 steps (what tests/dist/test_examples.py runs)

The model: a GPT-style transformer (token embedding, pre-norm blocks of causal multi-head attention
and a GELU MLP, final layer norm, an untied output head), float32. Its weights live in ten stacked
tensors ("buckets", e.g. ``qkv_w`` of shape (layers, 3, d, d) in ``nn.Linear`` (out, in) order);
every parameter is a view into one, so the optimizer updates the buckets in place and a weight
sync moves ten tensors, as weight-sync systems bucket theirs.

Trainers: two Ray actors of the user's own (``Trainer``, mixing in ``reshard.runtime.DeviceRole``)
in a torch.distributed gloo world of their own, Megatron-style: q/k/v and the first MLP linear
column-parallel (split by their output rows: heads, hidden units), the attention output and the
second MLP linear row-parallel (split by their inputs), their outputs all-reduced; embedding, head,
layer norms and the row-parallel biases replicated. Each trainer keeps its shards in
``reshard_device.empty()`` memory and ``share``s them with their global shape and placements; the
driver ``adopt``s them as ShardedTensors over a (1, 2) mesh, no copy. They train with Adam on
random-walk token sequences.

Inference: four actors (``Inference``) over a (1, 4) mesh and a gloo world of their own, 4-way
tensor-parallel with a vocab-parallel embedding and head: every sharded bucket is split 4 ways
instead of 2, and the embedding and head, replicated on the trainers, are split by vocabulary rows;
layer norms and biases stay replicated. Their buckets are adopted once; after every training step
each is overwritten in place by ``reshard(source, trainer_mesh, target.layout, out=target)``
(staged, then committed, so a failed sync leaves the old weights), and the four run a forward pass.

Checks, every step:
- every inference actor's buckets equal, bit for bit, the slices of the reference model's weights
  (the driver trains a single-process copy with the same data and seed; it computes both TP ranks
  with the same split, shapes and summation order, so its weights and loss are bit-identical to
  the trainers': the 2-way all-reduce is one addition, and addition commutes). Each sync path
  starts from inference weights filled with NaN, so an element a path does not write is caught;
- the weights the naive path gathers from the trainers equal the reference's, bit for bit, and so
  do the trainers' losses;
- the inference forward (4-way: partial sums added in another order than the 2-way reference's)
  agrees with the reference's logits within ``LOGITS_RTOL``/``LOGITS_ATOL`` (float32 rounding).

The weight sync is timed along five paths in the same run (median over the steps; the paths take
turns going first): ``reshard`` into the inference actors' tensors (pulls through shared memory,
the default on one machine; staged, then committed); the same with ``direct=True`` (written in
place, no second copy; a failure leaves them partly written); the same through gloo only
(``shared_memory=False``, the path between machines); the naive path (every bucket gathered to
the driver with ``to_numpy()``, ``ray.put``, each inference actor ``ray.get``s it and copies its
slice into its buckets); and Ray's object store as a user writes it (each trainer ``ray.put``s its
shards, the replicated ones from rank 0 only, and each inference actor ``ray.get``s the shards
that overlap its own and copies the overlap).
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
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from reshard import DeviceMesh, Replicate, Shard, reshard  # noqa: E402
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
class Bucket:
    """One stacked weight tensor and the tensor dim each side splits (None: every actor holds all)."""

    name: str
    train_dim: int | None
    infer_dim: int | None
    layered: bool  # dim 0 enumerates the layers: one parameter per layer

    def __post_init__(self):
        if self.train_dim is not None and self.infer_dim not in (None, self.train_dim):
            raise ValueError(f"bucket {self.name}: both sides must split the same dim (or one none)")


BUCKETS = (
    Bucket("qkv_w", 2, 2, True),  # (L, 3, d, d): q, k, v weights, split by output rows (heads)
    Bucket("qkv_b", 2, 2, True),  # (L, 3, d)
    Bucket("proj_w", 2, 2, True),  # (L, d, d): attention output, split by its inputs (heads)
    Bucket("fc1_w", 1, 1, True),  # (L, ffn, d)
    Bucket("fc1_b", 1, 1, True),  # (L, ffn)
    Bucket("fc2_w", 2, 2, True),  # (L, d, ffn): split by its inputs
    Bucket("norms", None, None, True),  # (L, 6, d): ln1 weight, bias, ln2 weight, bias, proj bias, fc2 bias
    Bucket("final", None, None, False),  # (2, d): final layer norm weight, bias
    Bucket("embed", None, 0, False),  # (vocab, d): vocab-parallel on the inference side
    Bucket("head", None, 0, False),  # (vocab, d)
)


BY_NAME = {b.name: b for b in BUCKETS}


def bucket_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    layers, d, f, v = cfg.layers, cfg.d_model, cfg.ffn, cfg.vocab
    return {
        "qkv_w": (layers, 3, d, d), "qkv_b": (layers, 3, d), "proj_w": (layers, d, d), "fc1_w": (layers, f, d),
        "fc1_b": (layers, f), "fc2_w": (layers, d, f), "norms": (layers, 6, d), "final": (2, d), "embed": (v, d),
        "head": (v, d),
    }  # fmt: skip


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
    rng = np.random.default_rng(cfg.seed)
    out = {name: (rng.standard_normal(shape) * 0.02).astype(np.float32) for name, shape in bucket_shapes(cfg).items()}
    for name in ("qkv_b", "fc1_b", "norms", "final"):
        out[name][...] = 0.0
    out["norms"][:, (0, 2)] = 1.0
    out["final"][0] = 1.0
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
    dict of bucket tensors per rank (replicated buckets the same tensor in each). Parameters are
    views into the buckets, one per layer."""

    def __init__(self, cfg: Config, ranks, comm, *, vocab_parallel: bool = False, trainable: bool = True):
        self.cfg, self.comm, self.vocab_parallel = cfg, comm, vocab_parallel
        views: dict[int, list] = {}
        self.ranks = []
        for buckets in ranks:
            mine = {}
            for b in BUCKETS:
                t = buckets[b.name]
                if id(t) not in views:
                    ps = [t[i] for i in range(t.shape[0])] if b.layered else [t.view(t.shape)]
                    for p in ps:
                        p.requires_grad_(trainable)
                    views[id(t)] = ps
                mine[b.name] = views[id(t)]
            self.ranks.append(mine)
        self.params = [p for ps in views.values() for p in ps]

    def loss(self, tokens):
        logits = self.logits(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()), logits

    def logits(self, tokens):
        d, rep, comm = self.cfg.d_model, self.ranks[0], self.comm
        x = self.embed(tokens)
        causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)
        for i in range(self.cfg.layers):
            ln1_w, ln1_b, ln2_w, ln2_b, proj_b, fc2_b = rep["norms"][i]
            h = F.layer_norm(x, (d,), ln1_w, ln1_b)
            x = x + (comm.reduce([self.attention(comm.enter(h), r, i, causal) for r in self.ranks]) + proj_b)
            h = F.layer_norm(x, (d,), ln2_w, ln2_b)
            x = x + (comm.reduce([self.mlp(comm.enter(h), r, i) for r in self.ranks]) + fc2_b)
        w, b = rep["final"][0]
        x = F.layer_norm(x, (d,), w, b)
        logits = F.linear(x, rep["head"][0])
        return self.comm.gather_last(logits) if self.vocab_parallel else logits

    def embed(self, tokens):
        w = self.ranks[0]["embed"][0]
        if not self.vocab_parallel:
            return F.embedding(tokens, w)
        local = tokens - self.comm.rank * w.shape[0]
        outside = (local < 0) | (local >= w.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), w).masked_fill(outside[..., None], 0.0)
        return self.comm.reduce([rows])

    def attention(self, h, r, i, causal):
        batch, seq, _ = h.shape
        head_dim = self.cfg.d_model // self.cfg.heads
        qkv = F.linear(h, r["qkv_w"][i].flatten(0, 1), r["qkv_b"][i].flatten())
        q, k, v = qkv.view(batch, seq, 3, -1, head_dim).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * head_dim**-0.5
        out = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return F.linear(out.transpose(1, 2).reshape(batch, seq, -1), r["proj_w"][i])

    def mlp(self, h, r, i):
        return F.linear(F.gelu(F.linear(h, r["fc1_w"][i], r["fc1_b"][i])), r["fc2_w"][i])


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
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip


# ---------------------------------------------------------------- the actors


@ray.remote(num_cpus=0)
class Trainer(DeviceRole):
    """One of the tensor-parallel trainers: its shard of every bucket in shard memory, shared."""

    def __init__(self, rank: int, cfg: Config):
        torch.set_num_threads(1)
        self.rank, self.cfg = rank, cfg
        self.buckets: dict[str, torch.Tensor] = {}

    def join(self, port: int) -> None:
        join_world(self.rank, TRAIN_TP, port)

    def load(self, full: dict) -> None:
        for b in BUCKETS:
            shard = split(full[b.name], b.train_dim, TRAIN_TP, self.rank)
            t = self.reshard_device.empty(shard.shape, torch.float32)
            t.numpy()[...] = shard
            self.reshard_device.share(b.name, t, shape=full[b.name].shape, placements=placements(b.train_dim))
            self.buckets[b.name] = t
        self.model = TPModel(self.cfg, [self.buckets], World())
        self.opt = adam(self.model, self.cfg)

    def step(self, tokens: np.ndarray) -> float:
        return train_step(self.model, self.opt, tokens)

    def put_shards(self, names) -> dict:
        """The object-store path: this trainer's shards of buckets ``names`` in Ray's object store
        (replicated buckets from rank 0 only)."""
        return {
            b.name: ray.put(self.buckets[b.name].numpy())
            for b in BUCKETS
            if b.name in names and (b.train_dim is not None or self.rank == 0)
        }


@ray.remote(num_cpus=0)
class Inference(DeviceRole):
    """One of the tensor-parallel inference actors: buckets in shard memory that syncs write into."""

    def __init__(self, rank: int, cfg: Config):
        torch.set_num_threads(1)
        self.rank, self.cfg = rank, cfg
        self.buckets: dict[str, torch.Tensor] = {}

    def join(self, port: int) -> None:
        join_world(self.rank, INFER_TP, port)

    def allocate(self) -> None:
        shapes = bucket_shapes(self.cfg)
        for b in BUCKETS:
            local = list(shapes[b.name])
            if b.infer_dim is not None:
                local[b.infer_dim] //= INFER_TP
            t = self.reshard_device.empty(tuple(local), torch.float32)
            t.fill_(float("nan"))
            self.reshard_device.share(b.name, t, shape=shapes[b.name], placements=placements(b.infer_dim))
            self.buckets[b.name] = t
        self.model = TPModel(self.cfg, [self.buckets], World(), vocab_parallel=True, trainable=False)

    def poison(self) -> None:
        for t in self.buckets.values():
            t.fill_(float("nan"))

    def weights(self) -> dict[str, np.ndarray]:
        return {name: t.numpy().copy() for name, t in self.buckets.items()}

    def load_full(self, refs: dict) -> None:
        """The naive path: whole tensors from the object store, this actor's shard copied out."""
        arrays = ray.get(list(refs.values()), timeout=TIMEOUT_S)
        for name, a in zip(refs, arrays, strict=True):
            self.buckets[name].numpy()[...] = split(a, BY_NAME[name].infer_dim, INFER_TP, self.rank)

    def load_from_trainers(self, shards: list[dict]) -> None:
        """The object-store path: get the trainers' shards that overlap this actor's, copy the overlap."""
        shapes = bucket_shapes(self.cfg)
        for b in BUCKETS:
            if b.name not in shards[0]:
                continue
            dst = self.buckets[b.name].numpy()
            if b.train_dim is None:
                whole = ray.get(shards[0][b.name], timeout=TIMEOUT_S)
                dst[...] = split(whole, b.infer_dim, INFER_TP, self.rank)
                continue
            dim, n = b.train_dim, shapes[b.name][b.train_dim]
            mine = span(n, b.infer_dim, INFER_TP, self.rank)
            for t in range(TRAIN_TP):
                theirs = span(n, dim, TRAIN_TP, t)
                lo, hi = max(mine[0], theirs[0]), min(mine[1], theirs[1])
                if lo < hi:
                    src = ray.get(shards[t][b.name], timeout=TIMEOUT_S)
                    dst[along(dim, lo - mine[0], hi - mine[0])] = src[along(dim, lo - theirs[0], hi - theirs[0])]

    def forward(self, tokens: np.ndarray) -> tuple[float, np.ndarray | None]:
        with torch.no_grad():
            loss, logits = self.model.loss(torch.from_numpy(tokens))
        return loss.item(), logits.numpy() if self.rank == 0 else None


# ---------------------------------------------------------------- the reference


class Reference:
    """The single-process model: both trainer ranks' shards, computed in this process."""

    def __init__(self, cfg: Config, full: dict[str, np.ndarray]):
        self.ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(TRAIN_TP)]
        for b in BUCKETS:
            rep = torch.from_numpy(full[b.name].copy())
            for r, buckets in enumerate(self.ranks):
                shard = split(full[b.name], b.train_dim, TRAIN_TP, r)
                buckets[b.name] = rep if b.train_dim is None else torch.from_numpy(np.ascontiguousarray(shard))
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
        for b in BUCKETS:
            parts = [r[b.name].numpy() for r in self.ranks]
            out[b.name] = parts[0].copy() if b.train_dim is None else np.concatenate(parts, axis=b.train_dim)
        return out


# ---------------------------------------------------------------- weight sync, four ways


class SyncPath(enum.Enum):
    RESHARD = "reshard(out=)"
    RESHARD_DIRECT = "reshard(out=, direct=True)"
    RESHARD_GLOO = "reshard(out=, shared_memory=False)"
    NAIVE = "naive: gather to driver, ray.put"
    OBJECT_STORE = "object store: trainers put, inference get"


@dataclass(frozen=True, slots=True)
class Actors:
    """The running example: actors, meshes, and the buckets adopted on both sides."""

    trainers: tuple
    inference: tuple
    t_mesh: DeviceMesh
    i_mesh: DeviceMesh
    sources: dict  # bucket name -> ShardedTensor adopted on the trainers
    targets: dict  # bucket name -> ShardedTensor adopted on the inference actors


def sync(path: SyncPath, a: Actors, buckets=BUCKETS) -> dict[str, np.ndarray] | None:
    """One weight sync of ``buckets`` along ``path``; the naive path returns what it gathered."""
    names = [b.name for b in buckets]
    if path in (SyncPath.RESHARD, SyncPath.RESHARD_DIRECT, SyncPath.RESHARD_GLOO):
        for name in names:
            out = a.targets[name]
            reshard(
                a.sources[name], a.t_mesh, out.layout, out=out, direct=path is SyncPath.RESHARD_DIRECT,
                shared_memory=path is not SyncPath.RESHARD_GLOO, timeout_s=TIMEOUT_S,
            )  # fmt: skip
        return None
    if path is SyncPath.NAIVE:
        full = {name: a.sources[name].to_numpy(timeout_s=TIMEOUT_S) for name in names}
        refs = {name: ray.put(arr) for name, arr in full.items()}
        ray.get([i.load_full.remote(refs) for i in a.inference], timeout=TIMEOUT_S)
        return full
    shards = ray.get([t.put_shards.remote(names) for t in a.trainers], timeout=TIMEOUT_S)
    ray.get([i.load_from_trainers.remote(shards) for i in a.inference], timeout=TIMEOUT_S)
    return None


def bit_equal(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def inference_bit_exact(a: Actors, want: dict[str, np.ndarray]) -> bool:
    got = ray.get([i.weights.remote() for i in a.inference], timeout=TIMEOUT_S)
    return all(
        bit_equal(held[b.name], split(want[b.name], b.infer_dim, INFER_TP, rank))
        for rank, held in enumerate(got)
        for b in BUCKETS
    )


# ---------------------------------------------------------------- the run


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    trainer_losses: tuple[float, ...]
    reference_loss: float
    sync_s: tuple[float, ...]  # per SyncPath, in its order
    inference_bit_exact: tuple[bool, ...]  # per SyncPath: every inference actor's buckets equal the reference's
    gathered_bit_exact: bool  # the trainers' weights (gathered by the naive path) equal the reference's
    inference_loss: float
    reference_eval_loss: float
    logits_max_abs_err: float
    logits_close: bool

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

    @property
    def ok(self) -> bool:
        return len(self.steps) == self.config.steps and all(s.ok for s in self.steps)

    def median_s(self, path: SyncPath) -> float:
        return statistics.median(s.sync_s[list(SyncPath).index(path)] for s in self.steps)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started(cfg: Config):
    """The actors up, in their worlds and meshes, with the initial weights loaded and adopted
    (yields ``Actors``); everything stopped afterwards. Uses the running Ray session when there is
    one, else starts (and then stops) a local one."""
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
        ray.get(loads, timeout=TIMEOUT_S)
        del full_ref
        t_mesh, i_mesh = meshes
        yield Actors(
            trainers, inference, t_mesh, i_mesh, {b.name: adopt(t_mesh, b.name) for b in BUCKETS},
            {b.name: adopt(i_mesh, b.name) for b in BUCKETS},
        )  # fmt: skip
    finally:
        for m in meshes:
            m.shutdown()
        for actor in (*trainers, *inference):
            ray.kill(actor)
        if own_ray:
            ray.shutdown()


def run(cfg: Config, log=print) -> Report:
    """Train ``cfg.steps`` steps, syncing along every path and checking after each (module docstring)."""
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
            outs = ray.get([i.forward.remote(eval_tokens) for i in inference], timeout=TIMEOUT_S)
            ref_eval_loss, ref_logits = reference.eval(eval_tokens)
            logits = outs[0][1]
            result = StepResult(
                step, tuple(losses), ref_loss, tuple(times), tuple(exact), gathered, outs[0][0], ref_eval_loss,
                float(np.abs(logits - ref_logits).max()),
                bool(np.allclose(logits, ref_logits, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)),
            )  # fmt: skip
            results.append(result)
            log(
                f"step {step}: train loss {losses[0]:.6f} (reference {ref_loss:.6f}), "
                f"inference weights bit-exact on all paths: {all(exact)}, trainers' weights bit-exact: {gathered}, "
                f"inference loss {outs[0][0]:.6f} (reference {ref_eval_loss:.6f}), "
                f"logits max |diff| {result.logits_max_abs_err:.2e}; "
                + ", ".join(f"{p.name.lower()} {t * 1e3:.0f} ms" for p, t in zip(paths, times, strict=True))
            )
        weight_bytes = sum(w.nbytes for w in want.values())
        delivered = sum(
            split(w, b.infer_dim, INFER_TP, 0).nbytes * INFER_TP for b, w in zip(BUCKETS, want.values(), strict=True)
        )
        return Report(cfg, tuple(results), weight_bytes, delivered)


def print_report(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    base = report.median_s(SyncPath.RESHARD)
    table = Table(
        title=f"Weight sync per step: {report.weight_bytes / mib:.1f} MiB of weights, trainers (1, {TRAIN_TP}) -> "
        f"inference (1, {INFER_TP}), {report.delivered_bytes / mib:.1f} MiB written per sync, "
        f"median of {len(report.steps)} steps",
    )
    for col in ("path", "median ms", "first ms", "GB/s written", "x reshard", "bit-exact"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for k, path in enumerate(SyncPath):
        med = report.median_s(path)
        table.add_row(
            path.value, f"{med * 1e3:.1f}", f"{report.steps[0].sync_s[k] * 1e3:.1f}",
            f"{report.delivered_bytes / med / 1e9:.2f}", f"{med / base:.2f}",
            "yes" if all(s.inference_bit_exact[k] for s in report.steps) else "NO",
        )  # fmt: skip
    Console(width=max(120, Console().width)).print(table)


def main(argv: list[str] | None = None) -> Report:
    """The command line: run, print the table, return the report (``report.ok``: every check passed)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 steps")
    ap.add_argument("--steps", type=int, help="training steps (each followed by the syncs)")
    ap.add_argument("--layers", type=int, help="transformer blocks")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    if args.layers is not None:
        cfg = replace(cfg, layers=args.layers)
    report = run(cfg)
    print_report(report)
    print("all checks passed" if report.ok else "CHECKS FAILED")
    return report


if __name__ == "__main__":
    sys.exit(0 if main().ok else 1)
