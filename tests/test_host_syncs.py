"""Host syncs of a training step (a GPU waits for its queue at each; FSDP2's run-ahead stops): train_step makes
one, the forward's argument check, which also reads the global label count that refuses an empty batch; its
metrics are read from the device only when asked. A decode step of ``generate`` reads only its stopping check.
Counted by wrapping every way a tensor reaches the host (item, tolist, numpy, cpu, int/float/bool of a tensor,
torch.cuda.synchronize), one per source line that reads; torch.optim's reads of its step counters are left out
(they live on the CPU beside GPU parameters: no sync)."""
from __future__ import annotations

import contextlib
import os
import sys

from distributed import run_ranks

_READS = ("item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def counting_host_syncs(counts: list):
    import torch

    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            where = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
            chained = counts and counts[-1][0] == where and counts[-1][1] != name  # x.cpu().tolist(): one read
            if f"{os.sep}optim{os.sep}" not in caller.f_code.co_filename and not chained:
                counts.append((where, name))
            return original(self, *args, **kwargs)
        return read

    sync = torch.cuda.synchronize
    try:
        for name in _READS:
            setattr(torch.Tensor, name, wrap(name))
        torch.cuda.synchronize = lambda *a, **k: (counts.append(("synchronize", "")), sync(*a, **k))[1]
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.cuda.synchronize = sync


def _steps(rank, world, path):
    import torch

    import fxparallel
    from checks import raised
    from fxparallel.runtime import init_mesh, train_step

    mesh = init_mesh(tp=2, dp=1, cp=1)
    model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    train_step(model, opt, {"input_ids": ids}, mesh, max_norm=1.0)  # the first call captures
    per_step, metrics = [], []
    for _ in range(3):
        counts = []
        with counting_host_syncs(counts):
            m = train_step(model, opt, {"input_ids": ids}, mesh, max_norm=1.0)
        per_step.append(counts)
        metrics.append(m)
    read = []
    with counting_host_syncs(read):
        values = [(m.loss, m.grad_norm) for m in metrics]
    # a global batch without label tokens: refused (read with the check) before the backward changes anything
    before = [p.detach().clone() for p in model.parameters()]
    empty = raised(lambda: train_step(model, opt, {"input_ids": ids, "labels": torch.full_like(ids, -100)}, mesh),
                   ValueError)
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    # generate: a decode step's one read is the stopping check (on CUDA read one step late, from a copy)
    decoding = {}
    # planned first (under FXPARALLEL_PLANNING=first a rank reads the graphs rank 0 sent it once): counted, the calls
    # whose graphs exist
    model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    for new_tokens in (4, 8):
        counts = []
        with counting_host_syncs(counts):
            model.generate(input_ids=ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        decoding[new_tokens] = counts
    return per_step, read, values, (empty, unchanged), decoding


def test_one_host_sync_per_training_step(checkpoints):
    for per_step, read, values, (empty, unchanged), decoding in run_ranks(2, _steps, checkpoints["llama"]):
        short, long = decoding[4], decoding[8]
        extra = long[len(short):]  # the same reads, then one per further token
        assert [w.split(":")[0] for w, _ in long[:len(short)]] == [w.split(":")[0] for w, _ in short], decoding
        assert len(extra) == 4 and {(w.split(":")[0], name) for w, name in extra} == {("loop.py", "__bool__")}, \
            decoding
        assert "the global batch has no label tokens" in empty and unchanged, (empty, unchanged)
        # the forward's argument check: one exchange, read on the host, the step's global label count riding on it
        assert all([w.split(":")[0] for w, _ in c] == ["inputs.py"] for c in per_step), per_step
        assert [w.split(":")[0] for w, _ in read] == ["train.py"] * 3, read  # each step's metrics: one read, when asked
        assert values[1][0] < values[0][0] and all(v == v and v > 0 for pair in values for v in pair)
