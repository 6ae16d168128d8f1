#!/usr/bin/env bash
# The Hopper routes (cuDNN fused attention, CUTLASS grouped GEMM, batch embeddings) and the CUPTI
# traces on one GPU machine. PARTS picks what runs (default "tests attention moe train trace kimi";
# two 10-minute calls: PARTS="tests attention moe" then PARTS="train trace kimi"):
#   tests      CudnnSdpa.* (fp64 reference: training layouts, extraction's fused-qkv and MLA
#              layouts), GpuDraft.* (CudnnAttentionMatchesReference, BatchEmbeddingsGiveTheSameBits
#              among them), CudaMoe.* (the CUTLASS route among them), CudaParallel.* (the
#              expert-parallel overlap among them), CudaDecode.*AcceptanceOnTheDevice* (sampled
#              chains and trees decided on the device), and the whole-model goldens
#              with the prefill attention through cuDNN (TALON_ATTENTION=cudnn);
#   attention  attention alone, each route on the same inputs (talon_bench_attention), TFLOP/s;
#   moe        one Kimi-K2 MoE layer with bf16 experts: the mma.sync tiles vs CUTLASS
#              (TALON_MOE_GEMM=cutlass);
#   train      draft training tokens/s and device memory at the 8B draft shape, 2048 and 4096
#              tokens: fused kernels vs cuDNN, the embedding on the device vs per batch;
#   trace      CUPTI traces: one 8B draft training step (its idle gaps by host cause) and three
#              greedy 8B decode steps at batch 1, context 2048; Chrome traces among the logs;
#   extract    (not in the default list) `talon extract` on random Llama-3.1-8B weights, end to end,
#              with and without TALON_ATTENTION=cudnn (bench/extract_gpu.py --talon-only);
#   kimi       the Kimi-K2-shaped forward (talon_bench_deepseek, 4 layers): default, cuDNN
#              attention, bf16 experts, bf16 experts on CUTLASS with cuDNN attention;
#   graphs     (not in the default list) greedy one-token steps at batch 1, context 2048, 8B and
#              SmolLM2 shapes, with the step's graph in parts of 0 (one graph), 1, 2, 4, 8, 16
#              layers (talon_bench_decode --graph-layers);
#   moedecode  (not in the default list) one Kimi-K2 MoE layer at 1-2048 tokens by expert route
#              (int4 tiles, CUDA-core decode-sized kernel, tensor-core decode kernel with each of
#              its settings, the default choice with the activations staged a block or loaded by
#              each warp; bf16 on CUTLASS), and Kimi-K2-shaped decoding with
#              the int4 decode kernel off and on;
#   wgmma      (not in the default list) the CudaMoe tests, then one Kimi-K2 MoE layer at 256-16384
#              tokens: int4 experts on the default kernels (grid plain and in groups of 4 and 16
#              tiles, TALON_CUDA_MOE_GRID_GROUP) and on the wgmma kernel (grid in
#              groups of 4 tiles, 1, 16 and all; gate | up fused and apart), FP8 128x128 experts
#              on the tiles and on the wgmma kernel, bf16 on the wgmma kernel, on the tiles in
#              groups of 4 and on CUTLASS (each tile configuration of
#              TALON_MOE_CUTLASS_TILES), and the bf16 GEMM ceiling; WG_TAGS (a regular
#              expression over the run names) and WG_TOKENS narrow it;
#   compare    (not in the default list) bench/train_compare_gpu.sh at 2048 and 4096 tokens, loss
#              share 0.675, VARIANT=cudnn+rows, with the PyTorch peer.
# Logs go to $LOGS (default: a temporary folder); a summary to stdout. TESTS overrides the tests
# part's gtest filter.
#   tar xzf .gpucarry/deps.tgz && bash scripts/gpu_build.sh && LOGS=$OUT PARTS="tests attention moe" \
#     bash bench/cudnn_gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
[ -f build/env.sh ] && source build/env.sh
LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$LOGS"
PARTS=${PARTS:-"tests attention moe train trace kimi"}
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); parts: $PARTS"
if want tests; then
  TESTS=${TESTS:-"*CudnnSdpa*:*GpuDraft*:*CudaMoe*:*CudaParallel*:*CudaDecode*"}
  echo "== tests: $TESTS"
  build/tests/talon_tests --gtest_filter="$TESTS" \
    --gtest_brief=1 \
    > "$LOGS/tests.log" 2>&1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" "$LOGS/tests.log" | tail -4
  grep -E "^\[  FAILED  \]|Failure|Expected|Which is|actual|cuDNN|CUTLASS" "$LOGS/tests.log" | head -40
  echo "== goldens with TALON_ATTENTION=cudnn"
  TALON_ATTENTION=cudnn build/tests/talon_tests --gtest_filter='*CudaGolden*:*CudaModel*:*DeepseekExtract*:*DeepSeek*' \
    --gtest_brief=1 > "$LOGS/cudnn-goldens.log" 2>&1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" "$LOGS/cudnn-goldens.log" | tail -4
  grep -E "^\[  FAILED  \]" "$LOGS/cudnn-goldens.log" | sort -u | head -20
