"""The device actor: one Ray actor per device, holding tensor shards and running programs.

State (``DeviceContext``, also what ``call(fn, ...)`` hands to ``fn``):
  ``buffers``   named torch tensors (this device's shards), on ``torch_device``
  ``staging``   one reusable byte buffer for non-contiguous slices
  ``pool``      freed shards kept for reuse (``BufferPool``, bounded by ``buffer_pool_bytes``)
  ``shared``    this actor's shared-memory allocations (``SharedShards``; None: plain memory)
  ``peers``     peers' shards mapped for PULL ops (``PeerShards``)
  ``groups``    the communicator cache (``GroupCache``), lazily connected, driver-bounded
  ``programs``  decoded ``DeviceProgram``s by program id (shipped once, then run by id)
  ``backend``   this actor's ``Backend`` instance
  ``before_op`` optional hook ``fn(ctx, op)`` run before every op (fault injection, tracing)

Programs arrive as msgpack (``reshard.serialize``) the first time and are cached by id; the
driver mirrors the cache (``max_programs``, LRU) and says which ids to drop. ``run`` applies the
driver's updates (drops first, then new generations), runs the program, keeps the destination
shard, and on any failure aborts the program's communicators and frees the partial shard.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import OrderedDict

import numpy as np
import torch

from reshard.errors import ReshardError, ReshardTimeout
from reshard.lowering import DeviceProgram
from reshard.runtime.communicator import Backend, Communicator
from reshard.runtime.executor import (
    STAGING_KEEP_BYTES,
    CompiledProgram,
    StagingBuffer,
    compile_program,
    run_program,
    torch_dtype,
)
from reshard.runtime.groups import GroupCache, group_key
from reshard.runtime.shared_memory import PeerShards, SharedShards
from reshard.serialize import decode_device_program

log = logging.getLogger(__name__)

#: Default bound on the idle bytes of freed shards a device keeps for reuse (``BufferPool``).
BUFFER_POOL_BYTES = 256 << 20


class BufferPool:
    """Freed shards kept for reuse, so that a new destination shard of a size seen before does
    not pay fresh-memory page faults. Keyed by byte size, least recently freed evicted first;
    the idle bytes never exceed ``limit_bytes`` (0 disables the pool). Buffers in the pool are
    idle: a run takes its destination from here (or allocates), and only live buffers count
    towards a run's memory bound."""

    def __init__(self, device: torch.device, limit_bytes: int):
        self.device = device
        self.limit_bytes = int(limit_bytes)
        self.idle: OrderedDict = OrderedDict()  # (nbytes, serial) -> flat uint8 tensor
        self.by_size: dict[int, list[int]] = {}
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._serial = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        serials = self.by_size.get(nbytes)
        if not serials:
            self.misses += 1
            return None
        serial = serials.pop()
        if not serials:
            del self.by_size[nbytes]
        self.nbytes -= nbytes
        self.hits += 1
        return self.idle.pop((nbytes, serial))

    def put(self, t: torch.Tensor, refs: int) -> bool:
        """Keep ``t`` if nothing else references it (``refs``: the caller's own references) and
        it owns its whole storage; evict the oldest entries to stay within the bound."""
        nbytes = t.numel() * t.element_size()
        if not 0 < nbytes <= self.limit_bytes or t.device != self.device or not t.is_contiguous():
            return False
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != nbytes:
            return False
        base = t._base
        if sys.getrefcount(t) > refs + 2 or (base is not None and sys.getrefcount(base) > 3):
            return False  # a view or an array of it is still alive elsewhere
        flat = base if base is not None and base.dtype == torch.uint8 and base.dim() == 1 else None
        if flat is None:
            flat = t.reshape(-1).view(torch.uint8)
        self._serial += 1
        self.idle[(nbytes, self._serial)] = flat
        self.by_size.setdefault(nbytes, []).append(self._serial)
        self.nbytes += nbytes
        while self.nbytes > self.limit_bytes:
            (n, serial), _ = self.idle.popitem(last=False)
            lst = self.by_size[n]
            lst.remove(serial)
            if not lst:
                del self.by_size[n]
            self.nbytes -= n
        return True

    def clear(self) -> None:
        self.idle.clear()
        self.by_size.clear()
        self.nbytes = 0


