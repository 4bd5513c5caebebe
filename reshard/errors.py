"""Exceptions: ValueError/TypeError for misuse, ReshardError subclasses for runtime failures."""


class ReshardError(RuntimeError):
    """A reshard failed at run time; the source tensor is intact."""


class PlanError(ReshardError):
    """A plan or program breaks an invariant (a planner bug, never user input)."""


class ReshardTimeout(ReshardError):
    """A device did not finish its part within the timeout."""


class WorkerDied(ReshardError):
    """A device actor died."""


class MeshClosed(ReshardError):
    """The mesh was shut down."""
