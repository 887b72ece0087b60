#!/usr/bin/env bash
# Re-measures the one-H200 rows of BENCHMARKS.md's results table on a lent GPU machine: each
# group runs the commands the table names, one log per command under $OUT, and the end of each
# log (the bench's table) on stdout. Groups: tbo (device steps), serve (generate against
# transformers), kernels (grouped GEMM, attention), presets (grouped GEMM at model shapes), fp8
# (the FP8 kernels' GPU tests, the FP8 layer at decode sizes, the kernels alone at prefill
# sizes), fp8-step (the device step with bf16, then FP8 experts), real-dims (device steps at
# published models' dimensions), host (the runner's host time per step: the step model's cost
# table section runner_host), mla (the paged kernel's launch over an MLA latent pool),
# fp8-tiles (the Pallas FP8 layer's tiles at decode sizes), gemm-kernels (the grouped GEMM
# layer's kernels at Qwen3-30B-A3B's shape, bf16 and FP8), mosaic-odd (Mosaic with an odd
# column tile against Pallas), fp8-threshold (Pallas against Mosaic FP8 around "auto"'s
# threshold), ranks (the expert layer with the blocked group ranks against the one-hot ones),
# dsv3-walk (the Mosaic walk's row tiles per column pair at DeepSeek-V3's 4096 tokens),
# prefetch (the Mosaic kernels' one pipeline over a CTA's tiles, against the default),
# fp8-mosaic-decode / fp8-mosaic-prefill (the FP8 Mosaic default, one pipeline over a CTA's
# tiles, against the waited pipelines; STACKS picks the decode stacks), sampler (the sampled
# step's keys-only sort against the key-value sorts, and a sampled against a greedy serve),
# memory-registers (the memory warpgroup's registers), tma-layout (TMA streaming FP8 weight
# tiles from the stored order against a tile-major copy), tma-rows (the same with a row block
# beside each weight tile, as the FP8 decode kernels load theirs), split-default (the FP8
# default as shipped, splitting the columns at decode sizes, against the unsplit one and
# Pallas), pallas-rows (the FP8 Pallas decode kernels' row tiles at twice the balanced load
# against the default's one).
# loads (the Mosaic kernels timed without their products: tools/mosaic_load_probe.py),
# fp8-step (the decode device step with FP8 experts beside bf16, Qwen3-30B-A3B's dimensions),
# gpu-tests (the grouped GEMM kernels' and the sampler's tests on the GPU), profile (the Mosaic
# kernels' compute warpgroups' time per named scope, tools/mosaic_profile_probe.py),
# profile-decode (the same of the FP8 default at DeepSeek-V3's and Mixtral-8x7B's decode sizes),
# fp8-default (the FP8 Mosaic default launch shapes against the waited pipelines they replaced),
# epilogue (the Mosaic gate / up epilogue as shipped against the precise one it replaced),
# fp8-registers-pe (the FP8 default with its gate / up memory warpgroup's registers raised),
# fp8-registers-default (the FP8 default at 88 such registers against 40: GPU tests, DeepSeek-V3
# prefill 16384, decode stacks), fp8-side (FP8 against bf16 experts side by side, the FP8
# kernels alone on a slot buffer), fp8-registers-step (the FP8 prefill device step at 88 and
# at 40 gate / up memory registers).
# Usage: tools/gpu_results.sh GROUP...   (jax-triton travels as a wheel in .whl/, if present)
set -uo pipefail
OUT=${OUT:-/tmp/jtbo-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
# One persistent compilation cache for every command of the call: a bench's runners (bench
# tbo's plain / TBO runner and its "auto" runner) compile equal step programs, compiled once.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jtbo-jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi

# DEADLINE (epoch seconds, optional): each command's time limit is cut to what is left before it,
# and a command with under a minute left is skipped and said so, so that a call of several groups
# ends inside the device machine's per-call limit with the logs of what ran.
# The lines of tools/mosaic_profile_probe.py's log that probe prints: its tables, its headings.
PROFILE_LINES='^|\|kernel\|tokens'

budget() {  # budget SECONDS NAME: prints min(SECONDS, time left); fails if under 60 s are left
  [ -z "${DEADLINE:-}" ] && { echo "$1"; return 0; }
  local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 60 ]; then
    echo "== $2: skipped, ${left} s left before DEADLINE" >&2
    return 1
  fi
  echo $(($1 < left ? $1 : left))
}

