"""Data parallelism around the tensor-parallel group under ``transformers.Trainer`` (world = dp x tp).

Trainer leaves gradient reduction to a model sharded at load time. The parallel model's parameters are then
DTensor views (``dtensor_parameters.py``) over the 2-D (dp, tp) mesh, ``Replicate()`` over dp: every dp rank keeps
its whole tp shard, as DistributedDataParallel does, and ``DataParallelGradients`` averages their gradients over
the dp ranks in each backward, bucket by bucket as the gradients are written (overlapped with the rest of the
backward, as DDP's buckets are), except inside ``model.no_sync()``: DDP's
name, which accelerate enters between the micro-batches of gradient accumulation, so there is one average per
optimizer step. Trainer multiplies the loss by the dp size (its convention for a model that averages), so the
average is the gradient of the global batch.

The mesh comes from the DeviceMesh the model was parallelized over: its tp sub-mesh's root, whose one other dim of
size > 1 is the data-parallel one (``view_mesh``)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .trainer_fsdp import deferred_reduction, under_trainer


def view_mesh(model, who: str = "transformers.Trainer / accelerate"):
    """The mesh of the views: the tp group's (1-D) when it spans the job; else the 2-D (data, tp) mesh from the
    root of the DeviceMesh the model was parallelized over, checked to be laid out as accelerate lays out
    ``ParallelismConfig(dp_shard_size=dp, cp_size=cp, tp_size=tp)`` (consecutive ranks form a tp group, then the
    cp dim, then the data-parallel one), so that Trainer's data split, its context-parallel split and the model's
    groups agree. With context parallelism the data dim of the views is dp x cp flattened: the cp ranks hold the
    same weights, and their gradients are averaged with the dp ranks'. ``who``: what needs the views, for the
    refusals."""
    from torch.distributed.device_mesh import DeviceMesh

    from .dtensor_parameters import DTensorParametersError
    from .group import given_mesh

    group, cp_group = model.tp_group, model.cp_group
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
    sizes = dict(zip(root.mesh_dim_names, root.mesh.shape))
    cp_name = _cp_dim(cp_group, root, who)
    others = [(n, s) for n, s in sizes.items() if n not in (tp_name, cp_name) and s > 1]
    if root.mesh.numel() != world or len(others) > 1 or (not others and cp_name is None):
        raise DTensorParametersError(
            f"{who}: the DTensor views of the parallel model's parameters need a mesh of one data-parallel dim"
            f"{', the cp dim' if cp_name else ''} and the tp dim over the whole job ({world} ranks); the model's tp "
            f"mesh {tp_name!r} belongs to a mesh of dims {sizes} over {root.mesh.numel()} ranks")
    data = [others[0][0]] if others else []
    order = data + ([cp_name] if cp_name else []) + [tp_name]
    shape = [sizes[n] for n in order]
    names = list(root.mesh_dim_names)
    grid = root.mesh.movedim([names.index(n) for n in order], list(range(len(order)))).reshape(shape).cpu()
    if not torch.equal(grid, torch.arange(world).reshape(shape)):
        raise DTensorParametersError(
            f"{who}: the DTensor views of the parallel model's parameters assume consecutive ranks form each tp "
            f"group{', then the cp dim,' if cp_name else ''} as accelerate splits the data "
            f"(ParallelismConfig({', '.join(f'{n}_size={s}' for n, s in zip(order, shape))})), but the model's "
            f"mesh groups ranks {grid.tolist()} ({' x '.join(order)}): put the tp dim last"
            f"{' and the cp dim before it' if cp_name else ''} when building the mesh")
    if len(order) == 3:  # the dp and cp ranks average their gradients together: one data dim of dp x cp ranks
        return _data_by_tp(root.device_type, grid.reshape(-1, shape[-1]), (f"{order[0]}_{order[1]}", tp_name))
    return root[tuple(order)]


_MESHES = {}  # (device type, ranks, names) -> the 2-D DeviceMesh built for them (its groups made once)


def _data_by_tp(device_type: str, grid, names: tuple):
    """A 2-D DeviceMesh over ``grid`` (data x tp ranks); every rank of the job builds it (new groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (device_type, tuple(grid.flatten().tolist()), names)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh(device_type, grid, mesh_dim_names=names)
    return _MESHES[key]


def _cp_dim(cp_group, root, who: str):
    """The name of the dim of ``root`` the model's cp group was given as (None without context parallelism); a
    cp group that is not a dim of the tp mesh's root mesh is refused (Trainer's split would not be its)."""
    from .dtensor_parameters import DTensorParametersError
    from .group import given_mesh
    from .trainer_context_parallel import PARALLELIZE_WITH_CP

    if cp_group is None:
        return None
    cp_mesh = given_mesh(cp_group)
    if cp_mesh is None or cp_mesh._get_root_mesh() is not root:
        raise DTensorParametersError(
            f"{who} with context parallelism needs the model's cp group to be a dim of the same DeviceMesh as its "
            f"tp group: {PARALLELIZE_WITH_CP}")
    return cp_mesh.mesh_dim_names[0]


BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket size


class DataParallelGradients:
    """Averages the views' gradients over the data-parallel ranks once per backward, as DDP does, and overlapped
    with it as DDP overlaps it: the views are put in buckets of about ``BUCKET_BYTES`` (one dtype each, in the
    reverse of the parameters' order, roughly the order the backward produces their gradients), and a bucket's
    all-reduce starts, asynchronously, as soon as its last gradient is written, while the backward goes on; buckets
    start in their order only (a later one ready first waits for those before it), so every rank issues the same
    collectives in the same order. At the end of the backward the buckets not started (a view without a gradient
    in this backward) start, and all are waited for and written back. Inside ``suspended()`` (``model.no_sync()``)
    gradients only accumulate, and the next backward outside it averages the sum. Which views have a gradient
    travels with them, so a parameter without one on every rank keeps none."""

    def __init__(self, group, views):
        self.group, self.views = group, views
        self.size = dist.get_world_size(group)
        self.sync = True
        self.queued_in = None  # the backward (autograd graph task) whose end averages; one that failed never ends
        self.buckets = _buckets(views)
        self.bucket_of = {id(v): i for i, bucket in enumerate(self.buckets) for v in bucket}
        self._start()

    def _start(self) -> None:
        """A new backward's bookkeeping: no bucket started, each waiting for its views that take gradients."""
        self.waiting = [sum(1 for v in bucket if v.requires_grad) for bucket in self.buckets]
        self.written = set()  # ids of the views whose gradient this backward wrote
        self.started = {}  # bucket index -> (work, flat buffer)
        self.next = 0  # the first bucket not started

    def after_backward(self, view=None) -> None:
        """From the hook that moved ``view``'s gradient: queue the average at the end of this backward (once), and
        start the buckets that are complete."""
        if not self.sync:
            return
        task = torch._C._current_graph_task_id()
        if task != self.queued_in:
            self._finish(write=False)  # (a backward that failed before its end: its started buckets dropped)
            self.queued_in = task
            torch.autograd.Variable._execution_engine.queue_callback(self.average)
        if view is not None and id(view) not in self.written:
            self.written.add(id(view))
            self.waiting[self.bucket_of[id(view)]] -= 1
            while self.next < len(self.buckets) and self.waiting[self.next] <= 0:
                self._start_bucket(self.next)

    @contextlib.contextmanager
    def suspended(self):
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    def _start_bucket(self, i: int) -> None:
        views = self.buckets[i]
        local = [v._local_tensor for v in views]
        parts = [v.grad._local_tensor.reshape(-1) if v.grad is not None and v.requires_grad else t.new_zeros(t.numel())
                 for v, t in zip(views, local)]
        held = torch.tensor([v.grad is not None and v.requires_grad for v in views], dtype=local[0].dtype,
                            device=local[0].device)
        flat = torch.cat(parts + [held])
        self.started[i] = (dist.all_reduce(flat, group=self.group, async_op=True), flat)
        self.next = i + 1

    def average(self) -> None:
        """Start the buckets not started yet, wait for every bucket's all-reduce, and write the averages."""
        while self.next < len(self.buckets):
            self._start_bucket(self.next)
        self._finish(write=True)

    def _finish(self, write: bool) -> None:
        from .dtensor_parameters import like_view

        for i, (work, flat) in sorted(self.started.items()):
            work.wait()
            if not write:
                continue
            views = self.buckets[i]
            local = [v._local_tensor for v in views]
            counts = flat[-len(views):].tolist()
            pieces = flat[:-len(views)].div_(self.size).split([t.numel() for t in local])
            for view, t, piece, count in zip(views, local, pieces, counts):
                if count == 0 or not view.requires_grad:
                    continue
                if view.grad is None:
                    view.grad = like_view(view, piece.view_as(t).clone())
                else:
                    view.grad._local_tensor.copy_(piece.view_as(t))
        self._start()


def _buckets(views) -> list:
    """The views in buckets of one dtype and about ``BUCKET_BYTES`` each, from the last parameter to the first."""
    buckets, open_ = [], {}  # dtype -> (bucket, bytes)
    for view in reversed(views):
        bucket, size = open_.get(view.dtype, (None, 0))
        if bucket is None or size >= BUCKET_BYTES:
            bucket, size = [], 0
            buckets.append(bucket)
        bucket.append(view)
        open_[view.dtype] = (bucket, size + view._local_tensor.numel() * view._local_tensor.element_size())
    return buckets


def no_gradient_sync(model):
    """The context of ``model.no_sync()``: no data-parallel gradient average in the backwards run inside it
    (fxparallel's FSDP under Trainer: ``trainer_fsdp.deferred_reduction``; a no-op without data parallelism)."""
    dp = model.__dict__.get("_dtensor_data_parallel")
    if dp is not None:
        return dp.suspended()
    return deferred_reduction(model) if under_trainer(model) else contextlib.nullcontext()
