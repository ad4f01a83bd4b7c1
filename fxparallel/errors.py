"""Errors raised by fxparallel. Each names what is wrong and where."""


class FxParallelError(Exception):
    """Base class of every error fxparallel raises on bad input."""


class ShardingError(FxParallelError):
    """The model cannot be split over the requested tensor-parallel size."""


class CaptureError(FxParallelError):
    """The model could not be captured as one whole graph."""


class CheckpointError(FxParallelError):
    """The checkpoint is missing, incomplete or inconsistent with the config."""


class GroupError(FxParallelError):
    """The tensor-parallel group is not usable."""
