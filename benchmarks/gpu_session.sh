#!/usr/bin/env bash
# Everything that needs a GPU, on a machine with one CUDA device:
#   bash benchmarks/gpu_session.sh [OUT_DIR [STAGE ...]]   (default: $OUT, else benchmarks/results/gpu; all stages,
#   about 25 minutes: a lent machine's call runs 10 at most, so name the stages for one call)
# Stages, in this order:
#   tests                     the gpu-marked tests (tests/test_cuda.py: TP=1 over NCCL against transformers in
#                             fp32/bf16/fp16, greedy generation eager / compiled / CUDA graphs, a compiled
#                             training step, checkpointing with deterministic kernels, a mixture of experts with
#                             the grouped_mm kernel and its load-balancing loss in fp32 / bf16, stock Trainer;
#                             tests/test_cuda_tp2.py: TP=2 as two processes on the one GPU over "cuda:gloo":
#                             training, LoRA, generate eager / compiled / CUDA graphs, DCP, save_pretrained, a
#                             mixture of experts with grouped_mm and the planner's whole experts per rank);
#   generate-fp32, -bf16      benchmarks/generate.py on CUDA at TP=1: every system (static cache, compile, CUDA
#                             graphs) on the small default Llama in fp32, then bf16 on a 160M-parameter one;
#   generate-1b               the same in bf16 on a Llama-3.2-1B-shaped model (16 layers, hidden 2048, vocabulary
#                             128256; random weights, built on the machine), batch 8 and 1, eager and CUDA graphs
#                             (fxparallel's also without its run-ahead of the stopping check);
#   decode-profile-1b         benchmarks/step_profile.py --device cuda on that model, batch 1 and 8: where a decode
#                             step's time goes (kernels by kind, the GPU's idle time, the host's CUDA calls), eager
#                             and with CUDA graphs, for both systems;
#   compile                   benchmarks/compile.py (training step, eager against compiled, both systems);
#   compare, activation-checkpointing
#                             benchmarks/compare_tp_plan.py and benchmarks/activation_checkpointing.py (step time,
#                             peak memory of the CUDA allocator, agreement with the single-device model).
# Wheels in .whl/ (e.g. a newer transformers than the machine has) are installed into /tmp/site first.
# Each stage has its own time limit and a failing stage does not stop the next; the
# exit status is 1 if any failed. Results in OUT_DIR: session.log and one JSON per benchmark (docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-benchmarks/results/gpu}}
shift $(($# > 0 ? 1 : 0))
wanted=" ${*:-tests generate-fp32 generate-bf16 generate-1b decode-profile-1b compile compare activation-checkpointing} "
mkdir -p "$out"

session() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || return 1
    export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__,
'| cuda', torch.version.cuda, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA DEVICE')"
  python3 -c "import importlib.util as u; print('test extras:', {m: u.find_spec(m) is not None for m in
('peft', 'accelerate', 'psutil', 'trl', 'datasets')})"

  local shape_1b=hidden=2048,layers=16,heads=32,kv_heads=8,intermediate=8192,vocab=128256
  local failed=() run1=(python3 -m torch.distributed.run --nproc_per_node=1)
  stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    [[ $wanted == *" $name "* ]] || return 0
    echo "== $name (limit ${limit} s)"
    timeout -k 10 "$limit" "$@"
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" = 0 ] || failed+=("$name")
  }
  stage tests 240 python3 -m pytest -q -n 0 -m gpu tests/test_cuda.py tests/test_cuda_tp2.py -p no:cacheprovider
  stage generate-fp32 130 "${run1[@]}" benchmarks/generate.py --device cuda --systems cuda --repeats 3 \
    --out "$out/generate_tp1.json"
  stage generate-bf16 140 "${run1[@]}" benchmarks/generate.py --device cuda --repeats 3 --dtype bfloat16 \
    --systems fxparallel,fxparallel-cudagraphs,transformers,transformers-cudagraphs \
    --shape hidden=1024,layers=8,heads=16,kv_heads=8,intermediate=2816,vocab=32000 --out "$out/generate_tp1_bf16.json"
  stage generate-1b 300 "${run1[@]}" benchmarks/generate.py --device cuda --repeats 7 --dtype bfloat16 --batches 8,1 \
    --systems fxparallel,fxparallel-cudagraphs,fxparallel-cudagraphs-sync,transformers,transformers-cudagraphs \
    --shape "$shape_1b" --out "$out/generate_tp1_1b.json"
  for b in 1 8; do
    stage decode-profile-1b 200 "${run1[@]}" benchmarks/step_profile.py --device cuda --dtype bfloat16 --batch $b \
      --systems fxparallel,fxparallel-cudagraphs,transformers,transformers-cudagraphs --shape "$shape_1b" \
      --out "$out/decode_profile_1b_b$b.json"
  done
  stage compile 100 "${run1[@]}" benchmarks/compile.py --device cuda --repeats 10 --out "$out/compile_tp1.json"
  stage compare 40 "${run1[@]}" benchmarks/compare_tp_plan.py --steps 10 --json "$out/compare_tp1.json"
  stage activation-checkpointing 65 "${run1[@]}" benchmarks/activation_checkpointing.py --device cuda \
    --seqs 512,1024,2048 --out "$out/activation_checkpointing_tp1.json"

  echo "failed stages: ${failed[*]:-none}"
  [ ${#failed[@]} = 0 ]
}

session 2>&1 | tee "$out/session.log"
exit "${PIPESTATUS[0]}"
