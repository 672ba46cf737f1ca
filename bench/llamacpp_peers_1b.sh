#!/usr/bin/env bash
# llama.cpp's own figures on the LLaMA-3.2-1B-shaped model (bench/make_1b_model.py) and on
# stories260K, the peers of jitgraph's perplexity and generate (issues 39 and 40): llama-bench
# pp512 / tg32, llama-perplexity tokens/s and PPL, each with its peak RSS (/usr/bin/time -v) and
# the load average beside it, then numpy's sgemm rate.
#
#   LLAMACPP=/work/llamacpp/build/bin MODELS=/work/models bash bench/llamacpp_peers_1b.sh [STAGE...]
#
# STAGE (default: quantize bench ppl stories sgemm):
#   make      write $MODELS/llama1b-f32.gguf (bench/make_1b_model.py; needs VOCAB, llama.cpp's
#             models/ggml-vocab-llama-bpe.gguf)
#   quantize  llama-quantize it to f16, bf16, q8_0, q4_k_m, and stories260K to f16, bf16, q8_0
#             ($MODELS/stories260K-*.gguf); files already there are kept
#   bench     llama-bench -p 512 -n 32 on the 1B model in F32, F16, BF16, Q8_0, Q4_K_M
#   ppl       llama-perplexity -c 512 --chunks 4 on the 1B model in F32, F16, Q8_0
#   stories   llama-perplexity -c 128 over the whole text on stories260K in F32, F16, BF16, Q8_0
#             (tests/test_perplexity.py's figure: 547 chunks, PPL 156.82 in F32)
#   sgemm     numpy's sgemm 1024^3 rate (jitgraph/cli/roofline.py), GFLOP/s
# On a CPU with AMX (this host: an Intel Xeon with amx_int8), llama.cpp 0.3.36's AMX path, built
# in by -DGGML_NATIVE=ON, crashes (SIGSEGV in ggml_backend_amx_mul_mat) on Q8_0 and Q4_K weights:
# build its ggml-cpu library a second time without AMX and give its folder as LLAMACPP_LIB
# (put before the tools' own RUNPATH through LD_LIBRARY_PATH):
#   cmake -B build-noamx -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
#       -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DCMAKE_CXX_FLAGS="<the same>"
#   cmake --build build-noamx -j2 --target ggml-cpu
# Environment: LLAMACPP_LIB, THREADS (2), REPS (llama-bench repetitions, 3), TEXT (tests/data/tinyshakespeare_
# tail.txt), STORIES (tests/data/stories260K.gguf), PY (.venv/bin/python), LOGS (llamacpp-peers-logs:
# every command's full output).
set -euo pipefail
: "${LLAMACPP:?set LLAMACPP to the build/bin folder of llama.cpp}" "${MODELS:?set MODELS to the models folder}"
here=$(cd "$(dirname "$0")/.." && pwd)
THREADS=${THREADS:-2}
REPS=${REPS:-3}
TEXT=${TEXT:-$here/tests/data/tinyshakespeare_tail.txt}
STORIES=${STORIES:-$here/tests/data/stories260K.gguf}
PY=${PY:-$here/.venv/bin/python}
LOGS=${LOGS:-llamacpp-peers-logs}
mkdir -p "$LOGS"
if [ -n "${LLAMACPP_LIB:-}" ]; then
    [ -e "$LLAMACPP_LIB/libggml-cpu.so" ] || { echo "LLAMACPP_LIB=$LLAMACPP_LIB: no libggml-cpu.so there" >&2; exit 2; }
    export LD_LIBRARY_PATH=$LLAMACPP_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
for t in llama-bench llama-perplexity llama-quantize; do
    [ -x "$LLAMACPP/$t" ] || { echo "LLAMACPP=$LLAMACPP: no executable $t there" >&2; exit 2; }
done

load() { cut -d' ' -f1-3 /proc/loadavg; }

# timed NAME CMD...: run CMD under /usr/bin/time -v into $LOGS/NAME.log; print its peak RSS.
timed() {
    local name=$1; shift
    /usr/bin/time -v "$@" > "$LOGS/$name.log" 2>&1 || { echo "$name: failed, see $LOGS/$name.log" >&2; return 1; }
    awk '/Maximum resident set size/ {printf "%.0f MiB", $6 / 1024}' "$LOGS/$name.log"
}

