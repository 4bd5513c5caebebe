"""The pipeline runtime (runtime layer: ray, torch): ``pipeline`` (the driver: ``Pipeline``,
``Stage``, results and errors) and ``worker`` (each device's stage worker, inside the device
actors). Everything it moves goes through ``reshard.runtime``'s compile step, groups and calls."""

from scheduler.runtime.pipeline import IterationResult, Pipeline, PipelineError, PipelineTimeout, Stage, TimelineEvent

__all__ = ["IterationResult", "Pipeline", "PipelineError", "PipelineTimeout", "Stage", "TimelineEvent"]
