"""How a sharded dimension is divided among the tp ranks: evenly, or unevenly in whole units.

An even split gives every rank ``size // tp``. When tp does not divide a size the model
fixes (attention heads, MLP width, vocabulary), the dimension is split in whole units:

* attention: a unit is one key/value head with its query heads (``n_heads / n_kv``
  query heads, ``head_dim`` rows each), so every kv head stays with its query heads:
  9 query / 3 kv heads at tp=2 give kv heads 2/1 and query heads 6/3; with more
  ranks than kv heads, the kv heads are replicated and a unit is one query head. The
  first ranks take one unit more;
* MLP width, vocabulary and any other embedding table's rows (learned positions, so that
  table can be vocab-parallel rather than split on the hidden dim): a unit is one column
  (one row), in torch.chunk's sizes: ``ceil(size / tp)`` each, the last rank the rest
  (100 at tp=3: 34/34/32; OPT's 2050 positions at tp=4: 513/513/513/511). That is what
  DTensor's Shard means, so distributed checkpoints keep these shards; the largest shard
  is the same as with one more on the first ranks. Where it would leave a rank empty
  (9 at tp=8), the first ranks take one more instead.

The layout is a table ``full size -> per-rank sizes`` holding only the uneven sizes;
every dimension of that size is split that way, so values that meet in an op (q and
the o_proj input, logits and the lm_head rows) agree by construction, and the rules
check that a reshape keeps each rank's block whole. A size not in the table splits
evenly when tp divides it, and cannot be split otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..capture.adapters import hf_name
from ..capture.expert_counts import experts_modules


def balanced(units: int, parts: int) -> tuple:
    """``units`` whole units over ``parts`` ranks, the first ``units % parts`` taking one more."""
    base, extra = divmod(units, parts)
    return tuple(base + (1 if r < extra else 0) for r in range(parts))


def chunked(units: int, parts: int) -> Optional[tuple]:
    """torch.chunk's sizes (``ceil(units / parts)`` each, the last rank the rest), or None where that
    leaves a rank empty."""
    size = -(-units // parts)
    sizes = tuple(max(0, min(size, units - r * size)) for r in range(parts))
    return sizes if all(sizes) else None


def by_rows(units: int, parts: int) -> tuple:
    """A split in units of one row or column: torch.chunk's sizes where no rank is left empty."""
    return chunked(units, parts) or balanced(units, parts)


