#!/usr/bin/env bash
# The GPU check: one script, at most 7 minutes on one H100/H200 with no network.
#
#   bash bench/gpu/run.sh             # on the GPU machine (results in $OUT or bench/gpu/out)
#   bash bench/gpu/run.sh --dry-run   # the same stages on the CPU at toy sizes (CI runs this)
#
# Each stage runs in its own process under its own time limit (its output in NAME.out and
# NAME.err) and writes one JSON line to results.jsonl (a stage that fails or runs out of time writes a line saying so; the others
# still run); the table at the end is `python bench/gpu/stages.py report results.jsonl`.
# zeal is used from this tree (PYTHONPATH), not installed. Wheels the GPU image lacks
# (pydantic, pyyaml) are installed from bench/gpu/wheels, filled beforehand by
# bench/gpu/fetch_wheels.sh on a machine with network.
set -u
cd "$(dirname "$0")/../.."
DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; fi
OUT_DIR="${OUT:-bench/gpu/out}"
mkdir -p "$OUT_DIR"
RES="$OUT_DIR/results.jsonl"
: > "$RES"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

if ! "$PY" -c "import pydantic, yaml" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --find-links bench/gpu/wheels pydantic pyyaml >"$OUT_DIR/install.log" 2>&1 \
    || echo '{"stage": "install", "error": "pydantic/pyyaml missing and not installable from bench/gpu/wheels"}' >>"$RES"
fi

stage() {  # stage NAME SECONDS
  local name=$1 limit=$2 line rc
  line=$(timeout -k 10 "$limit" "$PY" bench/gpu/stages.py "$name" $DRY 2>"$OUT_DIR/$name.err" \
    | tee "$OUT_DIR/$name.out" | tail -n 1)
  rc=${PIPESTATUS[0]}
  case "$line" in
    "{"*) ;;
    *) line="{\"stage\": \"$name\", \"error\": \"no result (exit $rc, limit ${limit} s): see $name.err\"}" ;;
  esac
  echo "$line" >>"$RES"
  echo "$line"
}

LIMITS="env:45 train_correct:90 train_speed:120 serve_correct:75 serve_speed:90"
if [ -n "$DRY" ]; then
  # on the CPU the stages are forked from one process that has imported torch, transformers and
  # zeal once (same stages, same limits, same files); on a GPU each is a fresh interpreter
  "$PY" bench/gpu/forked.py "$OUT_DIR" $LIMITS
else
  for spec in $LIMITS; do stage "${spec%%:*}" "${spec##*:}"; done
fi
echo
"$PY" bench/gpu/stages.py report "$RES"
