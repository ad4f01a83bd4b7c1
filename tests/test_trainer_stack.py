"""The pieces of transformers' training stack the parallel model answers to (issue 31's first part):
``num_items_in_batch`` (Trainer's loss normalization under gradient accumulation) against transformers'
loss and every gradient at TP=2; ``num_parameters(exclude_embeddings=True)`` (Trainer's FLOP count);
``activation_checkpointing_enable`` with Trainer's arguments (``every_n_layers``); and stock
``transformers.Trainer`` training the parallel model at TP=1 with clipping, gradient accumulation,
gradient checkpointing and a learning-rate schedule, at TP=2 (world = tp) and TP=1: the single-device
Trainer's losses, grad norms (the true global norm, clipping by it) and final weights, replicated weights
bit-identical on both ranks, and then ``evaluate()`` (``compute_metrics`` over complete logits) and ``predict()`` of
the trained model giving the single-device Trainer's loss, metrics and predictions, and ``load_best_model_at_end``
loading the best checkpoint (not the last) as the single-device Trainer does; ``label_smoothing_factor`` too (Trainer
shifts the labels for the class name the model answers, transformers'). At TP=2 Trainer takes transformers' tensor-parallel path
(``ParallelismConfig(tp_size=2)``), which accelerate allows on GPUs only: the one check that refuses it
on CPU is simulated (``fxparallel.accelerate_cpu``, what a CPU user calls); everything else is the path GPU users take.
``Trainer.save_model`` then writes what transformers loads as the trained model. Trainer checkpoints
(``save_only_model=True``, as transformers requires for models sharded at load, with ``fxparallel.TrainerCheckpoints``
adding the optimizer, hyperparameters, schedule and random states) resume to the uninterrupted run's steps and weights,
and a checkpoint without those files is refused on resuming. And
Module hooks run on the model and its decoder layers and are refused on the modules its graphs never call (so
Trainer's NEFTune stops before any step), and so does ``torch_compile=True`` (Trainer would broadcast rank 0's shards
through torch.compile's wrapper); a ``load_state_dict`` on one rank only is named at the next call. ``pipeline("text-generation")`` takes the parallel model: its repr, transformers' text, and stop strings
(``stop_sequence``) stopping where they stop transformers'; so does lm-eval's ``HFLM`` (a task's loglikelihoods and
accuracy through ``simple_evaluate``, rolling loglikelihoods, ``generate_until``: transformers' numbers and text). TRL: the fused LM head its trainers add
(``add_fused_lm_head``, with a temperature and every optional output) computed across the vocabulary shards equals
TRL's on transformers' model (each field, the loss, every gradient), and stock ``SFTTrainer`` at TP=2 gives the
single-device SFTTrainer's losses, grad norms, entropy and token accuracy and weights (DPOTrainer, with a parallel
reference model, its losses, reward margins and weights), and so does SFTTrainer training a
LoRA adapter (on the parallel model with ``load_adapter(..., is_trainable=True)``, against PeftModel; its trained
adapter equal too), while ``SFTTrainer(peft_config=...)``, whose ``get_peft_model`` cannot wrap the parallel model, is
refused naming ``add_adapter``; GRPOTrainer at TP=2 samples, rewards, trains and logs as the same training at TP=1
(its ``scale_rewards="batch"`` refused, every weight unchanged). (The SFT runs use SGD:
Adam's first steps divide each gradient by its own magnitude, which turns fp32 rounding in near-zero gradients into
1e-4 weight differences whatever computed them; Trainer's run above uses AdamW.)"""
from __future__ import annotations

import os

from distributed import run_ranks


def _trainer_run(model, out_dir, save_to=None, optim="adamw_torch", use_cpu=True, batch=2, rows=16,
                 sampling="random", length=9, mask=False, callbacks=None, resume=None, **arguments):
    """Train ``model`` with stock Trainer for 4 optimizer steps of 2 micro-batches of ``batch`` rows of ``length``
    tokens (then ``save_model(save_to)``); returns (losses, grad norms, Trainer's counters: the tokens seen at each
    logged step and the total flos). ``arguments``: more TrainingArguments. ``use_cpu=False``: on the GPU
    (tests/test_cuda.py); ``sampling="sequential"``: the same rows make each global batch however data parallelism
    splits it; ``mask``: the rows carry an attention mask of all ones, as a collator that pads gives; ``callbacks``:
    Trainer's; ``resume``: ``train(resume_from_checkpoint=resume)``."""
    import torch
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(3)
    data = []
    for i in range(rows):
        ids = torch.randint(0, 128, (length,), generator=g).tolist()
        labels = list(ids)
        labels[2 + i % 3] = -100  # masked tokens, unequal per row: num_items_in_batch counts only the others
        data.append({"input_ids": ids, "labels": labels, **({"attention_mask": [1] * length} if mask else {})})
    arguments.setdefault("save_strategy", "no")
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=2,
                             max_steps=4, learning_rate=5e-2, lr_scheduler_type="linear", warmup_steps=1,
                             max_grad_norm=0.5, gradient_checkpointing=True, logging_steps=1, report_to=[],
                             use_cpu=use_cpu, seed=7, dataloader_num_workers=0, optim=optim,
                             train_sampling_strategy=sampling, include_num_input_tokens_seen="all", **arguments)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    if save_to is not None:
        trainer.save_model(save_to)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    counters = [h["num_input_tokens_seen"] for h in logs] + [trainer.state.total_flos]
    return [h["loss"] for h in logs], [float(h["grad_norm"]) for h in logs], counters


def _trainer_eval(model, out_dir, rows=6, batch=2):
    """Stock Trainer's ``evaluate()`` (with ``compute_metrics``) and ``predict()`` on ``rows`` rows: the metrics and
    the predictions (as gathered over the processes)."""
    import numpy as np
    import torch
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(11)
    data = [{"input_ids": ids, "labels": list(ids)} for ids in (torch.randint(0, 128, (9,), generator=g).tolist()
                                                                 for _ in range(rows))]

    def metrics(prediction):  # a mean over the rows, and one an argmax over the vocabulary decides
        logits = prediction.predictions
        return {"mean_logit": float(logits.mean()),
                "top1": float((logits[:, :-1].argmax(-1) == prediction.label_ids[:, 1:]).mean())}

    args = TrainingArguments(output_dir=out_dir, per_device_eval_batch_size=batch, report_to=[], use_cpu=True,
                             save_strategy="no")
    trainer = Trainer(model=model, args=args, eval_dataset=data, compute_metrics=metrics)
    return {"metrics": trainer.evaluate(), "predictions": np.asarray(trainer.predict(data).predictions)}


