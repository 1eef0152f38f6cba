"""jattn.nn.DAT against the torch reference on the same random weights, the checkpoint
converter (config inference, errors, files) and tiled upscaling (the command lines:
test_cli.py)."""

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")

from jattn.interop.checkpoint_files import read_state_dict
from jattn.interop.checkpoints import (DAT_DERIVED, dat_from_state_dict, dat_to_torch_state_dict,
                                       infer_dat_config, load_dat)
from jattn.interop.converted import load_converted, read_converted_config, save_converted
from jattn.interop.convert import load_torch_state_dict
from jattn.interop.dat_torch import dat_torch
from jattn.nn import DAT, DAT_PRESETS, DATConfig
from jattn.nn.dat import relative_positions
from jattn.upscale import jit_model, tile_starts, upscale_image

# Presets with fewer blocks for CI time; (2, 2) keeps a plain and a shifted spatial
# block and a channel block, DAT-light's single group keeps its 3conv + direct upsampler.
# DAT and DAT-S differ from DAT-2 only in sizes (MLP width, window height): DAT-2 stands
# for the three.
REDUCED = {
    "DAT-2": dict(depth=(2, 2), num_heads=(6, 6)),
    "DAT-light": dict(depth=(3,), num_heads=(6,)),
}
SMALL = DATConfig(embed_dim=32, depth=(1, 2), num_heads=(2, 4), split_size=(4, 8), upscale=2)
IMAGE = (10, 12)  # SMALL's tests share it (one compiled forward); off the windows: padded


@pytest.fixture(autouse=True)
def _reference_window_attention(monkeypatch):
  """The model tests compare layers with torch: they run the XLA window attention
  (the kernels have their own tests); the one that needs the kernels asks for them."""
  monkeypatch.setenv("JATTN_INTERPRET", "0")


