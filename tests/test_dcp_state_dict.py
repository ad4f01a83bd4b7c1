"""torch.distributed.checkpoint fed `model.state_dict()`, as users write by habit: the shards are saved as
full-shape tensors (each rank its pieces, fused weights included) that load exactly into a model parallelized
at another tp size (uneven heads at TP=3) and into a transformers model on one process; under FSDP (dp 2 x tp 2) each
value is described by the rows of the full tensor its FSDP chunk holds. `optimizer.state_dict()` of a torch optimizer over the shards likewise. torch's
state-dict helpers (``get_state_dict`` / ``set_state_dict``), full and sharded."""
from __future__ import annotations

import io
import os
import sys

import pytest

from distributed import run_ranks


def _ids():
    import torch

    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))


def _save(rank, world, path, out):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fxparallel

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    dcp.save(model.state_dict(), checkpoint_id=out)
    return model(input_ids=_ids()).logits.detach().numpy()


def _load(rank, world, path, out):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fxparallel

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    before = model(input_ids=_ids()).logits.detach().numpy()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=out)
    model.load_state_dict(state)  # the habit's second line (DCP already loaded in place)
    return before, model(input_ids=_ids()).logits.detach().numpy()


def _one_process(original, out):
    import torch
    import torch.distributed.checkpoint as dcp

    from models import reference

    hf = reference(original)
    state = hf.state_dict()
    for value in state.values():
        value.zero_()
    dcp.load(state, checkpoint_id=out, no_dist=True)
    hf.load_state_dict(state)
    with torch.no_grad():
        return hf(input_ids=_ids()).logits


@pytest.mark.parametrize("family", ["llama", "gpt2", "bamba"])
def test_dcp_of_state_dict_reloads_at_any_layout(family, checkpoints, tmp_path):
    import torch
    from transformers import GPT2Config

    from models import reference, save_checkpoint, tiny_config

    if family in ("gpt2", "bamba"):
        # GPT-2's fused c_attn: each rank's q, k and v heads are three pieces of one weight. Bamba's Mamba-2 mixer
        # split by heads, of one group: in_proj's B and C rows whole on every rank (saved once), beside its pieces
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
        from tiny_configs import tiny_config as any_config

        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64) if family == "gpt2" \
            else any_config("bamba", hidden_size=128, mamba_d_state=16, mamba_d_head=32)
        original, other = (save_checkpoint(config, str(tmp_path / n), seed=s) for n, s in (("a", 0), ("b", 1)))
    else:
        original = checkpoints["llama"]
        other = save_checkpoint(tiny_config("llama"), str(tmp_path / "other"), seed=1)
    out = str(tmp_path / "dcp")
    with torch.no_grad():
        expected = reference(original)(input_ids=_ids()).logits
    saved = run_ranks(2, _save, original, out)
    assert abs(saved[0] - expected.numpy()).max() < 1e-5
    for tp in (1, 3) if family == "llama" else (1,):  # llama at TP=3: kv heads 2/1/1, query heads 4/2/2
        for before, after in run_ranks(tp, _load, other, out):
            assert abs(before - expected.numpy()).max() > 1e-2  # another model until loaded
            assert abs(after - expected.numpy()).max() < 1e-5, tp
    assert (_one_process(original, out) - expected).abs().max() < 1e-5