fi
if want attention; then
  echo "== attention alone"
  build/talon_bench_attention --seq-len 2048,4096 --seqs 4 2>&1 | tee "$LOGS/attention.log"
fi
if want moe; then
  echo "== one Kimi-K2 MoE layer, bf16 experts: mma.sync tiles vs CUTLASS wgmma grouped GEMM (TALON_MOE_GEMM=cutlass)"
  TALON_MOE_GEMM=tiles build/talon_bench_moe --bf16 --tokens 256,1024,4096,8192,16384 2>&1 | tee "$LOGS/moe-bf16-tiles.log" | tail -6
  TALON_MOE_GEMM=cutlass build/talon_bench_moe --bf16 --tokens 256,1024,4096,8192,16384 2>&1 |
    tee "$LOGS/moe-bf16-cutlass.log" | tail -6
  build/talon_bench_moe --tokens 256,1024,4096,8192,16384 2>&1 | tee "$LOGS/moe-int4.log" | tail -6
fi
if want train; then
  echo "== draft training, 8B draft shape: fused kernels vs cuDNN; the embedding on the device vs per batch"
  for seq in 2048 4096; do
    for v in flash flash+rows cudnn+rows; do
      args=(--gpu-attention "${v%+rows}")
      [ "$v" != "${v%+rows}" ] && args+=(--gpu-batch-embeddings)
      build/talon_bench_train --shape llama3-8b --seq "$seq" --samples 1 --steps 7 --loss-share 0.675 \
        "${args[@]}" > "$LOGS/train-$v-$seq.log" 2>&1
      echo "$v seq $seq: $(tail -1 "$LOGS/train-$v-$seq.log")"
    done
  done
fi
if want trace; then
  echo "== where the 8B draft step's idle gaps go (CUPTI trace of one step, seq 4096)"
  build/talon_bench_train --shape llama3-8b --seq 4096 --samples 1 --steps 4 --loss-share 0.675 \
    --trace "$LOGS/train-trace.json" > "$LOGS/train-trace.log" 2>&1
  sed -n '/^trace of step/,/^step /p' "$LOGS/train-trace.log" | head -40
  echo "== the 8B decode step at batch 1, context 2048: idle gaps (CUPTI trace of 3 greedy graph steps)"
  build/talon_bench_decode --context 2048 --batches 1 --steps 16 --tree 0 --trace "$LOGS/decode-trace.json" \
    > "$LOGS/decode-trace.log" 2>&1
  sed -n '/^trace of 3/,$p' "$LOGS/decode-trace.log" | head -30
fi
if want extract; then
  echo "== dense 8B extraction end to end (random Llama-3.1-8B weights): tensor-core attention vs cuDNN"
  [ -f /tmp/rand8b/config.json ] || python3 tools/make_random_checkpoint.py --shape llama3-8b --out /tmp/rand8b \
    > "$LOGS/rand8b.log" 2>&1
  python3 bench/extract_gpu.py --model /tmp/rand8b --samples 128 --repeats 2 --talon-only \
    > "$LOGS/extract-talon.log" 2>&1
  tail -6 "$LOGS/extract-talon.log"
  TALON_ATTENTION=cudnn python3 bench/extract_gpu.py --model /tmp/rand8b --samples 128 --repeats 2 --talon-only \
    > "$LOGS/extract-cudnn.log" 2>&1
  tail -6 "$LOGS/extract-cudnn.log"
