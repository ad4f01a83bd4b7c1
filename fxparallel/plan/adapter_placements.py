"""Where a LoRA adapter's matrices go: after its base layer's placement, so that the adapter adds no
collective of the activations' size. A column-parallel base (output features split): A whole, B split by the
same output features (and segments) as the base, so each rank adds its columns of ``B @ A x`` to its columns of
the base output; what the adapter adds is the backward all-reduce of A's output, r floats per token. A
row-parallel base (input features split): A split by the same input features, its partial ``A x`` (r floats per
token) all-reduced, B whole. A replicated base: both whole. Stacked experts under expert parallelism (whole
experts per rank, ``target_parameters``): each rank holds its experts' part of both, A's rows (PEFT keeps them
expert-major, [experts x r, in]) and B's columns (expert-minor, [out, r x experts]: a segment of every expert per
rank of r), so the change to a rank's experts is computed from its own matrices: no collective at all. Fixed
before the solve, these also spare the search two decisions per adapted layer."""
from __future__ import annotations

from torch import nn

from ..capture.adapters import adapted_weight
from .placement import R, S


_OF_EXPERTS = "LoRA of experts split whole over the ranks: A's rows and B's columns of this rank's experts"


def adapter_placements(meta_model, fixed: dict, experts: dict) -> dict:
    """{adapter parameter name: (Placement, why)} for each LoRA layer of ``meta_model`` whose base weight has a
    placement in ``fixed`` (parameter name -> Placement) or is in ``experts`` ({name: expert count} of the
    weights split by whole experts)."""
    placements = {}
    for path, layer in meta_model.named_modules():
        lora_a = getattr(layer, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict):
            continue
        base_name, out_dim, in_dim = adapted_weight(path, layer)
        base, count = fixed.get(base_name), experts.get(base_name)
        if base is None and count is None:
            continue
        for adapter in lora_a:
            a, b = f"{path}.lora_A.{adapter}.weight", f"{path}.lora_B.{adapter}.weight"
            if count is not None:
                why = _OF_EXPERTS
                placements[a], placements[b] = (S(0), why), (S(1, (count,) * layer.r[adapter]), why)
            elif base.is_shard and base.dim == out_dim:
                why = "LoRA of a column-parallel layer: A whole, B split by its output features"
                placements[a], placements[b] = (R, why), (base.with_dim(0), why)  # B: [out, r]
            elif base.is_shard and base.dim == in_dim:
                why = "LoRA of a row-parallel layer: A split by its input features, B whole"
                placements[a], placements[b] = (base.with_dim(1), why), (R, why)  # A: [r, in]
            else:
                why = "LoRA of a replicated layer: whole"
                placements[a] = placements[b] = (R, why)
    return placements


def expert_adapter_rows(placements: dict) -> set:
    """{(experts, r)} of the expert adapters in ``placements``: A's rows are r per expert, split as the experts are
    (``ShardLayout.add_experts``)."""
    return {(p.segments[0], len(p.segments)) for p, why in placements.values() if why == _OF_EXPERTS and p.segments}
