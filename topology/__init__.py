"""Topology: abstract meshes and clusters (pure: no ray/torch/cupy)."""

from topology.cluster import Cluster
from topology.mesh import Mesh

__all__ = ["Cluster", "Mesh"]
