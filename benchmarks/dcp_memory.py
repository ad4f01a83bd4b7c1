"""Memory of a distributed checkpoint (``fxparallel.runtime.save_checkpoint`` / ``load_checkpoint``) of a model with
fused weights under FSDP: what the checkpoint's views copy beyond the model's and optimizer's own storage, per rank.

    torchrun --nproc_per_node=4 benchmarks/dcp_memory.py [--dp 2 --tp 2] [--model qwen3_moe|phi3]

DCP reads every tensor through a full-shape DTensor view. A plain shard is a view of the parameter; a fused weight
(stacked experts' gate_up_proj, Phi-3's qkv_proj) is one view per segment, which needs a copy where FSDP's dim-0
chunk of the tensor-parallel shard straddles segments. What is counted: the bytes of the views (parameters and
AdamW's exp_avg / exp_avg_sq, after one step) whose storage is not a parameter's or a state's, all alive together
while DCP saves or loads: exact and deterministic, unlike RSS on CPU. Also reported: peak RSS growth during the
save and the load (VmHWM, reset before each), and the sharded state's bytes for scale.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

MiB = 2**20
SHAPES = {  # a model whose fused weights are most of its bytes
    "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=2,
                      num_hidden_layers=4, vocab_size=1024, head_dim=64, num_attention_heads=4,
                      num_key_value_heads=2, mlp_only_layers=[], decoder_sparse_step=1),
    "phi3": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=1024,
                 num_attention_heads=4, num_key_value_heads=4),
}


def _rss_peak_reset() -> int:
    """Reset the peak resident size to the current one (Linux) and return it, in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmHWM")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _copied_bytes(model, optimizer, mesh) -> tuple:
    """(bytes of the checkpoint views that are copies, bytes of the sharded parameters and states)."""
    from fxparallel.runtime.checkpoint import state_dict_views
    from fxparallel.runtime.dtensor import local_part

    own, state = set(), 0
    for p in model.parameters():
        for t in [p, *(v for v in optimizer.state[p].values() if v.dim())]:
            local = local_part(t)
            own.add(local.untyped_storage().data_ptr())
            state += local.numel() * local.element_size()
    copies = {}
    for view in state_dict_views(model, optimizer, mesh, with_optimizer=True).values():
        local = local_part(view)
        if local.dim() and local.untyped_storage().data_ptr() not in own:
            copies[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(copies.values()), state


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3_moe", choices=sorted(SHAPES))
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the per-rank results as JSON here (rank 0)")
    args = parser.parse_args()

    import torch

    import fxparallel
    from fxparallel.runtime import apply_data_parallel, init_mesh, load_checkpoint, save_checkpoint, train_step
    from models import save_checkpoint as save_model
    from ranks import everyone, start
    from tiny_configs import tiny_config

    directory = os.path.join(tempfile.gettempdir(), f"fxparallel_dcp_memory_{args.model}")
    _, _, path = start(None, directory, lambda d: save_model(tiny_config(args.model, **SHAPES[args.model]), d))
    torch.set_num_threads(1)
    mesh = init_mesh(dp=args.dp, tp=args.tp, cp=1)
    model = apply_data_parallel(fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(mesh.dp_rank))
    train_step(model, optimizer, {"input_ids": ids, "labels": ids}, mesh)
    copied, state = _copied_bytes(model, optimizer, mesh)
    with tempfile.TemporaryDirectory() as root:
        root = everyone(root)[0]
        before = _rss_peak_reset()
        saved = save_checkpoint(root, model, optimizer, mesh, 1)
        save_peak = _status("VmHWM") - before
        before = _rss_peak_reset()
        load_checkpoint(saved, model, optimizer, mesh)
        load_peak = _status("VmHWM") - before
        torch.distributed.barrier()  # rank 0's directory is removed when it leaves
    row = {"rank": mesh.rank, "state MiB": round(state / MiB, 2), "view copies MiB": round(copied / MiB, 2),
           "save RSS growth MiB": round(save_peak / MiB, 2), "load RSS growth MiB": round(load_peak / MiB, 2)}
    rows = everyone(row)
    if mesh.rank == 0:
        print(f"{args.model} dp={args.dp} tp={args.tp}")
        for r in rows:
            print(r)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"model": args.model, "dp": args.dp, "tp": args.tp, "ranks": rows}, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
