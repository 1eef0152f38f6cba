"""The before/after picture of docs/dat.md, end to end through our own pieces: train a
small DAT (x4) on generated images in JAX, write it as a PyTorch ``.pth`` with the
original's tensor names, super-resolve a new generated image with the ``jattn-upscale``
CLI (in tiles), and set input, bicubic, DAT and ground truth side by side.

    python bench/dat_demo.py --out docs/img

Runs on the CPU in about 20 minutes (the window attention in XLA there). Random weights would
give noise, hence the training; the images are shapes, stripes and gradients, so the
model learns sharp edges and thin lines, which bicubic blurs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jattn.interop.checkpoints import dat_to_torch_state_dict  # noqa: E402
from jattn.nn import DAT, DATConfig  # noqa: E402

SCALE = 4
CONFIG = DATConfig(embed_dim=48, depth=(2, 2), num_heads=(4, 4), split_size=(8, 16),
                   expansion_factor=2.0, upscale=SCALE, resi_connection="1conv",
                   upsampler="pixelshuffle")


def generated_image(rng: np.random.Generator, size: int) -> np.ndarray:
  """``[size, size, 3]`` in [0, 1]: a colour gradient under random discs, boxes,
  lines and stripe patches."""
  yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
  c0, c1 = rng.uniform(size=3), rng.uniform(size=3)
  angle = rng.uniform(0, np.pi)
  t = (np.cos(angle) * xx + np.sin(angle) * yy)[..., None]
  img = c0 * (1 - t) + c1 * t
  for _ in range(rng.integers(4, 10)):
    colour = rng.uniform(size=3)
    kind = rng.integers(4)
    cy, cx = rng.uniform(size=2)
    if kind == 0:
      inside = (yy - cy) ** 2 + (xx - cx) ** 2 < rng.uniform(0.02, 0.3) ** 2
    elif kind == 1:
      hh, ww = rng.uniform(0.05, 0.4, size=2)
      inside = (abs(yy - cy) < hh) & (abs(xx - cx) < ww)
    elif kind == 2:
      a = rng.uniform(0, np.pi)
      inside = abs(np.cos(a) * (xx - cx) + np.sin(a) * (yy - cy)) < rng.uniform(0.004, 0.02)
    else:
      a, period = rng.uniform(0, np.pi), rng.uniform(0.03, 0.12)
      phase = (np.cos(a) * xx + np.sin(a) * yy) / period
      inside = ((phase % 1.0) < 0.5) & (abs(yy - cy) < 0.25) & (abs(xx - cx) < 0.25)
    img = np.where(inside[..., None], colour, img)
  return np.clip(img, 0, 1).astype(np.float32)


def downscale(hr: np.ndarray) -> np.ndarray:
  """Area downscaling by ``SCALE`` (the degradation the model learns to invert)."""
  h, w, c = hr.shape
  return hr.reshape(h // SCALE, SCALE, w // SCALE, SCALE, c).mean(axis=(1, 3))


def train(steps: int, batch: int, patch: int, seed: int = 0) -> DAT:
  model = DAT(CONFIG, backend="xla", rngs=nnx.Rngs(seed))
  schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, min(200, steps // 10), steps,
                                               end_value=1e-5)
  optimizer = nnx.Optimizer(model, optax.adam(schedule), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, lr, hr):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(jnp.abs(m(lr) - hr)))(model)
    optimizer.update(model, grads)
    return loss

  rng = np.random.default_rng(seed)
  start = time.perf_counter()
  for i in range(steps):
    hr = np.stack([generated_image(rng, patch * SCALE) for _ in range(batch)])
    lr = np.stack([downscale(x) for x in hr])
    loss = step(model, optimizer, jnp.asarray(lr), jnp.asarray(hr))
    if i % 100 == 0 or i == steps - 1:
      print(f"step {i:5d}  L1 {float(loss):.4f}  ({time.perf_counter() - start:.0f} s)",
            flush=True)
  return model


def psnr(a: np.ndarray, b: np.ndarray) -> float:
  return float(10 * np.log10(1.0 / np.mean((a - b) ** 2)))


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "img"))
  parser.add_argument("--steps", type=int, default=5000)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--patch", type=int, default=16, help="low-resolution training patch")
  args = parser.parse_args()
  import torch
  from PIL import Image

  model = train(args.steps, args.batch, args.patch)
  work = tempfile.mkdtemp()
  checkpoint = os.path.join(work, "4x_demo_dat.pth")
  # As BasicSR writes DAT checkpoints: {"params": state dict}, buffers included.
  torch.save({"params": {k: torch.from_numpy(v) for k, v in
                         dat_to_torch_state_dict(model, img_size=64).items()}}, checkpoint)

  hr = generated_image(np.random.default_rng(12345), 384)
  lr = downscale(hr)
  lr_png, sr_png = os.path.join(work, "input.png"), os.path.join(work, "dat.png")
  Image.fromarray(np.round(lr * 255).astype(np.uint8)).save(lr_png)
  subprocess.run([sys.executable, "-m", "jattn.interop.upscale_cli", "--model", checkpoint,
                  "--tile", "48", "--overlap", "8", lr_png, sr_png], check=True,
                 cwd=os.path.join(os.path.dirname(__file__), ".."))
  sr = np.asarray(Image.open(sr_png), np.float32) / 255
  lr_u8 = Image.open(lr_png)
  size = (hr.shape[1], hr.shape[0])
  bicubic = np.asarray(lr_u8.resize(size, Image.BICUBIC), np.float32) / 255
  nearest = np.asarray(lr_u8.resize(size, Image.NEAREST), np.float32) / 255
  hr8 = np.round(hr * 255) / 255

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = [(f"input {lr.shape[1]}x{lr.shape[0]} (nearest)", nearest),
            (f"bicubic x4, PSNR {psnr(bicubic, hr8):.1f} dB", bicubic),
            (f"DAT x4 (jattn-upscale), PSNR {psnr(sr, hr8):.1f} dB", sr),
            ("ground truth", hr8)]
  fig, axes = plt.subplots(1, 4, figsize=(16, 4.4))
  for ax, (title, img) in zip(axes, panels):
    ax.imshow(np.clip(img, 0, 1), interpolation="nearest")
    ax.set_title(title, fontsize=10)
    ax.axis("off")
  fig.tight_layout()
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "dat_before_after.png")
  fig.savefig(path, dpi=80)
  print(f"{path}: " + "; ".join(title for title, _ in panels))


if __name__ == "__main__":
  main()
