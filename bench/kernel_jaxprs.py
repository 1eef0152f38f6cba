"""Writes the jaxpr of every Triton-family kernel (flash: plain, causal, window,
soft-cap, segments; window, dilated, parallel and chunkwise retention; forward and
backward; fp16 and fp32) and of the Hopper flash forward (traced, not compiled: this
runs on a CPU; the Hopper backward traces only with the GPU image's newer jax) to one
text file. Two checkouts whose files are equal run
identical kernels, so a refactor's GPU figures still hold.

    JATTN_INTERPRET=1 python bench/kernel_jaxprs.py before.txt   # in each checkout
    cmp before.txt after.txt
"""

import sys

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr

import jattn
from jattn.core.op import Call, run
from jattn.flash import FLASH
from jattn.kernels.flash import default_mosaic_config


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


def main(path):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
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
  mosaic = FLASH.impl("pallas_mosaic")
  for causal in (False, True):
    x = jax.random.normal(keys[0], (1, 1024, 4, 128), jnp.bfloat16)

    def hopper(q, k, v):  # the call "auto" makes on a Hopper GPU
      problem, arrays = FLASH.bind(q, k, v, causal=causal)
      return FLASH.finish(problem, run(Call(FLASH, mosaic, problem, default_mosaic_config(128),
                                            False), arrays))
    out += kernel_jaxprs(jax.make_jaxpr(hopper)(x, x, x).jaxpr, [])
  with open(path, "w") as f:
    f.write("\n=====\n".join(out))
  print(f"{len(out)} kernels -> {path}")


if __name__ == "__main__":
  main(sys.argv[1])