def _under_fsdp(rank, world, path, out):
    """dp=2 x tp=2 under FSDP (each value FSDP's chunk of a tp shard), after one SGD step with momentum beside the
    same step on one device: DCP given ``model.state_dict()`` and ``optimizer.state_dict()``, loaded back into another
    model under FSDP (its own states zeroed first) and, on rank 0, into a transformers model on one process; and
    torch's helpers with ``full_state_dict=True``."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_optimizer_state_dict)

    import fxparallel
    from fxparallel.runtime import apply_data_parallel, init_mesh
    from fxparallel.runtime.dtensor import local_part
    from models import reference

    mesh = init_mesh(tp=2, dp=2, cp=1)

    def parallel():
        return apply_data_parallel(fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32), mesh)

    def stepped(m, dp=1):  # (FSDP sums the dp ranks' gradients: each rank's loss of the same batch is halved)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
        (m(input_ids=_ids(), labels=_ids()).loss / dp).backward()
        optimizer.step()
        return optimizer

    model, single = parallel(), reference(path)
    optimizers = [stepped(model, 2), stepped(single)]
    result = {}
    for what, state in (("model", model.state_dict), ("optimizer", optimizers[0].state_dict)):
        dcp.save(state(), checkpoint_id=os.path.join(out, what))
    other = parallel()
    other_optimizer = stepped(other, 2)
    for state in other_optimizer.state.values():
        state["momentum_buffer"].to_local().zero_()
    with torch.no_grad():
        for p in other.parameters():
            p.to_local().zero_()
    for what, state in (("model", other.state_dict()), ("optimizer", other_optimizer.state_dict())):
        dcp.load(state, checkpoint_id=os.path.join(out, what))
        (other if what == "model" else other_optimizer).load_state_dict(state)  # the habit's second line
    result["dcp weights"] = max((local_part(b) - local_part(a)).abs().max().item()
                                for a, b in zip(model.parameters(), other.parameters()))
    result["dcp momentum"] = max(
        (local_part(other_optimizer.state[b]["momentum_buffer"]) -
         local_part(optimizers[0].state[a]["momentum_buffer"])).abs().max().item()
        for a, b in zip(model.parameters(), other.parameters()))
    dist.barrier()
    if rank == 0:  # the checkpoint's complete weights, read by one process: the single-device step's
        state = {k: torch.zeros_like(v) for k, v in single.state_dict().items()}
        dcp.load(state, checkpoint_id=os.path.join(out, "model"), no_dist=True)
        result["dcp one process"] = max((state[k] - v).abs().max().item() for k, v in single.state_dict().items())
    full = StateDictOptions(full_state_dict=True)
    ours, ref = get_model_state_dict(model, options=full), get_model_state_dict(single, options=full)
    result["weights"] = max((ours[k] - v).abs().max().item() for k, v in ref.items())
    ours, ref = (get_optimizer_state_dict(m, o, options=full)["state"] for m, o in zip((model, single), optimizers))
    result["momentum"] = max((ours[k]["momentum_buffer"] - v["momentum_buffer"]).abs().max().item()
                             for k, v in ref.items())
    # the complete momenta loaded into another model's optimizer (its own zeroed first): each rank's shard of them
    for state in other_optimizer.state.values():
        state["momentum_buffer"].to_local().zero_()
    full_state = get_optimizer_state_dict(model, optimizers[0], options=full)
    set_optimizer_state_dict(other, other_optimizer, optim_state_dict=copy.deepcopy(full_state), options=full)
    result["loaded momentum"] = max(
        (other_optimizer.state[b]["momentum_buffer"] - optimizers[0].state[a]["momentum_buffer"]).abs().max().item()
        for a, b in zip(model.parameters(), other.parameters()))
    return result


def test_dcp_of_state_dict_under_fsdp(checkpoints, tmp_path):
    """Under FSDP a state's value is FSDP's DTensor of its chunk of this rank's tp shard, which DCP would take for a
    chunk of the whole tensor (the optimizer's, before: rank 0 read its momenta back 0.04 off, silently): it is
    described as the rows of the full tensor it holds, so ``model.state_dict()`` and ``optimizer.state_dict()`` save
    and load back exactly at dp 2 x tp 2, and the saved weights are the single-device step's. torch's helpers asked
    for complete tensors give the single-device weights and momenta, and ``set_optimizer_state_dict(full_state_dict=
    True)`` loads the complete momenta back exactly."""
    results = run_ranks(4, _under_fsdp, checkpoints["llama"], str(tmp_path / "dcp"))
    assert results[0]["dcp one process"] < 1e-5, results[0]
    for result in results:
        assert result["dcp weights"] == 0.0 and result["dcp momentum"] == 0.0, result
        assert result["weights"] < 1e-5 and result["momentum"] < 1e-5 and result["loaded momentum"] == 0.0, result


def _optimizer_states(rank, world, path, out, save):
    """One AdamW step on the parallel model over this group; ``save``: dcp.save the optimizer's state_dict (and
    round-trip ``model.state_dict()`` and ``optimizer.state_dict()`` through ``torch.save`` / ``torch.load``),
    then load it back into zeroed state; else dcp.load it. Returns ({name: {state key: array}} after, the plan,
    whether this rank got its own state back from both)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fxparallel

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=_ids(), labels=_ids()).loss.backward()
    optimizer.step()
    names = [n for n, _ in model.local_named_parameters()]
    own = {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()}
    pickled = True
    if save:
        dcp.save({"optim": optimizer.state_dict()}, checkpoint_id=out)
        # the other habit, a file per rank: torch.save keeps this rank's shards as they are
        for state, live in ((model.state_dict(), dict(model.local_named_parameters())),
                            (optimizer.state_dict()["state"], own)):
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            back = torch.load(buffer, weights_only=True)
            pickled &= set(back) >= set(live) and all(
                torch.equal(back[k], v) if isinstance(v, torch.Tensor) else
                all(torch.equal(back[k][n], t) for n, t in v.items()) for k, v in live.items())
    state = {"optim": optimizer.state_dict()}
    for entry in state["optim"]["state"].values():
        for value in entry.values():
            value.zero_()  # in place: what comes back is what DCP read
    dcp.load(state, checkpoint_id=out)
    optimizer.load_state_dict(state["optim"])
    states = optimizer.state_dict()["state"]
    same = all(torch.equal(v, own[i][k]) for i, s in states.items() for k, v in s.items())
    return ({names[i]: {k: v.numpy().copy() for k, v in s.items() if v.dim() > 0} for i, s in states.items()},
            model.plan.to_dict(), same and pickled)