@dataclass
class ShardLayout:
    tp: int
    uneven: dict = field(default_factory=dict)  # full size -> per-rank sizes (only sizes tp does not split evenly)
    # from the config: a fused projection's part of fewer heads than ranks is kept whole (planning only)
    head_dim: Optional[int] = field(default=None, compare=False)
    # widths of a part every head reads, kept whole where its groups do not split over the ranks (Mamba-2's B and
    # C: n_groups x state_size, one group in Bamba, Granite-4, Falcon-H1, Zamba-2) (planning only)
    shared_widths: tuple = field(default=(), compare=False)

    def sizes(self, full) -> Optional[tuple]:
        """Per-rank sizes of a dimension of ``full`` elements, or None if it cannot be split."""
        if not isinstance(full, int):
            return None
        if full in self.uneven:
            return self.uneven[full]
        if full % self.tp == 0:
            return (full // self.tp,) * self.tp
        return None

    def can_split(self, full) -> bool:
        return self.sizes(full) is not None

    def is_even(self, full) -> bool:
        return full not in self.uneven

    def local(self, full: int, rank: int) -> int:
        sizes = self.sizes(full)
        if sizes is None:
            raise ValueError(f"size {full} cannot be split over tp size {self.tp} (not divisible, no uneven split)")
        return sizes[rank]

    def start(self, full: int, rank: int) -> int:
        self.local(full, rank)
        return sum(self.sizes(full)[:rank])

    # ---- from a config ------------------------------------------------------
    @classmethod
    def for_config(cls, config, tp: int) -> "ShardLayout":
        """The uneven splits of ``config``'s heads, MLP width and vocabulary over ``tp`` ranks
        (what validate.py allows; sizes it refuses are left out)."""
        layout = cls(tp)
        if tp <= 1:
            return layout
        config = text_config(config)
        heads = config_int(config, "num_attention_heads")
        kv = config_int(config, "num_key_value_heads") or heads
        head_dim = layout.head_dim = head_dim_of(config)
        if heads and kv and head_dim and heads % kv == 0:
            group = heads // kv
            q = None
            if tp <= kv and kv % tp:  # whole kv heads with their query heads
                kv_heads = balanced(kv, tp)
                layout._add(kv * head_dim, tuple(k * head_dim for k in kv_heads))
                layout._add(kv, kv_heads)
                q = tuple(k * group for k in kv_heads)
            elif tp > kv and tp % kv == 0 and heads % tp and group >= tp // kv:
                # kv heads replicated: each kv head's query heads over its tp // kv ranks
                q = balanced(group, tp // kv) * kv
            elif tp > kv and tp % kv:
                # kv heads replicated, and a rank's query heads may belong to two kv heads: the
                # kv heads are expanded to one per query head before they are sliced, so any
                # run of whole query heads works. k/v rows split by column (then gathered whole)
                # rather than leaving k_proj / v_proj replicated
                q = balanced(heads, tp) if heads % tp else None
                if (kv * head_dim) % tp:
                    layout._add(kv * head_dim, by_rows(kv * head_dim, tp))
            if q is not None:
                layout._add(heads * head_dim, tuple(h * head_dim for h in q))
                layout._add(heads, q)
        for size in [*mlp_widths(config).values(), config_int(config, "vocab_size")]:
            layout._add_rows(size)
        layout.shared_widths = state_group_widths(config, tp)
        return layout

    def add_embedding_rows(self, model) -> "ShardLayout":
        """Uneven row splits for ``model``'s embedding tables whose row count tp does not divide.
        Without them such a table (OPT's 2048 + 2 learned positions) could only be replicated or
        split on its hidden dim, which shards the residual stream it is added to."""
        import torch.nn as nn

        if self.tp > 1:
            for module in model.modules():
                if isinstance(module, nn.Embedding):
                    self._add_rows(module.num_embeddings)
        return self

    def add_experts(self, counts, adapter_rows=()) -> "ShardLayout":
        """Whole experts per rank (expert parallelism): ``E`` experts over tp ranks, the first ``E % tp``
        ranks one more; ``adapter_rows``: (E, r) of LoRA adapters on them, whose A has r rows per expert."""
        for experts in sorted(counts):
            if experts % self.tp:
                self._add(experts, balanced(experts, self.tp))
        for experts, r in sorted(adapter_rows):
            if experts % self.tp:
                self._add(experts * r, tuple(k * r for k in balanced(experts, self.tp)))
        return self

    def _add_rows(self, size) -> None:
        """A split of ``size`` single rows (columns) where tp does not divide it and every rank gets one."""
        if isinstance(size, int) and size % self.tp and size >= self.tp:
            self._add(size, by_rows(size, self.tp))

    def _add(self, full: int, sizes: tuple) -> None:
        # the first claim of a size wins: attention's head units also serve an MLP of the same width
        if len(set(sizes)) > 1 and full not in self.uneven:
            self.uneven[full] = tuple(sizes)

    # ---- persistence --------------------------------------------------------
    def to_dict(self) -> dict:
        return {str(k): list(v) for k, v in sorted(self.uneven.items())}

    @classmethod
    def from_dict(cls, tp: int, d: dict) -> "ShardLayout":
        return cls(tp, {int(k): tuple(v) for k, v in (d or {}).items()})


def uneven_split(placement, size: int, layout: Optional[ShardLayout]) -> Optional[tuple]:
    """Per segment (or block; the dim for a plain shard), each rank's size along ``placement``'s sharded
    dim of ``size`` elements if the split is uneven (a whole segment: its size on every rank); None if even."""
    if layout is None or not placement.is_shard:
        return None
    parts = placement.parts(size)
    if all(layout.is_even(s) for i, s in enumerate(parts) if i not in placement.whole):
        return None
    return tuple((s,) * layout.tp if i in placement.whole else layout.sizes(s) for i, s in enumerate(parts))


def text_config(config):
    """The decoder's config (a multimodal config keeps it in ``text_config``)."""
    get = getattr(config, "get_text_config", None)
    try:
        return get() if callable(get) else config
    except Exception:  # noqa: BLE001 - a config that cannot say: use it as it is
        return config


_STATE_GROUPS = (("n_groups", "state_size"), ("n_groups", "ssm_state_size"), ("mamba_n_groups", "mamba_d_state"),
                 ("mamba_ngroups", "mamba_d_state"))


def state_group_widths(config, tp: int) -> tuple:
    """Mamba-2's B and C widths (groups x state size) where the groups do not split over ``tp`` ranks."""
    widths = set()
    for groups, state in _STATE_GROUPS:
        g, n = config_int(config, groups), config_int(config, state)
        if g and n and g % tp:
            widths.add(g * n)
    return tuple(sorted(widths))


def config_int(config, name) -> Optional[int]:
    """An integer field, or None: absent, not an integer, or one that varies by layer (reading Gemma 4's
    ``head_dim`` raises, its global layers have their own)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # noqa: BLE001
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# config fields that hold an MLP's width: ``intermediate_size`` and its MoE / shared-expert variants,
# OPT / XGLM / BART-style ``ffn_dim``, Falcon's ``ffn_hidden_size``, GPT-2's ``n_inner``, Llama 4's
# ``intermediate_size_mlp``
_MLP_WIDTH_SUFFIXES = ("intermediate_size", "ffn_dim", "ffn_hidden_size")
_MLP_WIDTH_NAMES = ("n_inner", "intermediate_size_mlp")


def expert_parameters(model) -> dict:
    """{name: experts} of the parameters stacked by expert in ``model``'s mixture-of-experts layers: those of
    transformers' experts modules (``use_experts_implementation`` marks them) whose dim 0 is the experts (the 3-D
    weights' first size), weights and biases; Hugging Face names (a LoRA adapter's wrappers left out)."""
    found = {}
    for prefix, module, experts in experts_modules(model):
        found.update({hf_name(f"{prefix}.{name}"): experts for name, p in module.named_parameters(recurse=False)
                      if p.dim() >= 2 and int(p.shape[0]) == experts})
    return found


def mlp_widths(config) -> dict:
    """``{field: width}`` for every MLP width ``config`` sets (dense, expert and shared-expert)."""
    fields = getattr(config, "__dict__", {})
    names = ["intermediate_size"] + [n for n in fields if n.endswith(_MLP_WIDTH_SUFFIXES) or n in _MLP_WIDTH_NAMES]
    widths = {n: config_int(config, n) for n in names}  # getattr: ``intermediate_size`` may be an alias
    return {n: w for n, w in widths.items() if w}


def head_dim_of(config) -> Optional[int]:
    hd = config_int(config, "head_dim")
    if hd:
        return hd
    hidden, heads = config_int(config, "hidden_size"), config_int(config, "num_attention_heads")
    if hidden and heads and hidden % heads == 0:
        return hidden // heads
    return None
