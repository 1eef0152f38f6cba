"""Writes the jaxpr of every kernel jattn launches for a fixed set of calls (forward
and gradient) to one text file, one kernel per section: the Triton-lowered families
(flash: plain, causal, window, soft-cap, segments; window, dilated, parallel and
chunkwise retention; fp16 and fp32) everywhere, and on a Hopper GPU the Mosaic
kernels too (flash forward and backward with every mask and feature, the fused dQ,
wide heads, flex functions, parallel retention). Two checkouts whose files are
equal launch identical kernels, so a refactor's GPU figures still hold.

It calls only the public API, so one copy of this script traces any checkout:

    PYTHONPATH=old JATTN_INTERPRET=1 python bench/kernel_jaxprs.py before.txt
    PYTHONPATH=new JATTN_INTERPRET=1 python bench/kernel_jaxprs.py after.txt
    cmp before.txt after.txt

Names of traced Python functions (``name=...``) are replaced by ``_``: renaming a
helper changes no kernel. The Mosaic backward traces only with jax >= 0.11.
"""

import re
import sys

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr

import jattn


def kernel_jaxprs(jaxpr, out):
  """Appends the kernel jaxpr and grid of every pallas_call in ``jaxpr`` (nested too)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      out.append(f"{eqn.params['jaxpr']}\n{eqn.params['grid_mapping'].grid}")
      continue
    if "jaxprs" in eqn.params and "meshes" in eqn.params:  # a Mosaic GPU kernel
      out.append("\n".join(map(str, eqn.params["jaxprs"] + eqn.params["meshes"]))
                 + f"\n{eqn.params['compiler_params']}")
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, ClosedJaxpr):
          kernel_jaxprs(sub.jaxpr, out)
        elif hasattr(sub, "eqns"):
          kernel_jaxprs(sub, out)
  return out


def of_gradient(f, *args):
  """The kernels of ``f``'s forward and of its gradient in every argument."""
  loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))
  return kernel_jaxprs(jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(args)))))(
      *args).jaxpr, [])


def triton_cases(keys):
  out = []
  for dtype in (jnp.float16, jnp.float32):
    q = jax.random.normal(keys[0], (2, 100, 4, 64), dtype)
    k, v = (jax.random.normal(key, (2, 130, 2, 64), dtype) for key in keys[1:3])
    segments = dict(q_segment_ids=jnp.zeros((2, 100), jnp.int32),
                    kv_segment_ids=jnp.zeros((2, 130), jnp.int32))
    for kw in [{}, dict(causal=True), dict(local_window=(20, 5)), dict(softcap=30.0),
               dict(causal=True, **segments)]:
      out += of_gradient(lambda q, k, v: jattn.flash_attention(
          q, k, v, backend="pallas_triton", **kw), q, k, v)
    x = jax.random.normal(keys[0], (8, 49, 3, 32), dtype)
    bias = jax.random.normal(keys[3], (3, 49, 49), jnp.float32)
    out += of_gradient(lambda q, k, v, b: jattn.window_attention(
        q, k, v, b, backend="pallas_triton"), x, x, x, bias)
    x = jax.random.normal(keys[0], (1, 256, 4, 32), dtype)
    out += of_gradient(lambda q, k, v: jattn.dilated_attention(
        q, k, v, segment_lengths=(64, 128), dilation_rates=(1, 2), backend="pallas_triton"),
        x, x, x)
    for mode in ("parallel", "chunkwise"):
      out += of_gradient(lambda q, k, v: jattn.retention(
          q, k, v, mode=mode, backend="pallas_triton"), x, x, x)
  return out


def mosaic_cases(keys):
  """Every Hopper kernel variant the op layer launches (fixed tiles, so that the
  autotuner's cache does not choose them)."""
  from jattn.kernels.flash import MosaicBlockConfig, default_mosaic_config
  out = []
  q = jax.random.normal(keys[0], (2, 300, 4, 128), jnp.bfloat16)
  k, v = (jax.random.normal(key, (2, 260, 2, 128), jnp.bfloat16) for key in keys[1:3])
  ids = jnp.sort(jax.random.randint(keys[3], (2, 300), 0, 3), axis=1)
  segments = dict(q_segment_ids=ids, kv_segment_ids=ids[:, :260])
  config = default_mosaic_config(128)
  for kw in [{}, dict(causal=True), dict(local_window=(70, 10)), dict(softcap=30.0),
             dict(causal=True, **segments), dict(causal=True, dropout_rate=0.1,
                                                 dropout_key=jax.random.PRNGKey(1)),
             dict(config=MosaicBlockConfig(persistent=True)),
             dict(deterministic=False, config=MosaicBlockConfig(fused_dq=True)),
             dict(causal=True, config=MosaicBlockConfig(block_q=128, block_kv=64, stages=3,
                                                        block_q_dkv=128, bwd_stages=3))]:
    kw = dict(dict(config=config), **kw)
    out += of_gradient(lambda q, k, v: jattn.flash_attention(
        q, k, v, backend="pallas_mosaic", **kw), q, k, v)
  out += of_gradient(lambda q, k, v, s: jattn.flash_attention(
      q, k, v, sinks=s, causal=True, backend="pallas_mosaic", config=config), q, k, v,
      jnp.linspace(-1.0, 1.0, 4))
  for dk, dv in ((64, 64), (192, 128), (256, 256)):
    a = jax.random.normal(keys[0], (1, 200, 2, dk), jnp.bfloat16)
    b = jax.random.normal(keys[1], (1, 200, 2, dv), jnp.bfloat16)
    out += of_gradient(lambda q, k, v: jattn.flash_attention(
        q, k, v, causal=True, backend="pallas_mosaic",
        config=default_mosaic_config(dk, dv)), a, a, b)
  slopes = jnp.linspace(0.1, 1.0, 4)
  docs = ids[:, :260]
  out += of_gradient(lambda q, k, v: jattn.flex_attention(
      q[:, :260], k, v, score_mod=lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j),
      mask_mod=lambda b, h, i, j: (docs[b, i] == docs[b, j]) & (j <= i),
      backend="pallas_mosaic", config=config), q, k, v)
  x = jax.random.normal(keys[0], (2, 300, 4, 128), jnp.bfloat16)
  out += of_gradient(lambda q, k, v: jattn.retention(
      q, k, v, mode="parallel", backend="pallas_mosaic"), x, x, x)
  return out


def main(path):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  out = triton_cases(keys)
  on_gpu = any(d.platform == "gpu" for d in jax.devices())
  if on_gpu:
    out += mosaic_cases(keys)
  text = re.sub(r"name=[\w<>.-]+", "name=_", "\n=====\n".join(out))
  with open(path, "w") as f:
    f.write(text)
  print(f"{len(out)} kernels ({'with' if on_gpu else 'without'} Hopper) -> {path}")


if __name__ == "__main__":
  main(sys.argv[1])
