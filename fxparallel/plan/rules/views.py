"""View-like ops: reshape, transpose, expand, view_as, cat / stack, pad.

The rule follows the sharded dimension through the shape change (``dim_maps.py`` says
where it goes). Literal sizes of the sharded dimension in the op's arguments (hard-coded
head counts, hidden sizes) are rewritten to local sizes (``rewrite/view_sizes.py``).
Indexing lives in ``indexing.py``.
"""
from __future__ import annotations

import torch.fx as fx

from ..op_traits import SAME_VALUES, SIZED_VIEWS, op_name
from ..placement import R, S
from .base import LocalOp, Strategy, arg, norm_dim, register, tensor_inputs
from .conv import depthwise_conv_reading
from .dim_maps import _hint, _same, dim_groups, permutation, reshape_shard_dim
from .experts import expert_note, input_choices, is_expert_weight, is_weight, weight_choices


def _view_size(dim: int, full: int, segmented=None) -> LocalOp:
    """The view must spell out the local size at ``dim`` (rewrite/view_sizes.py)."""
    return LocalOp.of("local_view_size", dim=dim, full=full, segmented=segmented)


def _block_size(dim: int, block: int) -> LocalOp:
    return LocalOp.of("block_view_size", dim=dim, block=block)


def _reshape(node, placements, ctx):
    inputs = tensor_inputs(node)
    if not inputs or node.args[0] is not inputs[0]:
        return []
    x = inputs[0]
    conv = depthwise_conv_reading(node) if op_name(node) in ("squeeze", "unsqueeze") else None
    strategies = []
    for p in _view_input_choices(node, x, placements, ctx, conv):
        strategies.extend(_sharded_view(node, x, p, ctx))
    if strategies and conv is not None:
        for s in strategies:  # the reason the plan gives for the weight's split
            s.note = s.note or "depthwise convolution weight, split by channels"
    strategies.append(Strategy({x: R}, R))
    return strategies


def _view_input_choices(node, x, placements, ctx, conv) -> list:
    """A weight only given a size-1 dim or losing one (Mamba's depthwise conv weight, squeezed and
    unsqueezed before the conv) may take any split here, first the channels' split of the activation that
    conv reads where it is placed already (a gated delta net's q, k and v); any other input comes as it is
    placed. ``conv``: the depthwise convolution that reads ``node`` as its weight, or None."""
    if op_name(node) not in ("squeeze", "unsqueeze") or not is_weight(x, ctx.ndim(x)):
        return [placements[x]]
    if is_expert_weight(x) and conv is None:
        return [placements[x]]
    channels = _conv_channels_placement(conv, ctx)
    choices = [] if channels is None else [S(0, channels.segments, whole=channels.whole)]
    if placements[x].is_shard:  # decided already (a generation graph reads the training plan's weights)
        choices.append(placements[x])
    return choices + [c for c in weight_choices(x, ctx, first_dim=0) if c.is_shard and c not in choices]


def _conv_channels_placement(conv, ctx):
    """The placement of the input of the depthwise convolution ``conv`` (or None), where it is a segmented
    shard of the channels; else None."""
    x = arg(conv, 0, "input") if conv is not None else None
    while isinstance(x, fx.Node) and ctx.placement_of(x) is None and op_name(x) in SAME_VALUES \
            and isinstance(x.args[0], fx.Node) and ctx.fake(x.args[0]) is not None \
            and ctx.fake(x.args[0]).shape == ctx.fake(x).shape:
        x = x.args[0]  # a cast written after the weight's view (transformers' causal_conv1d_fn)
    p = ctx.placement_of(x)
    return p if p is not None and p.is_shard and p.dim == 1 and p.segments else None