fi
if want kimi; then
  echo "== Kimi-K2-shaped forward, 4 layers: Talon's attention vs cuDNN; bf16 experts on the tiles vs CUTLASS"
  run_kimi() {
    local tag=$1; shift
    env "$@" build/talon_bench_deepseek --layers 4 --seqs 4 --seq-len 2048 --steps 3 ${BF16:+--bf16-experts} \
      > "$LOGS/kimi-$tag.log" 2>&1
    echo "$tag: $(tail -1 "$LOGS/kimi-$tag.log")"
  }
  run_kimi talon TALON_ATTENTION=
  run_kimi cudnn TALON_ATTENTION=cudnn
  BF16=1 run_kimi bf16 TALON_ATTENTION=
  BF16=1 run_kimi bf16-cudnn-cutlass TALON_ATTENTION=cudnn TALON_MOE_GEMM=cutlass
  echo "== --ep 2 on shared GPUs, without and with the overlap (plumbing: shared GPUs serialize)"
  build/talon_bench_deepseek --layers 4 --seqs 4 --seq-len 2048 --steps 3 --ep 2 --devices 0,0 --share-gpus > "$LOGS/kimi-ep2.log" 2>&1
  echo "ep2: $(tail -1 "$LOGS/kimi-ep2.log")"
  TALON_EP_OVERLAP=1 build/talon_bench_deepseek --layers 4 --seqs 4 --seq-len 2048 --steps 3 --ep 2 --devices 0,0 --share-gpus \
    > "$LOGS/kimi-ep2-overlap.log" 2>&1
  echo "ep2 overlap: $(tail -1 "$LOGS/kimi-ep2-overlap.log")"
fi
if want graphs; then
  echo "== greedy one-token steps at batch 1, context 2048: the step's graph in parts of n layers"
  for sh in llama3-8b smollm2; do
    build/talon_bench_decode --shape "$sh" --context 2048 --batches 1 --steps 32 --tree 0 --verify-tokens 1 \
      --graph-layers 0,1,2,4,8,16 > "$LOGS/graphs-$sh.log" 2>&1
    echo "$sh:"; grep -A7 "^greedy graph steps" "$LOGS/graphs-$sh.log" | tail -6
  done
fi
if want compare; then
  echo "== draft training against the PyTorch peer (cuDNN attention, batch embeddings)"
  LOGS="$LOGS/compare" LOSS_SHARE=0.675 VARIANT=cudnn+rows bash bench/train_compare_gpu.sh llama3-8b "2048 4096" 1 full
fi
if want wgmma; then
  # WG_TIMEOUT bounds each run (s), so a kernel that never finishes costs one run, not the call.
  TO=${WG_TIMEOUT:-150}
  [ "${WG_SKIP_TESTS:-0}" = 1 ] || timeout "$TO" build/tests/talon_tests --gtest_filter='*CudaMoe*:*CudaWgmma*' \
    --gtest_brief=1 > "$LOGS/wgmma-tests.log" 2>&1
  echo "== CudaMoe tests:"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" "$LOGS/wgmma-tests.log" | tail -4
  grep -E "wgmma" "$LOGS/wgmma-tests.log" | grep -E "rel err" | sort -t' ' -k1,1 | tail -40
  grep -E "^\[  FAILED  \]|Failure" "$LOGS/wgmma-tests.log" | head -20
  W=${WG_TOKENS:-256,1024,2048,4096,8192,16384}
  wg() {  # WG_TAGS: an extended regular expression; only matching runs (default all)
    local tag=$1; shift
    [[ $tag =~ ${WG_TAGS:-.} ]] || return 0
    local flag=""
    case "${1:-}" in --fp8 | --bf16) flag=$1; shift ;; esac
    timeout "$TO" env "$@" build/talon_bench_moe $flag --tokens $W > "$LOGS/wgmma-$tag.log" 2>&1
    echo "$tag ($*):"; tail -8 "$LOGS/wgmma-$tag.log"
  }
  echo "== one Kimi-K2 MoE layer, int4 and FP8 experts: default kernels vs the wgmma kernel"
  wg int4-default
  wg int4-default-grid-group4 TALON_CUDA_MOE_GRID_GROUP=4
  wg int4-default-grid-group16 TALON_CUDA_MOE_GRID_GROUP=16
  wg int4-wgmma TALON_CUDA_MOE_WGMMA=0
  wg int4-wgmma-tile-major TALON_CUDA_MOE_WGMMA=0 TALON_CUDA_MOE_WGMMA_GROUP=1
  wg int4-wgmma-group16 TALON_CUDA_MOE_WGMMA=0 TALON_CUDA_MOE_WGMMA_GROUP=16
  wg int4-wgmma-weight-major TALON_CUDA_MOE_WGMMA=0 TALON_CUDA_MOE_WGMMA_GROUP=1000000
  wg int4-wgmma-separate-gate-up TALON_CUDA_MOE_WGMMA=0 TALON_CUDA_MOE_INT4_SWIGLU=0
  wg fp8-tiles --fp8
  wg fp8-tiles-grid-group4 --fp8 TALON_CUDA_MOE_GRID_GROUP=4
  wg fp8-wgmma --fp8 TALON_CUDA_MOE_WGMMA=0
  wg bf16-wgmma --bf16 TALON_CUDA_MOE_WGMMA=0
  wg bf16-tiles-grid-group4 --bf16 TALON_MOE_GEMM=tiles TALON_CUDA_MOE_GRID_GROUP=4
  for tl in rows128 out128x64 out128x128; do
    [[ bf16-cutlass-$tl =~ ${WG_TAGS:-.} ]] || continue
    TALON_MOE_GEMM=cutlass TALON_MOE_CUTLASS_TILES=$tl timeout "$TO" build/talon_bench_moe --bf16 --tokens $W \
      > "$LOGS/wgmma-bf16-cutlass-$tl.log" 2>&1
    echo "bf16 on CUTLASS, tiles $tl:"; tail -8 "$LOGS/wgmma-bf16-cutlass-$tl.log"
  done
  echo "== bf16 GEMM ceiling (torch, 8192^3, median of 10)"
  python3 -c '
