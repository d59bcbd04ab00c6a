#!/usr/bin/env bash
# The GPU checks of issue #20 in one run on a lent GPU machine (the `device` tool): the GPU-marked tests, the
# trainer-mfu and attention suites, and the hand-written cuDNN step of ../shared/bench/gpu_llama1b.py (carried in
# .gpu/) as the same-device baseline. Missing wheels (jmp, tensorboardX, zstandard) travel in .whl/.
# Usage there: bash benchmarks/gpu_checks.sh STAGE... (stages: env tests mfu mfu-none mfu-plain mfu-packed mfu-b8
# mfu-b8-remat mfu-b16-acc4 mfu-b16-acc8 mfu-b16-remat mfu-b8-dots mfu-b16-dots mfu-unrolled mfu-b8-unrolled mfu-flags base base-b8 profile
# attention; the default is the plan for the next lease, about 550 s). Results go to $OUT (JSON lines + logs).
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
export PYTHONPATH="$PWD:$PWD/packages/namedtensor/src:$PWD/packages/datacache/src:$PWD/packages/models/src:$PWD/packages/trainer/src:/tmp/site"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 TF_CPP_MIN_LOG_LEVEL=2
stages=${*:-env mfu mfu-unrolled mfu-b8 mfu-b8-unrolled base base-b8}
t0=$(date +%s)
stamp() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
mfu() {  # label timeout env...
  local label=$1 limit=$2; shift 2
  stamp "trainer-mfu $label ($*)"
  env "$@" timeout "$limit" python3 -m benchmarks run trainer-mfu -o "$OUT/mfu.jsonl" >"$OUT/mfu-$label.log" 2>&1
  echo "rc=$?"; grep -E "step_time|mfu =|peak_memory|first_step" "$OUT/mfu-$label.log"; tail -n 3 "$OUT/mfu-$label.log" | grep -i error
}
for stage in $stages; do
  case $stage in
    env) stamp env; nvidia-smi -L; python3 -c "import jax, jaxlib, equinox, optax; print(jax.__version__, equinox.__version__, optax.__version__, jax.devices())" ;;
    tests) stamp tests
      # the GPU-marked kernel tests, and the fused loss's numerics (float32 products) on the GPU
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not multidevice" -rs \
        packages/models/tests/test_attention_backends.py packages/models/tests/test_fused_loss.py \
        >"$OUT/tests.log" 2>&1; echo "rc=$?"; grep -E "passed|failed|Error|error" "$OUT/tests.log" | tail -n 12 ;;
    mfu) mfu b4 170 PONENTE_BENCH_MFU_BATCH=4 ;;
    mfu-none) mfu b4-none 150 PONENTE_BENCH_MFU_BATCH=4 PONENTE_BENCH_MFU_SEGMENTS=none ;;
    mfu-plain) mfu b4-plain 150 PONENTE_BENCH_MFU_BATCH=4 PONENTE_BENCH_MFU_LOSS=plain ;;
    mfu-packed) mfu b4-packed 150 PONENTE_BENCH_MFU_BATCH=4 PONENTE_BENCH_MFU_SEGMENTS=packed ;;
    mfu-b8) mfu b8 170 PONENTE_BENCH_MFU_BATCH=8 ;;
    mfu-b8-remat) mfu b8-remat 170 PONENTE_BENCH_MFU_BATCH=8 PONENTE_BENCH_MFU_REMAT=true ;;
    # batch 16: four microbatches of 4 or two of 8 (the optimizer update once per 16 rows), or one with remat
    mfu-b16-acc4) mfu b16-acc4 200 PONENTE_BENCH_MFU_BATCH=16 PONENTE_BENCH_MFU_PER_DEVICE=4 ;;
    mfu-b16-acc8) mfu b16-acc8 200 PONENTE_BENCH_MFU_BATCH=16 PONENTE_BENCH_MFU_PER_DEVICE=8 ;;
    mfu-b16-remat) mfu b16-remat 200 PONENTE_BENCH_MFU_BATCH=16 PONENTE_BENCH_MFU_REMAT=true ;;
    # selective checkpointing: every projection's output kept, the attention kernel and the elementwise ops recomputed
    mfu-b8-dots) mfu b8-dots 200 PONENTE_BENCH_MFU_BATCH=8 PONENTE_BENCH_MFU_REMAT=attn_qkv,attn_context,attn_out,mlp_in,mlp_out ;;
    mfu-b16-dots) mfu b16-dots 220 PONENTE_BENCH_MFU_BATCH=16 PONENTE_BENCH_MFU_REMAT=attn_qkv,attn_context,attn_out,mlp_in,mlp_out ;;
    # model.scan_layers=false: the 16 layers unrolled in the compiled step (no loop, no stacked residual buffers)
    mfu-unrolled) mfu b4-unrolled 200 PONENTE_BENCH_MFU_BATCH=4 PONENTE_BENCH_MFU_SCAN_LAYERS=false ;;
    mfu-b8-unrolled) mfu b8-unrolled 200 PONENTE_BENCH_MFU_BATCH=8 PONENTE_BENCH_MFU_SCAN_LAYERS=false ;;
    # trainer.quantization: FP8 (delayed scaling) against bf16 in one process (the ratio is recorded)
    mfu-fp8) mfu b4-fp8 260 PONENTE_BENCH_MFU_BATCH=4 PONENTE_BENCH_MFU_QUANT=off,fp8 ;;
    # XLA's GPU flags: cuBLAS for every matrix product (no Triton GEMM fusions); MFU_XLA_FLAGS overrides the set
    mfu-flags) mfu b4-flags 170 PONENTE_BENCH_MFU_BATCH=4 \
      XLA_FLAGS="${MFU_XLA_FLAGS:---xla_gpu_enable_triton_gemm=false}" ;;
    base) stamp "hand-written cuDNN step (gpu_llama1b.py pos-cudnn, batch 4)"
      (cd .gpu && GPU_BENCH_STEPS=10 timeout 150 python3 gpu_llama1b.py --size 1b --only pos-cudnn --out "$OUT/base.jsonl" \
        --timeout 140 >"$OUT/base.log" 2>&1); echo "rc=$?"; tail -n 2 "$OUT/base.log" ;;
    base-b8) stamp "hand-written cuDNN step, batch 8"
      (cd .gpu && GPU_BENCH_STEPS=10 timeout 150 python3 gpu_llama1b.py --size 1b-b8 --only pos-cudnn --out "$OUT/base.jsonl" \
        --timeout 140 >"$OUT/base-b8.log" 2>&1); echo "rc=$?"; tail -n 2 "$OUT/base-b8.log" ;;
    profile) stamp "profile: Trainer step (batch 4, no segment ids) vs the hand-written cuDNN step"
      # with the optimized HLO of both steps (hlo-*/...after_optimizations.txt), to match kernels to ops offline
      XLA_FLAGS="--xla_dump_to=/tmp/hlo-ponente --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train.*" \
        PONENTE_BENCH_MFU_BATCH=4 PONENTE_BENCH_MFU_SEGMENTS=none PONENTE_BENCH_STEPS=3 timeout 150 \
        python3 -m benchmarks.gpu_profile ponente >"$OUT/profile-ponente.log" 2>&1; echo "rc=$?"
      grep -E "^---|^    " "$OUT/profile-ponente.log" | head -n 40
      XLA_FLAGS="--xla_dump_to=/tmp/hlo-positional --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*update.*" \
        GPU_BENCH_STEPS=3 timeout 120 python3 -m benchmarks.gpu_profile positional >"$OUT/profile-positional.log" 2>&1
      echo "rc=$?"; grep -E "^---|^    " "$OUT/profile-positional.log" | head -n 40
      for d in ponente positional; do
        mkdir -p "$OUT/hlo-$d"; find "/tmp/hlo-$d" -name "*after_optimizations.txt" -size -20M -exec cp {} "$OUT/hlo-$d/" \;
      done; ls -la "$OUT"/hlo-* ;;
    attention) stamp attention
      PONENTE_BENCH_ATTN_MASKS=${ATTN_MASKS:-causal,packed} PONENTE_BENCH_ATTN_SEQ_LENS=${ATTN_LENS:-512,1024,2048,4096,8192} timeout 200 python3 -m benchmarks run attention \
        -o "$OUT/attention.jsonl" >"$OUT/attention.log" 2>&1; echo "rc=$?"; grep -E "time_ratio|error" "$OUT/attention.log" | tail -n 40 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
stamp done
