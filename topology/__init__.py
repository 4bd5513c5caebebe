"""Topology: abstract meshes, clusters (the cost model) and the network simulator (pure: no ray/torch/cupy)."""

from topology.cluster import PRESETS, Cluster
from topology.mesh import Mesh
from topology.simulator import HostStats, SimKind, SimResult, SimTransfer, simulate_transfers

__all__ = ["PRESETS", "Cluster", "HostStats", "Mesh", "SimKind", "SimResult", "SimTransfer", "simulate_transfers"]