import torch, statistics
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
ts = []
for _ in range(10):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); a @ b; e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
print(f"ceiling: {2 * 8192**3 / statistics.median(ts) / 1e12:.0f} TFLOP/s")' 2>&1 | tail -1
fi
if want moedecode; then
  # One Kimi-K2 MoE layer (talon_bench_moe), ms a layer at 1-2048 tokens, each expert route forced:
  # int4 on the tiles, on the CUDA-core decode-sized kernel, on the tensor-core decode kernel (as
  # chosen by size, then with each of its settings fixed), bf16 on CUTLASS; then Kimi-K2-shaped
  # decoding (talon_bench_decode, 2 layers) with the int4 decode kernel off and on.
  T=1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192
  moe() {
    local tag=$1; shift
    env "$@" build/talon_bench_moe --tokens $T > "$LOGS/moedecode-$tag.log" 2>&1
    echo "$tag ($*):"; tail -12 "$LOGS/moedecode-$tag.log"
  }
  echo "== one Kimi-K2 MoE layer at decode-sized batches, by expert route"
  moe int4-tiles TALON_CUDA_MOE_SKINNY=0 TALON_CUDA_MOE_INT4_MMA=0
  moe int4-skinny TALON_CUDA_MOE_SKINNY=1000000 TALON_CUDA_MOE_INT4_MMA=0
  moe int4-mma TALON_CUDA_MOE_SKINNY=0 TALON_CUDA_MOE_INT4_MMA=1000000
  moe int4-mma-16rows TALON_CUDA_MOE_SKINNY=0 TALON_CUDA_MOE_INT4_MMA=1000000 TALON_CUDA_MOE_INT4_TILES=1 TALON_CUDA_MOE_INT4_KSPLIT=0
  moe int4-mma-32rows TALON_CUDA_MOE_SKINNY=0 TALON_CUDA_MOE_INT4_MMA=1000000 TALON_CUDA_MOE_INT4_TILES=2
  moe int4-default
  moe int4-default-unstaged TALON_CUDA_MOE_INT4_STAGED=0
  moe int4-mma-8rows TALON_CUDA_MOE_INT4_ROWS=8
  moe int4-mma-16rows-a-pass TALON_CUDA_MOE_INT4_ROWS=16
  moe int4-mma-32rows-a-pass TALON_CUDA_MOE_INT4_ROWS=32
  moe int4-3stages TALON_CUDA_MOE_INT4_STAGES=3
  moe int4-4stages TALON_CUDA_MOE_INT4_STAGES=4
  moe int4-separate-gate-up TALON_CUDA_MOE_INT4_SWIGLU=0
  moe int4-one-block-a-tile TALON_CUDA_MOE_INT4_SPLIT=0
  moe int4-a-block-a-pass TALON_CUDA_MOE_INT4_SPLIT=2
  TALON_MOE_GEMM=cutlass build/talon_bench_moe --bf16 --tokens $T > "$LOGS/moedecode-bf16-cutlass.log" 2>&1
  echo "bf16 on CUTLASS:"; tail -12 "$LOGS/moedecode-bf16-cutlass.log"
  for v in 0 1000000000; do
    TALON_CUDA_MOE_INT4_MMA=$v build/talon_bench_decode --model random:kimi-k2:2 --context 2048 --batches 1,8,64 \
      --tree 0 --verify-tokens 4 > "$LOGS/kimi-decode-int4mma-$v.log" 2>&1
    echo "Kimi-K2 decode, TALON_CUDA_MOE_INT4_MMA=$v:"; tail -8 "$LOGS/kimi-decode-int4mma-$v.log"
  done
fi