def test_dcp_of_optimizer_state_dict_reloads_exactly_at_any_layout(checkpoints, tmp_path):
    """``dcp.save({"optim": optimizer.state_dict()})`` of a torch optimizer over the shards (every rank's state
    under one key, one rank's kept, before dcp_optimizer.py: rank 1 reloaded rank 0's moments, 0.03 off) saves
    full-shape state: at TP=2 every rank reads its own back bit for bit, and on one process the full moments
    are those whose slices the ranks held."""
    import torch

    import fxparallel

    out = str(tmp_path / "optim")
    saved = run_ranks(2, _optimizer_states, checkpoints["llama"], out, True)
    assert [same for _, _, same in saved] == [True, True]  # each rank its own state back, torch.save'd too
    full = run_ranks(1, _optimizer_states, checkpoints["llama"], out, False)[0][0]
    plan = fxparallel.ShardingPlan.from_dict(saved[0][1])
    sharded = 0
    for rank, (states, _, _) in enumerate(saved):
        for name, entry in states.items():
            assert set(entry) == {"exp_avg", "exp_avg_sq"}, (name, entry.keys())
            for key, value in entry.items():
                expected = plan.param(name).shard_of(torch.from_numpy(full[name][key]), rank, 2)
                assert torch.equal(torch.from_numpy(value), expected), (rank, name, key)
                sharded += plan.param(name).placement.is_shard
    assert sharded > 20  # the sharded weights' moments, not only replicated ones


def _state_dict_helpers(rank, world, path, out):
    """torch's state-dict helpers (``torch.distributed.checkpoint.state_dict``) on the parallel model and a torch
    optimizer over its shards, after one SGD step with momentum beside the same step on one device."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, get_state_dict, set_state_dict)

    import fxparallel
    from models import reference

    def trained():
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
        return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    def step(model, optimizer):
        model(input_ids=_ids(), labels=_ids()).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def apart(a, b):  # the largest difference between two parallel models' shards
        return max((p.detach() - q.detach()).abs().max().item()
                   for (_, p), (_, q) in zip(a.local_named_parameters(), b.local_named_parameters()))

    model, optimizer = trained()
    single = reference(path)
    single_optimizer = torch.optim.SGD(single.parameters(), lr=0.5, momentum=0.9)
    step(model, optimizer)
    step(single, single_optimizer)
    full = StateDictOptions(full_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=full)
    ref_model, ref_optim = get_model_state_dict(single, options=full), get_optimizer_state_dict(single, single_optimizer,
                                                                                               options=full)
    result = {"keys": (sorted(model_state) == sorted(ref_model), sorted(optim_state["state"]) == sorted(ref_optim["state"])),
              "weights": max((model_state[k] - v).abs().max().item() for k, v in ref_model.items()),
              "momentum": max((optim_state["state"][k]["momentum_buffer"] - v["momentum_buffer"]).abs().max().item()
                              for k, v in ref_optim["state"].items())}
    offloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    result["offloaded"] = sorted({tuple(v.shape) == tuple(ref_model[k].shape) for k, v in offloaded.items()})
    # loaded back: the complete tensors (a copy, as from a file); the sharded form through DCP
    fresh, fresh_optimizer = trained()
    set_state_dict(fresh, fresh_optimizer, model_state_dict=copy.deepcopy(model_state),
                   optim_state_dict=copy.deepcopy(optim_state), options=full)
    copies = {"full": (fresh, fresh_optimizer)}
    sharded = get_state_dict(model, optimizer)
    dcp.save({"model": sharded[0], "optim": sharded[1]}, checkpoint_id=out)
    fresh, fresh_optimizer = trained()
    state = dict(zip(("model", "optim"), get_state_dict(fresh, fresh_optimizer)))
    dcp.load(state, checkpoint_id=out)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    copies["sharded, through DCP"] = (fresh, fresh_optimizer)
    step(model, optimizer)
    for how, (fresh, fresh_optimizer) in copies.items():
        step(fresh, fresh_optimizer)  # the momentum matters: the step equals the original's only with it
        result[how] = apart(model, fresh)
    return result


def test_torch_state_dict_helpers_give_complete_tensors_and_load_them(checkpoints, tmp_path):
    """``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=True`` gather DTensors only:
    over the shards they gave each rank's pieces under the full names (q_proj [32, 64] of [64, 64]). Now the
    complete weights and momenta of the single-device run (rank 0 alone with ``cpu_offload``), which
    ``set_state_dict(full_state_dict=True)`` loads back as the sharded form saved through DCP does: the next step
    equal to the original's."""
    results = run_ranks(2, _state_dict_helpers, checkpoints["llama"], str(tmp_path / "helpers"))
    for r in results:
        assert r["keys"] == (True, True) and r["weights"] < 1e-5 and r["momentum"] < 1e-5, r
        assert r["full"] == 0.0 and r["sharded, through DCP"] == 0.0, r
    assert [r["offloaded"] for r in results] == [[True], []]  # every tensor complete, on rank 0 alone