def _hooks(rank, world, path, root):
    """Module hooks: on the model and its decoder layers they run; on the modules that only hold shards, and on
    the view get_input_embeddings() returns, they are refused when registered (the graphs never call those), so
    Trainer's NEFTune (a hook on the input embeddings) stops before any step, every weight kept."""
    import torch
    import torch.distributed as dist

    from transformers import AutoModelForCausalLM

    import fxparallel
    from checks import raised

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ran = []
    handles = [model.register_forward_hook(lambda *_: ran.append("model")),
               model.model.layers[1].register_forward_pre_hook(lambda *_: ran.append("layer 1"))]
    model(input_ids=torch.arange(9).reshape(1, 9))
    layers = [len(model.model.layers), [type(layer).__name__ for layer in model.model.layers]]
    for handle in handles:
        handle.remove()
    before = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    # a load on one rank only (transformers' state dict: complete tensors) leaves the ranks with shards of two
    # models: the next call says so on every rank
    other = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    if rank == 0:
        other.load_state_dict({n: torch.zeros_like(p) for n, p in
                               AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict().items()})
    one_rank_load = raised(lambda: other(input_ids=torch.arange(9).reshape(1, 9)))
    return {"ran": ran, "layers": layers, "one rank load": one_rank_load,
            "submodule": raised(lambda: model.model.layers[0].mlp.up_proj.register_forward_hook(lambda *_: None)),
            "backward": raised(lambda: model.lm_head.register_full_backward_hook(lambda *_: None)),
            "neftune": raised(lambda: _trainer_run(model, f"{root}/neftune{rank}", neftune_noise_alpha=5.0)),
            "torch_compile": raised(lambda: _trainer_run(model, f"{root}/compiled{rank}", torch_compile=True)),
            "kept": all(torch.equal(p, before[n]) for n, p in model.local_named_parameters())}


def _best_model_run(model, out_dir):
    """Stock Trainer evaluating every 2 steps and loading the best checkpoint at the end (a learning rate that
    overshoots, so the best is not the last); returns the evaluations' losses and the loaded model's."""
    import torch
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 128, (9,), generator=g).tolist()
                                                          for _ in range(16))]
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                             max_steps=6, learning_rate=40.0, optim="sgd", report_to=[], use_cpu=True, seed=7,
                             eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                             save_only_model=True, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                             greater_is_better=False)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4])
    trainer.train()
    return {"evals": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
            "best": os.path.basename(trainer.state.best_model_checkpoint), "loaded": trainer.evaluate()["eval_loss"]}


def _reset_accelerate():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _single_process(fn, *args, **kwargs):
    """Run ``fn`` as a job of one process (accelerate reads the launcher's variables)."""
    import os

    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    _reset_accelerate()
    try:
        return fn(*args, **kwargs)
    finally:
        os.environ.update(env)
        _reset_accelerate()


def _tensor_parallel_trainer(rank, world, path, root):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    import fxparallel
    from fxparallel.accelerate_cpu import allow_tensor_parallel_on_cpu
    from transformers import AutoModelForCausalLM

    allow_tensor_parallel_on_cpu()
    parallel = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    result = {"trainer": _trainer_run(parallel, f"{root}/tp{rank}", save_to=f"{root}/saved")}
    replicated = [p for _, p in parallel.named_parameters() if p.placements == (Replicate(),)]
    local = torch.cat([p.to_local().detach().flatten() for p in replicated])
    copies = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(copies, local)
    result["replicated_identical"] = all(torch.equal(c, copies[0]) for c in copies)
    result["replicated_count"] = len(replicated)
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    result["trainer_ref"] = _single_process(_trainer_run, single, f"{root}/single{rank}")
    # label smoothing: Trainer shifts the labels for the class names of causal LMs it knows (model._get_name())
    result["smoothed"] = _trainer_run(fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32),
                                      f"{root}/smoothed{rank}", label_smoothing_factor=0.1)
    result["smoothed_ref"] = _single_process(_trainer_run, AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32), f"{root}/smoothed_single{rank}", label_smoothing_factor=0.1)
    # load_best_model_at_end: the tp ranks share the output folder (rank 0 writes each checkpoint)
    result["best"] = _best_model_run(fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32),
                                     f"{root}/best")
    if rank == 0:  # (a job of one process on rank 1 would not write its checkpoints: accelerate's main process is 0)
        result["best_ref"] = _single_process(_best_model_run, AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32), f"{root}/best_single")
    # evaluate() / predict() of the trained models
    result["eval"] = _trainer_eval(parallel, f"{root}/eval{rank}")
    result["eval_ref"] = _single_process(_trainer_eval, single, f"{root}/eval_single{rank}")
    ref_params = dict(single.named_parameters())
    result["trainer_weights"] = max(
        (p.detach() - parallel.plan.param(n).shard_of(ref_params[n].detach(), rank, world)).abs().max().item()
        for n, p in parallel.local_named_parameters())
    # Trainer.save_model: every rank took part (save_pretrained gathers); transformers loads what was trained
    saved = dict(AutoModelForCausalLM.from_pretrained(f"{root}/saved", dtype=torch.float32).named_parameters())
    result["saved_equals_shards"] = all(
        torch.equal(parallel.plan.param(n).shard_of(saved[n], rank, world), p.detach())
        for n, p in parallel.local_named_parameters())
    result["saved_vs_single"] = max((saved[n] - p.detach()).abs().max().item() for n, p in single.named_parameters())
    return result


