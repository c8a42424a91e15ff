#!/usr/bin/env bash
# The GPU check, self-contained: one command on a lent device machine, one Markdown table.
#
#   bash benchmarks/gpu_check.sh            # cuda: the device machine (its python3 has torch)
#   bash benchmarks/gpu_check.sh cpu        # the same steps, smaller, on the CPU (tested in CI)
#
# Prepare here: `.venv/bin/python benchmarks/device_wheels.py --out .whl` (the server's wheels
# the device image lacks, checked offline), then carry `.whl` with the call. This script
# installs them into a folder of its own (no network there), then runs, each step bounded by
# `timeout` so that the whole stays inside ~8 minutes on cuda (~3 on a 2-core CPU):
#   1. the parity tests on the device (models built there; block, low-rank and dense solvers)
#   2. published patchsets through a real server on the device and the client, timed
#      (sbottom-B's 218 published points, the stau heterogeneous ones), from the workspaces
#      the repository ships (tests/data/workspaces, gzip; PYHF_GPU_SHARED_WORKSPACES overrides)
#   3. a generated HVTWZ-class analysis (40 x 40 bins, 2107 parameters; cpu: 12 x 25) through
#      the server and the client: one workspace, and 24 signal patches in one command
#   4. the large-model scaling table (benchmarks/bench_large.py)
#   5. eager vs compiled, CUDA graphs on/off, float64 vs float32 (benchmarks/bench_device.py)
# Writes $OUT/gpu_check.md (the table, then each step's own table) and a log per step.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${1:-${DEVICE:-cuda}}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ]; then
    PYTHON=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
fi
export PYTHONUNBUFFERED=1 PYHF_GPU_TEST_DEVICE=$DEVICE
WORKSPACES=${PYHF_GPU_SHARED_WORKSPACES:-tests/data/workspaces}
# on_disk FILE: FILE, or FILE.gz where only that exists (the repository's copies are gzip)
on_disk() { if [ -e "$1" ] || [ ! -e "$1.gz" ]; then echo "$1"; else echo "$1.gz"; fi; }
if [ "$DEVICE" = cpu ]; then
    LARGE=(12 25 240) SIZES=tiny PARITY_LIMIT=240 STEP_LIMIT=180
else
    LARGE=(40 40 500) SIZES=small PARITY_LIMIT=150 STEP_LIMIT=120
fi
TABLE="$OUT/gpu_check.md"
ROWS="$OUT/rows.md"
: > "$ROWS"
status=0