class DeviceContext:
    """Everything a device actor owns; the first argument of functions run through ``call``."""

    def __init__(self, device: int, backend: Backend, options: dict):
        self.device = device
        self.backend = backend
        kind = options.get("device_type") or getattr(backend, "device_type", "cpu")
        self.torch_device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
        self.options = dict(options)
        self.buffers: dict[str, torch.Tensor] = {}
        self.staging = StagingBuffer(self.torch_device, int(options.get("staging_keep_bytes", STAGING_KEEP_BYTES)))
        self.groups = GroupCache(
            backend, device, int(options.get("max_communicators", 64)), float(options.get("op_timeout_s", 300.0))
        )
        self.pool = BufferPool(self.torch_device, int(options.get("buffer_pool_bytes", BUFFER_POOL_BYTES)))
        shared = options.get("shared_memory", False) and self.torch_device.type == "cpu" and SharedShards.available()
        self.shared = SharedShards() if shared else None
        self.peers = PeerShards(device)
        self.programs: OrderedDict[int, CompiledProgram] = OrderedDict()
        self.before_op = None
        self.peak_bytes = 0  # destination + staging bytes of the last run
        self.counters = {"programs_received": 0, "runs": 0, "failed_runs": 0}

    # ---------------------------------------------------------------- for functions run by ``call``

    def communicator(self, group) -> Communicator:
        """This device's communicator for ``group`` (set up by ``reshard.runtime.ensure_groups``)."""
        return self.groups.get(group_key(group))

    def run_program(
        self, program, src, dst, *, dtype: str | None = None, timeout_s: float = 60.0, groups=None, peers=None
    ) -> dict:
        """Run one ``DeviceProgram`` (or ``CompiledProgram``) over ``src``/``dst`` tensors.

        ``dtype`` defaults to that of ``src`` or ``dst``. ``groups`` (``.get(key)``) overrides the
        communicator cache. On failure the program's communicators are aborted (peers fail fast)
        and the error is raised. ``peers`` maps each holder of the program's PULL ops to its
        source shard (mapped through ``self.peers``)."""
        if isinstance(program, DeviceProgram):
            if dtype is None:
                t = src if src is not None else dst
                if t is None:
                    raise ValueError("run_program needs dtype= when neither src nor dst is given")
                dtype = str(t.dtype).removeprefix("torch.")
            program = compile_program(program, dtype)
        own_groups = groups is None
        deadline = time.monotonic() + timeout_s
        try:
            if own_groups:
                self.groups.connect(program.groups, timeout_s)
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReshardTimeout(f"device {self.device}: timeout_s={timeout_s:g}s passed while connecting groups")
            return run_program(self, program, src, dst, left, groups, peers)
        except BaseException:
            if own_groups:
                self.groups.abort(program.groups)
            raise
        finally:
            self.staging.trim()

    def note_peak(self, nbytes: int) -> None:
        self.peak_bytes = nbytes

    def allocate(self, shape, dtype: str) -> torch.Tensor:
        """A new shard: a pooled buffer of the same byte size if there is one, else fresh memory
        (shared memory, when this actor keeps its shards there)."""
        tdtype = torch_dtype(dtype)
        shape = tuple(shape)
        numel = 1
        for n in shape:
            numel *= n
        flat = self.pool.take(numel * tdtype.itemsize) if numel else None
        if flat is None:
            try:
                flat = self.shared.allocate(numel * tdtype.itemsize) if self.shared is not None and numel else None
            except OSError as e:  # out of descriptors, say: a private shard, moved by the backend
                log.warning("device %d: shard of %s not in shared memory (%s)", self.device, shape, e)
            if flat is None:
                return torch.empty(shape, dtype=tdtype, device=self.torch_device)
        return flat.view(tdtype).view(shape)

    def descriptor(self, t: torch.Tensor | None):
        """How peers on this machine map shard ``t`` (None: they cannot, it is not shared)."""
        return None if self.shared is None else self.shared.descriptor(t)

    def release(self, name: str) -> bool:
        """Drop shard ``name``; its memory goes to the pool when nothing else references it."""
        t = self.buffers.pop(name, None)
        if t is None:
            return False
        self.pool.put(t, 1)
        return True

    def memory(self) -> dict:
        sizes = {k: v.numel() * v.element_size() for k, v in self.buffers.items()}
        return {
            "buffers": sizes,
            "buffer_bytes": sum(sizes.values()),
            "staging_bytes": self.staging.nbytes,
            "last_run_peak_bytes": self.peak_bytes,
            "pool_bytes": self.pool.nbytes,  # idle freed shards kept for reuse (not live)
            "pool_limit_bytes": self.pool.limit_bytes,
            "pool_hits": self.pool.hits,
            "pool_misses": self.pool.misses,
        }

    # ---------------------------------------------------------------- driver updates

    def apply(self, updates) -> None:
        if not updates:
            return
        for pid in updates.get("program_drops", ()):
            self.programs.pop(pid, None)
        self.groups.apply(updates.get("group_drops", ()), updates.get("group_sets", ()))


