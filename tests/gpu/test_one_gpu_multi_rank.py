"""The one-GPU tier with NCCL's own support for several ranks on one GPU (NCCL >= 2.30,
``NCCL_MULTI_RANK_GPU_ENABLE=1``, ``gpu_sharing="multi_rank"``): NCCL then connects the ranks with
its intra-node transports instead of sockets. Its own module: its ranks need the GPU that the
NCCL_HOSTID tier's ranks hold until their module ends."""

from __future__ import annotations

import pytest
from gpu_bodies import environment, exchange_bits

pytestmark = pytest.mark.gpu(1, torch_cuda=True)


def test_multi_rank_gpu_mode_on_nccl_2_30(nccl_ranks, connect_ranks):
    from cupy.cuda import nccl

    from reshard.runtime.backends.cuda_buffers import nccl_version_tuple
    from reshard.runtime.backends.nccl import MULTI_RANK_GPU_MIN_VERSION

    if nccl_version_tuple(nccl.get_version()) < MULTI_RANK_GPU_MIN_VERSION:
        pytest.skip("NCCL_MULTI_RANK_GPU_ENABLE needs NCCL >= 2.30")
    ranks = nccl_ranks(2, 0.5, timeout_s=60, gpu_sharing="multi_rank")
    assert {e["NCCL_MULTI_RANK_GPU_ENABLE"] for e in ranks.call(environment)} == {"1"}
    group = (0, 1)
    connect_ranks(ranks, ranks.rendezvous([group]))
    (a, ta), (b, tb) = ranks.call(exchange_bits, group, "bfloat16", 3)
    assert a == b and ta == tb == 3