gpu_pytest() {  # gpu_pytest NAME SECONDS ARGS...: pytest ARGS on the GPU, logged to $OUT/NAME.log;
  # -v names each test as it ends, so a log cut by its limit still says which ones failed
  local name=$1 limit
  limit=$(budget "$2" "$name") || return 0
  shift 2
  echo "== $name: pytest $*"
  timeout "$limit" python3 -m pytest -v -rf --tb=short -p no:cacheprovider "$@" \
    >"$OUT/$name.log" 2>&1
  echo "(exit $?)"; grep -E "FAILED|ERROR|passed|failed" "$OUT/$name.log" | tail -n 12
}

probe() {  # probe NAME SECONDS TOOL ARGS...: PYTHONPATH=. python tools/TOOL ARGS, logged to
  # $OUT/NAME.log; prints the log's lines that match PROBE_LINES (its tables and device line)
  local name=$1 tool=$3 limit
  limit=$(budget "$2" "$name") || return 0
  shift 3
  echo "== $name: PYTHONPATH=. python tools/$tool $*"
  PYTHONPATH=. timeout "$limit" python3 "tools/$tool" "$@" >"$OUT/$name.log" 2>&1
  echo "(exit $?)"; grep "${PROBE_LINES:-^|\|^device}" "$OUT/$name.log"
}

bench() {  # bench NAME LINES ARGS...: one `python -m jtbo.bench` run, logged to $OUT/NAME.log
  local name=$1 lines=$2 limit
  shift 2
  limit=$(budget "${LIMIT:-300}" "$name") || return 0
  echo "== $name: python -m jtbo.bench $*"
  timeout "$limit" python3 -m jtbo.bench "$@" >"$OUT/$name.log" 2>&1
  echo "(exit $?)"
  tail -n "$lines" "$OUT/$name.log"
}