def _resumed(rank, world, path, root, use_cpu=True, tp_group=None, data_parallel=None, other_layout=None):
    """Trainer checkpoints at TP=2 (``save_only_model=True``, ``fxparallel.TrainerCheckpoints``): 4 steps with a
    checkpoint after 2, then a fresh parallel model resumed from it (``resume_from_checkpoint``): its steps 3 and 4
    (losses, clipped grad norms, learning rates) and final weights against the uninterrupted run's; a checkpoint
    without the callback's files, and states of another checkpoint than the one Trainer resumes, refused before the
    resumed run's first step. And ``load_state_dict`` of
    transformers' complete state dict (what the resume loads) gives transformers' logits. ``use_cpu=False``: on the
    GPU (tests/test_cuda.py); ``tp_group``: the model's (default: the whole job; a tp sub-mesh for dp x tp);
    ``data_parallel``: the ParallelMesh of fxparallel's FSDP over dp (``apply_data_parallel``), or None;
    ``other_layout``: (tp_group, data_parallel, rows per device) of another layout of the same global batches, which
    also resumes from the checkpoint (its steps 3 and 4 in ``out["other layout"]``)."""
    import shutil

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import fxparallel
    from checks import raised
    from fxparallel.accelerate_cpu import allow_tensor_parallel_on_cpu
    from fxparallel.runtime import apply_data_parallel
    from fxparallel.runtime.dtensor import local_part
    from fxparallel.runtime.fsdp import reshard

    allow_tensor_parallel_on_cpu()
    tp_group = dist.group.WORLD if tp_group is None else tp_group

    def parallel_model(layout=(tp_group, data_parallel)):
        model = fxparallel.parallelize(path, layout[0], dtype=torch.float32)
        return model if layout[1] is None else apply_data_parallel(model, layout[1])

    def local_weights(model):  # (FSDP's chunks of the tp shards)
        reshard(model)
        return {n: local_part(p.detach()) for n, p in model.local_named_parameters()}

    g = torch.Generator().manual_seed(11)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (32, 9), generator=g).tolist()]
    out_dir = f"{root}/resume" if data_parallel is None else f"{root}/resume-fsdp"

    def train(resume=None, callbacks=None, layout=(tp_group, data_parallel, 2)):
        model = parallel_model(layout[:2])
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=layout[2],
                                 gradient_accumulation_steps=2,
                                 max_steps=4, learning_rate=5e-2, lr_scheduler_type="linear", warmup_steps=1,
                                 max_grad_norm=0.5, logging_steps=1, report_to=[], use_cpu=use_cpu, seed=7,
                                 dataloader_num_workers=0, save_strategy="steps", save_steps=2, save_only_model=True)
        trainer = Trainer(model=model, args=args, train_dataset=rows,
                          callbacks=callbacks or [fxparallel.TrainerCheckpoints()])
        trainer.train(resume_from_checkpoint=resume)
        logs = [(h["step"], h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history
                if "loss" in h]
        return model, logs

    full, full_logs = train()
    weights = {n: p.clone() for n, p in local_weights(full).items()}
    resumed, resumed_logs = train(resume=f"{out_dir}/checkpoint-2")
    out = {"full": full_logs, "resumed": resumed_logs,
           "weights": max((p - weights[n]).abs().max().item() for n, p in local_weights(resumed).items())}
    if other_layout is not None:
        out["other layout"] = train(resume=f"{out_dir}/checkpoint-2", layout=other_layout)[1]
    if rank == 0:  # a checkpoint of Trainer's alone (the callback's files left out)
        shutil.copytree(f"{out_dir}/checkpoint-2", f"{out_dir}-plain",
                        ignore=shutil.ignore_patterns("fxparallel_*"))
    dist.barrier()
    out["without_files"] = raised(lambda: train(resume=f"{out_dir}-plain", callbacks=[
        fxparallel.TrainerCheckpoints(resume_from=f"{out_dir}-plain")]))
    out["other_folder"] = raised(lambda: train(resume=f"{out_dir}/checkpoint-2", callbacks=[  # step 4's states
        fxparallel.TrainerCheckpoints(resume_from=f"{out_dir}/checkpoint-4")]))

    model = parallel_model()
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in single.parameters():
            p.add_(0.01)  # other weights than the parallel model's
        ids = torch.randint(0, 128, (2, 9), generator=g)
        model.load_state_dict(single.state_dict())
        out["full_state_dict"] = (model(input_ids=ids).logits.cpu() - single(input_ids=ids).logits).abs().max().item()
    return out


def _pipeline(rank, root):
    """pipeline("text-generation") on the parallel model and on transformers' (each rank builds its own)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    import fxparallel
    from models import save_with_tokenizer

    path = f"{root}/with_tokenizer"
    if rank == 0:
        save_with_tokenizer(path)
    dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(path)
    pipes = [pipeline("text-generation", model=m, tokenizer=tokenizer) for m in (
        fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32),
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))]
    prompt = "the cat sat on"
    texts = [p(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"] for p in pipes]
    stop = texts[1][len(prompt):][3:6]  # a piece of the continuation: generation stops on reaching it
    stopped = [p(prompt, max_new_tokens=8, do_sample=False, stop_sequence=stop)[0]["generated_text"] for p in pipes]
    return {"texts": texts, "stopped": stopped, "stop": stop, "repr": repr(pipes[0])}


_LM_EVAL_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""


def _lm_eval(rank, root):
    """lm-eval's ``HFLM`` handed the parallel model and transformers' (every tp rank runs the whole evaluation,
    as lm-eval does with a model it is handed): ``simple_evaluate`` of a multiple-choice task read from a local
    file (the per-choice loglikelihoods it logs, its accuracy), ``loglikelihood_rolling`` and ``generate_until``."""
    import json

    import torch
    import torch.distributed as dist
    from lm_eval import simple_evaluate
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fxparallel

    path, tasks = f"{root}/with_tokenizer", f"{root}/lm_eval_{rank}"
    os.makedirs(tasks, exist_ok=True)
    rows = [("the cat sat on the", [" mat", " dog", " ran"], 0), ("a dog ran", [" far", " the", " cat"], 0),
            ("the mat", [" sat", " on", " a"], 1), ("on the", [" cat", " mat"], 1)]
    with open(f"{tasks}/data.jsonl", "w") as f:
        f.writelines(json.dumps({"question": q, "choices": c, "label": a}) + "\n" for q, c, a in rows)
    with open(f"{tasks}/tiny_choice.yaml", "w") as f:
        f.write(_LM_EVAL_TASK.format(data=f"{tasks}/data.jsonl"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    out = {}
    for name, model in (("parallel", fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)),
                        ("transformers", AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2)
        result = simple_evaluate(model=lm, tasks=["tiny_choice"], task_manager=TaskManager(include_path=tasks),
                                 log_samples=True)
        text = "the cat sat on the mat and the dog ran far"
        out[name] = {} if result is None else {  # (lm-eval reports on LOCAL_RANK 0 alone, as for transformers' TP)
            "acc": result["results"]["tiny_choice"]["acc,none"],
            "choices": [[ll for ll, _ in s["filtered_resps"]] for s in result["samples"]["tiny_choice"]]}
        out[name].update({
            "rolling": lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)]),
            "generated": lm.generate_until([Instance("generate_until", {}, (
                "the cat", {"until": ["dog"], "max_gen_toks": 8, "do_sample": False}), 0)])})
    return out


def _fused_head(rank, world, path):
    """TRL's fused LM head on the parallel model and on transformers': {field: max difference}, "grad"."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    import fxparallel

    parallel = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    fields = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    for m in (parallel, single):
        add_fused_lm_head(m, temperature=0.7, outputs=fields)
    ids = torch.randint(3, single.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    with torch.no_grad():  # the last labels are the model's own top token there: is_top1 True somewhere
        labels[:, 6:] = single(input_ids=ids).logits.argmax(-1)[:, 5:-1]
    labels[0, 3] = labels[1, :4] = -100
    ours, theirs = (m(input_ids=ids, labels=labels, fused_lm_head=True) for m in (parallel, single))
    out = {k: (getattr(ours, k).float() - getattr(theirs, k).float()).abs().max().item()
           for k in fields + ("loss", "label_mask")}
    out["top1_hits"] = int(theirs.is_top1.sum())
    try:  # an option the fused head does not take is refused, not ignored
        parallel(input_ids=ids, labels=labels, fused_lm_head=True, logits_to_keep=1)
        out["refused"] = "no error"
    except TypeError as err:
        out["refused"] = str(err)
    ours.loss.backward()
    theirs.loss.backward()
    grads = dict(single.named_parameters())
    out["grad"] = max((p.grad - parallel.plan.param(n).shard_of(grads[n].grad, rank, world)).abs().max().item()
                      for n, p in parallel.local_named_parameters())
    return out


def _sft_run(model, tokenizer, out_dir, batch=2):
    """Stock SFTTrainer for 3 optimizer steps of 2 micro-batches of ``batch`` rows, pre-tokenized, of different
    lengths (padded, the pads masked); returns its logged losses, grad norms, entropies and token accuracies."""
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    g = torch.Generator().manual_seed(11)
    rows = [{"input_ids": torch.randint(3, tokenizer.vocab_size, (int(n),), generator=g).tolist()}
            for n in torch.randint(5, 12, (16,), generator=g)]
    args = SFTConfig(output_dir=out_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=2, max_steps=3,
                     learning_rate=5e-2, max_grad_norm=0.5, logging_steps=1, report_to=[], use_cpu=True,
                     save_strategy="no", seed=7, dataloader_num_workers=0, bf16=False, max_length=None, optim="sgd")
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {k: [float(h[k]) for h in logs] for k in ("loss", "grad_norm", "entropy", "mean_token_accuracy")}


def _sft(rank, world, root):
    """SFTTrainer on the parallel model at TP=2 and on transformers' in a job of one process."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fxparallel

    path = f"{root}/with_tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(path)
    parallel = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    out = {"tp2": _sft_run(parallel, tokenizer, f"{root}/sft{rank}")}
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out["single"] = _single_process(_sft_run, single, tokenizer, f"{root}/sft-single{rank}")
    weights = dict(single.named_parameters())
    out["weights"] = max((p.detach() - parallel.plan.param(n).shard_of(weights[n].detach(), rank, world)).abs().max()
                         .item() for n, p in parallel.local_named_parameters())
    return out


def _dpo_run(model, ref_model, tokenizer, out_dir):
    """Stock DPOTrainer, 3 steps of 2 preference pairs (SGD); returns its logged losses and reward margins."""
    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    g = torch.Generator().manual_seed(5)
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "a"]
    text = lambda n: " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))  # noqa: E731
    rows = [{"prompt": text(4), "chosen": text(3), "rejected": text(5)} for _ in range(8)]
    args = DPOConfig(output_dir=out_dir, per_device_train_batch_size=2, max_steps=3, learning_rate=5e-2,
                     logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=7, dataloader_num_workers=0,
                     bf16=False, optim="sgd", max_grad_norm=10.0)
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {k: [float(h[k]) for h in logs] for k in ("loss", "rewards/margins", "logps/chosen")}


def _dpo(rank, world, root):
    """DPOTrainer on the parallel model with a parallel reference model at TP=2, and on transformers' (its
    reference loaded by TRL) in a job of one process."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fxparallel

    path = f"{root}/with_tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(path)
    parallel, reference = (fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32) for _ in range(2))
    out = {"tp2": _dpo_run(parallel, reference, tokenizer, f"{root}/dpo{rank}")}
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out["single"] = _single_process(_dpo_run, single, None, tokenizer, f"{root}/dpo-single{rank}")
    weights = dict(single.named_parameters())
    out["weights"] = max((p.detach() - parallel.plan.param(n).shard_of(weights[n].detach(), rank, world)).abs().max()
                         .item() for n, p in parallel.local_named_parameters())
    return out


