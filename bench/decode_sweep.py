"""A sweep of the Triton decode kernel's tiles, splits and stages at q_len 1 (GQA 32/8,
head dim 128, bf16) on the four (batch, cache) rows of issue 39, with the peers and the
copy bandwidth in the same run: what ``flash/decode_config.py``'s choices rest on.

    python bench/decode_sweep.py      # on the GPU; writes $OUT/probe.json (or /tmp)

(bench/decode.py is the benchmark of record; this is the tuning sweep.)
"""
import statistics, time, json, os
import jax, jax.numpy as jnp
import jattn
from jattn.kernels.flash.decode_config import decode_config, DecodeConfig
from jattn.kernels.flash.triton_decode import flash_triton_decode

def med(fn, *args, reps=30):
  jax.block_until_ready(fn(*args))
  ts=[]
  for _ in range(reps):
    t=time.perf_counter(); jax.block_until_ready(fn(*args)); ts.append(time.perf_counter()-t)
  return statistics.median(ts)*1e3

x = jnp.ones((1024, 1024, 1024), jnp.bfloat16)  # 2 GiB
copy = jax.jit(lambda x: x + 1)
t = med(copy, x, reps=20); bw = 2 * x.size * 2 / t / 1e6  # GB/s (t in ms)
print(f"copy bandwidth {bw:.0f} GB/s ({t:.3f} ms)"); del x
res = {"copy_GBps": bw, "rows": []}
try:
  from jax.experimental.pallas.ops.gpu import decode_attention as jda
except Exception as e:
  jda = None; print("no jax decode_attention", e)
for (B, S) in [(8, 32768), (32, 8192), (1, 131072), (64, 4096)]:
  H, KH, D = 32, 8, 128
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(k1, (B, 1, H, D), jnp.bfloat16)
  k = jax.random.normal(k2, (B, S, KH, D), jnp.bfloat16)
  v = jax.random.normal(k3, (B, S, KH, D), jnp.bfloat16)
  lens = jnp.full((B,), S, jnp.int32)
  kv_bytes = 2 * B * S * KH * D * 2
  row = {"B": B, "S": S}
  fns = {
    "jattn_auto": jax.jit(lambda q, k, v: jattn.flash_attention(q, k, v, kv_lengths=lens)),
    "jattn_triton": jax.jit(lambda q, k, v: jattn.flash_attention(q, k, v, kv_lengths=lens, backend="pallas_triton")),
    "jattn_nolen": jax.jit(lambda q, k, v: jattn.flash_attention(q, k, v, backend="pallas_triton")),
    "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")),
    "xla": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")),
  }
  if jda is not None:
    fns["jax_pallas"] = jax.jit(lambda q, k, v: jda.gqa(q[:, 0], k, v))
  for name, fn in fns.items():
    try:
      row[name] = med(fn, q, k, v)
    except Exception as e:
      row[name] = None; print(name, "failed", type(e).__name__, str(e)[:300])
  base = decode_config(B, 1, H, KH, S, D, D, 2, jax.devices()[0].core_count)
  row["config"] = str(base)
  # split / block sweep of the Triton kernel
  sweep = {}
  for bk in (64, 128, 256):
    for sp in sorted({max(1, base.splits // 2), base.splits, base.splits * 2, base.splits * 4}):
      for st in (2, 3, 4):
        cfg = DecodeConfig(16, bk, sp, 4, st)
        f = jax.jit(lambda q, k, v, cfg=cfg: flash_triton_decode(q, k, v, None, causal=False, scale=D**-0.5, local_window=None, softcap=None, config=cfg, interpret=False)[0])
        try:
          sweep[f"bk{bk}-s{sp}-st{st}"] = med(f, q, k, v, reps=15)
        except Exception as e:
          sweep[f"bk{bk}-s{sp}-st{st}"] = None; print("sweep fail", bk, sp, st, str(e)[:200])
  best = min((t, n) for n, t in sweep.items() if t)
  row["sweep"] = sweep
  row["best"] = best
  tb = lambda ms: kv_bytes / ms / 1e6 if ms else 0  # GB/s
  print(f"B{B} S{S} cfg={base}")
  for n in fns: 
    if row.get(n): print(f"  {n:14s} {row[n]:.3f} ms  {tb(row[n]):.0f} GB/s  {tb(row[n])/bw*100:.0f}%")
  print(f"  best sweep {best[1]} {best[0]:.3f} ms {tb(best[0]):.0f} GB/s {tb(best[0])/bw*100:.0f}%")
  res["rows"].append(row)
  del q, k, v
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
