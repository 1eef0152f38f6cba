"""DAT, the Dual Aggregation Transformer for image super-resolution (Chen et al.,
ICCV 2023), in Flax NNX on ``jattn.window_attention``.

Class by class it mirrors the original PyTorch code (zhengchen1999/DAT, as spandrel
ships it), and parameter paths are the torch state-dict names (``nn.Sequential``
members sit at their torch index in an ``nnx.List``, parameter-free members as
``Fn``), so ``jattn.interop.checkpoints`` loads real checkpoints by a mechanical mapping.
Images are ``[batch, H, W, C]``; inside a block the tokens stay an image.
Inference and fine-tuning: dropout and stochastic depth (0 at inference) are left out.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn.nn.loaders import checkpoint_loader
from jattn.window import window_attention

RGB_MEAN = (0.4488, 0.4371, 0.4040)
NUM_FEAT = 64  # channels before the pixel-shuffle upsampler (fixed in DAT)
gelu = functools.partial(jax.nn.gelu, approximate=False)  # torch's nn.GELU


class Fn(nnx.Module):
  """A parameter-free member of a torch ``nn.Sequential`` (activation, reshape):
  ``fn(x, **options)``. ``fn`` is a module-level function and the options plain values,
  so two models of one config have equal graph definitions (one compiled program
  serves both; a lambda or ``functools.partial`` would compare unequal)."""

  def __init__(self, fn, **options):
    self.fn, self.options = fn, tuple(sorted(options.items()))

  def __call__(self, x):
    return self.fn(x, **dict(self.options))


def identity(x):
  return x


def spatial_mean(x):
  """``[B, H, W, C] -> [B, 1, 1, C]`` (torch's ``AdaptiveAvgPool2d(1)``)."""
  return x.mean(axis=(1, 2), keepdims=True)


def run(layers, x):
  """Applies an ``nnx.List`` standing for a torch ``nn.Sequential``."""
  for layer in layers:
    x = layer(x)
  return x


def pixel_shuffle(x, r: int):
  """torch's ``PixelShuffle`` on ``[B, H, W, C * r * r]`` -> ``[B, H * r, W * r, C]``."""
  b, h, w, c = x.shape
  x = x.reshape(b, h, w, c // (r * r), r, r).transpose(0, 1, 4, 2, 5, 3)
  return x.reshape(b, h * r, w * r, c // (r * r))


def to_windows(x, hs: int, ws: int):
  """``[B, H, W, C]`` -> ``[B * (H/hs) * (W/ws), hs * ws, C]``, windows in row-major order."""
  b, h, w, c = x.shape
  x = x.reshape(b, h // hs, hs, w // ws, ws, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(-1, hs * ws, c)


def from_windows(x, hs: int, ws: int, h: int, w: int):
  """Inverse of ``to_windows``."""
  b = x.shape[0] // ((h // hs) * (w // ws))
  x = x.reshape(b, h // hs, w // ws, hs, ws, -1).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, h, w, -1)


def relative_positions(hs: int, ws: int):
  """``(table, index)``: the ``[(2hs-1)(2ws-1), 2]`` relative offsets fed to the bias MLP,
  and ``[hs*ws, hs*ws]`` indices into it for every pair of tokens in a window."""
  dh, dw = np.meshgrid(np.arange(1 - hs, hs), np.arange(1 - ws, ws), indexing="ij")
  table = np.stack([dh.ravel(), dw.ravel()], axis=1).astype(np.float32)
  ch, cw = np.meshgrid(np.arange(hs), np.arange(ws), indexing="ij")
  coords = np.stack([ch.ravel(), cw.ravel()])  # [2, T]
  rel = coords[:, :, None] - coords[:, None, :]
  index = (rel[0] + hs - 1) * (2 * ws - 1) + (rel[1] + ws - 1)
  return table, index


def shift_masks(h: int, w: int, split: tuple[int, int], shift: tuple[int, int]):
  """The two branches' shifted-window masks ``[windows, T, T]`` (0 within a region,
  -100 across), as DAT's ``calculate_mask`` builds them for an ``h x w`` image."""

  def regions(split_h, split_w, shift_h, shift_w):
    img = np.zeros((h, w), np.float32)
    spans = lambda s, t: (slice(0, -s), slice(-s, -t), slice(-t, None))
    count = 0
    for hs in spans(split_h, shift_h):
      for ws in spans(split_w, shift_w):
        img[hs, ws] = count
        count += 1
    win = to_windows(img[None, :, :, None], split_h, split_w)[..., 0]  # [nW, T]
    return np.where(win[:, None, :] - win[:, :, None] != 0, -100.0, 0.0).astype(np.float32)

  return (regions(split[0], split[1], shift[0], shift[1]),
          regions(split[1], split[0], shift[1], shift[0]))


# Bounds on what a config may ask for, so that one read from a file cannot ask for
# unbounded memory: the relative-position bias [heads, T, T] of a window of T tokens is
# built whole and images are padded to a multiple of the longer window side (DAT's own
# windows are 8 x 32), and the output has upscale^2 times the input's pixels.
MAX_WINDOW_SIDE = 64
MAX_UPSCALE = 16


class DATConfigError(ValueError):
  """A ``DATConfig`` the model cannot run. ``fields`` names the fields at fault, a
  group's entry of ``depth`` or ``num_heads`` as ``"num_heads[i]"``: what a checkpoint
  loader needs to name the tensors the values were read from."""

  def __init__(self, message: str, *fields: str):
    super().__init__(message)
    self.fields = fields


def _int_field(name: str, value, low: int, high: int | None = None) -> None:
  if (not isinstance(value, int) or isinstance(value, bool) or value < low
      or (high is not None and value > high)):
    bounds = f">= {low}" if high is None else f"from {low} to {high}"
    raise DATConfigError(f"{name} must be an int {bounds}, got {value!r}", name)


def _int_tuple(name: str, value) -> tuple:
  if not isinstance(value, (list, tuple)):
    raise DATConfigError(f"{name} must be a list of ints, got {value!r}", name)
  return tuple(value)


@dataclasses.dataclass(frozen=True)
class DATConfig:
  """Hyper-parameters of a DAT model (the original constructor's, minus training
  ones). Each is checked when the config is made: a ``DATConfigError`` (a
  ``ValueError``) names the fields of one the forward pass cannot run, or that are
  out of bounds (``MAX_WINDOW_SIDE``, ``MAX_UPSCALE``)."""

  in_chans: int = 3
  embed_dim: int = 180
  split_size: tuple[int, int] = (8, 32)
  depth: tuple[int, ...] = (6, 6, 6, 6, 6, 6)
  num_heads: tuple[int, ...] = (6, 6, 6, 6, 6, 6)
  expansion_factor: float = 2.0
  qkv_bias: bool = True
  upscale: int = 4
  img_range: float = 1.0
  resi_connection: str = "1conv"
  upsampler: str = "pixelshuffle"

  def __post_init__(self):
    for name in ("split_size", "depth", "num_heads"):
      object.__setattr__(self, name, _int_tuple(name, getattr(self, name)))
    _int_field("in_chans", self.in_chans, 1)
    _int_field("embed_dim", self.embed_dim, 1)
    if len(self.split_size) != 2:
      raise DATConfigError(f"split_size must be two window sides (h, w), got {self.split_size}",
                           "split_size")
    for side in self.split_size:
      _int_field("split_size", side, 1, MAX_WINDOW_SIDE)
    if len(self.depth) != len(self.num_heads) or not self.depth:
      raise DATConfigError(f"depth {self.depth} and num_heads {self.num_heads} must be non-empty "
                           "and of the same length (one entry per residual group)",
                           "depth", "num_heads")
    for i, (blocks, heads) in enumerate(zip(self.depth, self.num_heads)):
      _int_field(f"depth[{i}]", blocks, 1)
      _int_field(f"num_heads[{i}]", heads, 1)
    _int_field("upscale", self.upscale, 1, MAX_UPSCALE)
    for name in ("expansion_factor", "img_range"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and value > 0):
        raise DATConfigError(f"{name} must be a finite number > 0, got {value!r}", name)
    if not isinstance(self.qkv_bias, bool):
      raise DATConfigError(f"qkv_bias must be True or False, got {self.qkv_bias!r}", "qkv_bias")
    if self.resi_connection not in ("1conv", "3conv"):
      raise DATConfigError("resi_connection must be '1conv' or '3conv', got "
                           f"{self.resi_connection!r}", "resi_connection")
    if self.upsampler not in ("pixelshuffle", "pixelshuffledirect"):
      raise DATConfigError("upsampler must be 'pixelshuffle' or 'pixelshuffledirect', got "
                           f"{self.upsampler!r}", "upsampler")
    scale = self.upscale
    if self.upsampler == "pixelshuffle" and not (scale == 3 or not scale & (scale - 1)):
      raise DATConfigError(f"upscale {scale} is not supported by 'pixelshuffle': use 2^n or 3",
                           "upscale")
    # What the original's forward pass needs (its constructor checks none of it):
    # two spatial branches of half the channels and half the heads (rounded down),
    # channel attention over all of them, and a gate that halves the FFN's width.
    # Widths from 16 to 30 are fine: the position-bias MLP is embed_dim // 32 wide, and
    # at 0 its output is its last bias, as in the original.
    if self.embed_dim < 16 or self.embed_dim % 2:
      raise DATConfigError(f"embed_dim must be even (the spatial branches take half the "
                           f"channels each) and >= 16 (the spatial interaction map is "
                           f"embed_dim // 16 channels wide), got {self.embed_dim}", "embed_dim")
    hidden = int(self.embed_dim * self.expansion_factor)
    if hidden < 2 or hidden % 2:
      raise DATConfigError(f"embed_dim * expansion_factor must give an even FFN width (its gate "
                           f"splits it in halves), got int({self.embed_dim} * "
                           f"{self.expansion_factor}) = {hidden}", "embed_dim", "expansion_factor")
    for i, (heads, blocks) in enumerate(zip(self.num_heads, self.depth)):
      if heads < 2 or (self.embed_dim // 2) % (heads // 2):
        raise DATConfigError(f"num_heads {heads} must be >= 2 with {heads // 2 or 'its half'} "
                             f"dividing embed_dim / 2 = {self.embed_dim // 2} (each spatial "
                             "branch takes half the heads, rounded down)",
                             f"num_heads[{i}]", "embed_dim")
      if blocks >= 2 and self.embed_dim % heads:
        raise DATConfigError(f"num_heads {heads} must divide embed_dim {self.embed_dim} (the "
                             "channel-attention blocks split the channels among the heads)",
                             f"num_heads[{i}]", "embed_dim")

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


PRESETS = {
    "DAT": DATConfig(expansion_factor=4.0, split_size=(8, 32)),
    "DAT-S": DATConfig(expansion_factor=2.0, split_size=(8, 16)),
    "DAT-2": DATConfig(expansion_factor=2.0, split_size=(8, 32)),
    "DAT-light": DATConfig(embed_dim=60, depth=(18,), num_heads=(6,), expansion_factor=2.0,
                           split_size=(8, 32), resi_connection="3conv",
                           upsampler="pixelshuffledirect"),
}


class _Layers:
  """Layer factories with the model's dtypes and torch's defaults (LayerNorm eps 1e-5)."""

  def __init__(self, dtype, param_dtype, rngs):
    self.kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def linear(self, i, o, bias=True):
    return nnx.Linear(i, o, use_bias=bias, **self._empty_init(i, o), **self.kw)

  def conv(self, i, o, k, groups=1):
    return nnx.Conv(i, o, (k, k), padding="SAME", feature_group_count=groups,
                    **self._empty_init(i, o), **self.kw)

  @staticmethod
  def _empty_init(i, o):
    # A zero-width layer (narrow models) has no weights to draw, and the default
    # initialisers divide by the fan.
    return {"kernel_init": nnx.initializers.zeros} if 0 in (i, o) else {}

  def norm(self, d):
    return nnx.LayerNorm(d, epsilon=1e-5, use_fast_variance=False, **self.kw)

  def batch_norm(self, d):
    return nnx.BatchNorm(d, use_running_average=True, epsilon=1e-5, use_fast_variance=False,
                         **self.kw)

  def interaction(self, dim):
    """The adaptive interaction maps: (channel, spatial) as ``nnx.List`` Sequentials."""
    channel = nnx.List([Fn(spatial_mean),
                        self.conv(dim, dim // 8, 1), self.batch_norm(dim // 8), Fn(gelu),
                        self.conv(dim // 8, dim, 1)])
    spatial = nnx.List([self.conv(dim, dim // 16, 1), self.batch_norm(dim // 16), Fn(gelu),
                        self.conv(dim // 16, 1, 1)])
    return channel, spatial

  def dwconv(self, dim):
    return nnx.List([self.conv(dim, dim, 3, groups=dim), self.batch_norm(dim), Fn(gelu)])


class DynamicPosBias(nnx.Module):
  """The MLP that maps relative offsets ``[n, 2]`` to per-head biases ``[n, heads]``."""

  def __init__(self, dim: int, num_heads: int, layers: _Layers, residual: bool = False):
    self.residual = residual
    pos_dim = dim // 4
    self.pos_proj = layers.linear(2, pos_dim)
    block = lambda out: nnx.List([layers.norm(pos_dim), Fn(jax.nn.relu),
                                  layers.linear(pos_dim, out)])
    self.pos1, self.pos2, self.pos3 = block(pos_dim), block(pos_dim), block(num_heads)

  def __call__(self, offsets):
    pos = self.pos_proj(offsets)
    if self.residual:
      pos = pos + run(self.pos1, pos)
      pos = pos + run(self.pos2, pos)
      return run(self.pos3, pos)
    return run(self.pos3, run(self.pos2, run(self.pos1, pos)))


class SpatialAttention(nnx.Module):
  """Window attention of one branch: ``idx`` 0 takes ``split_size`` windows, 1 the
  transposed ones; the bias comes from ``DynamicPosBias`` and gets a gradient."""

  def __init__(self, dim: int, idx: int, split_size, num_heads: int, layers: _Layers,
               backend: str):
    self.num_heads, self.backend = num_heads, backend
    self.window = tuple(split_size) if idx == 0 else (split_size[1], split_size[0])
    self.pos = DynamicPosBias(dim // 4, num_heads, layers)

  def bias(self):
    """``[heads, T, T]`` float32 relative-position bias of this branch's windows."""
    table, index = relative_positions(*self.window)
    t = index.shape[0]
    pos = self.pos(jnp.asarray(table)).astype(jnp.float32)  # [n, heads]
    return pos[index.reshape(-1)].reshape(t, t, -1).transpose(2, 0, 1)

  def __call__(self, q, k, v, mask=None):
    """q, k, v: ``[B, H, W, C]`` (H, W multiples of the window) -> ``[B, H, W, C]``."""
    b, h, w, c = q.shape
    hs, ws = self.window
    heads = lambda x: to_windows(x, hs, ws).reshape(-1, hs * ws, self.num_heads,
                                                     c // self.num_heads)
    o = window_attention(heads(q), heads(k), heads(v), self.bias(), mask=mask,
                         backend=self.backend)
    return from_windows(o.reshape(-1, hs * ws, c), hs, ws, h, w)


def _is_shifted(rg_idx: int, b_idx: int) -> bool:
  """Which spatial blocks shift their windows (DAT's alternating pattern)."""
  if rg_idx % 2 == 0:
    return b_idx > 0 and (b_idx - 2) % 4 == 0
  return b_idx % 4 == 0


class AdaptiveSpatialAttention(nnx.Module):
  """Dual-branch spatial window attention + depthwise-conv branch, mixed by the
  adaptive interaction module; pads the image to a window multiple inside."""

  def __init__(self, dim, num_heads, split_size, shift_size, qkv_bias, rg_idx, b_idx,
               layers: _Layers, backend: str):
    self.split_size, self.shift_size = tuple(split_size), tuple(shift_size)
    self.shifted = _is_shifted(rg_idx, b_idx)
    self.qkv = layers.linear(dim, 3 * dim, qkv_bias)
    self.proj = layers.linear(dim, dim)
    self.attns = nnx.List([SpatialAttention(dim // 2, i, split_size, num_heads // 2, layers,
                                            backend) for i in range(2)])
    self.dwconv = layers.dwconv(dim)
    self.channel_interaction, self.spatial_interaction = layers.interaction(dim)

  def __call__(self, x):
    b, h, w, c = x.shape
    q, k, v = jnp.moveaxis(self.qkv(x).reshape(b, h, w, 3, c), 3, 0)
    size = max(self.split_size)
    pad = ((0, 0), (0, -h % size), (0, -w % size), (0, 0))
    qkv = [jnp.pad(t, pad) for t in (q, k, v)]  # zeros after the projection, as in DAT
    hp, wp = h + pad[1][1], w + pad[2][1]
    halves = [[t[..., :c // 2] for t in qkv], [t[..., c // 2:] for t in qkv]]
    if self.shifted:
      s0, s1 = self.shift_size
      masks = shift_masks(hp, wp, self.split_size, self.shift_size)
      outs = []
      for attn, part, mask, (dh, dw) in zip(self.attns, halves, masks, ((s0, s1), (s1, s0))):
        rolled = [jnp.roll(t, (-dh, -dw), axis=(1, 2)) for t in part]
        outs.append(jnp.roll(attn(*rolled, mask=jnp.asarray(mask)), (dh, dw), axis=(1, 2)))
    else:
      outs = [attn(*part) for attn, part in zip(self.attns, halves)]
    attended = jnp.concatenate([o[:, :h, :w] for o in outs], axis=-1)
    conv_x = run(self.dwconv, v)
    channel_map = run(self.channel_interaction, conv_x)
    spatial_map = run(self.spatial_interaction, attended)
    attended = attended * jax.nn.sigmoid(channel_map)
    conv_x = jax.nn.sigmoid(spatial_map) * conv_x
    return self.proj(attended + conv_x)


class AdaptiveChannelAttention(nnx.Module):
  """Channel self-attention (XCiT style: L2-normalised q, k over positions, learned
  temperature per head) + depthwise-conv branch, mixed by the interaction module."""

  def __init__(self, dim, num_heads, qkv_bias, layers: _Layers):
    self.num_heads = num_heads
    self.temperature = nnx.Param(jnp.ones((num_heads, 1, 1), layers.kw["param_dtype"]))
    self.qkv = layers.linear(dim, 3 * dim, qkv_bias)
    self.proj = layers.linear(dim, dim)
    self.dwconv = layers.dwconv(dim)
    self.channel_interaction, self.spatial_interaction = layers.interaction(dim)

  def __call__(self, x):
    b, h, w, c = x.shape
    heads, hd = self.num_heads, c // self.num_heads
    qkv = self.qkv(x).reshape(b, h * w, 3, heads, hd)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 3, 1) for i in range(3))  # [b, heads, hd, N]
    normalize = lambda t: t / jnp.maximum(jnp.linalg.norm(t, axis=-1, keepdims=True), 1e-12)
    attn = jnp.einsum("bhcn,bhdn->bhcd", normalize(q), normalize(k))
    attn = jax.nn.softmax(attn * self.temperature[...].astype(attn.dtype), axis=-1)
    attended = jnp.einsum("bhcd,bhdn->bnhc", attn, v).reshape(b, h, w, c)
    conv_x = run(self.dwconv, qkv[:, :, 2].reshape(b, h, w, c))
    channel_map = run(self.channel_interaction, attended)
    spatial_map = run(self.spatial_interaction, conv_x)
    attended = attended * jax.nn.sigmoid(spatial_map)
    conv_x = conv_x * jax.nn.sigmoid(channel_map)
    return self.proj(attended + conv_x)


class SpatialGate(nnx.Module):
  def __init__(self, dim, layers: _Layers):
    self.norm = layers.norm(dim)
    self.conv = layers.conv(dim, dim, 3, groups=dim)

  def __call__(self, x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x1 * self.conv(self.norm(x2))


class SGFN(nnx.Module):
  """Spatial-gate feed-forward network."""

  def __init__(self, dim, hidden, layers: _Layers):
    self.fc1 = layers.linear(dim, hidden)
    self.sg = SpatialGate(hidden // 2, layers)
    self.fc2 = layers.linear(hidden // 2, dim)

  def __call__(self, x):
    return self.fc2(self.sg(gelu(self.fc1(x))))


class DATB(nnx.Module):
  """A dual aggregation block: spatial attention on even ``b_idx``, channel on odd."""

  def __init__(self, dim, num_heads, split_size, expansion_factor, qkv_bias, rg_idx, b_idx,
               layers: _Layers, backend: str):
    self.norm1 = layers.norm(dim)
    if b_idx % 2 == 0:
      shift = (split_size[0] // 2, split_size[1] // 2)
      self.attn = AdaptiveSpatialAttention(dim, num_heads, split_size, shift, qkv_bias, rg_idx,
                                           b_idx, layers, backend)
    else:
      self.attn = AdaptiveChannelAttention(dim, num_heads, qkv_bias, layers)
    self.ffn = SGFN(dim, int(dim * expansion_factor), layers)
    self.norm2 = layers.norm(dim)

  def __call__(self, x):
    x = x + self.attn(self.norm1(x))
    return x + self.ffn(self.norm2(x))


def _residual_conv(dim, resi_connection, layers: _Layers):
  if resi_connection == "1conv":
    return layers.conv(dim, dim, 3)
  leaky = Fn(jax.nn.leaky_relu, negative_slope=0.2)
  return nnx.List([layers.conv(dim, dim // 4, 3), leaky, layers.conv(dim // 4, dim // 4, 1),
                   leaky, layers.conv(dim // 4, dim, 3)])


def _apply(layer, x):
  return run(layer, x) if isinstance(layer, nnx.List) else layer(x)


class ResidualGroup(nnx.Module):
  def __init__(self, config: DATConfig, rg_idx: int, layers: _Layers, backend: str):
    c = config
    self.blocks = nnx.List([
        DATB(c.embed_dim, c.num_heads[rg_idx], c.split_size, c.expansion_factor, c.qkv_bias,
             rg_idx, b, layers, backend) for b in range(c.depth[rg_idx])])
    self.conv = _residual_conv(c.embed_dim, c.resi_connection, layers)

  def __call__(self, x):
    res = x
    for block in self.blocks:
      x = block(x)
    return res + _apply(self.conv, x)


MODEL_OPTIONS = ("dtype", "param_dtype", "backend")  # DAT's keywords besides config and rngs


class DAT(nnx.Module):
  """Dual Aggregation Transformer: ``[batch, H, W, in_chans]`` in ``[0, 1]`` ->
  ``[batch, H * upscale, W * upscale, in_chans]``.

  Args:
    config: a ``DATConfig`` (``PRESETS`` has DAT, DAT-S, DAT-2 and DAT-light).
    dtype: computation dtype (e.g. ``jnp.bfloat16``); parameters stay ``param_dtype``.
    backend: the ``jattn.window_attention`` backend.
    rngs: ``nnx.Rngs`` for the (random) initial weights.

  Any H and W work: the spatial attention pads to a window multiple inside, as the
  original does. Weights from a PyTorch checkpoint: ``DAT.from_torch(path)``.
  """

  def __init__(self, config: DATConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
               backend: str = "auto", rngs: nnx.Rngs):
    self.config, self.dtype = config, dtype
    layers = _Layers(dtype, param_dtype, rngs)
    c = config
    self.conv_first = layers.conv(c.in_chans, c.embed_dim, 3)
    self.before_RG = nnx.List([Fn(identity), layers.norm(c.embed_dim)])
    self.layers = nnx.List([ResidualGroup(c, i, layers, backend) for i in range(len(c.depth))])
    self.norm = layers.norm(c.embed_dim)
    self.conv_after_body = _residual_conv(c.embed_dim, c.resi_connection, layers)
    if c.upsampler == "pixelshuffle":
      self.conv_before_upsample = nnx.List([layers.conv(c.embed_dim, NUM_FEAT, 3),
                                            Fn(jax.nn.leaky_relu)])  # torch's slope 0.01
      steps = [(2, 4)] * int(math.log2(c.upscale)) if c.upscale != 3 else [(3, 9)]
      self.upsample = nnx.List([m for r, n in steps for m in
                                (layers.conv(NUM_FEAT, n * NUM_FEAT, 3),
                                 Fn(pixel_shuffle, r=r))])
      self.conv_last = layers.conv(NUM_FEAT, c.in_chans, 3)
    else:
      self.upsample = nnx.List([layers.conv(c.embed_dim, c.upscale ** 2 * c.in_chans, 3),
                                Fn(pixel_shuffle, r=c.upscale)])
    self.mean = RGB_MEAN if c.in_chans == 3 else (0.0,) * c.in_chans

  @classmethod
  def preset(cls, name: str, *, upscale: int = 4, rngs: nnx.Rngs | None = None, **kwargs):
    """A randomly initialised preset (``"DAT"``, ``"DAT-S"``, ``"DAT-2"``,
    ``"DAT-light"``). ``kwargs``: the model's ``dtype``, ``param_dtype`` and
    ``backend``, and ``DATConfig`` fields that change the preset (``depth=(2, 2)``);
    ``rngs`` defaults to ``nnx.Rngs(0)``. Any other keyword is a ``TypeError``."""
    if name not in PRESETS:
      raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    fields = {f.name for f in dataclasses.fields(DATConfig)}
    unknown = sorted(set(kwargs) - fields - set(MODEL_OPTIONS))
    if unknown:
      raise TypeError(f"DAT.preset() got unexpected keywords {unknown}: it takes the DATConfig "
                      f"fields {sorted(fields)} and {', '.join(MODEL_OPTIONS)}, rngs")
    config = dataclasses.replace(PRESETS[name], upscale=upscale,
                                 **{k: v for k, v in kwargs.items() if k in fields})
    return cls(config, rngs=rngs or nnx.Rngs(0),
               **{k: v for k, v in kwargs.items() if k in MODEL_OPTIONS})

  @classmethod
  def from_torch(cls, path, **kwargs):
    """Loads a PyTorch DAT checkpoint (``.pth`` / ``.safetensors``), inferring the
    config from its tensors, through the loader the torch side offers
    (``jattn.interop.load_dat``; ``kwargs`` are its own)."""
    return checkpoint_loader("dat")(path, **kwargs)

  def features(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.norm(x)

  def __call__(self, x):
    """x: ``[batch, H, W, in_chans]`` -> ``[batch, H * upscale, W * upscale, in_chans]``."""
    if x.ndim != 4 or x.shape[-1] != self.config.in_chans:
      raise ValueError(f"x must be [batch, H, W, {self.config.in_chans}], got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      # An integer image's scale (0-255? 0-65535?) is not the model's to guess.
      raise TypeError(f"x has dtype {x.dtype}: DAT takes float images in [0, 1] (divide "
                      "uint8 images by 255)")
    c = self.config
    mean = jnp.asarray(self.mean, jnp.float32)
    x = ((x.astype(jnp.float32) - mean) * c.img_range).astype(self.dtype)
    x = self.conv_first(x)
    x = _apply(self.conv_after_body, self.features(run(self.before_RG, x))) + x
    if c.upsampler == "pixelshuffle":
      x = self.conv_last(run(self.upsample, run(self.conv_before_upsample, x)))
    else:
      x = run(self.upsample, x)
    return x.astype(jnp.float32) / c.img_range + mean