def _sft_lora(rank, world, root):
    """SFTTrainer training a LoRA adapter: on the parallel model (the adapter attached with load_adapter, trainable)
    at TP=2 and on PeftModel in a job of one process; SFTTrainer(peft_config=...) on the parallel model refused
    by PEFT's wrapping, naming add_adapter."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    import fxparallel

    path = f"{root}/with_tokenizer"
    adapter = f"{root}/sft-adapter"
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    if rank == 0:
        get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config).save_pretrained(adapter)
    dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(path)
    parallel = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    parallel.load_adapter(adapter, is_trainable=True)
    out = {"tp2": _sft_run(parallel, tokenizer, f"{root}/sft-lora{rank}")}
    single = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter,
                                       is_trainable=True)
    out["single"] = _single_process(_sft_run, single, tokenizer, f"{root}/sft-lora-single{rank}")
    ours, theirs = parallel.get_adapter_state_dict(), {
        k.removeprefix("base_model.model.").replace(".default.", "."): p.detach()
        for k, p in single.named_parameters() if ".lora_" in k}
    out["adapter weights"] = (sorted(ours) == sorted(theirs), max((ours[k] - theirs[k]).abs().max().item()
                                                                  for k in theirs))
    try:
        SFTTrainer(model=fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32),
                   args=SFTConfig(output_dir=f"{root}/sft-refused{rank}", report_to=[], use_cpu=True, max_steps=1),
                   train_dataset=Dataset.from_list([{"input_ids": [3, 4, 5]}]), processing_class=tokenizer,
                   peft_config=config)
        out["peft_config"] = "no error"
    except AttributeError as err:
        out["peft_config"] = str(err)
    return out


def _reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _grpo_run(model, tokenizer, out_dir, **options):
    """Stock GRPOTrainer, 2 steps of 4 sampled completions of one prompt each (SGD; GRPOConfig ``options``); returns
    its logged values and the completions it sampled."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = ["the cat", "a dog ran", "one two", "big red tree", "the mat", "it was", "then a", "under the"]
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=5,
                      max_steps=2, learning_rate=5e-2, logging_steps=1, report_to=[], use_cpu=True,
                      save_strategy="no", seed=7, dataloader_num_workers=0, bf16=False, optim="sgd",
                      max_grad_norm=10.0, **options)
    trainer = GRPOTrainer(model=model, args=args, reward_funcs=_reward_length, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    values = {k: [float(h[k]) for h in logs] for k in ("loss", "reward", "reward_std", "grad_norm")}
    return {"logs": values, "completions": list(trainer._logs["completion"])}


def _grpo(rank, world, root):
    """TRL's GRPOTrainer at TP=2 against the same on the parallel model at TP=1 (a job of one process), whose
    sampling draws as fxparallel's generate draws (transformers' generate draws otherwise). TRL seeds each process
    differently and shuffles each generation batch with the global generator after sampling: a sampling generate
    leaves the tp ranks' generators alike, so they shuffle alike (before: each rank its own order, refused at
    the first forward by the input check). ``scale_rewards="batch"`` is refused before any update."""
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    import fxparallel
    from fxparallel.errors import ArgumentError

    path = f"{root}/with_tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(path)
    groups = [dist.new_group([r]) for r in range(world)]
    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    try:  # advantages over the std of the whole gathered batch, where each tp rank's rewards are repeated
        _grpo_run(model, tokenizer, f"{root}/grpo-batch{rank}", scale_rewards="batch")
        out = {"batch std": "no error"}
    except ArgumentError as err:
        out = {"batch std": str(err)}
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.local_named_parameters())
    out["tp2"] = _grpo_run(model, tokenizer, f"{root}/grpo{rank}")
    if rank == 0:
        single = fxparallel.parallelize(path, groups[rank], dtype=torch.float32)
        out["tp1"] = _single_process(_grpo_run, single, tokenizer, f"{root}/grpo-single")
        weights = dict(single.local_named_parameters())
        out["weights"] = max((p.detach() - model.plan.param(n).shard_of(weights[n].detach(), rank, world)).abs().max()
                             .item() for n, p in model.local_named_parameters())
    out["trained"] = max((p.detach() - before[n]).abs().max().item() for n, p in model.local_named_parameters())
    return out


