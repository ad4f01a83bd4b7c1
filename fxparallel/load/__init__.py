"""Stage 4: resolve the checkpoint and fill this rank's shards."""
from .checkpoint_files import CheckpointFiles, local_checkpoint, resolve_checkpoint
from .dtype import resolve_dtype
from .source import ModelSource, default_dtype, resolve_source
from .weights import initialize, load_from_files, load_from_state_dict, slice_pieces

__all__ = ["CheckpointFiles", "local_checkpoint", "resolve_checkpoint", "ModelSource", "default_dtype",
           "resolve_dtype", "resolve_source", "initialize", "load_from_files", "load_from_state_dict", "slice_pieces"]
