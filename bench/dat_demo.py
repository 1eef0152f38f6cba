"""The before/after picture of docs/dat.md, on real photographs: train a DAT-light-sized
model (x4) in JAX on crops of scikit-image's sample photographs, holding one out; write
it as a PyTorch ``.pth`` with the original's tensor names; super-resolve the held-out
photo's x4-downscaled copy with the ``jattn-upscale`` command (in tiles); compare with
bicubic by PSNR and SSIM and set input, bicubic, DAT and ground truth side by side.

    python bench/dat_demo.py --minutes 8          # on the GPU

Writes ``bench/results/dat_demo.{json,md}`` and ``docs/img/dat_before_after.png``.
The degradation is bicubic downscaling (PIL, antialiased), as in the SR benchmarks;
PSNR and SSIM are on RGB in [0, 1] with a 4-pixel border left out, as is usual.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from jattn.interop.checkpoints import dat_to_torch_state_dict  # noqa: E402
from jattn.nn import DAT, DAT_PRESETS  # noqa: E402

SCALE = 4
TRAIN = ("astronaut", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field",
         "retina")
HELD_OUT = "coffee"
BORDER = 4


def photo(name: str) -> np.ndarray:
  """scikit-image's sample photo ``name`` as float32 RGB in [0, 1], cropped to a
  multiple of the scale."""
  import skimage.data

  img = getattr(skimage.data, name)()[..., :3]
  h, w = (s - s % SCALE for s in img.shape[:2])
  return img[:h, :w].astype(np.float32) / 255.0


def bicubic(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
  """PIL's bicubic resize of ``img`` to ``(width, height)`` (antialiased when shrinking)."""
  from PIL import Image

  u8 = Image.fromarray(np.round(np.clip(img, 0, 1) * 255).astype(np.uint8))
  return np.asarray(u8.resize(size, Image.Resampling.BICUBIC), np.float32) / 255.0


