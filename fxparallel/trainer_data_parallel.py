"""Data parallelism around the tensor-parallel group under ``transformers.Trainer`` (world = dp x tp).

Trainer leaves gradient reduction to a model sharded at load time. The parallel model's parameters are then
DTensor views (``dtensor_parameters.py``) over the 2-D (dp, tp) mesh, ``Replicate()`` over dp: every dp rank keeps
its whole tp shard, as DistributedDataParallel does, and ``DataParallelGradients`` averages their gradients over
the dp ranks at the end of each backward, in one all-reduce per dtype, except inside ``model.no_sync()``: DDP's
name, which accelerate enters between the micro-batches of gradient accumulation, so there is one average per
optimizer step. Trainer multiplies the loss by the dp size (its convention for a model that averages), so the
average is the gradient of the global batch.

The mesh comes from the DeviceMesh the model was parallelized over: its tp sub-mesh's root, whose one other dim of
size > 1 is the data-parallel one (``view_mesh``)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def view_mesh(model, who: str = "transformers.Trainer / accelerate"):
    """The mesh of the views: the tp group's (1-D) when it spans the job; else the 2-D (dp, tp) mesh from the
    root of the DeviceMesh the model was parallelized over, checked to be laid out as accelerate lays out
    ``ParallelismConfig(dp_shard_size=dp, tp_size=tp)`` (consecutive ranks form a tp group), so that Trainer's
    data split and the model's groups agree. ``who``: what needs the views, for the refusals."""
    from torch.distributed.device_mesh import DeviceMesh

    from .dtensor_parameters import DTensorParametersError
    from .group import given_mesh

    group = model.tp_group
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == group.size:
        return DeviceMesh.from_group(group.process_group, model.device_.type)
    tp_mesh = given_mesh(group)
    if tp_mesh is None:
        raise DTensorParametersError(
            f"{who}, with data parallelism around the parallel model (the world has {world} ranks and the model's "
            f"tp group {group.size}), needs the DTensor views of its parameters, and they need its device mesh: parallelize over the tp sub-mesh of a "
            "DeviceMesh over the whole job, fxparallel.parallelize(..., fxparallel.runtime.init_mesh(tp=..., "
            "dp=...).tp_mesh) (or torch's init_device_mesh(..., mesh_dim_names=('dp', 'tp'))['tp']), not a "
            "ProcessGroup")
    root = tp_mesh._get_root_mesh()
    tp_name = tp_mesh.mesh_dim_names[0]
    others = [(n, s) for n, s in zip(root.mesh_dim_names, root.mesh.shape) if n != tp_name and s > 1]
    if root.mesh.numel() != world or len(others) != 1 or "cp" in others[0][0]:
        raise DTensorParametersError(
            f"{who}: the DTensor views of the parallel model's parameters need a mesh of one data-parallel dim and "
            f"the tp dim over the whole job ({world} ranks); the model's tp mesh {tp_name!r} belongs to a mesh of dims "
            f"{dict(zip(root.mesh_dim_names, root.mesh.shape.tolist()))} over {root.mesh.numel()} ranks"
            + (" (context parallelism through Trainer is not supported)" if any("cp" in n for n, _ in others) else ""))
    (dp_name, dp), names = others[0], list(root.mesh_dim_names)
    grid = root.mesh.movedim((names.index(dp_name), names.index(tp_name)), (0, 1)).reshape(dp, group.size).cpu()
    if not torch.equal(grid, torch.arange(world).reshape(dp, group.size)):
        raise DTensorParametersError(
            f"{who}: the DTensor views of the parallel model's parameters assume consecutive ranks form each tp "
            f"group, as accelerate splits the data (ParallelismConfig(dp_shard_size={dp}, tp_size={group.size})), but the model's mesh groups ranks "
            f"{grid.tolist()} (dp x tp): put the tp dim after the data-parallel one when building the mesh")
    return root[(dp_name, tp_name)]


class DataParallelGradients:
    """Averages the views' gradients over the data-parallel ranks once per backward, at its end (one all-reduce
    per dtype), as DDP does; inside ``suspended()`` (``model.no_sync()``) gradients only accumulate, and the
    next backward outside it averages the sum. Which views have a gradient travels with them, so a parameter
    without one on every rank keeps none."""

    def __init__(self, group, views):
        self.group, self.views = group, views
        self.size = dist.get_world_size(group)
        self.sync = True
        self.queued_in = None  # the backward (autograd graph task) whose end averages; one that failed never ends

    def after_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if self.sync and task != self.queued_in:
            self.queued_in = task
            torch.autograd.Variable._execution_engine.queue_callback(self.average)

    @contextlib.contextmanager
    def suspended(self):
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    def average(self) -> None:
        from .dtensor_parameters import like_view

        by_dtype = {}
        for view in self.views:
            if view.requires_grad:
                by_dtype.setdefault(view.dtype, []).append(view)
        for dtype, views in by_dtype.items():
            local = [v._local_tensor for v in views]
            parts = [v.grad._local_tensor.reshape(-1) if v.grad is not None else t.new_zeros(t.numel())
                     for v, t in zip(views, local)]
            held = torch.tensor([v.grad is not None for v in views], dtype=dtype, device=local[0].device)
            flat = torch.cat(parts + [held])
            dist.all_reduce(flat, group=self.group)
            counts = flat[-len(views):].tolist()
            pieces = flat[:-len(views)].div_(self.size).split([t.numel() for t in local])
            for view, t, piece, count in zip(views, local, pieces, counts):
                if count == 0:
                    continue
                if view.grad is None:
                    view.grad = like_view(view, piece.view_as(t).clone())
                else:
                    view.grad._local_tensor.copy_(piece.view_as(t))


def no_gradient_sync(model):
    """The context of ``model.no_sync()``: no data-parallel gradient average in the backwards run inside it
    (a no-op without data parallelism)."""
    dp = model.__dict__.get("_dtensor_data_parallel")
    return dp.suspended() if dp is not None else contextlib.nullcontext()