class DeviceActor:
    """Ray actor of one device (wrapped with ``ray.remote`` by ``DeviceMesh.create``)."""

    def __init__(self, device: int, backend: Backend, options: dict):
        threads = int(options.get("torch_threads", 1))
        if threads > 0:
            torch.set_num_threads(threads)
        self.ctx = DeviceContext(device, backend, options)
        setup = getattr(backend, "setup_actor", None)  # optional backend hook
        if setup is not None:
            setup()

    def ready(self) -> dict:
        import ray

        rc = ray.get_runtime_context()
        return {
            "device": self.ctx.device,
            "pid": os.getpid(),
            "node_id": rc.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "torch_device": str(self.ctx.torch_device),
            "shared_memory": self.ctx.shared is not None,
        }

    # ---------------------------------------------------------------- tensors

    def load(self, name: str, array: np.ndarray, box, dtype: str):
        """Keep ``array[box]`` (a read-only object-store array) as shard ``name``; returns its
        shared-memory descriptor (``DeviceContext.descriptor``)."""
        shape = tuple(hi - lo for lo, hi in box)
        wire = torch.int16 if dtype == "bfloat16" else torch_dtype(dtype)
        if self.ctx.torch_device.type == "cpu":
            host = self.ctx.allocate(shape, "int16" if dtype == "bfloat16" else dtype)
        else:
            host = torch.empty(shape, dtype=wire)
        host.numpy()[...] = array[tuple(slice(lo, hi) for lo, hi in box)]
        t = host.view(torch.bfloat16) if dtype == "bfloat16" else host
        if t.device != self.ctx.torch_device:
            t = t.to(self.ctx.torch_device)
        self.ctx.buffers[name] = t
        return self.ctx.descriptor(t)

    def fetch(self, name: str) -> np.ndarray:
        """Shard ``name`` as a numpy array (bfloat16 as its int16 bit pattern)."""
        t = self._buffer(name).detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        return t.numpy()

    def free(self, *names: str) -> int:
        n = 0
        for name in names:
            n += self.ctx.release(name)
        return n

    def _buffer(self, name: str) -> torch.Tensor:
        try:
            return self.ctx.buffers[name]
        except KeyError:
            raise KeyError(f"device {self.ctx.device} holds no buffer {name!r} (freed?)") from None

    # ---------------------------------------------------------------- programs

    def update(self, updates) -> None:
        """Apply driver updates only (group set-up for ``ensure_groups``, cache drops)."""
        self.ctx.apply(updates)

    def run(self, msg: tuple) -> tuple:
        """Run a program. ``msg`` is ``(pid, blob, updates, src_name, dst_name, timeout_s, pulls)``:
        run program ``pid`` (decoding ``blob`` first if given, applying the driver's ``updates`` if
        any) over source shard ``src_name`` into a new destination shard ``dst_name``; ``pulls``
        maps each device this one pulls from to its source shard's descriptor. Returns ``(run_s,
        elapsed_s, comm_s, peak_bytes, descriptor of the destination shard)`` (the driver expands
        the statistics, see ``Runtime.last_run``)."""
        t0 = time.monotonic()
        pid, blob, updates, src_name, dst_name, timeout_s, pulls = msg
        ctx = self.ctx
        try:
            ctx.apply(updates)
            if blob is not None:
                dtype, prog = decode_device_program(blob)
                ctx.programs[pid] = compile_program(prog, dtype)
                ctx.counters["programs_received"] += 1
            compiled = ctx.programs.get(pid)
            if compiled is None:
                raise ReshardError(f"device {ctx.device}: program {pid} is not cached here and was not shipped")
            ctx.programs.move_to_end(pid)
            prog = compiled.program
            src = None
            if prog.src_shape is not None:
                src = ctx.buffers.get(src_name)
                if src is None:
                    self._fail_fast(compiled, timeout_s)
                    raise ReshardError(f"device {ctx.device}: source shard {src_name!r} is missing (tensor freed?)")
            peers = None
            if pulls:
                tdtype = torch_dtype(compiled.dtype)
                try:
                    peers = {h: ctx.peers.get(h, desc, tdtype) for h, desc in pulls.items()}
                except ReshardError:
                    self._fail_fast(compiled, timeout_s)
                    raise
                ctx.peers.purge()  # mappings of shards their owners dropped since: let that memory go
            dst = ctx.allocate(prog.dst_shape, compiled.dtype) if prog.dst_shape is not None else None
            ctx.counters["runs"] += 1
            stats = ctx.run_program(compiled, src, dst, timeout_s=timeout_s, peers=peers)
        except ReshardError:
            ctx.counters["failed_runs"] += 1
            raise
        except Exception as e:
            ctx.counters["failed_runs"] += 1
            raise ReshardError(f"device {ctx.device}: {type(e).__name__}: {e}") from e
        desc = None
        if dst is not None:
            ctx.buffers[dst_name] = dst
            desc = ctx.descriptor(dst)
        return (time.monotonic() - t0, stats["elapsed_s"], stats["comm_s"], stats["peak_bytes"], desc)

    def _fail_fast(self, compiled: CompiledProgram, timeout_s: float) -> None:
        """This device cannot run its part: join the program's groups anyway and abort them at
        once, so that peers waiting for it fail now instead of at their deadline."""
        try:
            self.ctx.groups.connect(compiled.groups, min(timeout_s, 5.0))
        except Exception:  # best effort: peers still have their deadline
            pass
        self.ctx.groups.abort(compiled.groups)

    def cleanup(self, dst_name: str | None, group_drops) -> None:
        """After a failed reshard: free the partial destination shard, drop the failed groups."""
        if dst_name is not None:
            self.ctx.release(dst_name)
        self.ctx.groups.abort([g for g, gen in group_drops if self.ctx.groups.generation(g) == gen])
        self.ctx.staging.trim()

    # ---------------------------------------------------------------- extension point

    def call(self, fn, *args, **kwargs):
        """Run ``fn(ctx, *args, **kwargs)`` on this device and return its result."""
        return fn(self.ctx, *args, **kwargs)

    def stats(self) -> dict:
        ctx = self.ctx
        return {
            "device": ctx.device,
            "programs": list(ctx.programs),
            "groups": ctx.groups.live(),
            "group_entries": {g: e.generation for g, e in ctx.groups.entries.items()},
            "group_stats": dict(ctx.groups.stats),
            **ctx.counters,
            **ctx.memory(),
        }

    def close(self) -> None:
        self.ctx.groups.close_all()
        self.ctx.buffers.clear()
        self.ctx.pool.clear()
        self.ctx.peers.clear()
        self.ctx.staging.buf = None
