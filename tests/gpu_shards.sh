# Runs the GPU tests (-m gpu: the gpu-marked tests and every kernel test, compiled) as N
# parallel pytest processes: they are compile-bound (JATTN_SHARD in conftest.py).
# usage (on the device, from the repository root): OUT=dir bash tests/gpu_shards.sh N [pytest args]
# It installs the working tree first (editable, no dependencies: the device has them),
# since jattn.kernels and jattn.interop map to folders of other names. Logs: $OUT/gpu_tests.log.
OUT=${OUT:-.}
N=$1; shift
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/jattn_install.log 2>&1 \
  || { cat /tmp/jattn_install.log; exit 1; }
start=$(date +%s)
for i in $(seq 0 $((N-1))); do
  (JATTN_SHARD=$i/$N XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -q -m gpu \
     -p no:cacheprovider --durations=5 "${@:-tests}" > /tmp/jattn_shard_$i.log 2>&1) &
done
wait
cat /tmp/jattn_shard_*.log > $OUT/gpu_tests.log
echo "GPU suite: $(( $(date +%s) - start )) s in $N shards"
tail -q -n 1 /tmp/jattn_shard_*.log
grep -h -E "^(FAILED|ERROR)" /tmp/jattn_shard_*.log | head -40
