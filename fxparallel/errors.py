"""Errors raised by fxparallel. Each names what is wrong and where."""


class FxParallelError(Exception):
    """Base class of every error fxparallel raises on bad input."""


class ShardingError(FxParallelError):
    """The model cannot be split over the requested tensor-parallel size."""


class CaptureError(FxParallelError):
    """The model could not be captured as one whole graph."""


class CacheNotCarried(CaptureError):
    """The model's cache (keys and values, or recurrent states) cannot be carried by the graphs: ``use_cache`` is
    refused; ``generate`` recomputes the sequence at each step instead (generation/recompute.py). ``why``: the
    model and what of its cache."""

    def __init__(self, why: str):
        self.why = why
        super().__init__(f"{why}: use_cache is not supported for this model (generate recomputes the sequence at "
                         "each step instead; forward and training are unaffected)")

    def __reduce__(self):  # raised in a rank's process, pickled back whole
        return type(self), (self.why,)


class PromptLengthFixed(CaptureError):
    """A forward of several tokens with a cache, whose code fixes the number of tokens (a Python loop or scan over
    them: Mamba's, xLSTM's), would need a graph per prompt length; the model then takes them one at a time
    (``module.py``)."""


class CheckpointError(FxParallelError):
    """The checkpoint is missing, incomplete or inconsistent with the config."""


class GroupError(FxParallelError):
    """The tensor-parallel group is not usable."""


class InputError(FxParallelError, ValueError):
    """The arguments of a call are inconsistent (shapes, ranges, or across the ranks of a group)."""


class ConfigError(FxParallelError, ValueError):
    """The model's config is invalid (transformers' own validation refused it)."""


class ArgumentError(FxParallelError, ValueError):
    """An argument has a value fxparallel does not accept (e.g. an unknown dtype)."""


class ContextParallelError(FxParallelError):
    """The model or the input cannot run with context parallelism."""


class RankTimeoutError(GroupError, TimeoutError):
    """A rank of the group did not reach an agreement point within the wait (FXPARALLEL_AGREE_TIMEOUT)."""