for group in "$@"; do
  case $group in
    tbo)
      bench tbo 14 tbo --devices 1 --attention-kind gqa --prefill 4096 16384 --decode 128 \
        --iters 15 --no-profile ;;
    serve)
      bench serve 12 serve --hf-config tools/hf_configs/qwen3_30b_a3b.json --num-layers 8 \
        --prompts 64 --peer transformers ;;
    kernels)
      bench grouped_gemm 12 grouped_gemm --tokens 128,256,2048,4096,16384 \
        --impls dense,pallas,mosaic --iters 5 --reps 7
      bench attention 12 attention
      bench extend 8 attention --cases extend --kernel-time ;;
    presets)
      for preset in qwen3-30b-a3b qwen3-235b-a22b deepseek-v2-lite deepseek-v3 mixtral-8x7b; do
        bench "gemm-$preset" 10 grouped_gemm --preset "$preset" --tokens 64,128,256,4096,16384 \
          --impls dense,pallas,mosaic --iters 5 --reps 5
      done ;;
    fp8)  # the FP8 kernels: GPU tests, the layer and the kernels alone at the Qwen3 shape
      gpu_pytest pytest-fp8 "${LIMIT:-150}" -x tests/kernels/test_grouped_gemm_mosaic_fp8.py \
        tests/kernels/test_fp8_blocks.py tests/kernels/test_grouped_gemm.py -k "fp8 or FP8"
      LIMIT=200 bench gemm-qwen3-fp8 12 grouped_gemm --preset qwen3-30b-a3b \
        --expert-dtype float8_e4m3fn --tokens 64,256 --impls dense,pallas,mosaic \
        --iters 5 --reps 5 --check-rows 64
      echo "== the kernels alone at prefill sizes: tools/fp8_layer_probe.py"
      PYTHONPATH=. timeout 150 python3 tools/fp8_layer_probe.py --tokens 4096,16384,256 \
        --pallas-fp8-max 256 >"$OUT/fp8-probe.log" 2>&1
      echo "(exit $?)"; grep "^|\|rel diff" "$OUT/fp8-probe.log" ;;
    fp8-step)  # the device step with bf16, then FP8 experts (both "auto": Mosaic at prefill)
      for dtype in bfloat16 float8_e4m3fn; do
        LIMIT=240 bench "tbo-$dtype" 8 tbo --devices 1 --attention-kind gqa --prefill 4096 \
          --decode 128 --iters 10 --no-profile --expert-dtype "$dtype"
      done ;;
    real-dims)  # the plain and TBO device steps at published models' dimensions (8 layers); a cold
      # machine compiles each model's eight step programs for several minutes
      for model in qwen3_30b_a3b deepseek_v2_lite; do
        LIMIT=${LIMIT:-500} bench "tbo-$model" 10 tbo --devices 1 \
          --hf-config "tools/hf_configs/$model.json" --num-layers 8 --prefill 4096 --decode 128 --iters 10 --no-profile
      done ;;
    fp8-step)  # the decode device step with FP8 experts beside bf16 ones ("auto" kernels),
      # Qwen3-30B-A3B's dimensions, 8 layers: one bench tbo process each, back to back
      for dtype in bfloat16 float8_e4m3fn; do
        fp8=""; [ "$dtype" = float8_e4m3fn ] && fp8="--expert-dtype $dtype"
        LIMIT=${LIMIT:-300} bench "step-$dtype" 12 tbo --devices 1 \
          --hf-config tools/hf_configs/qwen3_30b_a3b.json --num-layers 8 --prefill \
          --decode 64 128 --iters 10 --no-profile $fp8
      done ;;
    mla)  # the paged kernel over an MLA latent pool (DeepSeek-V2-Lite's 16 heads): launch
      # shapes at a TBO micro-batch's 64 sequences and a plain step's 128
      for seqs in 64 128; do
        bench "mla-$seqs" 24 attention --mla --q-heads 16 --cases decode --decode-seqs "$seqs" \
          --decode-context 1024 --backends pallas --min-programs 64,128,512 --num-stages 2,3 \
          --kernel-time --iters 20
      done ;;
    fp8-tiles)  # the Pallas FP8 layer's tiles at decode sizes (Qwen3-30B-A3B's expert shape)
      LIMIT=240 bench fp8-tiles 30 grouped_gemm --preset qwen3-30b-a3b \
        --expert-dtype float8_e4m3fn --tokens 64,128,256,512 --impls \
        pallas,pallas:16x128x512w4s3,pallas:16x128x256w4s4,pallas:32x128x256w4s3 --iters 5 --reps 5 ;;
    gemm-kernels)  # where the grouped GEMM layer's time goes at Qwen3-30B-A3B's expert shape:
      # each row's kernels (--kernel-time), bf16 and FP8, decode row tiles of 16 beside the
      # defaults, Mosaic at prefill sizes
      for dtype in bfloat16 float8_e4m3fn; do
        experts=()
        decode=pallas,pallas:16x128x64w8s3/16x256x64w8s3,pallas:16x128x64w4s4/16x256x64w4s4
        if [ "$dtype" = float8_e4m3fn ]; then
          experts=(--expert-dtype "$dtype")
          decode=pallas,pallas:16x128x128w4s3,pallas:16x128x128w8s3,pallas:32x128x128w4s3
        fi
        LIMIT=240 bench "gemm-decode-$dtype" 14 grouped_gemm --preset qwen3-30b-a3b "${experts[@]}" \
          --tokens 64,128,256 --impls "$decode" --check-rows 16 --kernel-time
        LIMIT=240 bench "gemm-prefill-$dtype" 8 grouped_gemm --preset qwen3-30b-a3b "${experts[@]}" \
          --tokens 4096,16384 --impls dense,mosaic --check-rows 16 --kernel-time
      done ;;
    mosaic-odd)  # the Mosaic kernels with an odd column tile (DeepSeek-V2-Lite's F = 1408)
      # against the Pallas ones, the measure of "auto"'s rule (grouped_gemm._mosaic_serves)
      LIMIT=240 bench gemm-dsv2-lite-mosaic 10 grouped_gemm --preset deepseek-v2-lite \
        --tokens 4096,16384 --impls dense,pallas,mosaic --check-rows 16 --kernel-time ;;
    fp8-threshold)  # the FP8 layer on Pallas (balanced row tiles) against Mosaic around
      # MOSAIC_FP8_MIN_ROWS (4096 rows: 512 tokens x 8)
      LIMIT=240 bench fp8-threshold 14 grouped_gemm --preset qwen3-30b-a3b \
        --expert-dtype float8_e4m3fn --tokens 256,512,1024,2048 --impls pallas,mosaic \
        --check-rows 16 --kernel-time ;;
    dsv3-walk)  # DeepSeek-V3's experts at 4096 tokens (about 128 rows an expert): the Mosaic
      # walk's grid_tile_width, row tiles that take the same weight columns at once
      LIMIT=240 bench dsv3-walk 10 grouped_gemm --preset deepseek-v3 --tokens 4096 \
        --impls dense,mosaic,mosaic:128x128x64s4t8/128x256x64s4t8,mosaic:128x128x64s4t16/128x256x64s4t16,mosaic:128x128x64s4t32/128x256x64s4t32 \
        --check-rows 16 --kernel-time ;;
    prefetch)  # one pipeline over each CTA's tiles, waited and with a step in flight,
      # against the default, side by side with the dense yardstick at prefill sizes
      impls=dense,mosaic,mosaic:128x128x64s4p/128x256x64s4p,mosaic:128x128x64s4f1p/128x256x64s4f1p
      LIMIT=170 bench prefetch-qwen3 18 grouped_gemm --preset qwen3-30b-a3b --tokens 4096,16384 \
        --impls "$impls" --no-copy-ceiling --check-rows 16
      for preset in deepseek-v3 qwen3-235b-a22b mixtral-8x7b; do
        LIMIT=170 bench "prefetch-$preset" 10 grouped_gemm --preset "$preset" --tokens 4096 \
          --impls "$impls" --no-copy-ceiling --check-rows 16
      done ;;
    fp8-mosaic-decode)  # the FP8 Mosaic default (prefetching across tiles) against the waited
      # pipelines, in decode stacks: where "auto" takes Mosaic (DeepSeek-V3, Mixtral-8x7B) and
      # where it takes Pallas (Qwen3-30B-A3B, its 6 down steps in 3 stages when prefetching).
      # STACKS (default "dsv3 mixtral qwen3") picks which of the three run.
      fp8="--expert-dtype float8_e4m3fn"
      impls=mosaic,mosaic:128x128x128s4
      for stack in ${STACKS:-dsv3 mixtral qwen3}; do
        case $stack in
          dsv3) LIMIT=200 bench fp8-decode-dsv3 10 grouped_gemm --no-kernel-rows \
            --preset deepseek-v3 $fp8 --tokens 64 --impls "$impls" --layers-per-call 4 ;;
          mixtral) LIMIT=150 bench fp8-decode-mixtral 10 grouped_gemm --no-kernel-rows \
            --preset mixtral-8x7b $fp8 --tokens 128,256 --impls "$impls" --layers-per-call 8 ;;
          qwen3) LIMIT=150 bench fp8-decode-qwen3 10 grouped_gemm --no-kernel-rows \
            --preset qwen3-30b-a3b $fp8 --tokens 64,256 --impls "pallas,$impls" \
            --layers-per-call 8 ;;
          *) echo "== fp8-mosaic-decode: unknown stack $stack (dsv3, mixtral, qwen3)" ;;
        esac
      done ;;
    split-default)  # the FP8 default as shipped (the warpgroups splitting the columns up to
      # 32 rows an expert) against the unsplit default it replaced at decode sizes, and Pallas
      # (what "auto" takes below 32 rows an expert where it indexes the weights).
      # STACKS (default "dsv3 mixtral qwen3") picks which run: each takes about 80 s a token
      # count on a warm machine (compile-bound), so give a call one or two.
      fp8="--expert-dtype float8_e4m3fn"
      for stack in ${STACKS:-dsv3 mixtral qwen3}; do
        case $stack in
          dsv3) LIMIT=300 bench split-default-dsv3 10 grouped_gemm --no-kernel-rows \
            --preset deepseek-v3 $fp8 --tokens 64,256 --layers-per-call 4 \
            --impls mosaic,mosaic:128x128x128s4pr88/128x128x128s4p ;;
          mixtral) LIMIT=250 bench split-default-mixtral 10 grouped_gemm --no-kernel-rows \
            --preset mixtral-8x7b $fp8 --tokens 64,128 --layers-per-call 8 \
            --impls pallas,mosaic,mosaic:128x128x128s4pr88/128x128x128s4p ;;
          qwen3) LIMIT=250 bench split-default-qwen3 10 grouped_gemm --no-kernel-rows \
            --preset qwen3-30b-a3b $fp8 --tokens 64,256 --layers-per-call 8 \
            --impls pallas,mosaic,mosaic:128x128x128s4pr88/128x128x128s3p ;;
          *) echo "== split-default: unknown stack $stack (dsv3, mixtral, qwen3)" ;;
        esac
      done ;;
    pallas-rows)  # the FP8 Pallas kernels' row tiles at decode: the default's, sized for the
      # balanced load (an expert past it takes a second tile over the same weights), against
      # tiles twice that (a spec's rows follow the capacity, 4x the balanced load here, so each
      # token count names its own), beside the Mosaic default. TOKENS picks which run
      # (default "qwen3:256 mixtral:64 mixtral:128 mixtral:256"), about 100 s each.
      fp8="--expert-dtype float8_e4m3fn"
      for case in ${TOKENS:-qwen3:256 mixtral:64 mixtral:128 mixtral:256}; do
        stack=${case%%:*} tokens=${case##*:}
        case $stack in
          qwen3) preset=qwen3-30b-a3b balanced=$((tokens * 8 / 128)) ;;
          mixtral) preset=mixtral-8x7b balanced=$((tokens * 2 / 8)) ;;
          *) echo "== pallas-rows: unknown stack $stack (qwen3, mixtral)"; continue ;;
        esac
        rows=$((2 * balanced < 16 ? 16 : 2 * balanced))
        LIMIT=200 bench "pallas-rows-$stack-$tokens" 9 grouped_gemm --no-kernel-rows \
          --preset $preset $fp8 --tokens "$tokens" --layers-per-call 8 \
          --impls "pallas,pallas:${rows}x128x128w8s3,mosaic"
      done ;;
    fp8-mosaic-prefill)  # the same at Qwen3-30B-A3B's FP8 prefill, beside bf16's yardstick
      impls=dense,mosaic,mosaic:128x128x128s4/128x128x128s4
      LIMIT=200 bench fp8-prefill-qwen3 14 grouped_gemm --preset qwen3-30b-a3b \
        --expert-dtype float8_e4m3fn --tokens 4096,16384 --impls "$impls" --no-copy-ceiling \
        --check-rows 16 ;;
    memory-registers)  # the memory warpgroup's registers (spec r): those where ptxas spills
      # least on the CPU (tools/mosaic_ptxas_report.py) against the default 40
      LIMIT=170 bench registers-bf16-qwen3 10 grouped_gemm --preset qwen3-30b-a3b \
        --tokens 4096,16384 --impls dense,mosaic,mosaic:128x128x64s4f1r72/128x256x64s4f1r72 \
        --no-copy-ceiling --check-rows 16
      impls=mosaic,mosaic:128x128x128s4/128x128x128s4r104,mosaic:128x128x128s4r72/128x128x128s4r104
      LIMIT=170 bench registers-fp8-qwen3 10 grouped_gemm --preset qwen3-30b-a3b \
        --expert-dtype float8_e4m3fn --tokens 4096 --impls "dense,$impls" --no-copy-ceiling \
        --check-rows 16
      LIMIT=200 bench registers-fp8-dsv3 8 grouped_gemm --preset deepseek-v3 \
        --expert-dtype float8_e4m3fn --tokens 256 --impls "$impls" --layers-per-call 8 ;;
    fp8-registers-pe)  # the FP8 default (prefetching across tiles) with its gate / up kernel's
      # memory warpgroup at 72 / 88 registers, against the default 40: ptxas spills 404 / 456
      # bytes in the default's gate / up kernel at Qwen3-30B-A3B's shape, 104 / 176 at r72,
      # 64 / 128 at r88 (tools/mosaic_ptxas_report.py; at r24-r48 more: the memory warpgroup's)
      fp8="--expert-dtype float8_e4m3fn"
      impls=dense,mosaic,mosaic:128x128x128s4pr72/128x128x128s3p,mosaic:128x128x128s4pr88/128x128x128s3p
      LIMIT=150 bench fp8-registers-pe-qwen3 12 grouped_gemm --no-kernel-rows --preset qwen3-30b-a3b $fp8 \
        --tokens 4096,16384 --impls "$impls" --no-copy-ceiling --check-rows 16
      impls=dense,mosaic,mosaic:128x128x128s4pr72/128x128x128s4p,mosaic:128x128x128s4pr88/128x128x128s4p
      LIMIT=150 bench fp8-registers-pe-dsv3 12 grouped_gemm --no-kernel-rows --preset deepseek-v3 $fp8 \
        --tokens 4096,16384 --impls "$impls" --no-copy-ceiling --check-rows 16
      # the compute warpgroups' scopes at r88 (the default's gate / up epilogue: 8,300 cycles
      # a tile, 4,541 with the waited pipelines, which spill less)
      JAX_PLATFORMS=cuda,cpu PROBE_LINES="$PROFILE_LINES" probe profile-fp8-r88 150 \
        mosaic_profile_probe.py --expert-dtype float8_e4m3fn \
        --spec 128x128x128s4pr88/128x128x128s3p --profile-space 240 \
        --out /tmp/mosaic-profile-r88 ;;
    fp8-registers-default)  # the FP8 default with its gate / up memory warpgroup at 88
      # registers (gemm_config.MOSAIC_FP8_GATE_UP_MEMORY_REGISTERS) against the 40 it had: its
      # GPU tests, then where fp8-registers-pe did not reach (DeepSeek-V3 at 16384 tokens) and
      # the decode stacks where "auto" takes Mosaic (DeepSeek-V3, Mixtral-8x7B)
      fp8="--expert-dtype float8_e4m3fn"
      gpu_pytest pytest-mosaic-fp8 200 tests/kernels/test_grouped_gemm_mosaic_fp8.py
      LIMIT=200 bench registers-default-dsv3 6 grouped_gemm --no-kernel-rows --preset deepseek-v3 $fp8 \
        --tokens 16384 --impls mosaic,mosaic:128x128x128s4p/128x128x128s4p --no-copy-ceiling \
        --check-rows 16
      LIMIT=200 bench registers-default-decode-dsv3 6 grouped_gemm --no-kernel-rows --preset deepseek-v3 \
        $fp8 --tokens 64 --impls mosaic,mosaic:128x128x128s4p/128x128x128s4p --layers-per-call 4
      LIMIT=150 bench registers-default-decode-mixtral 7 grouped_gemm --no-kernel-rows \
        --preset mixtral-8x7b $fp8 --tokens 256,512 \
        --impls mosaic,mosaic:128x128x128s4p/128x128x128s4p --layers-per-call 8 ;;
    fp8-side)  # the FP8 expert layer against the bf16 one as the model calls it, side by side
      # in one process at the default launch shapes (tools/fp8_layer_side_probe.py --stages 4),
      # then the FP8 Mosaic kernels alone on a slot buffer (bench's "(kernel)" rows: each
      # capacity slot was quantized before the gather until the quantization order's mend)
      # SIDE_PRESETS (default "qwen3-30b-a3b deepseek-v3") picks the side-by-side presets
      # (DeepSeek-V3's bf16 and FP8 weights: 34 GB together); SIDE_KERNELS=0 skips the kernel rows
      for preset in ${SIDE_PRESETS:-qwen3-30b-a3b deepseek-v3}; do
        tokens=4096,16384
        [ "$preset" = deepseek-v3 ] && tokens=4096
        probe "side-$preset" 200 fp8_layer_side_probe.py --preset "$preset" --tokens "$tokens" \
          --stages 4
      done
      [ "${SIDE_KERNELS:-1}" = 0 ] || LIMIT=150 bench fp8-kernel-rows-qwen3 8 grouped_gemm --preset qwen3-30b-a3b \
        --expert-dtype float8_e4m3fn --tokens 4096,16384 --impls mosaic --no-copy-ceiling \
        --check-rows 16 ;;
    fp8-registers-step)  # the FP8 prefill device step at Qwen3-30B-A3B's dimensions (8 layers,
      # "auto": Mosaic) with the gate / up memory warpgroup at 88 registers (the default), then
      # at 40 (gemm_config.MOSAIC_FP8_GATE_UP_MEMORY_REGISTERS patched before the bench runs)
      for registers in 88 40; do
        limit=$(budget 260 "fp8-step-r$registers") || continue
        echo "== fp8-step-r$registers: python -m jtbo.bench tbo ... --expert-dtype float8_e4m3fn"
        timeout "$limit" python3 -c "import runpy, sys
