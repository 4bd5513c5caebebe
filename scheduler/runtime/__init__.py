"""The pipeline runtime (runtime layer: ray, torch): ``pipeline`` (the driver: ``Pipeline`` and
its errors), ``stages`` (``Stage`` and its checks), ``results`` (what an iteration measured),
``specs`` (what the driver ships its workers), ``worker`` (each device's stage worker, inside the
device actors) and ``stage_context`` (what the stage callables see). Everything it moves goes
through ``reshard.runtime``'s compile step, groups and calls."""

from scheduler.runtime.pipeline import Pipeline, PipelineError, PipelineTimeout
from scheduler.runtime.results import IterationResult, TimelineEvent
from scheduler.runtime.stages import Stage

__all__ = ["IterationResult", "Pipeline", "PipelineError", "PipelineTimeout", "Stage", "TimelineEvent"]