def _torch_out(model, x):
  with torch.no_grad():
    return model(torch.from_numpy(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()


def _image(h, w, seed=0):
  return np.random.default_rng(seed).uniform(size=(1, h, w, 3)).astype(np.float32)


def _abstract(config):
  """The model's structure without its weights (an eager init compiles op by op)."""
  return nnx.eval_shape(lambda: DAT(config, rngs=nnx.Rngs(0)))


# jitted: eagerly every op (of the interpret-mode window kernels too) compiles on its own.
_forward = nnx.jit(lambda model, x: model(x))


@pytest.mark.parametrize("preset", sorted(REDUCED))
def test_flax_matches_torch_reference(preset):
  config = dataclasses.replace(DAT_PRESETS[preset], **REDUCED[preset])
  reference = dat_torch(config, img_size=32)
  model = dat_from_state_dict(reference.state_dict())
  assert model.config == config
  fn = jit_model(model)
  for h, w in ((32, 32), (13, 21)):  # the stored shift masks, then the padded path
    x = _image(h, w)
    out = np.asarray(fn(jnp.asarray(x)))
    assert out.shape == (1, 4 * h, 4 * w, 3)
    np.testing.assert_allclose(out, _torch_out(reference, x), atol=1e-4, rtol=0)


@pytest.mark.parametrize("upscale,upsampler", [(2, "pixelshuffle"), (3, "pixelshuffledirect")])
def test_upsamplers_and_config_inference(upscale, upsampler):
  config = dataclasses.replace(SMALL, upscale=upscale, upsampler=upsampler,
                               resi_connection="3conv", qkv_bias=False, expansion_factor=1.5)
  reference = dat_torch(config, img_size=16)
  inferred, img_size = infer_dat_config(reference.state_dict())
  assert inferred == config and img_size == 16
  model = dat_from_state_dict(reference.state_dict())
  x = _image(11, 9, seed=upscale)
  np.testing.assert_allclose(np.asarray(_forward(model, jnp.asarray(x))), _torch_out(reference, x),
                             atol=1e-4, rtol=0)


def test_checkpoint_errors_name_the_keys():
  state = {k: v.numpy() for k, v in dat_torch(SMALL).state_dict().items()}
  model = _abstract(SMALL)
  broken = dict(state)
  broken["layers.0.blocks.0.attn.extra.weight"] = broken.pop("layers.0.blocks.0.attn.qkv.weight")
  with pytest.raises(ValueError, match=r"missing keys \['layers.0.blocks.0.attn.qkv.weight'\], "
                                       r"unexpected keys \['layers.0.blocks.0.attn.extra.weight'\]"):
    load_torch_state_dict(model, broken, derived=DAT_DERIVED)
  broken = dict(state, **{"norm.weight": np.ones(7, np.float32)})
  with pytest.raises(ValueError, match=r"'norm.weight' has shape \(7,\), the module expects \(32,\)"):
    load_torch_state_dict(model, broken, derived=DAT_DERIVED)
  with pytest.raises(ValueError, match="not a DAT checkpoint: key 'conv_first.weight'"):
    infer_dat_config({"encoder.weight": np.ones(3)})
  no_rpe = {k: v for k, v in state.items() if not k.endswith("rpe_biases")}
  with pytest.raises(ValueError, match="pass split_size"):
    infer_dat_config(no_rpe)
  assert infer_dat_config(no_rpe, split_size=(4, 8))[0] == SMALL


RPE = "layers.0.blocks.0.attn.attns.0.rpe_biases"
SHIFTED_TABLE = np.roll(relative_positions(4, 8)[0], 1, axis=0)  # the right rows, not in order


@pytest.mark.parametrize("key,value,message", [
    # issue 37, item 8: a window size read off one crafted value
    (RPE, np.full((5, 2), 1e9, np.float32), r"'layers.0.blocks.0.attn.attns.0.rpe_biases' is not "
     r"a table of relative window offsets \(its last row is \(1000000000.0, 1000000000.0\) of 5"),
    (RPE, np.full((5, 2), -7.0, np.float32), r"its last row is \(-7.0, -7.0\) of 5"),
    (RPE, SHIFTED_TABLE,
     r"not a table of relative window offsets \(its last row is \(3.0, 6.0\) of 105"),
    (RPE, np.zeros((127 * 127 + 1, 2), np.float32),
     r"has shape \(16130, 2\), expected \[offsets, 2\] with at most 16129 offsets"),
    # item 15: a mis-shaped tensor is named
    ("layers.0.blocks.0.ffn.fc1.weight", np.ones((63, 32), np.float32),
     r"'layers.0.blocks.0.ffn.fc1.weight' \(63, 32\)\): embed_dim \* expansion_factor must "
     r"give an even FFN width"),
    ("layers.1.blocks.1.attn.temperature", np.ones((5, 1, 1), np.float32),
     r"\('layers.1.blocks.1.attn.temperature' \(5, 1, 1\), 'conv_first.weight' "
     r"\(32, 3, 3, 3\)\): num_heads 5 must divide embed_dim 32"),
    ("layers.5.blocks.0.norm1.weight", np.ones(32, np.float32),
     r"its 'layers.<i>' keys are numbered \[0, 1, 5\], not 0, 1, ... in order"),
])
def test_every_value_a_config_is_read_from_is_checked(key, value, message):
  state = {k: v.numpy() for k, v in dat_torch(SMALL).state_dict().items()}
  with pytest.raises(ValueError, match=message):
    infer_dat_config({**state, key: value})


def test_checkpoint_files_and_wrappers(tmp_path):
  reference = dat_torch(SMALL, seed=4)
  state = reference.state_dict()
  torch.save({"params_ema": state, "params": {}}, tmp_path / "ema.pth")
  torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "dp.pth")
  from safetensors.torch import save_file

  save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "m.safetensors"))
  x = _image(*IMAGE)
  expected = _torch_out(reference, x)
  for name in ("ema.pth", "dp.pth", "m.safetensors"):
    model = DAT.from_torch(tmp_path / name)
    np.testing.assert_allclose(np.asarray(_forward(model, jnp.asarray(x))), expected, atol=1e-4,
                               rtol=0)
  assert set(read_state_dict(tmp_path / "ema.pth")) == set(state)


def test_converted_params_round_trip(tmp_path):
  model = load_dat_from(dat_torch(SMALL, seed=5), tmp_path)
  save_converted(model, tmp_path / "out")
  again = load_converted(tmp_path / "out")
  assert again.config == model.config
  x = jnp.asarray(_image(*IMAGE))
  np.testing.assert_array_equal(np.asarray(_forward(again, x)), np.asarray(_forward(model, x)))