def _own_loop(rank, world, path):
    """A loop of one's own with torch's clipping: the optimizer built on ``parameters()`` (the plain shards), then
    ``torch.nn.utils.clip_grad_norm_(model.parameters())``, which turns them into DTensor views first (with the
    backward's gradients), is the global norm and the optimizer, re-pointed at the views when it steps, trains the
    model: norms and weights of the single-device loop. A list of the shards taken before (torch's clipping then
    never asks the model) is refused by ``clip_grad_norm_`` with every gradient unchanged, before the views exist and
    after (when they hold the gradients and the list none); ``clip_grad_value_`` over it, exact on shards, runs.
    Adafactor (torch's and transformers'), whose update reads the whole tensor, and ZeroRedundancyOptimizer over the
    tp ranks are refused over the shards at their first step, every weight unchanged; so is GradScaler, whose inf
    check would be each rank's own, while ShardedGradScaler skips the step on every rank when one rank's piece
    overflows."""
    import torch
    from transformers import AutoModelForCausalLM

    import fxparallel
    from checks import raised
    from fxparallel.errors import ArgumentError

    model = fxparallel.parallelize(path, torch.distributed.group.WORLD, dtype=torch.float32)
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = torch.randint(0, 128, (4, 10), generator=torch.Generator().manual_seed(11))
    taken = list(model.parameters())

    def clip_taken() -> dict:
        model(input_ids=rows, labels=rows).loss.backward()
        grads = [None if p.grad is None else p.grad.clone() for p in taken]
        try:
            torch.nn.utils.clip_grad_norm_(taken, 0.5)
            error = "no error"
        except ArgumentError as err:
            error = str(err)
        kept = all((g is None and p.grad is None) or torch.equal(g, p.grad) for g, p in zip(grads, taken))
        held = [p.grad for p in taken if p.grad is not None]  # none once the views hold the gradients
        if held:
            torch.nn.utils.clip_grad_value_(taken, 2 ** -10)
        by_value = max(g.abs().max().item() for g in held) if held else None
        model.zero_grad(set_to_none=True)
        return {"error": error, "kept": kept, "by value": by_value}

    out = {"taken before": clip_taken()}
    norms = []
    for m, optimizer in ((model, torch.optim.AdamW(model.parameters(), lr=3e-4)),
                         (single, torch.optim.AdamW(single.parameters(), lr=3e-4))):
        for _ in range(3):
            m(input_ids=rows, labels=rows).loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5).item())
            optimizer.step()
            optimizer.zero_grad()
    reference = dict(single.named_parameters())
    weights = max((p.detach() - model.plan.param(n).shard_of(reference[n].detach(), rank, world)).abs().max().item()
                  for n, p in model.local_named_parameters())
    out["taken, views on"] = clip_taken()
    # an optimizer whose update reads the whole tensor, over the shards, and ZeRO over the tp ranks (each rank's
    # update broadcast over the others' shards): refused at the first step, nothing changed
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from transformers.optimization import Adafactor

    fresh = fxparallel.parallelize(path, torch.distributed.group.WORLD, dtype=torch.float32)
    before = [p.detach().clone() for p in fresh.parameters()]
    out["whole-tensor optimizers"] = []
    for optimizer in (torch.optim.Adafactor(fresh.parameters()), Adafactor(fresh.parameters()),
                      ZeroRedundancyOptimizer(fresh.parameters(), optimizer_class=torch.optim.AdamW)):
        fresh(input_ids=rows, labels=rows).loss.backward()
        out["whole-tensor optimizers"].append(raised(optimizer.step, ArgumentError))
        fresh.zero_grad(set_to_none=True)
    out["whole-tensor kept"] = all(torch.equal(a, p) for a, p in zip(before, fresh.parameters()))
    # loss scaling: GradScaler's inf check over the shards is each rank's own (refused, every gradient kept);
    # ShardedGradScaler's is the group's: an overflow in rank 0's piece alone skips the step on both ranks
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    scaled = {}
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0), ShardedGradScaler("cpu", init_scale=2.0)):
        scaler.scale(fresh(input_ids=rows, labels=rows).loss).backward()
        if rank == 0:
            dict(fresh.local_named_parameters())["model.layers.0.self_attn.q_proj.weight"].grad[0, 0] = float("inf")
        grads = [p.grad.clone() for p in fresh.parameters()]
        scaled[type(scaler).__name__] = raised(lambda: scaler.step(optimizer), ArgumentError)
        if isinstance(scaler, ShardedGradScaler):
            scaler.update()
            scaled["scale"] = scaler.get_scale()
        else:
            scaled["kept"] = all(torch.equal(g, p.grad) for g, p in zip(grads, fresh.parameters()))
        fresh.zero_grad(set_to_none=True)
    scaled["weights kept"] = all(torch.equal(a, p) for a, p in zip(before, fresh.parameters()))
    out["loss scaling"] = scaled
    return {**out, "norms": norms, "weights": weights}


def _single_device_state(path, directory, rows):
    """One AdamW step of the Hugging Face model under accelerate in one process, then ``save_state(directory)``."""
    import torch
    from accelerate import Accelerator

    from models import reference

    accelerator = Accelerator(cpu=True)
    model = reference(path)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    accelerator.backward(model(input_ids=rows, labels=rows).loss)
    optimizer.step()
    accelerator.save_state(directory)


def _accelerate_checkpoints(rank, world, path, root):
    """accelerate writes a state dict from its main process alone: ``accelerator.save_model`` (through its
    ``get_state_dict``) writes the complete trained weights; ``accelerator.save_state``, whose optimizer file would
    be the main process's moments alone, is refused before anything is written. ``accelerator.load_state`` of a
    single-device run's folder loads its weights into the shards, and its optimizer file (whole moments, paired with
    the shards by position) is refused before the first step, nothing stepped."""
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator
    from accelerate.utils import ParallelismConfig
    from safetensors.torch import load_file

    import fxparallel
    from checks import raised
    from fxparallel.accelerate_cpu import allow_tensor_parallel_on_cpu

    allow_tensor_parallel_on_cpu()
    _reset_accelerate()
    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=world))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    rows = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    accelerator.backward(model(input_ids=rows, labels=rows).loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.save_model(model, f"{root}/accelerate_model")
    out = {"others_get": len(accelerator.get_state_dict(model))}
    dist.barrier()
    saved = load_file(f"{root}/accelerate_model/model.safetensors")
    equal = []
    for name, param in model.local_named_parameters():
        plan = model.plan.param(name)
        key = next(n for n in plan.names if n in saved)
        equal.append(torch.equal(plan.shard_of(saved[key], rank, world), param.detach()))
    out["saved_equals_shards"] = (len(equal), all(equal))
    out["save_state"] = raised(lambda: accelerator.save_state(f"{root}/accelerate_state"))
    out["state_files"] = sorted(os.listdir(f"{root}/accelerate_state")) if os.path.isdir(
        f"{root}/accelerate_state") else []
    # what the refusal names instead: DCP of the model and the optimizer (over the DTensor views), then resumed
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=f"{root}/accelerate_dcp")
    fresh = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    fresh.tp_size  # noqa: B018 -- the views, as accelerate's run had them
    resumed = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh(input_ids=rows, labels=rows).loss.backward()
    resumed.step()  # the optimizer's state exists: DCP loads into it in place
    resumed.zero_grad()
    state = {"model": fresh.state_dict(), "optim": resumed.state_dict()}
    dcp.load(state, checkpoint_id=f"{root}/accelerate_dcp")
    fresh.load_state_dict(state["model"])
    resumed.load_state_dict(state["optim"])
    for m, o in ((model, optimizer), (fresh, resumed)):
        m(input_ids=rows, labels=rows).loss.backward()
        o.step()
        o.zero_grad()
    out["dcp_resumed"] = max((p.detach() - q.detach()).abs().max().item()
                             for (_, p), (_, q) in zip(model.local_named_parameters(), fresh.local_named_parameters()))
    # a single-device run's save_state, loaded at TP=2 (map_location: accelerate names the device "cpu:0" here)
    _reset_accelerate()
    _single_process(_single_device_state, path, f"{root}/single_state{rank}", rows)
    foreign = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=world))
    foreign, optimizer = accelerator.prepare(foreign, torch.optim.AdamW(foreign.parameters(), lr=1e-3))
    accelerator.load_state(f"{root}/single_state{rank}", map_location="cpu")
    saved = load_file(f"{root}/single_state{rank}/model.safetensors")
    out["foreign_weights"] = max((foreign.plan.param(n).shard_of(saved[n], rank, world) - p.detach()).abs().max().item()
                                 for n, p in foreign.local_named_parameters())
    accelerator.backward(foreign(input_ids=rows, labels=rows).loss)
    out["foreign_step"] = raised(optimizer.step)
    out["foreign_kept"] = max((foreign.plan.param(n).shard_of(saved[n], rank, world) - p.detach()).abs().max().item()
                              for n, p in foreign.local_named_parameters())
    _reset_accelerate()
    return out


