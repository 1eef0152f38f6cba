"""A PyTorch reference of DAT (Chen et al., ICCV 2023), written from the paper and
the original repository's architecture, with the original's state-dict names
(buffers included), so that its random weights exercise the checkpoint converter
exactly as a real ``.pth`` does. NCHW images, as the original.

``dat_torch(config)`` builds it from a ``jattn.nn.DATConfig``. This module imports
torch; nothing that must run without torch imports it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from jattn.nn.dat import NUM_FEAT, RGB_MEAN, DATConfig, relative_positions, shift_masks


def windows(x, hs, ws):
  """NCHW image -> ``[B * n, hs * ws, C]`` windows (row-major over the image)."""
  b, c, h, w = x.shape
  x = x.view(b, c, h // hs, hs, w // ws, ws).permute(0, 2, 4, 3, 5, 1)
  return x.reshape(-1, hs * ws, c)


def unwindows(x, hs, ws, h, w):
  """``[B * n, hs * ws, C]`` -> NHWC image."""
  b = x.shape[0] // ((h // hs) * (w // ws))
  return x.view(b, h // hs, w // ws, hs, ws, -1).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)


def tokens_to_image(x, h, w):
  """``[B, h * w, C]`` tokens -> NCHW image."""
  return x.transpose(1, 2).reshape(x.shape[0], -1, h, w)


# Modules rather than functions, so that the layers after them sit at the original's
# indices in their nn.Sequential (and so under its state-dict names).
class ToTokens(nn.Module):
  def forward(self, x):
    return x.flatten(2).transpose(1, 2)


class GlobalPool(nn.Module):
  def forward(self, x):
    return x.mean(dim=(2, 3), keepdim=True)


def interaction(dim):
  """The channel and the spatial interaction branches of a DAT attention block."""
  channel = nn.Sequential(GlobalPool(), nn.Conv2d(dim, dim // 8, 1), nn.BatchNorm2d(dim // 8),
                          nn.GELU(), nn.Conv2d(dim // 8, dim, 1))
  spatial = nn.Sequential(nn.Conv2d(dim, dim // 16, 1), nn.BatchNorm2d(dim // 16), nn.GELU(),
                          nn.Conv2d(dim // 16, 1, 1))
  return channel, spatial


def dwconv(dim):
  """Depth-wise 3x3 convolution, batch norm, GELU."""
  return nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1, groups=dim), nn.BatchNorm2d(dim),
                       nn.GELU())


class DynamicPosBias(nn.Module):
  def __init__(self, dim, num_heads):
    super().__init__()
    pos_dim = dim // 4
    self.pos_proj = nn.Linear(2, pos_dim)
    block = lambda out: nn.Sequential(nn.LayerNorm(pos_dim), nn.ReLU(), nn.Linear(pos_dim, out))
    self.pos1, self.pos2, self.pos3 = block(pos_dim), block(pos_dim), block(num_heads)

  def forward(self, offsets):
    return self.pos3(self.pos2(self.pos1(self.pos_proj(offsets))))


class SpatialAttention(nn.Module):
  def __init__(self, dim, idx, split_size, num_heads):
    super().__init__()
    self.num_heads = num_heads
    self.scale = (dim // num_heads) ** -0.5
    self.hs, self.ws = split_size if idx == 0 else (split_size[1], split_size[0])
    self.pos = DynamicPosBias(dim // 4, num_heads)
    table, index = relative_positions(self.hs, self.ws)
    self.register_buffer("rpe_biases", torch.from_numpy(table))
    self.register_buffer("relative_position_index", torch.from_numpy(index.astype(np.int64)))

  def forward(self, q, k, v, h, w, mask=None):
    """q, k, v: ``[B, C, h, w]`` -> ``[B, h, w, C]``."""
    c = q.shape[1]
    split = lambda x: windows(x, self.hs, self.ws).reshape(
        -1, self.hs * self.ws, self.num_heads, c // self.num_heads).transpose(1, 2)
    q, k, v = split(q), split(k), split(v)
    attn = (q * self.scale) @ k.transpose(-2, -1)
    t = self.hs * self.ws
    bias = self.pos(self.rpe_biases)[self.relative_position_index.view(-1)]
    attn = attn + bias.view(t, t, -1).permute(2, 0, 1).unsqueeze(0)
    if mask is not None:
      n = mask.shape[0]
      attn = (attn.view(-1, n, self.num_heads, t, t) + mask[None, :, None]).view(
          -1, self.num_heads, t, t)
    out = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(-1, t, c)
    return unwindows(out, self.hs, self.ws, h, w)


class AdaptiveSpatialAttention(nn.Module):
  def __init__(self, dim, num_heads, reso, split_size, shift_size, qkv_bias, shifted):
    super().__init__()
    self.split_size, self.shift_size, self.shifted, self.reso = split_size, shift_size, shifted, reso
    self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
    self.proj = nn.Linear(dim, dim)
    self.attns = nn.ModuleList([SpatialAttention(dim // 2, i, split_size, num_heads // 2)
                                for i in range(2)])
    if shifted:
      m0, m1 = shift_masks(reso, reso, split_size, shift_size)
      self.register_buffer("attn_mask_0", torch.from_numpy(m0))
      self.register_buffer("attn_mask_1", torch.from_numpy(m1))
    self.dwconv = dwconv(dim)
    self.channel_interaction, self.spatial_interaction = interaction(dim)

  def forward(self, x, h, w):
    b, n, c = x.shape
    qkv = self.qkv(x).reshape(b, n, 3, c).permute(2, 0, 3, 1).reshape(3, b, c, h, w)
    v_image = qkv[2]
    size = max(self.split_size)
    qkv = nn.functional.pad(qkv.reshape(3 * b, c, h, w), (0, -w % size, 0, -h % size))
    hp, wp = qkv.shape[-2:]
    qkv = qkv.view(3, b, c, hp, wp)
    halves = (qkv[:, :, :c // 2], qkv[:, :, c // 2:])
    s0, s1 = self.shift_size
    if self.shifted:
      if (hp, wp) == (self.reso, self.reso):
        masks = (self.attn_mask_0, self.attn_mask_1)
      else:
        masks = [torch.from_numpy(m).to(device=x.device, dtype=x.dtype) for m in
                 shift_masks(hp, wp, self.split_size, self.shift_size)]
      outs = []
      for attn, part, mask, (dh, dw) in zip(self.attns, halves, masks, ((s0, s1), (s1, s0))):
        part = torch.roll(part, shifts=(-dh, -dw), dims=(3, 4))
        out = attn(part[0], part[1], part[2], hp, wp, mask=mask)
        outs.append(torch.roll(out, shifts=(dh, dw), dims=(1, 2)))
    else:
      outs = [attn(part[0], part[1], part[2], hp, wp) for attn, part in zip(self.attns, halves)]
    attended = torch.cat([o[:, :h, :w] for o in outs], dim=-1).reshape(b, n, c)
    conv_x = self.dwconv(v_image)
    channel_map = self.channel_interaction(conv_x).view(b, 1, c)
    spatial_map = self.spatial_interaction(tokens_to_image(attended, h, w))
    attended = attended * torch.sigmoid(channel_map)
    conv_x = (torch.sigmoid(spatial_map) * conv_x).flatten(2).transpose(1, 2)
    return self.proj(attended + conv_x)


class AdaptiveChannelAttention(nn.Module):
  def __init__(self, dim, num_heads, qkv_bias):
    super().__init__()
    self.num_heads = num_heads
    self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))
    self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
    self.proj = nn.Linear(dim, dim)
    self.dwconv = dwconv(dim)
    self.channel_interaction, self.spatial_interaction = interaction(dim)

  def forward(self, x, h, w):
    b, n, c = x.shape
    qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads)
    q, k, v = qkv.permute(2, 0, 3, 4, 1)  # each [b, heads, head_dim, n]
    q = nn.functional.normalize(q, dim=-1)
    k = nn.functional.normalize(k, dim=-1)
    attn = ((q @ k.transpose(-2, -1)) * self.temperature).softmax(dim=-1)
    attended = (attn @ v).permute(0, 3, 1, 2).reshape(b, n, c)
    conv_x = self.dwconv(v.reshape(b, c, h, w))
    channel_map = self.channel_interaction(tokens_to_image(attended, h, w))
    spatial_map = self.spatial_interaction(conv_x).flatten(2).transpose(1, 2)
    attended = attended * torch.sigmoid(spatial_map)
    conv_x = (conv_x * torch.sigmoid(channel_map)).flatten(2).transpose(1, 2)
    return self.proj(attended + conv_x)


class SpatialGate(nn.Module):
  def __init__(self, dim):
    super().__init__()
    self.norm = nn.LayerNorm(dim)
    self.conv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

  def forward(self, x, h, w):
    x1, x2 = x.chunk(2, dim=-1)
    x2 = self.conv(tokens_to_image(self.norm(x2), h, w)).flatten(2).transpose(1, 2)
    return x1 * x2


class SGFN(nn.Module):
  def __init__(self, dim, hidden):
    super().__init__()
    self.fc1 = nn.Linear(dim, hidden)
    self.act = nn.GELU()
    self.sg = SpatialGate(hidden // 2)
    self.fc2 = nn.Linear(hidden // 2, dim)

  def forward(self, x, h, w):
    return self.fc2(self.sg(self.act(self.fc1(x)), h, w))


def is_shifted(rg_idx, b_idx):
  """Whether block ``b_idx`` of residual group ``rg_idx`` uses shifted windows."""
  return (b_idx > 0 and (b_idx - 2) % 4 == 0) if rg_idx % 2 == 0 else b_idx % 4 == 0


class DATB(nn.Module):
  def __init__(self, c: DATConfig, reso, rg_idx, b_idx):
    super().__init__()
    dim, heads = c.embed_dim, c.num_heads[rg_idx]
    self.norm1 = nn.LayerNorm(dim)
    if b_idx % 2 == 0:
      shift = (c.split_size[0] // 2, c.split_size[1] // 2)
      self.attn = AdaptiveSpatialAttention(dim, heads, reso, c.split_size, shift, c.qkv_bias,
                                           is_shifted(rg_idx, b_idx))
    else:
      self.attn = AdaptiveChannelAttention(dim, heads, c.qkv_bias)
    self.ffn = SGFN(dim, int(dim * c.expansion_factor))
    self.norm2 = nn.LayerNorm(dim)

  def forward(self, x, h, w):
    x = x + self.attn(self.norm1(x), h, w)
    return x + self.ffn(self.norm2(x), h, w)


def residual_conv(dim, kind):
  """The convolution closing a residual group and the body: ``"1conv"`` or ``"3conv"``."""
  if kind == "1conv":
    return nn.Conv2d(dim, dim, 3, padding=1)
  return nn.Sequential(nn.Conv2d(dim, dim // 4, 3, padding=1), nn.LeakyReLU(0.2),
                       nn.Conv2d(dim // 4, dim // 4, 1), nn.LeakyReLU(0.2),
                       nn.Conv2d(dim // 4, dim, 3, padding=1))


class ResidualGroup(nn.Module):
  def __init__(self, c: DATConfig, reso, rg_idx):
    super().__init__()
    self.blocks = nn.ModuleList([DATB(c, reso, rg_idx, b) for b in range(c.depth[rg_idx])])
    self.conv = residual_conv(c.embed_dim, c.resi_connection)

  def forward(self, x, h, w):
    res = x
    for block in self.blocks:
      x = block(x, h, w)
    return res + self.conv(tokens_to_image(x, h, w)).flatten(2).transpose(1, 2)


class DAT(nn.Module):
  def __init__(self, c: DATConfig, img_size: int):
    super().__init__()
    self.config = c
    mean = RGB_MEAN if c.in_chans == 3 else (0.0,) * c.in_chans
    self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
    self.conv_first = nn.Conv2d(c.in_chans, c.embed_dim, 3, padding=1)
    self.before_RG = nn.Sequential(ToTokens(), nn.LayerNorm(c.embed_dim))
    self.layers = nn.ModuleList([ResidualGroup(c, img_size, i) for i in range(len(c.depth))])
    self.norm = nn.LayerNorm(c.embed_dim)
    self.conv_after_body = residual_conv(c.embed_dim, c.resi_connection)
    if c.upsampler == "pixelshuffle":
      self.conv_before_upsample = nn.Sequential(nn.Conv2d(c.embed_dim, NUM_FEAT, 3, padding=1),
                                                nn.LeakyReLU())
      steps = [(2, 4)] * int(math.log2(c.upscale)) if c.upscale != 3 else [(3, 9)]
      self.upsample = nn.Sequential(*[m for r, n in steps for m in (
          nn.Conv2d(NUM_FEAT, n * NUM_FEAT, 3, padding=1), nn.PixelShuffle(r))])
      self.conv_last = nn.Conv2d(NUM_FEAT, c.in_chans, 3, padding=1)
    else:
      self.upsample = nn.Sequential(
          nn.Conv2d(c.embed_dim, c.upscale ** 2 * c.in_chans, 3, padding=1),
          nn.PixelShuffle(c.upscale))

  def forward(self, x):
    c = self.config
    mean = self.mean.to(x.dtype)
    x = (x - mean) * c.img_range
    x = self.conv_first(x)
    h, w = x.shape[-2:]
    feats = self.before_RG(x)
    for layer in self.layers:
      feats = layer(feats, h, w)
    x = self.conv_after_body(tokens_to_image(self.norm(feats), h, w)) + x
    if c.upsampler == "pixelshuffle":
      x = self.conv_last(self.upsample(self.conv_before_upsample(x)))
    else:
      x = self.upsample(x)
    return x / c.img_range + mean


def dat_torch(config: DATConfig, *, img_size: int = 64, seed: int = 0, randomize_norms=True):
  """A torch DAT with random weights (eval mode).

  ``img_size`` sets the stored shifted-window masks, as in the original (they are
  recomputed for other sizes). ``randomize_norms`` draws non-trivial LayerNorm and
  BatchNorm parameters and running statistics, so that a converter that drops them
  is caught.
  """
  torch.manual_seed(seed)
  model = DAT(config, img_size)
  if randomize_norms:
    with torch.no_grad():
      for m in model.modules():
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.BatchNorm2d)):
          m.weight.uniform_(0.5, 1.5)
          m.bias.uniform_(-0.2, 0.2)
        if isinstance(m, torch.nn.BatchNorm2d):
          m.running_mean.uniform_(-0.2, 0.2)
          m.running_var.uniform_(0.5, 1.5)
      for name, p in model.named_parameters():
        if name.endswith("temperature"):
          p.uniform_(0.5, 2.0)
  return model.eval()


__all__ = ["DAT", "dat_torch"]
