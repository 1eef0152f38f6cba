# Runs the GPU tests (-m gpu: the gpu-marked tests and every kernel test, compiled) in N
# pytest-xdist workers, handed out one test at a time: they are compile-bound.
# usage (on the device, from the repository root): OUT=dir bash tests/gpu_shards.sh N [pytest args]
# It installs the working tree first (editable, no dependencies: the device has them),
# since jattn.kernels and jattn.interop map to folders of other names. A test running
# past 240 s fails (where pytest-timeout is installed); the run is interrupted after
# JATTN_GPU_SUITE_LIMIT seconds (default 570), still printing its summary.
# Log: $OUT/gpu_tests.log.
OUT=${OUT:-.}
N=$1; shift
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/jattn_install.log 2>&1 \
  || { cat /tmp/jattn_install.log; exit 1; }
timeout_flag=$(python -c "import pytest_timeout" 2>/dev/null && echo "--timeout 240")
start=$(date +%s)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 20 "${JATTN_GPU_SUITE_LIMIT:-570}" \
  python -m pytest -q -m gpu -n "$N" --dist load -p no:cacheprovider $timeout_flag \
  --durations=0 --durations-min=2 -rfEs "${@:-tests}" > "$OUT/gpu_tests.log" 2>&1
rc=$?
echo "GPU suite: $(( $(date +%s) - start )) s in $N workers (pytest exit $rc)"
tail -n 1 "$OUT/gpu_tests.log"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -40
exit $rc