def _cases(rank, world, path, root):
    import torch
    import torch.distributed as dist

    import fxparallel
    from checks import compare
    from models import reference

    out = {}
    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ref = reference(path)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))

    # num_items_in_batch (a tensor, as Trainer passes it): loss = sum of token losses / it, every gradient
    out["items"] = compare(model, ref, rank, world, ids, num_items_in_batch=torch.tensor(7))
    out["items_loss_ratio"] = (model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(7)).loss
                               / model(input_ids=ids, labels=ids).loss).item()

    # Trainer's FLOP count asks for the parameters without the embeddings
    out["counts"] = [(model.num_parameters(exclude_embeddings=e), ref.num_parameters(exclude_embeddings=e))
                     for e in (False, True)]

    # Trainer's call: activation_checkpointing_enable(activation_checkpointing_kwargs=..., every_n_layers, offload)
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=None, every_n_layers=2, offload=False)
    out["checkpointed"] = [u.checkpoint is not None for u in model.layer_units()]
    out["checkpointed_grads"] = compare(model, ref, rank, world, ids)
    model.gradient_checkpointing_disable()
    try:
        model.activation_checkpointing_enable(offload=True)
        out["offload"] = "no error"
    except ValueError as err:
        out["offload"] = str(err)

    out["tp2"] = _tensor_parallel_trainer(rank, world, path, root)
    out["resumed"] = _resumed(rank, world, path, root)
    out["pipeline"] = _pipeline(rank, root)
    out["lm_eval"] = _lm_eval(rank, root)
    out["hooks"] = _hooks(rank, world, path, root)
    out["fused_head"] = _fused_head(rank, world, f"{root}/with_tokenizer")
    out["sft"] = _sft(rank, world, root)
    out["sft_lora"] = _sft_lora(rank, world, root)
    out["dpo"] = _dpo(rank, world, root)
    out["grpo"] = _grpo(rank, world, root)
    out["own_loop"] = _own_loop(rank, world, path)
    out["accelerate_checkpoints"] = _accelerate_checkpoints(rank, world, path, root)

    # stock Trainer at TP=1 (a group of this rank alone, as a job of one process)
    groups = [dist.new_group([r]) for r in range(world)]
    if rank == 0:
        from transformers import AutoModelForCausalLM

        parallel = fxparallel.parallelize(path, groups[rank], dtype=torch.float32)
        single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        out["tp1"] = {"trainer": _single_process(_trainer_run, parallel, f"{root}/parallel"),
                      "trainer_ref": _single_process(_trainer_run, single, f"{root}/single")}
        from fxparallel.dtensor_parameters import DTensorParametersError, use_dtensor_parameters

        try:  # a tp group smaller than the job: data parallelism around it, which Trainer cannot do for it
            use_dtensor_parameters(parallel)
            out["tp1"]["smaller_group"] = "no error"
        except DTensorParametersError as err:
            out["tp1"]["smaller_group"] = str(err)
        ref_params = dict(single.named_parameters())
        out["tp1"]["trainer_weights"] = max((p.detach() - ref_params[n].detach()).abs().max().item()
                                            for n, p in parallel.named_parameters())
    return out


def _check_trainer(run: dict) -> None:
    losses, norms, counters = run["trainer"]
    ref_losses, ref_norms, ref_counters = run["trainer_ref"]
    assert len(losses) == 4 and len(ref_losses) == 4
    # Trainer's tokens seen at each step and total flos: the single device's (each tp group's batch counted once)
    assert counters == ref_counters and ref_counters[0] > 0, (counters, ref_counters)
    for ours, theirs in zip(losses + norms, ref_losses + ref_norms):
        assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (losses, ref_losses, norms, ref_norms)
    assert max(ref_norms) > 0.5  # the clipping acted
    assert run["trainer_weights"] < 1e-5, run["trainer_weights"]


def _check_eval(run: dict, tp: int) -> None:
    """Trainer's evaluation of the parallel model against the single-device Trainer's: the loss and the metrics
    (``compute_metrics`` called, over complete logits), and the predictions, which accelerate gathers over every
    process, as for transformers' own TP models: each step's batch once per tp rank."""
    ours, theirs = run["eval"], run["eval_ref"]
    for key in ("eval_loss", "eval_mean_logit", "eval_top1"):
        assert abs(ours["metrics"][key] - theirs["metrics"][key]) < 1e-4, (key, ours["metrics"], theirs["metrics"])
    steps, batch = 3, 2
    got = ours["predictions"].reshape(steps, tp, batch, *theirs["predictions"].shape[1:])
    expected = theirs["predictions"].reshape(steps, 1, batch, *theirs["predictions"].shape[1:])
    assert abs(got - expected).max() < 1e-4, abs(got - expected).max()  # (trained weights 1e-5 apart)


def _check_resumed(resumed: dict) -> None:
    assert [log[0] for log in resumed["resumed"]] == [1, 2, 3, 4], resumed  # steps 1-2 from the checkpoint's state
    assert len(resumed["full"]) == 4
    for ours, theirs in zip(resumed["resumed"][2:], resumed["full"][2:]):
        assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(ours, theirs)), resumed
    assert resumed["full"][2][3] > 0 and max(log[2] for log in resumed["full"]) > 0.5, resumed  # lr > 0, clipped
    assert resumed["weights"] < 1e-6, resumed["weights"]
    if "other layout" in resumed:  # resumed at another layout: steps 3 and 4 those of the uninterrupted run
        for ours, theirs in zip(resumed["other layout"][2:], resumed["full"][2:], strict=True):
            assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(ours, theirs)), resumed
    assert "has no fxparallel_optimizer or fxparallel_trainer_state.json" in resumed["without_files"], resumed
    assert "its optimizer states were saved with other weights" in resumed["other_folder"], resumed["other_folder"]
    assert resumed["full_state_dict"] < 1e-5, resumed


