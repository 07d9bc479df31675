#!/bin/bash
# Remote CUDA on a machine with a GPU (tests/results/remote-cuda.md): toffload-remoted
# runs the calls on the local GPU; programs reach it through the client library
# (lib/cuda-remote/libcuda.so.1) over loopback TCP.
#  1. abi_test (backends/tests/c/abi_test.c) through the cuda backend, direct on the
#     driver and through the client (NVRTC compiles on the client; the module goes
#     by content hash, so the second run is a cache hit);
#  2. conn_server on the cuda backend, 64 connections under toffload-load: direct
#     (block wait), remote stock (block, spin), remote under libtoffload.so.
# Usage, from a folder holding target/toffload (cargo xtask gpu-check --build-only
# here, plus bin/toffload-remoted and lib/cuda-remote) and abi_test built against
# target/toffload/lib: DIR=that-folder OUT=results-folder bash gpu_remote.sh
set -u
G=${DIR:-$PWD}; D=$G/target/toffload; OUT=${OUT:-/tmp}
NV=$(find /usr/local /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname "$NV"):$D/lib
taskset -c 8-15 "$D/bin/toffload-remoted" --listen 127.0.0.1:7600 \
    --stats-file "$OUT/remoted-stats.txt" > "$OUT/remoted.log" 2>&1 & RD=$!
sleep 1
remote() { env LD_LIBRARY_PATH="$D/lib/cuda-remote:$LD_LIBRARY_PATH" TOFFLOAD_CUDA_REMOTE=127.0.0.1:7600 "$@"; }
for i in 1 2; do
    echo "== abi_test direct $i"
    TOFFLOAD_BACKEND=cuda TOFFLOAD_CUDA_MAX_INFLIGHT=4 timeout 60 "$G/abi_test" normal | grep -v '^ok'
    echo "== abi_test remote $i"
    remote TOFFLOAD_BACKEND=cuda TOFFLOAD_CUDA_MAX_INFLIGHT=4 timeout 60 "$G/abi_test" normal | grep -v '^ok'
done
for size in 4096 65536; do
    for mode in direct-block remote-block remote-spin remote-runtime; do
        pre=""; wait=block; run=env
        case $mode in remote-*) run=remote ;; esac
        case $mode in *spin) wait=spin ;; *runtime) pre=$D/lib/libtoffload.so ;; esac
        $run TOFFLOAD_BACKEND=cuda TOFFLOAD_WAIT=$wait LD_PRELOAD=$pre taskset -c 0 \
            "$D/bin/conn_server" --port 7791 --size $size > "$OUT/srv-$mode-$size.log" 2>&1 & SP=$!
        sleep 1.5
        r=$(taskset -c 1-3 timeout 30 "$D/bin/toffload-load" --port 7791 --size $size \
            --conns 64 --duration 3s --warmup 1s --json 2>&1)
        echo "$size $mode $(echo "$r" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("rps=%.0f p50=%.0f p99=%.0f wrong=%d errors=%d"%(d["requests_per_sec"],d["p50_us"],d["p99_us"],d["wrong"],d["errors"]))')"
        kill $SP; wait $SP 2>/dev/null
    done
done
sleep 1.5; kill -TERM $RD; sleep 1
grep -E '^cuda|^connections ' "$OUT/remoted-stats.txt"