@pytest.mark.parametrize("text,message", [
    ('{"model": ["DAT"], "config": {}}', "config.json is not what jattn-convert writes"),
    ("[" * 100000, "no readable config.json"),
    (" " * (1 << 20) + "{}", r"no readable config.json \(more than 1048576 bytes\)"),
])
def test_a_foreign_config_json_is_named_in_one_line(tmp_path, text, message):
  (tmp_path / "config.json").write_text(text)
  with pytest.raises(ValueError, match=message):
    read_converted_config(tmp_path)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """A converted folder of SMALL."""
  out = tmp_path_factory.mktemp("converted") / "small"
  save_converted(dat_from_state_dict(dat_torch(SMALL, seed=5).state_dict()), out)
  return out


@pytest.mark.parametrize("field,value,message", [
    ("depth", [1000000, 2], r"depth=\[1000000, 2\] does not match the checkpoint, whose tensors "
                            r"give depth=\(1, 2\)"),
    ("embed_dim", 1 << 40, "embed_dim=1099511627776 does not match"),
    ("split_size", [1 << 30, 1 << 30], "split_size must be an int from 1 to 64, got 1073741824"),
    ("split_size", [-6, -6], "split_size must be an int from 1 to 64, got -6"),
    ("img_range", "nan", "img_range must be a finite number > 0"),
    ("frobnicate", 1, "unexpected keyword argument 'frobnicate'"),
], ids=["depth", "embed_dim", "huge-window", "negative-window", "img_range", "unknown"])
def test_a_tampered_config_json_is_refused_before_a_model_is_built(converted, tmp_path, field,
                                                                    value, message):
  """What config.json says is checked against the weights (and range-checked where they
  do not say it) before anything is built."""
  out = tmp_path / "out"
  shutil.copytree(converted, out)
  meta = json.loads((out / "config.json").read_text())
  meta["config"][field] = value
  (out / "config.json").write_text(json.dumps(meta))
  with pytest.raises(ValueError, match=f"does not hold a DAT jattn can load: .*{message}"):
    load_converted(out)


def test_export_is_the_original_state_dict():
  """Flax -> torch state dict gives back every tensor the torch model holds, buffers
  included, so the original loads it strictly."""
  config = dataclasses.replace(SMALL, depth=(2, 2))
  reference = dat_torch(config, img_size=24, seed=8)
  exported = dat_to_torch_state_dict(dat_from_state_dict(reference.state_dict()), img_size=24)
  expected = reference.state_dict()
  assert set(exported) == set(expected)
  for key, value in expected.items():
    assert exported[key].shape == tuple(value.shape), key
    np.testing.assert_array_equal(exported[key], value.numpy(), err_msg=key)
  fresh = dat_torch(config, img_size=24, seed=9)
  fresh.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in exported.items()}, strict=True)


def load_dat_from(reference, tmp_path):
  torch.save(reference.state_dict(), tmp_path / "model.pth")
  return load_dat(tmp_path / "model.pth")


def test_bf16_is_close_to_fp32():
  reference = dat_torch(SMALL, seed=6)
  fp32 = dat_from_state_dict(reference.state_dict())
  bf16 = dat_from_state_dict(reference.state_dict(), dtype=jnp.bfloat16)
  x = jnp.asarray(_image(*IMAGE))
  a, b = np.asarray(_forward(fp32, x)), np.asarray(_forward(bf16, x))
  psnr = 10 * np.log10(1.0 / np.mean((a - b) ** 2))
  assert b.dtype == np.float32 and psnr > 30, psnr


def test_gradients_reach_the_position_bias_mlp(monkeypatch):
  # Through the Pallas window kernels (interpret mode): d(bias) trains the bias MLP.
  # embed_dim 64 gives the MLP 2 features (at 32 its one-feature LayerNorm makes the
  # bias a per-head constant, which the softmax ignores: the gradient is then 0).
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  config = dataclasses.replace(SMALL, embed_dim=64, depth=(1,), num_heads=(2,),
                               split_size=(4, 4))
  model = DAT(config, backend="pallas_triton", rngs=nnx.Rngs(1))
  x = jnp.asarray(_image(8, 8))
  grads = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x) ** 2)))(model)
  pos = grads.layers[0].blocks[0].attn.attns[0].pos.pos3[2].kernel[...]
  assert bool(jnp.all(jnp.isfinite(pos))) and float(jnp.abs(pos).max()) > 0


