"""On a CUDA device (skipped without one): TP=1 over NCCL against transformers on the same GPU, for the forward
and gradients in each dtype, greedy generation (eager, compiled, CUDA graphs), a compiled training step, a
mixture of experts with transformers' grouped_mm kernel and its load-balancing loss, and stock Trainer on the GPU.
TP=2 on the GPU: ``tests/test_cuda_tp2.py``.
Run on a lent GPU by ``benchmarks/gpu_session.sh``; CI has no GPU."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def nccl():
    """A one-rank NCCL group for the module's tests."""
    import datetime
    import os

    import torch.distributed as dist

    from distributed import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _reference(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


def _max_grad_error(model, ref) -> tuple:
    ref_params = dict(ref.named_parameters())
    return max(((p.grad.float() - ref_params[n].grad.float()).abs().max().item(), n)
               for n, p in model.named_parameters())


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_cuda_nccl_tp1_matches_single_device(checkpoints, nccl, dtype_name):
    import fxparallel
    from checks import batch

    dtype = getattr(torch, dtype_name)
    path = checkpoints["llama"]
    model = fxparallel.parallelize(path, nccl, dtype=dtype)
    assert next(model.parameters()).is_cuda
    ref = _reference(path, dtype)
    ids = batch(128, 2, 9).cuda()
    out, r = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    out.loss.backward()
    r.loss.backward()
    tol = 1e-4 if dtype == torch.float32 else 64 * torch.finfo(dtype).eps
    assert (out.loss.float() - r.loss.float()).abs().item() < tol
    assert _max_grad_error(model, ref)[0] < tol, _max_grad_error(model, ref)


def test_cuda_generate_matches_transformers(checkpoints, nccl):
    """Greedy tokens equal transformers' (fp32, left padding) eager, with the decode steps compiled and with
    CUDA graphs (mode="reduce-overhead"): compiled once, replayed without being skipped."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    import fxparallel

    path = checkpoints["llama"]
    model = fxparallel.parallelize(path, nccl, dtype=torch.float32)
    ref = _reference(path)
    ids = torch.randint(1, 128, (3, 7), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids = ids * mask  # left padding with id 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = ref.generate(**kwargs)
    assert torch.equal(model.generate(**kwargs), expected)
    for mode in ("default", "reduce-overhead"):
        counters.clear()
        config = CompileConfig(fullgraph=True, dynamic=False, mode=mode)
        first = model.generate(**kwargs, compile_config=config)
        second = model.generate(**kwargs, compile_config=config)  # the same cache tensors: no recompile
        assert torch.equal(first, expected) and torch.equal(second, expected), mode
        assert counters["stats"]["unique_graphs"] == 1, (mode, dict(counters["stats"]))
        assert not counters["inductor"].get("cudagraph_skips"), (mode, dict(counters["inductor"]))
        # the scores of every step, kept while later steps replay the graph
        scored = model.generate(**kwargs, compile_config=config, return_dict_in_generate=True, output_scores=True)
        assert torch.equal(scored.sequences, expected) and len(scored.scores) == 20, mode
        assert all(torch.equal(s.argmax(-1), expected[:, 7 + i]) for i, s in enumerate(scored.scores)), mode
    # every row stopped by EOS before max_new_tokens: on CUDA each decode step is queued before the host reads
    # whether the last one stopped every row, and the step after the last is dropped
    stop = dict(kwargs, eos_token_id=[int(expected[0, 7 + 4]), int(expected[1, 7 + 6]), int(expected[2, 7 + 8])])
    expected_stop = ref.generate(**stop)
    assert expected_stop.shape[1] < 7 + 20, expected_stop.shape
    assert torch.equal(model.generate(**stop), expected_stop)
    cuda_graphs = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
    for _ in range(2):
        assert torch.equal(model.generate(**stop, compile_config=cuda_graphs), expected_stop)
        assert torch.equal(model.generate(**kwargs, compile_config=cuda_graphs), expected)


def test_cuda_compiled_training_step_matches_eager(checkpoints, nccl):
    """torch.compile(model) (inductor on the GPU): loss and every gradient as transformers' eager step."""
    import fxparallel
    from checks import batch

    path = checkpoints["llama"]
    model = fxparallel.parallelize(path, nccl, dtype=torch.float32).train()
    ref = _reference(path).train()
    ids = batch(128, 2, 9).cuda()
    loss = torch.compile(model)(input_ids=ids, labels=ids).loss
    r = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    r.backward()
    assert (loss - r).abs().item() < 1e-5
    assert _max_grad_error(model, ref)[0] < 1e-5, _max_grad_error(model, ref)


def test_cuda_checkpointing_bit_identical_with_deterministic_kernels(checkpoints, nccl, monkeypatch):
    """Full and selective activation checkpointing give the gradients of the step without it, bit for bit, once
    CUDA's kernels are deterministic (without that, two identical steps already differ by ~1e-9: SDPA's and
    cuBLAS's reductions are not deterministic on a GPU)."""
    import fxparallel
    from checks import batch

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        model = fxparallel.parallelize(checkpoints["llama"], nccl, dtype=torch.float32).train()
        ids = batch(128, 2, 64).cuda()

        def grads():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            return {n: p.grad.clone() for n, p in model.named_parameters()}

        plain = grads()
        for mode in ("full", "selective"):
            model.gradient_checkpointing_enable({"use_reentrant": False}, mode=mode)
            assert all(torch.equal(g, plain[n]) for n, g in grads().items()), mode
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_cuda_moe_grouped_mm_with_router_logits(tmp_path, nccl, dtype_name):
    """A mixture of experts with transformers' grouped_mm kernel (its default on CUDA, never run on CPU): loss with
    the load-balancing term, aux_loss, router logits and every gradient as transformers' on the same GPU, and greedy
    generate's tokens (its static cache filled on meta with batched_mm: meta's grouped_mm takes bfloat16 only)."""
    import os
    import sys

    import fxparallel
    from checks import batch
    from models import save_checkpoint

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from tiny_configs import tiny_config

    dtype = getattr(torch, dtype_name)
    path = save_checkpoint(tiny_config("qwen3_moe", output_router_logits=True), str(tmp_path / "moe"))
    model = fxparallel.parallelize(path, nccl, dtype=dtype)
    assert all("grouped_mm" in g.code for g in model.graphs())
    ref = _reference(path, dtype)
    ids = batch(model.config.vocab_size, 2, 9).cuda()
    out, r = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    out.loss.backward()
    r.loss.backward()
    tol = 1e-4 if dtype == torch.float32 else 64 * torch.finfo(dtype).eps
    assert (out.loss.float() - r.loss.float()).abs().item() < tol
    assert (out.aux_loss.float() - r.aux_loss.float()).abs().item() < tol
    assert max((a.float() - b.float()).abs().max().item() for a, b in zip(out.router_logits, r.router_logits)) < tol
    assert _max_grad_error(model, ref)[0] < tol, _max_grad_error(model, ref)
    if dtype == torch.float32:
        kwargs = dict(input_ids=ids[:, :5], max_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(**kwargs), ref.generate(**kwargs))


def test_cuda_trainer_tp1_matches_single_device_trainer(checkpoints, nccl, tmp_path):
    """Stock Trainer on the GPU (accelerate's CUDA path, which the CPU tests simulate): the parallel model's losses,
    grad norms (clipped by the true norm) and final weights as the single-device Trainer's on the same GPU, with
    gradient accumulation, gradient checkpointing and a learning-rate schedule."""
    from transformers import AutoModelForCausalLM

    import fxparallel
    import test_trainer_stack as stack

    path = checkpoints["llama"]
    parallel = fxparallel.parallelize(path, nccl, dtype=torch.float32)
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    run = {"trainer": stack._single_process(stack._trainer_run, parallel, str(tmp_path / "parallel"), use_cpu=False),
           "trainer_ref": stack._single_process(stack._trainer_run, single, str(tmp_path / "single"), use_cpu=False)}
    assert next(single.parameters()).is_cuda and next(parallel.parameters()).is_cuda
    ref_params = dict(single.named_parameters())
    run["trainer_weights"] = max((p.detach() - ref_params[n].detach()).abs().max().item()
                                 for n, p in parallel.named_parameters())
    stack._check_trainer(run)


def test_cuda_trainer_checkpoints_resume_exactly(checkpoints, nccl, tmp_path):
    """Trainer checkpoints on the GPU (``save_only_model=True`` with ``fxparallel.TrainerCheckpoints``, whose random
    states Trainer reads back in its CUDA format): the resumed run's steps and weights as the uninterrupted run's."""
    import test_trainer_stack as stack

    stack._check_resumed(stack._single_process(stack._resumed, 0, 1, checkpoints["llama"], str(tmp_path),
                                               use_cpu=False))