stage_make() {
    : "${VOCAB:?set VOCAB to models/ggml-vocab-llama-bpe.gguf of llama.cpp}"
    "$PY" "$here/bench/make_1b_model.py" "$MODELS/llama1b-f32.gguf" --vocab "$VOCAB"
}

stage_quantize() {
    local t src
    for t in f16 bf16 q8_0 q4_k_m; do
        [ -e "$MODELS/llama1b-$t.gguf" ] && continue
        echo "quantize llama1b $t: $(timed "quantize-llama1b-$t" "$LLAMACPP/llama-quantize" \
            "$MODELS/llama1b-f32.gguf" "$MODELS/llama1b-$t.gguf" "${t^^}" "$THREADS")"
    done
    cp -n "$STORIES" "$MODELS/stories260K-f32.gguf"
    for t in f16 bf16 q8_0; do
        [ -e "$MODELS/stories260K-$t.gguf" ] && continue
        echo "quantize stories260K $t: $(timed "quantize-stories260K-$t" \
            "$LLAMACPP/llama-quantize" "$STORIES" "$MODELS/stories260K-$t.gguf" "${t^^}" 1)"
        # tensors whose rows do not split into the type's blocks fall back to another type
        grep -i "fallback\|not divisible" "$LOGS/quantize-stories260K-$t.log" | sed 's/^/    /' || true
    done
}

stage_bench() {
    local t rss
    for t in f32 f16 bf16 q8_0 q4_k_m; do
        echo "llama-bench llama1b $t, load before $(load):"
        rss=$(timed "bench-llama1b-$t" "$LLAMACPP/llama-bench" -m "$MODELS/llama1b-$t.gguf" \
            -p 512 -n 32 -t "$THREADS" -r "$REPS" -o md)
        grep '^|' "$LOGS/bench-llama1b-$t.log" | sed 's/^/    /'
        echo "    peak RSS $rss, load after $(load)"
    done
}

# ppl NAME MODEL ARGS...: llama-perplexity's PPL, prompt tokens/s and peak RSS, one line
ppl() {
    local name=$1 model=$2; shift 2
    local before rss
    before=$(load)
    rss=$(timed "$name" "$LLAMACPP/llama-perplexity" -m "$model" -f "$TEXT" -t "$THREADS" "$@")
    printf '%s: %s; %s; peak RSS %s; load %s -> %s\n' "$name" \
        "$(grep -o 'Final estimate: PPL = [0-9.]* +/- [0-9.]*' "$LOGS/$name.log")" \
        "$(rate "$LOGS/$name.log")" "$rss" "$before" "$(load)"
}

# rate LOG: tokens evaluated (chunks x n_ctx) over the time from "calculating perplexity" to
# "Final estimate", from the log's timestamps (M.SS.mmm.uuu); llama-perplexity prints no rate
rate() {
    awk 'function t(s, a) { split(s, a, "."); return a[1] * 60 + a[2] + a[3] / 1e3 + a[4] / 1e6 }
         /calculating perplexity over/ { t0 = t($1)
             for (i = 1; i <= NF; i++) { if ($i == "over") n = $(i + 1)
                                         if ($i ~ /^n_ctx=/) { c = $i; gsub(/[^0-9]/, "", c) } } }
         /Final estimate/ { t1 = t($1) }
         END { if (t1 > t0 && n * c > 0)
                   printf "%d chunks x %d tokens in %.2f s: %.1f tokens/s", n, c, t1 - t0, n * c / (t1 - t0) }' "$1"
}

stage_ppl() {
    local t
    for t in f32 f16 q8_0; do
        ppl "ppl-llama1b-$t" "$MODELS/llama1b-$t.gguf" -c 512 -b 512 --chunks 4
    done
}

stage_stories() {
    local t
    for t in f32 f16 bf16 q8_0; do
        ppl "ppl-stories260K-$t" "$MODELS/stories260K-$t.gguf" -c 128 -b 128
    done
}

stage_sgemm() {
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$PY" -c "from jitgraph.cli.roofline import \
sgemm_gflops; print(f'numpy sgemm 1024^3: {sgemm_gflops():.0f} GFLOP/s (median of 7)')"
    echo "load $(load)"
}

[ $# -gt 0 ] || set -- quantize bench ppl stories sgemm
for s in "$@"; do
    declare -F "stage_$s" > /dev/null || { echo "unknown stage $s" >&2; exit 2; }
    "stage_$s"
done