def _check_own_loop(r):
    norms = r["own_loop"]["norms"]
    assert min(norms) > 0.5, norms  # the clipping acted
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms[:3], norms[3:])), norms
    assert r["own_loop"]["weights"] < 1e-5, r["own_loop"]
    for when in ("taken before", "taken, views on"):  # a list of the shards taken earlier: refused, nothing changed
        refused = r["own_loop"][when]
        assert "clip_grad_norm_ reached a tensor-parallel shard" in refused["error"] and \
            "through a list of parameters taken before" in refused["error"] and refused["kept"], (when, refused)
    assert 0 < r["own_loop"]["taken before"]["by value"] <= 2 ** -10, r["own_loop"]  # by value: element by element
    adafactors, zero = r["own_loop"]["whole-tensor optimizers"][:2], r["own_loop"]["whole-tensor optimizers"][2]
    for refused, name in zip(adafactors, ("torch.optim.Adafactor", "transformers.optimization.Adafactor")):
        assert f"{name} over the parallel model's shards would compute its update from this rank's piece" in \
            refused, refused
    assert "ZeroRedundancyOptimizer over the parallel model: after each step it broadcasts" in zero and \
        "one rank's shards would overwrite the others'" in zero, zero
    assert r["own_loop"]["whole-tensor kept"], r["own_loop"]
    scaled = r["own_loop"]["loss scaling"]
    assert "torch.amp.GradScaler reached a tensor-parallel shard" in scaled["GradScaler"] and \
        "ShardedGradScaler" in scaled["GradScaler"] and scaled["kept"], scaled
    assert scaled["ShardedGradScaler"] == "no error" and scaled["scale"] == 1.0 and scaled["weights kept"], scaled


def test_trainer_stack(checkpoints, tmp_path):
    results = run_ranks(2, _cases, checkpoints["llama"], str(tmp_path))
    for r in results:
        for key in ("items", "checkpointed_grads"):
            assert r[key]["loss"] < 1e-5 and r[key]["logits"] < 1e-5 and r[key]["grad"] < 1e-5, (key, r[key])
        assert abs(r["items_loss_ratio"] - 16 / 7) < 1e-5  # 2 rows x 8 shifted labels, summed, over 7
        assert all(ours == theirs for ours, theirs in r["counts"]), r["counts"]
        assert r["counts"][1][0] < r["counts"][0][0]
        assert r["checkpointed"] == [True, False]  # two layers, every second one checkpointed
        assert "offload=True" in r["offload"] and "not supported" in r["offload"], r["offload"]
        _check_trainer(r["tp2"])
        _check_eval(r["tp2"], 2)
        smoothed, smoothed_ref = r["tp2"]["smoothed"], r["tp2"]["smoothed_ref"]
        assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(smoothed[0] + smoothed[1],
                                                                        smoothed_ref[0] + smoothed_ref[1])), \
            (smoothed, smoothed_ref)
        best, best_ref = r["tp2"]["best"], results[0]["tp2"]["best_ref"]
        assert best["best"] == best_ref["best"] == "checkpoint-4" and best_ref["evals"][2] > best_ref["evals"][1], best_ref
        assert all(abs(a - b) < 1e-4 for a, b in zip(best["evals"] + [best["loaded"]],
                                                      best_ref["evals"] + [best_ref["loaded"]])), (best, best_ref)
        assert r["tp2"]["replicated_identical"] and r["tp2"]["replicated_count"] == 5  # 2 x 2 layer norms + final
        assert r["tp2"]["saved_equals_shards"] and r["tp2"]["saved_vs_single"] < 1e-5, r["tp2"]
        _check_resumed(r["resumed"])
        _check_own_loop(r)
        ckpt = r["accelerate_checkpoints"]
        assert ckpt["saved_equals_shards"][1] and ckpt["saved_equals_shards"][0] > 10, ckpt
        assert ckpt["others_get"] > 10 if r is results[0] else ckpt["others_get"] == 0, ckpt
        assert "accelerator.save_state() cannot checkpoint the parallel model" in ckpt["save_state"] and \
            "dcp.save(" in ckpt["save_state"] and ckpt["state_files"] == [], ckpt
        assert ckpt["dcp_resumed"] == 0.0, ckpt  # the same step from the same weights and moments
        assert ckpt["foreign_weights"] == 0.0 and ckpt["foreign_kept"] == 0.0, ckpt
        assert "ArgumentError: optimizer state 'exp_avg' of the parallel model's parameter" in ckpt["foreign_step"] \
            and "a state saved by a run of another layout" in ckpt["foreign_step"], ckpt["foreign_step"]
        pipe = r["pipeline"]
        assert pipe["texts"][0] == pipe["texts"][1] and pipe["stopped"][0] == pipe["stopped"][1], pipe
        assert len(pipe["stopped"][1]) < len(pipe["texts"][1]) and pipe["stop"] in pipe["stopped"][1], pipe
        assert "text-generation" in pipe["repr"] or "TextGeneration" in pipe["repr"], pipe["repr"]
        hooks = r["hooks"]
        assert hooks["ran"] == ["layer 1", "model"] and hooks["layers"] == [2, ["LayerUnit"] * 2], hooks
        assert "module 'model.layers.0.mlp.up_proj'.register_forward_hook(...)" in hooks["submodule"] and \
            "would never run" in hooks["submodule"], hooks
        assert "module 'lm_head'.register_full_backward_hook" in hooks["backward"], hooks
        assert "InputError: the tp ranks hold shards of different weights: load_state_dict loaded weights into " \
            "this model 1 time(s) on tp rank 0, 0 time(s) on tp rank 1" in hooks["one rank load"], hooks
        assert "TrainingArguments(torch_compile=True)" in hooks["torch_compile"] and \
            "to broadcast it from rank 0" in hooks["torch_compile"], hooks["torch_compile"]
        assert "get_input_embeddings()" in hooks["neftune"] and "neftune_noise_alpha" in hooks["neftune"] and \
            hooks["kept"], hooks
        ours, theirs = r["lm_eval"]["parallel"], r["lm_eval"]["transformers"]
        if r is results[0]:
            assert [len(c) for c in ours["choices"]] == [3, 3, 3, 2] and ours["acc"] == theirs["acc"], (ours, theirs)
            assert max(abs(a - b) for x, y in zip(ours["choices"], theirs["choices"]) for a, b in zip(x, y)) < 1e-4, \
                (ours, theirs)
        else:
            assert "acc" not in ours and "acc" not in theirs, (ours, theirs)
        assert abs(ours["rolling"][0] - theirs["rolling"][0]) < 1e-4, (ours, theirs)
        assert ours["generated"] == theirs["generated"] and ours["generated"][0], (ours, theirs)
        fused = r["fused_head"]
        assert all(v < 1e-5 for k, v in fused.items() if k not in ("top1_hits", "refused")), fused
        assert "logits_to_keep is not taken with it" in fused["refused"], fused["refused"]
        assert fused["top1_hits"] > 0, fused  # is_top1 compared where it is True somewhere
        sft = r["sft"]
        for key, ours in sft["tp2"].items():
            assert len(ours) == 3 and all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(ours, sft["single"][key])), (
                key, ours, sft["single"][key])
        assert max(sft["single"]["grad_norm"]) > 0.5 and sft["weights"] < 1e-5, sft  # clipped; the same weights
        dpo = r["dpo"]
        for key, ours in dpo["tp2"].items():
            assert len(ours) == 3 and all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(ours, dpo["single"][key])), (
                key, ours, dpo["single"][key])
        assert dpo["single"]["rewards/margins"][-1] > 0.1 and dpo["weights"] < 1e-5, dpo  # it learned; the same weights
        lora = r["sft_lora"]
        for key, ours in lora["tp2"].items():
            assert len(ours) == 3 and all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(ours, lora["single"][key])), (
                key, ours, lora["single"][key])
        assert lora["adapter weights"][0] and lora["adapter weights"][1] < 1e-5, lora["adapter weights"]
        assert "cannot wrap the parallel model" in lora["peft_config"] and "add_adapter" in lora["peft_config"], lora
        grpo, grpo1 = r["grpo"], results[0]["grpo"]
        assert grpo["batch std"].startswith("GRPOConfig(scale_rewards='batch') at tp=2: accelerate gathers each tp "
                                            "rank's rewards") and grpo["unchanged"], grpo["batch std"]
        # the last step's completions, as TRL logs them (gathered: each tp rank's, the same, at TP=2)
        sampled = grpo1["tp1"]["completions"]
        assert len(sampled) == 4 and grpo["tp2"]["completions"] == sampled * 2, (grpo["tp2"], sampled)
        for key in ("loss", "reward", "grad_norm"):
            ours, theirs = grpo["tp2"]["logs"][key], grpo1["tp1"]["logs"][key]
            assert len(ours) == 2 and all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(ours, theirs)), (
                key, ours, theirs)
        # the logged reward_std is over the gathered batch, each of the 4 rewards twice: sqrt(6/7) of one device's
        for ours, theirs in zip(grpo["tp2"]["logs"]["reward_std"], grpo1["tp1"]["logs"]["reward_std"]):
            assert abs(ours - theirs * (6 / 7) ** 0.5) < 1e-5, (ours, theirs)
        # the rewards differ within a group, so it trained; the same weights
        assert min(grpo["tp2"]["logs"]["reward_std"]) > 0 and grpo["trained"] > 1e-3 and grpo1["weights"] < 1e-5, \
            (grpo["trained"], grpo1["weights"])
    _check_trainer(results[0]["tp1"])
    assert "the world has 2 ranks and the model's tp group 1" in results[0]["tp1"]["smaller_group"]