def downscale(hr: np.ndarray) -> np.ndarray:
  return bicubic(hr, (hr.shape[1] // SCALE, hr.shape[0] // SCALE))


def batches(pairs, batch: int, patch: int, rng: np.random.Generator):
  """Random aligned (LR, HR) crops with flips and transposes."""
  while True:
    lrs, hrs = [], []
    for _ in range(batch):
      lr, hr = pairs[rng.integers(len(pairs))]
      y, x = rng.integers(lr.shape[0] - patch + 1), rng.integers(lr.shape[1] - patch + 1)
      a = lr[y:y + patch, x:x + patch]
      b = hr[SCALE * y:SCALE * (y + patch), SCALE * x:SCALE * (x + patch)]
      if rng.integers(2):
        a, b = a[:, ::-1], b[:, ::-1]
      if rng.integers(2):
        a, b = a.transpose(1, 0, 2), b.transpose(1, 0, 2)
      lrs.append(a)
      hrs.append(b)
    yield jnp.asarray(np.stack(lrs)), jnp.asarray(np.stack(hrs))


def train(config, pairs, *, minutes: float, batch: int, patch: int, lr: float, seed: int = 0):
  model = DAT(config, rngs=nnx.Rngs(seed))
  schedule = optax.cosine_decay_schedule(lr, 100_000, alpha=0.05)
  optimizer = nnx.Optimizer(model, optax.adam(schedule), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, low, high):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(jnp.abs(m(low) - high)))(model)
    optimizer.update(model, grads)
    return loss

  data = batches(pairs, batch, patch, np.random.default_rng(seed))
  start, steps, losses = time.perf_counter(), 0, []
  while time.perf_counter() - start < minutes * 60:
    # The loss stays on the device: reading it every step would make the host wait for
    # each step before drawing the next batch.
    losses.append(step(model, optimizer, *next(data)))
    steps += 1
    if steps % 200 == 0:
      print(f"step {steps:6d}  L1 {float(jnp.mean(jnp.stack(losses))):.4f}  "
            f"({time.perf_counter() - start:.0f} s)", flush=True)
      losses = []
  jax.block_until_ready(nnx.state(model))
  return model, steps, time.perf_counter() - start


def scores(ours: np.ndarray, truth: np.ndarray) -> dict:
  from skimage.metrics import peak_signal_noise_ratio, structural_similarity

  a, b = (x[BORDER:-BORDER, BORDER:-BORDER] for x in (ours, truth))
  return {"psnr": float(peak_signal_noise_ratio(b, a, data_range=1.0)),
          "ssim": float(structural_similarity(b, a, data_range=1.0, channel_axis=2))}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--minutes", type=float, default=8.0, help="training time")
  parser.add_argument("--blocks", type=int, default=18, help="DAT-light has 18")
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--patch", type=int, default=32, help="low-resolution training crop")
  parser.add_argument("--lr", type=float, default=5e-4)
  parser.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--img", default=os.path.join(ROOT, "docs", "img"))
  args = parser.parse_args()
  import torch
  from PIL import Image

  config = dataclasses.replace(DAT_PRESETS["DAT-light"], upscale=SCALE, depth=(args.blocks,))
  pairs = [(downscale(hr), hr) for hr in map(photo, TRAIN)]
  model, steps, seconds = train(config, pairs, minutes=args.minutes, batch=args.batch,
                                patch=args.patch, lr=args.lr)

  work = tempfile.mkdtemp()
  checkpoint = os.path.join(work, "4x_demo_dat_light.pth")
  # As BasicSR writes DAT checkpoints: {"params": state dict}, buffers included.
  torch.save({"params": {k: torch.from_numpy(np.array(v)) for k, v in
                         dat_to_torch_state_dict(model, img_size=64).items()}}, checkpoint)
  hr = photo(HELD_OUT)
  lr = downscale(hr)
  lr_png, sr_png = os.path.join(work, "input.png"), os.path.join(work, "dat.png")
  Image.fromarray(np.round(lr * 255).astype(np.uint8)).save(lr_png)
  upscale = os.path.join(os.path.dirname(sys.executable), "jattn-upscale")
  subprocess.run([upscale, "--model", checkpoint, "--tile", "64", "--overlap", "8", lr_png,
                  sr_png], check=True)
  sr = np.asarray(Image.open(sr_png), np.float32) / 255.0
  size = (hr.shape[1], hr.shape[0])
  lr8 = np.asarray(Image.open(lr_png), np.float32) / 255.0
  results = {"bicubic": scores(bicubic(lr8, size), hr), "dat": scores(sr, hr)}
  record = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                config=dataclasses.asdict(config), train_images=TRAIN, held_out=HELD_OUT,
                steps=steps, train_seconds=round(seconds, 1), batch=args.batch,
                patch=args.patch, **results)
  os.makedirs(args.results, exist_ok=True)
  with open(os.path.join(args.results, "dat_demo.json"), "w") as f:
    json.dump(record, f, indent=1)
  with open(os.path.join(args.results, "dat_demo.md"), "w") as f:
    f.write(f"# DAT x4 on a held-out photograph ({record['device']}, jax {jax.__version__})\n\n"
            f"DAT-light layout with {args.blocks} blocks, trained {steps} steps "
            f"({seconds / 60:.1f} min) on {', '.join(TRAIN)}; tested on {HELD_OUT} "
            f"({hr.shape[1]}x{hr.shape[0]}), bicubic-downscaled x{SCALE}.\n\n"
            "| method | PSNR (dB) | SSIM |\n|---|---|---|\n"
            + "".join(f"| {name} | {r['psnr']:.2f} | {r['ssim']:.4f} |\n"
                      for name, r in results.items()))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  nearest = np.asarray(Image.open(lr_png).resize(size, Image.Resampling.NEAREST),
                       np.float32) / 255.0
  b, d = results["bicubic"], results["dat"]
  panels = [(f"input {lr.shape[1]}x{lr.shape[0]} (nearest)", nearest),
            (f"bicubic x4: {b['psnr']:.2f} dB, SSIM {b['ssim']:.3f}", bicubic(lr8, size)),
            (f"DAT x4 (jattn-upscale): {d['psnr']:.2f} dB, SSIM {d['ssim']:.3f}", sr),
            ("ground truth", hr)]
  fig, axes = plt.subplots(1, 4, figsize=(18, 3.6))
  for ax, (title, img) in zip(axes, panels):
    ax.imshow(np.clip(img, 0, 1), interpolation="nearest")
    ax.set_title(title, fontsize=10)
    ax.axis("off")
  fig.tight_layout()
  os.makedirs(args.img, exist_ok=True)
  path = os.path.join(args.img, "dat_before_after.png")
  fig.savefig(path, dpi=80)
  print(json.dumps(results), path)


if __name__ == "__main__":
  main()
