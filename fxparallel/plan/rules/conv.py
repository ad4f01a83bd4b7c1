"""Depthwise convolution (``groups`` = channels: Mamba's causal conv1d over the sequence): each
channel is convolved on its own, so channels split like any elementwise dimension, with the weight
and bias split alike (segment by segment where the channels are several parts of a fused projection)
and ``groups`` set to this rank's channels (``local_groups``). Other
convolutions mix channels and run replicated."""
from __future__ import annotations

import torch.fx as fx

from ..op_traits import op_name
from ..placement import R, S
from .base import LocalOp, Strategy, arg, register

_CONVS = ("conv1d", "conv2d", "conv3d")


def _conv(node, placements, ctx):
    x, w, b = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
    groups = arg(node, 6, "groups", 1)
    if not isinstance(w, fx.Node) or ctx.fake(w) is None or ctx.fake(x) is None:
        return []
    channels = ctx.fake(w).shape[0]
    bias = {b: S(0)} if isinstance(b, fx.Node) else {}
    strategies = []
    depthwise = isinstance(groups, int) and _depthwise(ctx.fake(w), groups) and groups == ctx.fake(x).shape[1]
    if depthwise and ctx.can_split(channels):
        strategies.append(Strategy({x: S(1), w: S(0), **bias}, S(1), note="depthwise convolution, split by channels",
                                   local=LocalOp.of("local_groups", channels=int(channels)), name="channels"))
    px = placements[x]
    if depthwise and px.is_shard and px.dim == 1 and px.segments \
            and all(ctx.can_split(part) for i, part in enumerate(px.segments) if i not in px.whole):
        # channels that are several segments of a fused projection (Mamba-2's x, B and C; B and C whole where
        # their groups do not split: every rank convolves them, and their weight rows' gradients are summed)
        split = S(0, px.segments, whole=px.whole)
        local = LocalOp.of("local_groups", channels=int(channels), segments=px.segments,
                           **({"whole": px.whole} if px.whole else {}))
        strategies.append(Strategy({x: px, w: split, **{k: split for k in bias}}, px, local=local, name="channels",
                                   note="depthwise convolution, split by channels segment by segment"))
    strategies.append(Strategy({x: R, w: R, **{k: R for k in bias}}, R))
    return strategies


register(*_CONVS, whole=True)(_conv)


def _depthwise(weight, groups) -> bool:
    """A convolution weight of one input channel per group, a group per output channel."""
    return weight is not None and weight.dim() >= 3 and weight.shape[1] == 1 and groups == weight.shape[0]


def depthwise_conv_reading(weight: fx.Node, views: int = 3):
    """The depthwise convolution that reads ``weight`` as its weight, directly or through up to ``views``
    squeezes / unsqueezes (transformers' ``causal_conv1d_fn`` takes the weight squeezed), or None."""
    value = weight
    for _ in range(views + 1):
        for user in value.users:
            if op_name(user) in _CONVS and arg(user, 1, "weight") is value:
                return user if _depthwise(value.meta.get("example_value"), arg(user, 6, "groups", 1)) else None
        nxt = [u for u in value.users if op_name(u) in ("squeeze", "unsqueeze")]
        if len(nxt) != 1:
            return None
        value = nxt[0]
    return None
