"""One capture serves many shapes; other argument sets and shapes outside the guards get their own
graph over the same parameters; attention masks and position ids match the single-device model."""
from __future__ import annotations

from distributed import run_ranks


def _shapes(rank, tp, path):
    import torch
    import torch.distributed as dist

    import fxparallel
    from checks import batch
    from models import reference

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ref = reference(path)
    ids0 = {n: id(p) for n, p in model.named_parameters()}
    data0 = {n: p.data_ptr() for n, p in model.named_parameters()}
    errs = {}
    with torch.no_grad():
        for b, s in [(2, 9), (3, 5), (4, 17)]:
            ids = batch(128, b, s, seed=b * s)
            errs[(b, s)] = (model(input_ids=ids, labels=ids).loss - ref(input_ids=ids, labels=ids).loss).abs().item()
        graphs_after_shapes = len(model.graphs())
        # batch 1 and sequence 1 are outside the dynamic guards (>= 2): a new graph, same parameters
        for b, s in [(1, 7), (2, 1)]:
            ids = batch(128, b, s, seed=7)
            errs[(b, s)] = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
        # attention mask with left padding, explicit position ids
        ids = batch(128, 3, 10, seed=3)
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
        mask[2, :2] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=ids)
        r = ref(input_ids=ids, attention_mask=mask, position_ids=pos, labels=ids)
        errs["mask"] = (out.loss - r.loss).abs().item()
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        keep = mask.bool()
        errs["mask_logits"] = (full - ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits)[keep].abs().max().item()
        gathered = model(input_ids=ids, labels=ids, gather_logits=True).logits
        errs["gather_logits"] = (gathered - ref(input_ids=ids).logits).abs().max().item()
    same = ids0 == {n: id(p) for n, p in model.named_parameters()} and data0 == {
        n: p.data_ptr() for n, p in model.named_parameters()}
    return errs, graphs_after_shapes, len(model.graphs()), same


def test_shapes_masks_and_argument_sets(checkpoints):
    for errs, graphs_after_shapes, graphs_total, same in run_ranks(2, _shapes, checkpoints["llama"]):
        assert graphs_after_shapes == 1, "three (batch, seq) shapes must share one graph"
        # + (1, s) and (b, 1) without labels (own guards) + mask/position_ids with and without labels
        assert graphs_total == 5
        assert same, "no parameter may be re-created or re-materialized"
        for key, err in errs.items():
            assert err < 1e-5, (key, err)
