"""An argument only one tp rank was given never leaves another rank waiting: every refusal of generate and
forward is raised after the exchange in which the ranks compare their arguments, on every rank (the rank
given the argument names it, the others name that rank), within seconds instead of the process group's
timeout. Also: ``return_dict=False`` gives transformers' tuple (never a vocabulary shard where the logits
are), ``num_return_sequences`` draws that many rows per prompt, and no call of ours makes transformers log
its ``past_key_values`` deprecation warning."""
from __future__ import annotations

import os
import time

from checks import raised
from distributed import run_ranks

GROUP_TIMEOUT = 30.0  # a rank left waiting in a collective fails after this (the test asserts far less)


def _raised(fn) -> tuple:
    """(the error's type and message, or "no error"; seconds taken)."""
    start = time.monotonic()
    message = raised(fn)
    return message, time.monotonic() - start


def _one_rank(rank, world, path, save_dir):
    import logging

    import torch
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    import fxparallel
    from models import reference

    # every rank plans alone: a cast on one rank (below) then plans there alone, and the next call names it (under
    # FXPARALLEL_PLANNING=first the cast itself waits for its peers: test_first_rank_planning.py)
    os.environ["FXPARALLEL_PLANNING"] = "each"
    # transformers' warnings (its logger; warning_once: the first use in this process is the one that logs)
    hf_logging.set_verbosity_warning()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("transformers").addHandler(Keep())

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ref = reference(path)
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    out = {}

    # ---- refusals on one rank only: (name, the call with the argument on the bad rank or not) ----------------
    generate = dict(input_ids=ids, max_new_tokens=2, pad_token_id=0)
    cases = {
        "num_beams": lambda bad: model.generate(**generate, **({"num_beams": 2} if bad else {})),
        "unknown generate argument": lambda bad: model.generate(**generate, **({"frobnicate": 1} if bad else {})),
        "generate shape": lambda bad: model.generate(**{**generate, "input_ids": ids[0] if bad else ids}),
        "generate mask shape": lambda bad: model.generate(**generate, attention_mask=torch.ones(2, 5 if bad else 7)),
        "do_sample with beams": lambda bad: model.generate(**generate, do_sample=True, top_k=5,
                                                           **({"num_beams": 2} if bad else {})),
        "output_attentions": lambda bad: model(input_ids=ids, output_attentions=True if bad else None),
        "logits_to_keep tensor": lambda bad: model(input_ids=ids, logits_to_keep=torch.tensor([6]) if bad else 0),
        "logits_to_keep with labels": lambda bad: model(input_ids=ids, labels=ids, logits_to_keep=1 if bad else 0),
        "past_key_values not a cache": lambda bad: model(input_ids=ids, past_key_values=(1, 2) if bad else None),
        "input_ids missing": lambda bad: model(input_ids=None if bad else ids),
        "save_pretrained state_dict": lambda bad: model.save_pretrained(save_dir, state_dict={} if bad else None),
        # not refusals, but options that change the collectives (one rank would gather the logits alone)
        "gather_logits": lambda bad: model(input_ids=ids, labels=ids, gather_logits=True if bad else None),
        "use_cache": lambda bad: model(input_ids=ids, use_cache=True if bad else None),
    }
    for name, call in cases.items():
        for bad_rank in (1, 0):
            out[(name, bad_rank)] = _raised(lambda: call(rank == bad_rank))
    # a model cast on one rank only (its collectives would carry other bytes): every rank names the dtypes
    if rank == 1:
        model.double()
    dist.barrier()  # (the time measured is the call's, not the cast's)
    out["dtype on rank 1"] = _raised(lambda: model(input_ids=ids))
    if rank == 1:
        model.float()
    # the ranks are still in step: a call given alike on both works and is right
    with torch.no_grad():
        after = model(input_ids=ids).logits
        out["after the refusals"] = (after - ref(input_ids=ids).logits).abs().max().item()

        # ---- return_dict=False: transformers' tuple, position by position --------------------------------------
        theirs = ref(input_ids=ids, labels=ids, use_cache=False, return_dict=False)
        ours = model(input_ids=ids, labels=ids, gather_logits=True, return_dict=False)
        out["tuple with labels"] = (len(ours), len(theirs), abs(ours[0].item() - theirs[0].item()),
                                    tuple(ours[1].shape) == tuple(theirs[1].shape)
                                    and (ours[1] - theirs[1]).abs().max().item())
        theirs = ref(input_ids=ids, use_cache=False, return_dict=False)
        ours = model(input_ids=ids, return_dict=False)
        out["tuple without labels"] = (len(ours), len(theirs), (ours[0] - theirs[0]).abs().max().item())
        theirs = ref(input_ids=ids, use_cache=True, return_dict=False)
        ours = model(input_ids=ids, use_cache=True, return_dict=False)
        out["tuple with a cache"] = (len(ours), len(theirs), (ours[0] - theirs[0]).abs().max().item(),
                                     type(ours[1]).__name__)
        out["tuple of a shard"] = _raised(lambda: model(input_ids=ids, labels=ids, return_dict=False))[0]
        out["tuple of a shard, gather_logits=False"] = _raised(
            lambda: model(input_ids=ids, gather_logits=False, return_dict=False))[0]
        model.generate(**generate, return_dict_in_generate=True)
        # num_return_sequences with sampling: that many rows per prompt, as transformers (before: one, silently)
        drawn = model.generate(**generate, do_sample=True, top_k=20, num_return_sequences=3)
        out["num_return_sequences"] = (tuple(drawn.shape), torch.equal(drawn[:, :7], ids.repeat_interleave(3, 0)),
                                       drawn.tolist())
    out["transformers warnings"] = records

    # ---- a collective method called on some ranks only: named, not left in a gather (load/coordinate.py) ----
    alone = save_dir + "-alone"
    # at once: rank 0 saves while rank 1 generates
    out["different methods"] = _raised(
        lambda: model.save_pretrained(alone) if rank == 0 else model.generate(**generate))
    out["nothing written alone"] = not os.path.exists(alone)
    # generate on rank 0 alone; rank 1 calls it after rank 0 stopped waiting
    os.environ["FXPARALLEL_AGREE_TIMEOUT"] = "2"
    if rank == 1:
        time.sleep(3)
    out["generate on rank 0 alone"] = _raised(lambda: model.generate(**generate))
    del os.environ["FXPARALLEL_AGREE_TIMEOUT"]
    # then the ranks meet again
    out["generate after"] = model.generate(**generate).tolist()
    out["save after"] = _raised(lambda: model.save_pretrained(save_dir + "-after"))[0]
    return out


