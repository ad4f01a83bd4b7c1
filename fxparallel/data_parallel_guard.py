"""No silent DistributedDataParallel (or accelerate's FSDP2) around the parallel model.

DDP's constructor broadcasts rank 0's parameters over every other rank's, then averages gradients
over its group: around a tensor-parallel model that copies rank 0's shards over the other ranks'
(silently: the shapes match) and mixes the gradients of different shards. accelerate wraps a
model in DDP when no ``ParallelismConfig(tp_size=...)`` tells it the model is tensor parallel
(``transformers.Trainer`` tells it: it reads ``model.tp_size``), and users wrap by habit. DDP reads the module's ``_ddp_params_and_buffers_to_ignore`` before it communicates;
answering that read with an error stops it on every rank before any parameter changes.

accelerate's FSDP2 (``Trainer(fsdp=..., fsdp_config={"fsdp_version": 2})`` or an accelerate config, on GPUs) would
``fully_shard`` the model's submodules, which the captured graphs never call: its first read of the model, the
``_no_split_modules`` its wrap policy starts from, is answered with an error naming what does shard over dp."""
from __future__ import annotations

from .errors import GroupError

ADVICE = ("parallelize over mesh.tp_mesh of fxparallel.runtime.init_mesh(tp=..., dp=...) and train with "
          "transformers.Trainer (it reads model.tp_size and leaves the model unwrapped; the dp ranks then average "
          "the gradients), accelerate with ParallelismConfig(tp_size=...), or fxparallel.runtime "
          "(apply_data_parallel(model, mesh): FSDP2 over the dp ranks, then train_step)")


class DataParallelError(GroupError):
    """The parallel model was handed to DistributedDataParallel."""


class RefusesDistributedDataParallel:
    """Mixin of the parallel model: DistributedDataParallel(model), and accelerate's FSDP2 preparation of it,
    raise ``DataParallelError``."""

    @property
    def _no_split_modules(self):
        from .callers import functions_on_stack

        if "fsdp2_prepare_model" in functions_on_stack("accelerate.utils.fsdp_utils"):
            raise DataParallelError(
                "accelerate's FSDP2 (Trainer's fsdp= / fsdp_config, or an accelerate config with FSDP) was given "
                "fxparallel's tensor-parallel model: it would wrap submodules the captured graphs never call. "
                "Nothing was changed. Shard over dp with fxparallel.runtime.apply_data_parallel(model, mesh) (FSDP2 "
                "per decoder layer) before handing the model to Trainer / accelerate without their FSDP, or train it "
                "with fxparallel.runtime.train_step; or train without FSDP (the dp ranks then keep whole tp shards "
                "and average gradients)")
        raise AttributeError("_no_split_modules")  # (transformers' attribute: the parallel model has none)

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        raise DataParallelError(
            "torch.nn.parallel.DistributedDataParallel was given fxparallel's tensor-parallel model (directly, or "
            "by accelerate's prepare without a ParallelismConfig(tp_size=...)): it "
            "would broadcast rank 0's shards over the other ranks' and average the gradients of different "
            f"shards. Nothing was changed. Instead, {ADVICE}")
