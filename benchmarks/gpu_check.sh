#!/usr/bin/env bash
# GPU check of the inference package: parity tests and benchmarks on cuda, then a short table.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on a machine with a GPU
#
# Needs a Python with a CUDA build of torch, pyhf 0.7.6 and pytest (PYTHON, default .venv's or
# python3), and the shared workspaces (PYHF_GPU_SHARED_WORKSPACES, default ../shared/workspaces).
# Writes its logs and the table under OUT (default ./gpu_check_out).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYHF_GPU_TEST_DEVICE=cuda PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"

"$PYTHON" - <<'PY' || { echo "no CUDA device visible to torch"; exit 2; }
import torch
assert torch.cuda.is_available()
print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY

# 1. parity on cuda (the same tests as on the CPU, models built on the GPU)
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_inference_minimize.py \
    tests/test_inference_reference.py tests/test_inference_pyhf_parity.py \
    tests/test_inference_toys.py 2>&1 | tee "$OUT/tests.log" | tail -5
tests_status=${PIPESTATUS[0]}

# 2. benchmarks on cuda (no peers there), then the H200 goals:
#    480 hypotests (24 patches x 20 test_poi) on the largest workspace < 1 s, 10^4 toys < 5 s
"$PYTHON" benchmarks/bench_inference.py --device cuda --peers none --threads 4 \
    --out "$OUT/bench_cuda.md" --goals 2>&1 | tee "$OUT/bench.log" | grep -v '^ours '
bench_status=${PIPESTATUS[0]}

# 3. the engine's logpdf throughput on cuda (eager and compiled)
"$PYTHON" benchmarks/bench_engine.py --device cuda 2>&1 | tee "$OUT/bench_engine_cuda.md" | tail -6

# 4. the service on cuda, end to end with the client: one patchset CLS over HTTP
WS=${PYHF_GPU_SHARED_WORKSPACES:-../shared/workspaces}/atlas-susy-2018-31-sbottom-B
PORT=${PORT:-8123}
"$PYTHON" -m pyhf_gpu_server.cli --device cuda --port "$PORT" --data-dir "$OUT/data" \
    > "$OUT/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 120); do
    "$PYTHON" -c "import httpx; httpx.get('http://127.0.0.1:$PORT/healthz').raise_for_status()" \
        2>/dev/null && break
    sleep 1
done
"$PYTHON" -m pyhf_gpu_client.cli --server "http://127.0.0.1:$PORT" info > "$OUT/info.json" 2>&1
"$PYTHON" -m pyhf_gpu_client.cli --server "http://127.0.0.1:$PORT" cls "$WS/BkgOnly.json" \
    --patchset "$WS/patchset.json" > "$OUT/e2e_cls.json" 2>&1
e2e_status=$?
# the published points (218, heterogeneous systematics, one untestable), timed as a user runs it
start=$("$PYTHON" -c "import time; print(time.time())")
"$PYTHON" -m pyhf_gpu_client.cli --server "http://127.0.0.1:$PORT" cls "$WS/BkgOnly.json" \
    --patchset "$WS/patchset.hepdata.json.gz" > "$OUT/e2e_hepdata.json" 2> "$OUT/e2e_hepdata.err"
hepdata_status=$?
hepdata_s=$("$PYTHON" -c "import time; print(round(time.time() - $start, 2))")
kill "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null

echo
echo "| check | result |"
echo "|---|---|"
echo "| parity tests on cuda | $(tail -1 "$OUT/tests.log") |"
grep '^GOAL' "$OUT/bench.log" | sed 's/^GOAL \(.*\): \(.*\)$/| \1 | \2 |/'
echo "| benchmark table | $OUT/bench_cuda.md |"
echo "| engine logpdf table | $OUT/bench_engine_cuda.md |"
echo "| 218 published sbottom-B points, client command on a warm cuda server | exit $hepdata_status, ${hepdata_s} s |"
echo "| server on cuda + client cls (24 patches) | exit $e2e_status, $OUT/e2e_cls.json, device: $(grep -o '"device": *"[^"]*"' "$OUT/info.json" | head -1) |"
exit $(( tests_status != 0 || bench_status != 0 || e2e_status != 0 ))
