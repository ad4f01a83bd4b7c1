"""Every kind of ``model`` argument and a 1-D DeviceMesh as ``tp_group`` give the single-device numbers."""
from __future__ import annotations

from distributed import run_ranks


def _kinds(rank, tp):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    import fxparallel
    from checks import compare
    from models import tiny_config

    config = tiny_config("llama")
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    errors = {}

    # a config: initialized with the seed, as transformers would with the same seed
    model = fxparallel.parallelize(config, mesh, dtype=torch.float32, seed=3)
    torch.manual_seed(3)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    errors["config"] = compare(model, ref, rank, tp, gather_logits=True)

    # an in-memory model with real weights (perturbed, so nothing is at its init value)
    torch.manual_seed(5)
    real = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in real.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model = fxparallel.parallelize(real, dist.group.WORLD, dtype=torch.float32)
    errors["model"] = compare(model, real, rank, tp, gather_logits=True)

    # a model built on the meta device: initialized from the seed like a config
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    model = fxparallel.parallelize(meta, dist.group.WORLD, dtype=torch.float32, seed=3)
    torch.manual_seed(3)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    errors["meta"] = compare(model, ref, rank, tp, gather_logits=True)
    return {k: {m: v[m] for m in ("loss", "logits", "grad")} for k, v in errors.items()}


def test_config_model_meta_model_and_device_mesh():
    for errors in run_ranks(2, _kinds):
        for kind, e in errors.items():
            assert max(e.values()) < 1e-5, (kind, e)
