"""generate's refusal of CUDA graphs over a tp group whose collectives they cannot record (gloo on CUDA tensors),
decided before the prefill: which compile configs record CUDA graphs, and which groups and devices are fine."""
from transformers import CompileConfig

from fxparallel.generation.loop import cuda_graphs_refusal


def test_cuda_graphs_over_gloo_on_cuda_refused_by_name():
    for config in (CompileConfig(mode="reduce-overhead"), CompileConfig(mode="max-autotune"),
                   CompileConfig(mode=None, options={"triton.cudagraphs": True})):
        message = cuda_graphs_refusal(config, "cuda", 2, nccl=False)
        assert message and "CUDA graphs" in message and "gloo" in message and "mode='default'" in message, config


def test_other_cases_allowed():
    graphs = CompileConfig(mode="reduce-overhead")
    assert cuda_graphs_refusal(graphs, "cuda", 2, nccl=True) is None  # NCCL's collectives are recorded
    assert cuda_graphs_refusal(graphs, "cuda", 1, nccl=False) is None  # no collective
    assert cuda_graphs_refusal(graphs, "cpu", 2, nccl=False) is None  # no CUDA graph on the CPU
    assert cuda_graphs_refusal(CompileConfig(mode="default"), "cuda", 2, nccl=False) is None
    assert cuda_graphs_refusal(CompileConfig(mode="max-autotune-no-cudagraphs"), "cuda", 2, nccl=False) is None
    assert cuda_graphs_refusal(None, "cuda", 2, nccl=False) is None