from jtbo.kernels import gemm_config
gemm_config.MOSAIC_FP8_GATE_UP_MEMORY_REGISTERS = $registers
sys.argv[0] = 'jtbo.bench'
runpy.run_module('jtbo.bench', run_name='__main__')" tbo --devices 1 \
          --hf-config tools/hf_configs/qwen3_30b_a3b.json --num-layers 8 --prefill 4096 --decode \
          --iters 10 --no-profile --expert-dtype float8_e4m3fn >"$OUT/fp8-step-r$registers.log" 2>&1
        echo "(exit $?)"; tail -n 8 "$OUT/fp8-step-r$registers.log"
      done ;;
    tma-layout)  # TMA streaming FP8 weight tiles from the stored order against a tile-major
      # copy (tools/tma_layout_probe.py: DeepSeek-V3's gate / up and down weights, 4 and 8
      # stages, beside XLA's copy): whether the weights' layout holds the FP8 decode layer
      # under copy bandwidth
      probe tma-layout "${LIMIT:-150}" tma_layout_probe.py ;;
    tma-rows)  # the same streaming with each step's row block beside its weight tile (32, 64
      # and 128 rows, as the FP8 decode kernels load their mostly-padding row tiles): whether
      # the row tiles' traffic holds the FP8 decode layer under copy bandwidth
      probe tma-rows "${LIMIT:-150}" tma_layout_probe.py --stages 4 --row-rows 32,64,128 ;;
    sampler)  # the sampler's keys-only sort against the key-value sorts (which compiled sort
      # each runs), then a sampled and a greedy serve at Qwen3-30B-A3B's dimensions
      # (SERVE_LAYERS of its layers, 8 by default)
      probe sampler-sort "${LIMIT:-300}" sampler_sort_probe.py
      for temperature in 0.7 0; do
        LIMIT=${SERVE_LIMIT:-240} bench "serve-t$temperature" 8 serve \
          --hf-config tools/hf_configs/qwen3_30b_a3b.json --num-layers "${SERVE_LAYERS:-8}" \
          --prompts 64 --temperature "$temperature" --top-p 0.9
      done ;;
    gpu-tests)  # the grouped GEMM kernels compiled for the GPU (the nested jit they are called
      # through included) and the sampler.
      # The sampler first, on its own (its sampled rows failed once on the GPU, the log cut
      # before the report).
      gpu_pytest pytest-gpu-test_sampler 240 tests/models/test_sampler.py
      gpu_pytest pytest-gpu-test_grouped_gemm 240 \
        tests/kernels/test_grouped_gemm.py tests/kernels/test_grouped_gemm_mosaic.py \
        tests/kernels/test_grouped_gemm_mosaic_fp8.py ;;
    epilogue)  # the Mosaic gate / up epilogue as shipped (grouped_gemm_mosaic.swiglu under
      # approx_math) against the precise one it replaced, bf16 and FP8, in one process per
      # preset (tools/epilogue_probe.py); then the Mosaic kernels' GPU tests, whose epilogue
      # numbers moved within float32's precision (DeepSeek-V3's weights need an H200)
      for case in "qwen3-30b-a3b 4096,16384" "deepseek-v3 4096"; do
        set -- $case
        probe "epilogue-$1" 150 epilogue_probe.py --preset "$1" --tokens "$2"
      done
      gpu_pytest pytest-mosaic 200 tests/kernels/test_grouped_gemm_mosaic.py \
        tests/kernels/test_grouped_gemm_mosaic_fp8.py ;;
    fp8-default)  # the FP8 Mosaic default (gemm_config.mosaic_ffn_fp8: prefetching across
      # tiles where the stages divide the steps) against the waited pipelines it replaced:
      # prefill at the other presets, decode where "auto" takes Mosaic (4 layers a call:
      # DeepSeek-V3's 8 FP8 layers and their checks ran past 280 s)
      fp8="--expert-dtype float8_e4m3fn"
      waited=mosaic:128x128x128s4/128x128x128s4
      for preset in deepseek-v3 qwen3-235b-a22b mixtral-8x7b deepseek-v2-lite; do
        LIMIT=150 bench "fp8-default-$preset" 8 grouped_gemm --preset "$preset" $fp8 \
          --tokens 4096,16384 --impls "dense,mosaic,$waited" --no-copy-ceiling --check-rows 16
      done
      LIMIT=200 bench fp8-default-decode-dsv3 6 grouped_gemm --preset deepseek-v3 $fp8 \
        --tokens 64 --impls "mosaic,$waited" --layers-per-call 4
      LIMIT=150 bench fp8-default-decode-mixtral 6 grouped_gemm --preset mixtral-8x7b $fp8 \
        --tokens 128,256 --impls "mosaic,$waited" --layers-per-call 8 ;;
    loads)  # the Mosaic kernels against themselves without their products (the loads, the
      # pipeline's barriers and the stores alone), bf16 and FP8, Qwen3-30B-A3B's prefill
      for dtype in bfloat16 float8_e4m3fn; do
        probe "loads-$dtype" 150 mosaic_load_probe.py --expert-dtype "$dtype" --tokens 4096,16384
      done ;;
    profile-decode)  # the same profile of the FP8 default at decode: DeepSeek-V3's 64 tokens
      # (most tiles one or two live rows; the layer reads its weights at 0.79 of copy while TMA
      # alone streams them at copy bandwidth, tools/tma_layout_probe.py) and Mixtral-8x7B's 128
      JAX_PLATFORMS=cuda,cpu PROBE_LINES="$PROFILE_LINES" probe profile-decode-dsv3 200 \
        mosaic_profile_probe.py --preset deepseek-v3 --tokens 64 --profile-space 240 \
        --out /tmp/mosaic-profile-decode-dsv3
      JAX_PLATFORMS=cuda,cpu PROBE_LINES="$PROFILE_LINES" probe profile-decode-mixtral 150 \
        mosaic_profile_probe.py --preset mixtral-8x7b --tokens 128 --profile-space 240 \
        --out /tmp/mosaic-profile-decode-mixtral ;;
    profile)  # where the Mosaic kernels' compute warpgroups spend their time (Mosaic GPU's
      # in-kernel profiler over the kernels' named scopes) at Qwen3-30B-A3B's 4096 tokens
      # (PROFILE_TOKENS):
      # FP8 (the default, prefetching across tiles, and the waited pipelines), then bf16, each
      # with the ranges per warpgroup that fit its shared memory (227 KB less the kernel's
      # own: 48 bytes a range)
      # (bf16 in 3 stages too: the default's 4 leave room for 60 ranges, short of its gate /
      # up kernel's first epilogue)
      for case in "float8_e4m3fn default 240" "float8_e4m3fn 128x128x128s4/128x128x128s4 240" \
          "bfloat16 default 60" "bfloat16 128x128x64s3f1/128x256x64s3f1 240"; do
        set -- $case
        # The profiler hands its buffer to the host through a callback, which needs the CPU
        # platform beside CUDA.
        JAX_PLATFORMS=cuda,cpu PROBE_LINES="$PROFILE_LINES" probe "profile-$1-${2//\//_}" 150 \
          mosaic_profile_probe.py --expert-dtype "$1" --spec "$2" --profile-space "$3" \
          --tokens "${PROFILE_TOKENS:-4096}" --out "/tmp/mosaic-profile-$1"
      done ;;
    ranks)  # the expert layer with blocked group ranks against the one-hot ranks, in turns
      echo "== PYTHONPATH=. python tools/layer_ranks_probe.py"
      PYTHONPATH=. timeout "${LIMIT:-250}" python3 tools/layer_ranks_probe.py >"$OUT/ranks.log" 2>&1
      echo "(exit $?)"; grep "^|" "$OUT/ranks.log" | tail -10 ;;
    host)  # the runner's host time per step into a copy of the shipped cost table
      cp jtbo/analysis/step_costs_h200.json "$OUT/step_costs_h200.json"
      echo "== python -m jtbo.bench predict --measure --sections runner_host"
      timeout "${LIMIT:-240}" python3 -m jtbo.bench predict --measure --sections runner_host \
        --out "$OUT/step_costs_h200.json" >"$OUT/runner-host.log" 2>&1
      echo "(exit $?)"; grep "runner_host\|wrote" "$OUT/runner-host.log" ;;
    *) echo "unknown group $group (tbo, serve, kernels, presets, fp8, fp8-step, real-dims, host," \
      "mla, fp8-tiles, gemm-kernels, mosaic-odd, fp8-threshold, ranks, dsv3-walk," \
      "prefetch, fp8-mosaic-decode, fp8-mosaic-prefill, sampler, memory-registers," \
      "fp8-registers-pe, fp8-registers-default, fp8-side, fp8-registers-step," \
      "tma-layout, tma-rows, split-default, gpu-tests, profile, profile-decode, fp8-default, epilogue)"
      exit 2 ;;
  esac
done
