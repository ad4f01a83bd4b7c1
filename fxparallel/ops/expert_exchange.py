"""Experts over data-parallel ranks: a grouped product whose rows travel to the rank holding their expert.

The ranks of an expert-parallel group (``ep``, carved from dp: ``runtime/mesh.py``) see different tokens and
hold different experts of the same tensor-parallel position: of the ``c`` experts a grouped product of this tp
rank covers (all of them when the experts are split inside, this rank's block when whole), ep rank ``j`` holds
the ``j``-th run (``expert_runs``: the first ranks one more where ep does not divide c). Rows arrive sorted by
expert with cumulative offsets (transformers' grouped_mm kernel), so the rows of each ep rank's experts are one
contiguous run. ``exchanged_grouped_mm``:

1. counts: each rank sends every peer its rows per expert of that peer (one all-to-all of ``ep x max run``
   integers), so each knows what it receives (read on the host: the row splits of the next two);
2. dispatch: an all-to-all of the rows, each run to its expert's rank;
3. the grouped product of the received rows, regrouped by expert (they arrive grouped by sender), with this
   rank's experts' weights;
4. combine: the products back to the rows' ranks, in their order, by the reverse all-to-all.

Both row exchanges are autograd functions (torch's functional ``all_to_all_single_autograd``): the backward
sends the rows' gradients the other way, and each expert's weight gradient sums the rows of every sender, so
the experts' gradients need no further reduction over the ep group. No row is dropped and there is no capacity
factor: the result is the single-device product. Rows past the last offset (none, or the rows a whole-expert
tp rank does not own) are not sent and come back zero.

``bytes_sent[handle]`` adds up the bytes each forward's two row exchanges send to other ranks (the backward sends
as many back): the exchange's volume, readable per ep group."""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..group import group_by_handle
from ..plan.layout import balanced

bytes_sent: collections.Counter = collections.Counter()

# the kernels the graphs call (plan/rules/experts.py), by the name the rewrite gives them
KERNELS = {"grouped_mm": lambda: getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm,
           "transformers::grouped_mm_fallback": lambda: torch.ops.transformers.grouped_mm_fallback}


def expert_runs(count: int, size: int) -> list:
    """[(first expert, number of experts)] of each of ``size`` ranks over ``count`` experts: the first ranks
    one more where ``size`` does not divide ``count`` (``plan/layout.balanced``)."""
    sizes = balanced(count, size)
    return [(sum(sizes[:rank]), n) for rank, n in enumerate(sizes)]


@dataclass
class Route:
    """Where a dispatch sent its rows, to bring their products back (``combine_rows``)."""

    handle: int  # the ep group's
    send_rows: list  # rows this rank sends each peer (its rows of that peer's experts)
    receive_rows: list  # rows it receives from each peer
    order: torch.Tensor  # regroups the received rows by expert
    offsets: torch.Tensor  # cumulative received rows per expert of this rank's run (int32)
    experts: int  # experts in this rank's run
    rows: int  # rows of the dispatched input (those past the ones sent come back zero)


def dispatch_rows(x: torch.Tensor, offs: torch.Tensor, handle: int) -> tuple:
    """Steps 1-2 of the module docstring: (the rows of this rank's experts, from every rank, grouped by expert; the
    ``Route``)."""
    group = group_by_handle(handle)
    runs = expert_runs(int(offs.shape[0]), group.size)
    mine = runs[group.rank][1]
    per_expert = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    send = torch.zeros(group.size, max(n for _, n in runs), dtype=torch.int64, device=x.device)
    for peer, (first, n) in enumerate(runs):
        send[peer, :n] = per_expert[first:first + n]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group.process_group)
    received = received[:, :mine]  # [sender, my expert]: rows from each sender per expert of mine
    send_rows, receive_rows = send.sum(1).tolist(), received.sum(1).tolist()
    sent = int(sum(send_rows))
    rows = _exchange(x[:sent], receive_rows, send_rows, group.process_group)
    bytes_sent[handle] += (sent - send_rows[group.rank]) * math.prod(x.shape[1:]) * x.element_size()
    order = _expert_major(received)
    route = Route(handle, send_rows, receive_rows, order, torch.cumsum(received.sum(0), 0).to(torch.int32), mine,
                  int(x.shape[0]))
    return rows[order], route


def local_grouped_mm(rows: torch.Tensor, weight: torch.Tensor, route: Route, kernel: str) -> torch.Tensor:
    """Step 3: the grouped product of dispatched rows with this rank's run of an expert weight (cast to the rows'
    dtype: under bf16 mixed precision the runs stay fp32 master weights outside FSDP's casts)."""
    if int(weight.shape[0]) != route.experts:
        raise ValueError(f"expert exchange: this rank holds {int(weight.shape[0])} experts of the product, the rows "
                         f"it received are of {route.experts}")
    return KERNELS[kernel]()(rows, weight.to(rows.dtype), offs=route.offsets)


def combine_rows(y: torch.Tensor, route: Route) -> torch.Tensor:
    """Step 4: products of dispatched rows back to their ranks, in the order the rows were dispatched in."""
    group = group_by_handle(route.handle)
    back = torch.empty_like(route.order)
    back[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    out = _exchange(y[back], route.send_rows, route.receive_rows, group.process_group)
    rows_back = int(sum(route.receive_rows)) - route.receive_rows[group.rank]
    bytes_sent[route.handle] += rows_back * math.prod(y.shape[1:]) * y.element_size()
    if out.shape[0] < route.rows:
        out = torch.cat([out, out.new_zeros((route.rows - out.shape[0],) + tuple(out.shape[1:]))])
    return out


def exchanged_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, handle: int,
                         kernel: str) -> torch.Tensor:
    """``kernel(x, full_weight, offs)`` where this rank holds ``weight``, its run of the experts, and its ep peers
    the other runs: dispatch, product, combine."""
    rows, route = dispatch_rows(x, offs, handle)
    return combine_rows(local_grouped_mm(rows, weight, route, kernel), route)


def _exchange(rows: torch.Tensor, output_splits: list, input_splits: list, process_group) -> torch.Tensor:
    out = funcol.all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, process_group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def _expert_major(received: torch.Tensor) -> torch.Tensor:
    """The index that regroups rows laid out by sender, then expert (``received[sender, expert]`` rows each) by
    expert, then sender."""
    by_sender = received.reshape(-1)
    first = torch.cumsum(by_sender, 0) - by_sender  # where each (sender, expert) run starts, as received
    by_expert = received.t().reshape(-1)
    first_by_expert = first.reshape(received.shape).t().reshape(-1)
    placed = torch.cumsum(by_expert, 0) - by_expert  # where it starts, regrouped
    total = int(by_expert.sum())
    return torch.arange(total, device=received.device) + torch.repeat_interleave(first_by_expert - placed, by_expert)