def test_config_errors():
  with pytest.raises(ValueError, match="num_heads 1 must be >= 2"):
    DATConfig(embed_dim=48, depth=(1,), num_heads=(1,))
  with pytest.raises(ValueError, match="num_heads 5 must divide embed_dim 48"):
    DATConfig(embed_dim=48, depth=(2,), num_heads=(5,))
  with pytest.raises(ValueError, match="upscale 5 is not supported"):
    DATConfig(upscale=5)
  with pytest.raises(ValueError, match="embed_dim must be even .* got 31"):
    DATConfig(embed_dim=31, num_heads=(2,), depth=(1,))
  with pytest.raises(ValueError, match="even FFN width"):
    DATConfig(embed_dim=18, num_heads=(2,), depth=(1,), expansion_factor=1.5)
  for kwargs, message in [
      (dict(split_size=(-6, -6)), "split_size must be an int from 1 to 64, got -6"),
      (dict(split_size=(8, 65)), "split_size must be an int from 1 to 64, got 65"),
      (dict(upscale=32), "upscale must be an int from 1 to 16, got 32"),
      (dict(img_range=float("nan")), "img_range must be a finite number > 0"),
      (dict(depth=(1.5,), num_heads=(6,)), r"depth\[0\] must be an int >= 1")]:
    with pytest.raises(ValueError, match=message):
      DATConfig(**kwargs)
  with pytest.raises(ValueError, match=r"x must be \[batch, H, W, 3\]"):
    _abstract(SMALL)(jnp.zeros((1, 3, 8, 8)))
  with pytest.raises(TypeError, match="x has dtype uint8: DAT takes float images in"):
    _abstract(SMALL)(jnp.full((1, 8, 8, 3), 200, jnp.uint8))


def test_preset_takes_config_fields_and_refuses_other_keywords():
  model = nnx.eval_shape(lambda: DAT.preset("DAT-light", upscale=2, depth=(1,),
                                            dtype=jnp.bfloat16))
  assert (model.config.depth, model.config.upscale, model.dtype) == ((1,), 2, jnp.bfloat16)
  with pytest.raises(TypeError, match=r"DAT.preset\(\) got unexpected keywords \['bogus'\]: it "
                                      r"takes the DATConfig fields \['depth', "):
    DAT.preset("DAT-light", bogus=1)


# What the original accepts beyond the presets: odd head counts (a spatial branch then
# has the rounded-down half), widths under 32 (the position-bias MLP is then 0 wide and
# gives its bias) and odd window sides (shifts of half, rounded down).
NARROW = DATConfig(embed_dim=30, depth=(2, 2), num_heads=(3, 2), split_size=(3, 5), upscale=2)


def test_odd_heads_narrow_widths_and_odd_windows_match_the_torch_reference():
  reference = dat_torch(NARROW, img_size=15, seed=1)
  assert infer_dat_config(reference.state_dict()) == (NARROW, 15)
  model = dat_from_state_dict(reference.state_dict())
  for h, w in ((15, 15), (11, 13)):  # the stored masks, then the padded path
    x = _image(h, w)
    np.testing.assert_allclose(np.asarray(_forward(model, jnp.asarray(x))),
                               _torch_out(reference, x), atol=1e-5, rtol=0)


@settings(max_examples=30, deadline=None)
@given(length=st.integers(1, 300), tile=st.integers(8, 64), overlap=st.integers(0, 7))
def test_tiles_cover_the_image_with_the_overlap(length, tile, overlap):
  starts = tile_starts(length, tile, overlap)
  size = min(tile, length)
  assert starts[0] == 0 and starts[-1] + size == length
  for a, b in zip(starts, starts[1:]):
    assert 0 < b - a <= size - overlap  # neighbours share at least `overlap` pixels


def test_tiled_upscaling_blends_to_the_untiled_result():
  # A pointwise "model" (nearest-neighbour x2 with a colour change) makes every tile
  # exact, so blending must reproduce the whole-image output.
  fn = lambda x: jnp.repeat(jnp.repeat(jnp.sqrt(x), 2, axis=1), 2, axis=2)
  image = np.random.default_rng(3).uniform(size=(45, 70, 3)).astype(np.float32)
  whole = upscale_image(fn, image, scale=2)
  seen = []
  tiled = upscale_image(fn, image, scale=2, tile=16, overlap=5,
                        progress=lambda done, total: seen.append((done, total)))
  np.testing.assert_allclose(tiled, whole, atol=1e-6)
  assert seen[-1][0] == seen[-1][1] == len(tile_starts(45, 16, 5)) * len(tile_starts(70, 16, 5))
