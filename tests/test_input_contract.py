"""The call contract of the parallel module (docs/reference.md, "Inputs"): size-1 batches and sequences get
their own graphs and never reuse another's; ids and labels outside the vocabulary, mismatched
shapes and empty batches are errors before any graph runs; ranks of one tp group given
different arguments all raise, naming what differs."""
from __future__ import annotations

from checks import raised
from distributed import run_ranks


def _raises(fn) -> str:
    """The InputError ``fn()`` raised ("InputError: message"), or "no error"; any other error propagates."""
    from fxparallel.errors import InputError

    return raised(fn, InputError)


def _contract(rank, tp, path):
    import torch
    import torch.distributed as dist

    import fxparallel
    from checks import batch
    from models import reference

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ref = reference(path)
    errs = {}
    with torch.no_grad():
        # size-1 dims first: a graph captured at batch 1 or sequence 1 must not serve other shapes
        for b, s in [(1, 7), (3, 7), (1, 1), (1, 5), (4, 9)]:
            ids = batch(128, b, s, seed=b + s)
            errs[(b, s)] = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
        ids = batch(128, 2, 6, seed=2)
        bad = ids.clone()
        messages = {
            "id too large": _raises(lambda: model(input_ids=torch.where(bad == bad[0, 0], 128, bad))),
            "id negative": _raises(lambda: model(input_ids=torch.where(bad == bad[0, 0], -1, bad))),
            "label too large": _raises(lambda: model(input_ids=ids, labels=torch.full_like(ids, 10 ** 6))),
            "label negative": _raises(lambda: model(input_ids=ids, labels=torch.full_like(ids, -5))),
            "labels shape": _raises(lambda: model(input_ids=ids, labels=ids[:, :4])),
            "empty": _raises(lambda: model(input_ids=torch.zeros(0, 8, dtype=torch.long))),
        }
        # rank 1 gets other tokens / another batch size / no labels
        other = ids.clone()
        other[1, 3] = (other[1, 3] + 1) % 128
        messages["tokens differ"] = _raises(lambda: model(input_ids=other if rank == 1 else ids, labels=ids))
        messages["batch differs"] = _raises(lambda: model(input_ids=ids[:1] if rank == 1 else ids))
        # float masks whose int64 checksums agree, but only rank 1's holds padding (zeros)
        half = torch.ones(2, 6)
        half[0, :2] = 0.5 if rank == 0 else 0.0
        messages["padding differs"] = _raises(lambda: model(input_ids=ids, attention_mask=half))
        messages["labels given on one rank"] = _raises(
            lambda: model(input_ids=ids, labels=None if rank == 1 else ids))
        # a local fault on one rank only: that rank says what, the other that it happened there
        messages["labels shape on rank 1"] = _raises(lambda: model(input_ids=ids, labels=ids[:, :4] if rank else ids))
        # ignore_index labels are fine, and the model still works after the errors
        labels = ids.clone()
        labels[:, :2] = -100
        # a dtype change works (tests/test_hf_methods.py); a device change does not
        messages["to meta"] = raised(lambda: model.to("meta"))
        model.to("cpu")  # no change: allowed
        errs["after errors"] = (model(input_ids=ids, labels=labels).loss - ref(input_ids=ids, labels=labels).loss
                                ).abs().item()
    return errs, messages


def test_input_contract(checkpoints):
    for rank, (errs, messages) in enumerate(run_ranks(2, _contract, checkpoints["llama"])):
        for key, err in errs.items():
            assert err < 1e-5, (key, err)
        assert "token id 128, outside the embedding table of 128 rows" in messages["id too large"]
        assert "token id -1, outside the embedding table" in messages["id negative"]
        assert "labels holds 12 value(s) outside [0, 128)" in messages["label too large"]
        assert "labels holds 12 value(s) outside [0, 128)" in messages["label negative"]
        assert "labels has shape (2, 4) but input_ids has (2, 6)" in messages["labels shape"]
        assert "input_ids (0, 8) is empty" in messages["empty"]
        assert "different arguments (the values of input_ids: rank 0 vs rank 1" in messages["tokens differ"]
        assert "different arguments (input_ids shape (2, 6) vs (1, 6)" in messages["batch differs"]
        assert "different arguments (whether attention_mask holds padding (zeros): rank 0 vs rank 1" in \
            messages["padding differs"]
        assert "arguments given ['input_ids', 'labels'] vs ['input_ids']" in messages["labels given on one rank"]
        expected = ("labels has shape (2, 4)" if rank else "the arguments of tp rank 1 are invalid (see the error on "
                                                           "that rank)")
        assert expected in messages["labels shape on rank 1"]
        assert messages["to meta"].startswith("ShardingError: this parallel model was captured and loaded in "
                                              "float32 on cpu; moving it to float32 on meta")
