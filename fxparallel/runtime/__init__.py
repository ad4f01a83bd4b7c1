"""Training runtime around a parallelized model: mesh, FSDP2 data parallelism, loss
normalization, clipping, distributed checkpoints, consolidated export, data.

    mesh = init_mesh()                                   # TP_SIZE / DP_SIZE / CP_SIZE (DP_SHARD_SIZE: HSDP)
    model = fxparallel.parallelize(path, mesh.tp_mesh, cp_group=mesh.cp_mesh)  # 1. TP shards (+ CP attention)
    model = apply_data_parallel(model, mesh)             # 2. FSDP2 over dp x cp, on the TP shards
    optimizer = torch.optim.AdamW(model.parameters())    # 3. after FSDP: it sees the sharded params
    metrics = train_step(model, optimizer, batches.batch(step), mesh, max_norm=1.0)
    save_checkpoint(root, model, optimizer, mesh, step)  # loads into any (dp, tp, cp) layout

Context parallelism (cp > 1): ``train_step`` gives each cp rank its load-balanced chunks of the
dp rank's rows (chunks i and 2cp-1-i of 2cp; labels shifted first, global position_ids); the
model's attention spans the cp group exactly (``fxparallel/ops/context_parallel_attention.py``). The
sequence length must divide by 2*cp; padding masks, packed sequences and non-causal or
sliding-window attention are refused.
"""
from .checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from .clip import clip_grad_norm_, global_grad_norm
from .compile import compile_layers
from .context_parallel_batches import shift_labels, split_for_context_parallel, split_sequence, unsplit_sequence
from .data import StepBatches, dataset_token_stream, pack_tokens, synthetic_token_stream
from .export import export_pretrained, gather_full_state_dict
from .fsdp import apply_data_parallel
from .loss_normalization import global_label_count, global_label_tokens, label_tokens, scaled_loss
from .mesh import ParallelMesh, init_mesh, world_size_error
from .train import StepMetrics, check_context_parallel, train_step

__all__ = ["init_mesh", "ParallelMesh", "world_size_error", "apply_data_parallel", "label_tokens",
           "global_label_count", "global_label_tokens", "scaled_loss", "clip_grad_norm_", "global_grad_norm", "save_checkpoint",
           "load_checkpoint", "latest_checkpoint", "list_checkpoints", "export_pretrained", "gather_full_state_dict",
           "synthetic_token_stream", "pack_tokens", "dataset_token_stream", "StepBatches", "train_step", "StepMetrics",
           "check_context_parallel", "compile_layers", "shift_labels", "split_sequence", "unsplit_sequence",
           "split_for_context_parallel"]