def _fused_weights(rank, world, paths, root):
    """Stock Trainer on models with fused weights of equal parts (Mixtral's experts split inside, gate / up; GPT-2's
    c_attn, q / k / v on dim 1) against one process: losses, grad norms, every weight as its view's full_tensor(); and
    Phi-3 with fewer kv heads (q / k / v of unequal sizes), refused naming the parameter, by Trainer's read and by
    torch's ``clip_grad_norm_`` (every gradient kept)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    import fxparallel
    from checks import raised
    from fxparallel.accelerate_cpu import allow_tensor_parallel_on_cpu
    from transformers import AutoModelForCausalLM

    allow_tensor_parallel_on_cpu()
    out = {}
    for name in ("mixtral", "gpt2"):
        parallel = fxparallel.parallelize(paths[name], dist.group.WORLD, dtype=torch.float32)
        # SGD: GPT-2's key bias has a gradient of exactly zero in exact arithmetic (softmax ignores a constant per
        # query), which AdamW would turn from fp32 rounding into lr-sized steps whatever computed it
        run = {"trainer": _trainer_run(parallel, f"{root}/{name}-tp{rank}", optim="sgd")}
        single = AutoModelForCausalLM.from_pretrained(paths[name], dtype=torch.float32)
        run["trainer_ref"] = _single_process(_trainer_run, single, f"{root}/{name}-single{rank}", None, "sgd")
        ref_params = dict(single.named_parameters())
        views = dict(parallel.named_parameters())  # Trainer's DTensor views: whole weights, fused ones included
        run["trainer_weights"] = max((v.full_tensor() - ref_params[n]).abs().max().item() for n, v in views.items())
        run["strided"] = sorted(n for n, v in views.items() if isinstance(v.placements[0], _StridedShard))
        out[name] = run
    phi3 = fxparallel.parallelize(paths["phi3"], dist.group.WORLD, dtype=torch.float32)
    rows = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    phi3(input_ids=rows, labels=rows).loss.backward()
    grads = {n: p.grad.clone() for n, p in phi3.named_parameters()}
    out["clip_refused"] = raised(lambda: torch.nn.utils.clip_grad_norm_(phi3.parameters(), 1e-3))
    out["clip_kept"] = all(torch.equal(p.grad, grads[n]) and not isinstance(p, DTensor)
                           for n, p in phi3.named_parameters())
    out["refused"] = raised(lambda: phi3.tp_size)
    out["gpt2_resumed"] = _resumed(rank, world, paths["gpt2"], root)  # checkpoints of strided (fused) states
    return out


def test_trainer_trains_fused_weights_of_equal_parts(tmp_path):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from models import save_checkpoint
    from tiny_configs import tiny_config

    paths = {"mixtral": save_checkpoint(tiny_config("mixtral"), str(tmp_path / "mixtral")),
             "gpt2": save_checkpoint(tiny_config("gpt2"), str(tmp_path / "gpt2")),
             "phi3": save_checkpoint(tiny_config("phi3", num_attention_heads=4, num_key_value_heads=2),
                                     str(tmp_path / "phi3"))}
    for r in run_ranks(2, _fused_weights, paths, str(tmp_path)):
        for name in ("mixtral", "gpt2"):
            _check_trainer(r[name])
        _check_resumed(r["gpt2_resumed"])
        assert r["mixtral"]["strided"] == [f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(2)], r["mixtral"]
        assert any(n.endswith("attn.c_attn.weight") for n in r["gpt2"]["strided"]), r["gpt2"]["strided"]
        assert "qkv_proj.weight is a segmented shard" in r["refused"] and "DTensor has no placement" in r["refused"], \
            r["refused"]
        assert r["clip_refused"].startswith("DTensorParametersError: torch.nn.utils.clip_grad_norm_(model.parameters(), ...)") and \
            "qkv_proj.weight is a segmented shard" in r["clip_refused"] and \
            "Clip with fxparallel.runtime.clip_grad_norm_(model, max_norm, mesh)" in r["clip_refused"], r["clip_refused"]
        assert r["clip_kept"], "a refused clip changed a gradient or the parameters"