# 0. the wheels the image lacks (offline), into a folder of this run's own
if ! "$PYTHON" -c "import fastapi, pyhf, jsonschema_rs, orjson, uvicorn" 2>/dev/null; then
    if ! ls .whl/*.whl > /dev/null 2>&1; then
        echo "the server's packages are missing and no .whl folder is here" >&2
        exit 2
    fi
    SITE=$(mktemp -d /tmp/pyhf-gpu-site.XXXXXX)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        .whl/*.whl > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 2; }
    export PYTHONPATH="$SITE:$PWD:${PYTHONPATH:-}"
else
    export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi
"$PYTHON" - > "$OUT/device.txt" 2>&1 <<PY || { cat "$OUT/device.txt"; exit 2; }
import torch
device = torch.device("$DEVICE")
if device.type == "cuda":
    assert torch.cuda.is_available(), "no CUDA device visible to torch"
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
else:
    print("cpu", torch.get_num_threads(), "threads, torch", torch.__version__)
PY

# step NAME LIMIT COMMAND...: run it bounded, log it, add a row (exit status, seconds, its last
# line)
step() {
    local name=$1 limit=$2
    shift 2
    local start end rc
    start=$(date +%s.%N)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    [ "$rc" -ne 0 ] && status=1
    local last
    last=$(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-160 | tr '|' '/')
    [ "$rc" -eq 124 ] && last="timed out after ${limit} s"
    printf '| %s | %s | %s | %s |\n' "$name" "$rc" \
        "$(awk "BEGIN { printf \"%.1f\", $end - $start }")" "$last" >> "$ROWS"
}

# 1. parity on the device
# (cpu: the reference cases alone, to test the step; the suite itself runs the others there)
PARITY=(tests/test_inference_reference.py)
[ "$DEVICE" != cpu ] && PARITY+=(tests/test_inference_block.py tests/test_inference_minimize.py \
    tests/test_inference_pyhf_parity.py)
step parity "$PARITY_LIMIT" "$PYTHON" -m pytest -q -p no:cacheprovider -x "${PARITY[@]}"

# 2-3. a server on the device, the client's commands timed as a user runs them
PORT=${PORT:-8123}
URL="http://127.0.0.1:$PORT"
"$PYTHON" -m pyhf_gpu_server.cli --device "$DEVICE" --port "$PORT" --data-dir "$OUT/data" \
    > "$OUT/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 120); do
    "$PYTHON" -c "import httpx; httpx.get('$URL/readyz').raise_for_status()" 2>/dev/null && break
    sleep 0.5
done
CLIENT=("$PYTHON" -m pyhf_gpu_client.cli --server "$URL")
if [ -d "$WORKSPACES/atlas-susy-2018-31-sbottom-B" ]; then
    B="$WORKSPACES/atlas-susy-2018-31-sbottom-B"
    step published-sbottom-B-218 "$STEP_LIMIT" "${CLIENT[@]}" cls "$(on_disk "$B/BkgOnly.json")" \
        --patchset "$B/patchset.hepdata.json.gz" --output-file "$OUT/sbottom-B.json"
    S="$WORKSPACES/atlas-susy-2018-04-stau"
    step published-stau-24 "$STEP_LIMIT" "${CLIENT[@]}" cls "$(on_disk "$S/BkgOnly.json")" \
        --patchset "$(on_disk "$S/patchset.heterogeneous.json")" --output-file "$OUT/stau.json"
else
    echo "| published patchsets | - | - | skipped: no workspaces at $WORKSPACES |" >> "$ROWS"
fi
GEN="$OUT/generated"
mkdir -p "$GEN"
"$PYTHON" benchmarks/generate_large.py --channels "${LARGE[0]}" --bins "${LARGE[1]}" \
    --systematics "${LARGE[2]}" --out "$GEN/ws.json" --background "$GEN/bkg.json" \
    --patchset "$GEN/patchset.json" > "$GEN/size.json"
step generated-workspace "$STEP_LIMIT" "${CLIENT[@]}" cls "$GEN/ws.json" \
    --output-file "$OUT/generated.json"
step generated-24-patches "$((2 * STEP_LIMIT))" "${CLIENT[@]}" cls "$GEN/bkg.json" \
    --patchset "$GEN/patchset.json" --output-file "$OUT/generated-24.json"
"${CLIENT[@]}" info > "$OUT/info.json" 2>&1
kill "$server_pid" 2> /dev/null
wait "$server_pid" 2> /dev/null

# 4. the scaling table, 5. the variants
step scaling "$STEP_LIMIT" "$PYTHON" benchmarks/bench_large.py --device "$DEVICE" \
    --sizes "$SIZES" --peer-python none --skip-commands
VARIANTS=(--device "$DEVICE" --large "$(IFS=x; echo "${LARGE[*]}")")
[ "$DEVICE" = cpu ] && VARIANTS+=(--no-compile --repeats 1)
step variants "$((STEP_LIMIT + 60))" "$PYTHON" benchmarks/bench_device.py "${VARIANTS[@]}"

{
    echo "# gpu_check on $(cat "$OUT/device.txt")"
    echo
    echo "Generated analysis: $(cat "$GEN/size.json")"
    echo
    echo "| step | exit | seconds | last line |"
    echo "|---|---|---|---|"
    cat "$ROWS"
    for name in scaling variants; do
        echo
        echo "## $name"
        echo
        grep '^|' "$OUT/$name.log"
    done
} > "$TABLE"
cat "$TABLE"
exit $status
