# Runs the GPU tests as N parallel pytest processes (compile-bound; JATTN_SHARD in conftest.py).
# usage (on the device): OUT=dir bash tests/gpu_shards.sh N tests/test_flash_mosaic_gpu.py ...
OUT=${OUT:-.}
N=$1; shift
for i in $(seq 0 $((N-1))); do
  (JATTN_SHARD=$i/$N XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python -m pytest -q -m gpu "$@" > $OUT/shard_$i.log 2>&1) &
done
wait
tail -n 2 $OUT/shard_*.log
grep -h -E "^(FAILED|ERROR)" $OUT/shard_*.log | head -40