def _sharded_view(node, x, p, ctx) -> list:
    out = ctx.fake(node)
    strategies = []
    sized = op_name(node) in SIZED_VIEWS  # sizes spelled out in the arguments
    if p.is_shard and p.block is not None and out is not None:
        strategies.extend(_from_block(node, x, p, out, ctx, sized))
    elif p.is_shard and out is not None:
        o = reshape_shard_dim(ctx.fake(x).shape, out.shape, p.dim, ctx.tp, ctx.split_sizes)
        if p.segments and (o is None or not _same(ctx.fake(x).shape[p.dim], out.shape[o])):
            strategies.extend(_segments_by_head(node, x, p, out, ctx, sized))
            strategies.extend(_segments_as_dim(node, x, p, out, ctx, sized))
            o = None  # a segmented dim survives a reshape otherwise only unchanged
        if o is not None:
            rw = _view_size(o, int(out.shape[o]), p if p.segments else None) if sized else None
            strategies.append(Strategy({x: p}, p.with_dim(o), local=rw))
        elif not p.segments:
            strategies.extend(_into_block(node, x, p, out, ctx, sized))
    return strategies


register("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", blocks=True, whole=True)(_reshape)


def _segments_by_head(node, x, p, out, ctx, sized) -> list:
    """A segmented dim with whole parts viewed as ``[heads, head_dim]`` (Falcon-7B's
    ``fused.view(b, s, heads + 2, head_dim)``): the segments, counted in heads, on the heads dim."""
    in_shape = ctx.fake(x).shape
    big_in, big_out = _group_of(in_shape, out.shape, p.dim)
    if not p.whole or big_in != [p.dim] or len(big_out) != 2 or not isinstance(out.shape[big_out[1]], int):
        return []
    unit = int(out.shape[big_out[1]])
    if any(seg % unit for seg in p.segments):
        return []
    heads = S(big_out[0], tuple(seg // unit for seg in p.segments), whole=p.whole)
    if not all(ctx.can_split(seg) for i, seg in enumerate(heads.segments) if i not in heads.whole):
        return []
    return [Strategy({x: p}, heads, local=_view_size(heads.dim, int(out.shape[heads.dim]), heads) if sized else None,
                     note="fused projection viewed by head")]


def _segments_as_dim(node, x, p, out, ctx, sized) -> list:
    """A dim of equal segments viewed as ``[segments, segment]`` (a LoRA B over stacked experts, [out, r x experts]
    viewed as [out, r, experts]): each rank's part of every segment is its part of the new inner dim, a plain
    shard."""
    in_shape = ctx.fake(x).shape
    big_in, big_out = _group_of(in_shape, out.shape, p.dim)
    if p.whole or big_in != [p.dim] or len(big_out) != 2 or len(set(p.segments)) != 1:
        return []
    count, seg = out.shape[big_out[0]], out.shape[big_out[1]]
    if not (_same(count, len(p.segments)) and _same(seg, p.segments[0]) and ctx.can_split(p.segments[0])):
        return []
    o = big_out[1]
    return [Strategy({x: p}, S(o), local=_view_size(o, p.segments[0]) if sized else None,
                     note="equal segments viewed as a dim of their own")]


def _group_of(in_shape, out_shape, dim):
    """(input dims, output dims) of the reshape group holding input ``dim``, size-1 dims left out."""
    for gi, gj in dim_groups(in_shape, out_shape) or ():
        if dim in gi:
            return [d for d in gi if _hint(in_shape[d]) != 1], [d for d in gj if _hint(out_shape[d]) != 1]
    return None, None


def _into_block(node, x, p, out, ctx, sized) -> list:
    """A sharded dim merged as the inner factor of one output dim (``(b, heads, s, d) -> (b * heads, s, d)``), or
    a dim of heads x features split so (``(b, s, heads * d) -> (b * s * heads, d)``, a gated norm's input): a
    blocked shard of that dim."""
    in_shape = ctx.fake(x).shape
    big_in, big_out = _group_of(in_shape, out.shape, p.dim)
    block = in_shape[p.dim]
    if not big_in or len(big_in) < 2 or big_in[-1] != p.dim or not isinstance(block, int):
        return []
    if len(big_out) == 2 and isinstance(out.shape[big_out[1]], int) and block % out.shape[big_out[1]] == 0:
        # (b, s, heads * d) -> (b * s * heads, d): the heads, outer factor of the sharded dim, become the block
        rest = int(out.shape[big_out[1]])
        if not ctx.splits_in_proportion(block, block // rest):
            return []
        block = block // rest
    elif len(big_out) != 1:
        return []
    o = big_out[0]
    return [Strategy({x: p}, S(o, block=block), local=_block_size(o, block) if sized else None,
                     note="sharded heads merged with the batch (blocked shard)")]


def _from_block(node, x, p, out, ctx, sized) -> list:
    """A blocked dim kept whole, or split back so that its block is a dim of its own (a plain shard), or the
    outer factor of the last dim (``(b * s * heads, d) -> (b, s, heads * d)``: a plain shard)."""
    in_shape = ctx.fake(x).shape
    big_in, big_out = _group_of(in_shape, out.shape, p.dim)
    if big_in and big_in[0] == p.dim and len(big_in) > 1 and big_out:
        o, rest = big_out[-1], 1
        for d in big_in[1:]:
            rest = rest * in_shape[d]
        size = out.shape[o]
        if isinstance(size, int) and isinstance(rest, int) and size == p.block * rest \
                and ctx.splits_in_proportion(size, p.block):
            return [Strategy({x: p}, S(o), local=_view_size(o, size) if sized else None,
                             note="blocked heads merged back with their features")]
        return []
    if big_in != [p.dim] or not big_out:
        return []
    if len(big_out) == 1 and _same(in_shape[p.dim], out.shape[big_out[0]]):
        o = big_out[0]
        return [Strategy({x: p}, p.with_dim(o), local=_block_size(o, p.block) if sized else None)]
    inner = out.shape[big_out[-1]]
    if len(big_out) >= 2 and isinstance(inner, int) and inner == p.block:
        o = big_out[-1]
        return [Strategy({x: p}, S(o), local=_view_size(o, p.block) if sized else None)]
    return []


def _view_as(node, placements, ctx):
    """``x.view_as(other)``: a reshape to ``other``'s shape, so ``other`` must hold the same shard."""
    x, other = node.args[0], arg(node, 1, "other")
    p, out = placements[x], ctx.fake(node)
    strategies = []
    if p.is_plain_shard and isinstance(other, fx.Node):
        o = reshape_shard_dim(ctx.fake(x).shape, out.shape, p.dim, ctx.tp, ctx.split_sizes)
        if o is not None:
            strategies.append(Strategy({x: p, other: S(o)}, S(o)))
    strategies.append(Strategy({t: R for t in tensor_inputs(node)}, R))
    return strategies


register("view_as")(_view_as)


def _complex_view(node, placements, ctx):
    """view_as_complex (last dim of 2 floats -> one complex) and view_as_real (the reverse): every
    other dim maps to itself, so a shard of another dim stays (Llama 4's complex rotary)."""
    x = node.args[0]
    p = placements[x]
    strategies = []
    if p.is_plain_shard and p.dim < min(ctx.ndim(x), ctx.ndim(node)) - 1:
        strategies.append(Strategy({x: p}, p))
    strategies.append(Strategy({x: R}, R))
    return strategies


register("view_as_complex", "view_as_real")(_complex_view)


def _expand(node, placements, ctx):
    x = node.args[0]
    p = placements[x]
    out = ctx.fake(node)
    strategies = []
    if p.is_shard:
        o = p.dim + out.dim() - ctx.ndim(x)
        if p.segments or ctx.can_split(out.shape[o]):
            strategies.append(Strategy({x: p}, p.with_dim(o),
                                       local=_view_size(o, int(out.shape[o]), p if p.segments else None)))
    strategies.append(Strategy({x: R}, R))
    return strategies


register("expand")(_expand)


def _expand_as(node, placements, ctx):
    """``x.expand_as(other)``: the output takes ``other``'s (local) shape, so it is sharded where ``other`` is:
    on a dim ``x`` holds sharded alike, or on one ``x`` broadcasts (size 1, or a leading dim it lacks)."""
    x, other = node.args[0], arg(node, 1, "other")
    if not isinstance(other, fx.Node):
        return []
    out = ctx.fake(node)
    lead = out.dim() - ctx.ndim(x)
    strategies = []
    for p in (placements[x], placements[other]):
        if not p.is_shard or p.segments or p.block is not None or not ctx.can_split(out.shape[p.dim]):
            continue
        o = p.dim if p is placements[other] else p.dim + lead
        broadcast = o < lead or ctx.fake(x).shape[o - lead] == 1
        s = Strategy({x: R if broadcast else S(o - lead), other: S(o)}, S(o))
        if all(s.output != t.output or s.inputs != t.inputs for t in strategies):
            strategies.append(s)
    strategies.append(Strategy({x: R, other: R}, R))
    return strategies


register("expand_as")(_expand_as)


def _permute(node, placements, ctx):
    x = node.args[0]
    strategies = []
    for p in input_choices(x, placements, ctx, matrices=True):  # a weight transposed first is decided here
        if p.is_shard:
            perm = permutation(node, ctx.ndim(x))
            if perm is not None:
                strategies.append(Strategy({x: p}, p.with_dim(perm.index(p.dim)), note=expert_note(x, ctx)))
    strategies.append(Strategy({x: R}, R))
    return strategies


register("transpose", "permute", "swapaxes", "swapdims", "t", "getattr", "movedim", blocks=True, whole=True)(_permute)


def _join(node, placements, ctx, new_dim: bool):
    """cat (new_dim False) and stack (True): inputs sharded alike on another dim stay sharded (segments and
    whole ones included: Mamba-2's convolution window joined before the new step's channels)."""
    tensors = node.args[0]
    if not isinstance(tensors, (tuple, list)) or not all(isinstance(t, fx.Node) for t in tensors):
        return []
    out = ctx.fake(node)
    join_dim = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), out.dim())
    # torch.cat skips 1-D empty tensors whatever the others' shapes (a cache's first cat onto torch.tensor([]))
    skipped = {t for t in tensors if not new_dim and out.dim() > 1 and ctx.ndim(t) == 1
               and isinstance(ctx.fake(t).shape[0], int) and ctx.fake(t).shape[0] == 0}
    strategies = []
    for t in tensors:
        p = placements[t]
        if t in skipped or not p.is_shard or (not new_dim and p.dim == join_dim):
            continue
        o = p.dim + 1 if new_dim and p.dim >= join_dim else p.dim
        if all(ctx.can_split(part) for i, part in enumerate(p.parts(out.shape[o])) if i not in p.whole):
            s = Strategy({u: R if u in skipped else p for u in tensors}, p.with_dim(o))
            if all(s.output != other.output for other in strategies):
                strategies.append(s)
    if not new_dim:
        strategies.extend(_cat_of_shards(tensors, skipped, placements, ctx, join_dim))
    strategies.append(Strategy({t: R for t in tensors}, R))
    return strategies


def _cat_of_shards(tensors, skipped, placements, ctx, dim) -> list:
    """Pieces each sharded along the joined dim (Qwen3-Next's ``cat([q, k, v], -1)`` of head-sharded parts):
    each rank's parts, joined, are its part of every piece, a segmented shard of the pieces' sizes."""
    joined = [t for t in tensors if t not in skipped]
    placed = [placements[t] for t in joined]
    if len(joined) < 2 or not all(p.is_shard and p.dim == dim and p.block is None for p in placed):
        return []
    segments, whole = [], []
    for t, p in zip(joined, placed):
        size = ctx.size(t, dim)
        if not isinstance(size, int):
            return []
        whole.extend(len(segments) + i for i in p.whole)
        segments.extend(p.segments or (size,))
    return [Strategy({t: R if t in skipped else placements[t] for t in tensors}, S(dim, tuple(segments),
                                                                                  whole=tuple(whole)),
                     note="shards joined along their dim: segments")]


def _cat(node, placements, ctx):
    return _join(node, placements, ctx, new_dim=False)


register("cat", whole=True)(_cat)


def _stack(node, placements, ctx):
    return _join(node, placements, ctx, new_dim=True)


register("stack")(_stack)


def _pad(node, placements, ctx):
    x = node.args[0]
    pad = arg(node, 1, "pad")
    p = placements[x]
    inputs = tensor_inputs(node)
    strategies = []
    pair = ctx.ndim(x) - 1 - p.dim if p.is_shard else None  # pad[2k:2k+2] pads the k-th dim from the end
    untouched = isinstance(pad, (tuple, list)) and (2 * pair >= len(pad) or tuple(pad[2 * pair:2 * pair + 2]) == (0, 0)) \
        if pair is not None else False
    if untouched and inputs == [x]:  # nothing padded along the sharded dim
        strategies.append(Strategy({x: p}, S(p.dim)))
    strategies.append(Strategy({i: R for i in inputs}, R))
    return strategies


register("pad")(_pad)