def test_a_refusal_on_one_rank_is_raised_on_every_rank_at_once(checkpoints, tmp_path):
    results = run_ranks(2, _one_rank, checkpoints["llama"], str(tmp_path / "saved"), group_timeout=GROUP_TIMEOUT)
    # what the rank given the argument says (it names the argument)
    own = {
        "num_beams": "InputError: generate: beam_search is not supported on the parallel model (num_beams=2",
        "unknown generate argument": "InputError: generate: unsupported arguments ['frobnicate']",
        "generate shape": "InputError: generate needs input_ids of shape [batch, prompt length], got shape (7,)",
        "generate mask shape": "InputError: attention_mask has shape (2, 5) but input_ids has (2, 7)",
        "do_sample with beams": "InputError: generate: beam_sample is not supported on the parallel model (num_beams=2",
        "output_attentions": "TypeError: fxparallel models take input_ids, attention_mask, position_ids, labels, "
                             "past_key_values, use_cache, gather_logits, logits_to_keep, return_dict; got unsupported "
                             "['output_attentions']",
        "logits_to_keep tensor": "TypeError: logits_to_keep as a tensor of positions is not supported",
        "logits_to_keep with labels": "TypeError: logits_to_keep with labels: the loss needs the logits of every "
                                      "position",
        "past_key_values not a cache": "TypeError: past_key_values must be the ParallelCache an earlier call "
                                       "returned",
        "input_ids missing": "TypeError: input_ids is required",
        "save_pretrained state_dict": "ArgumentError: save_pretrained(state_dict=...) is not supported on the "
                                      "parallel model",
    }
    for rank, out in enumerate(results):
        for (name, bad_rank), (message, seconds) in ((k, v) for k, v in out.items() if isinstance(k, tuple)):
            assert seconds < 10, (name, bad_rank, rank, seconds, message)  # not the group's timeout
            if name in own:
                if rank == bad_rank:
                    assert message.startswith(own[name]), (name, bad_rank, rank, message)
                elif name == "save_pretrained state_dict":
                    assert message == (f"ArgumentError: save_pretrained: the arguments of rank {bad_rank} were "
                                       "refused (see the error on that rank); every rank must call it with the same "
                                       "arguments"), (name, bad_rank, rank, message)
                elif name in ("num_beams", "unknown generate argument", "generate shape", "generate mask shape",
                              "do_sample with beams"):
                    assert message == (f"InputError: generate: the arguments of tp rank {bad_rank} were refused (see "
                                       f"the error on that rank); every tp rank must call generate with the same "
                                       f"prompts and generation arguments"), (name, bad_rank, rank, message)
                else:
                    assert message == (f"InputError: the arguments of tp rank {bad_rank} are invalid (see the error "
                                       f"on that rank); every tp rank must be given the same arguments"), \
                        (name, bad_rank, rank, message)
        # options given on one rank only: every rank names the option and both values
        for name, what in (("gather_logits", "gather_logits"), ("use_cache", "KV cache (use_cache / past_key_values) "
                                                                               "length")):
            for bad_rank in (1, 0):
                message = out[(name, bad_rank)][0]
                mine, theirs = ("128", "None") if name == "use_cache" else ("True", "False")
                first, second = (theirs, mine) if bad_rank == 1 else (mine, theirs)
                assert message.startswith(f"InputError: the ranks of one tensor-parallel group got different arguments "
                                          f"({what} {first} vs {second}: rank 0 vs rank 1"), (name, bad_rank, message)
        message, seconds = out["dtype on rank 1"]
        assert seconds < 10 and message.startswith(
            "InputError: the ranks of one tensor-parallel group got different arguments (the model's dtype float32 "
            "vs float64: rank 0 vs rank 1"), message
        assert out["after the refusals"] < 1e-5
        # return_dict=False: (loss, logits) as transformers, never the shard in the logits' place
        count, expected, loss_error, logits_error = out["tuple with labels"]
        assert (count, expected) == (2, 2) and loss_error < 1e-5 and logits_error is not False and logits_error < 1e-5
        count, expected, logits_error = out["tuple without labels"]
        assert (count, expected) == (1, 1) and logits_error < 1e-5
        count, expected, logits_error, cache = out["tuple with a cache"]
        assert (count, expected) == (2, 2) and logits_error < 1e-5 and cache == "ParallelCache"
        assert out["tuple of a shard"].startswith(
            "ArgumentError: return_dict=False returns transformers' tuple (loss, logits, ...), but this call's logits "
            "were not gathered (with labels the logits stay sharded by default; each rank holds its vocabulary "
            "shard): pass gather_logits=True"), out["tuple of a shard"]
        assert "(gather_logits=False leaves them sharded;" in out["tuple of a shard, gather_logits=False"]
        assert out["num_return_sequences"][:2] == ((6, 9), True), out["num_return_sequences"]
        assert out["num_return_sequences"][2] == results[0]["num_return_sequences"][2]  # the same draws on each rank
        # save_pretrained on rank 0 while rank 1 generates: both refused at once, naming each rank's call
        message, seconds = out["different methods"]
        assert message.startswith("GroupError: the ranks of the tensor-parallel group are at different steps: rank 0 "
                                  "at save_pretrained; rank 1 at generate. Every rank must take the same steps: "), \
            message
        assert "call the model's collective methods (save_pretrained, generate) on every rank, not `if rank == 0:`" \
            in message and seconds < 10 and out["nothing written alone"], (message, seconds)
        # generate on rank 0 alone: it stops waiting after FXPARALLEL_AGREE_TIMEOUT; rank 1, coming later, is told
        message, seconds = out["generate on rank 0 alone"]
        assert message.startswith(
            "RankTimeoutError: rank 0 waited 2 s for rank 1 of the tensor-parallel group (ranks [0, 1]) at generate: "
            "it did not arrive within 2 s (FXPARALLEL_AGREE_TIMEOUT) and reported no progress: stuck, exited, not "
            "making this call (one called on some ranks only, `if rank == 0: ...`, never completes)"), message
        assert message.endswith("(rank 1 is this process: it arrived after its peers had stopped waiting)") == \
            (rank == 1), message
        assert (2 <= seconds < 10) if rank == 0 else seconds < 1, seconds
        # after both: the ranks meet again, the same tokens, a save
        assert out["generate after"] == results[0]["generate after"] and out["save after"] == "no error"
        assert os.path.exists(os.path.join(str(tmp_path), "saved-after", "config.json"))
        # forward, forward with a cache and generate log no deprecation of past_key_values
        assert not [r for r in out["transformers warnings"] if "past_key_values" in r], out["transformers warnings"]
