#!/usr/bin/env bash
# benchmarks/gpu_check.py on a machine where mhgpo is not installed (its docstring says what it measures): the
# wheels in --wheels DIR (the pure-Python packages that machine lacks, e.g. bm25s) are installed into a temporary
# folder, which goes on PYTHONPATH after the repository; every other argument goes to gpu_check.py, under a time
# limit of --deadline-s plus 60 s (the script itself starts no case after the deadline). `--script FILE` runs another
# script the same way (benchmarks/gpu_pipeline.py: the command line end to end).
#
#   bash benchmarks/gpu_check.sh --wheels .gpu/wheels --tokenizer .gpu/tokenizer --out $OUT --deadline-s 420
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=""
script=benchmarks/gpu_check.py
deadline=420
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="${2:?--wheels takes a folder}"; shift 2 ;;
    --script) script="${2:?--script takes a file}"; shift 2 ;;
    --deadline-s) deadline="${2:?--deadline-s takes seconds}"; args+=("$1" "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
python="${PYTHON:-python3}"
if [ -n "$wheels" ]; then
  found=("$wheels"/*.whl)
  if [ -e "${found[0]}" ]; then
    site="$(mktemp -d "${TMPDIR:-/tmp}/mhgpo-site.XXXXXX")"
    "$python" -m pip install -q --no-index --no-deps --target "$site" "${found[@]}"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check.sh: no wheels in $wheels" >&2
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MHGPO_CACHE="${MHGPO_CACHE:-$(mktemp -d "${TMPDIR:-/tmp}/mhgpo-cache.XXXXXX")}"  # the world and its index
export HF_HUB_OFFLINE=1
limit=$("$python" -c "import sys; print(int(float(sys.argv[1])) + 60)" "$deadline")
exec timeout --kill-after=15 "$limit" "$python" "$script" "${args[@]}"
