"""Depthwise convolution (``groups`` = channels: Mamba's causal conv1d over the sequence): each
channel is convolved on its own, so channels split like any elementwise dimension, with the weight
and bias split alike and ``groups`` set to this rank's channels (``local_groups``). Other
convolutions mix channels and run replicated."""
from __future__ import annotations

import torch.fx as fx

from ..placement import R, S
from .base import LocalOp, Strategy, arg, register


def _conv(node, placements, ctx):
    x, w, b = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
    groups = arg(node, 6, "groups", 1)
    if not isinstance(w, fx.Node) or ctx.fake(w) is None or ctx.fake(x) is None:
        return []
    channels = ctx.fake(w).shape[0]
    bias = {b: S(0)} if isinstance(b, fx.Node) else {}
    strategies = []
    depthwise = isinstance(groups, int) and groups == channels == ctx.fake(x).shape[1] and ctx.fake(w).shape[1] == 1
    if depthwise and ctx.can_split(channels):
        strategies.append(Strategy({x: S(1), w: S(0), **bias}, S(1), note="depthwise convolution, split by channels",
                                   local=LocalOp.of("local_groups", channels=int(channels)), name="channels"))
    strategies.append(Strategy({x: R, w: R, **{k: R for k in bias}}, R))
    return strategies


register("conv1d", "conv2d", "conv3d")(_conv)
