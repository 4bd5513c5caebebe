"""Exceptions: ValueError/TypeError for misuse, ReshardError subclasses for runtime failures."""


class ReshardError(RuntimeError):
    """A reshard failed at run time; the source tensor is intact."""


class PlanError(ReshardError):
    """A plan or program breaks an invariant (a planner bug, never user input)."""


class ReshardTimeout(ReshardError):
    """A device did not finish its part within the timeout."""


class WorkerDied(ReshardError):
    """A device actor died (killed, out of memory, its node lost). Tensors that lived on it raise
    it too; the sources on the surviving devices are intact. Shut its mesh down and create a new
    one."""


class MeshClosed(ReshardError):
    """The mesh was shut down, or belongs to a Ray session or job that is gone: its shards are
    gone with it. Create a new mesh (``DeviceMesh.create``)."""
