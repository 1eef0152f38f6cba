"""``jattn.dot_product_attention`` against ``jax.nn.dot_product_attention`` (its XLA
path) on the same random inputs: outputs and gradients, every argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn


def inputs(seed, batch=2, q_len=12, kv_len=12, heads=4, kv_heads=2, d=16):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (batch, q_len, heads, d)),
          jax.random.normal(ks[1], (batch, kv_len, kv_heads, d)),
          jax.random.normal(ks[2], (batch, kv_len, kv_heads, d)))


def both(q, k, v, implementation="xla", **options):
  """(jattn's, JAX's) outputs and gradients (of q, k, v and a bias if given)."""
  bias = options.pop("bias", None)

  def loss(f):
    return lambda q, k, v, bias: jnp.sum(jnp.sin(f(q, k, v, bias=bias, **options)))

  ours = jax.jit(jax.value_and_grad(loss(lambda *a, **o: jattn.dot_product_attention(
      *a, implementation=implementation, **o)), argnums=(0, 1, 2, 3)))(q, k, v, bias)
  theirs = jax.jit(jax.value_and_grad(loss(lambda *a, **o: jax.nn.dot_product_attention(
      *a, implementation="xla", **o)), argnums=(0, 1, 2, 3)))(q, k, v, bias)
  return ours, theirs


def assert_close(ours, theirs, tol=2e-5):
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    scale = max(1.0, float(jnp.abs(b).max()))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol * scale, rtol=0)


@pytest.mark.parametrize("case", [
    dict(),
    dict(is_causal=True),
    dict(is_causal=True, lengths=(8, 12)),        # top-left causal, q_len != kv_len
    dict(is_causal=True, lengths=(12, 9)),
    dict(local_window_size=3, lengths=(10, 12)),
    dict(local_window_size=(4, 0), is_causal=True),
    dict(query_seq_lengths=[12, 7], key_value_seq_lengths=[9, 12]),
    dict(query_seq_lengths=[12, 7], key_value_seq_lengths=[9, 12], is_causal=True),
    dict(bias="per head"),
    dict(bias="per row", mask=True, is_causal=True),
    dict(bias="per key", lengths=(10, 12)),       # broadcast over the queries too
    dict(bias="one element", mask="one element"),  # constants the kernels read as such
])
def test_matches_jax_nn_outputs_and_gradients(case):
  case = dict(case)
  q_len, kv_len = case.pop("lengths", (12, 12))
  q, k, v = inputs(0, q_len=q_len, kv_len=kv_len)
  kb, km = jax.random.split(jax.random.key(1))
  bias = case.pop("bias", None)
  if bias is not None:  # broadcast over the batch, the heads, or the batch and queries
    shape = {"per head": (1, 4, q_len, kv_len), "per row": (2, 1, q_len, kv_len),
             "per key": (1, 4, 1, kv_len), "one element": (1, 1, 1, 1)}[bias]
    case["bias"] = jax.random.normal(kb, shape)
  mask = case.pop("mask", None)
  if mask == "one element":
    case["mask"] = jnp.ones((1, 1, 1, 1), bool)
  elif mask:  # random, with the diagonal kept so that no row is empty
    keep = jax.random.bernoulli(km, 0.6, (2, 4, q_len, kv_len))
    case["mask"] = keep | jnp.eye(q_len, kv_len, dtype=bool)
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if name in case:
      case[name] = jnp.asarray(case[name], jnp.int32)
  assert_close(*both(q, k, v, **case))
  if bias is not None or mask:  # the kernels, whose bias gradient is a pass of its own
    assert_close(*both(q, k, v, implementation="pallas_triton", **case))


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
def test_rows_of_large_bias_keep_their_gradients(implementation):
  """Rows of ``-1e9`` (an additive padding mask) or shifted by ``5e4`` or ``-1e3``: as
  jax.nn on the bias less each row's maximum (the same softmax, without float32's
  rounding of the large values), gradients of the bias included. Unshifted, the
  kernels' float32 log-sum-exp lost its log(sum) there, and the gradients were off by
  up to 2x (5e-4 relative at -1e3)."""
  q, k, v = inputs(2)
  bias = jax.random.normal(jax.random.key(3), (2, 1, 12, 12))
  bias = bias.at[0, :, 3].add(-1e9).at[1, :, 5].add(5e4).at[1, :, 7].add(-1e3)
  exact = bias - bias.max(axis=-1, keepdims=True)
  ours = both(q, k, v, implementation=implementation, bias=bias)[0]
  theirs = both(q, k, v, bias=exact)[1]
  assert_close(ours, theirs)
  # the log-sum-exp of the bias as given (its rows' shift added back)
  lse = lambda b: jattn.flex_attention(q, k, v, score_mod=jattn.flex.bias_score(b),
                                       return_lse=True, backend=implementation)[1]
  top = jnp.broadcast_to(bias.max(axis=-1), (2, 4, 12))
  np.testing.assert_allclose(lse(bias), lse(exact) + top, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
@pytest.mark.parametrize("hidden_by", ["causal", "lengths", "padding"])
def test_large_bias_at_keys_a_row_does_not_see(implementation, hidden_by):
  """Rows that share a bias row but see different keys of it get shifts of their own.
  A large value at keys that the causal mask, or another batch row's key length, hides
  from a row had shifted that row by it (each row took its bias row's maximum), and
  the small values the row sees were lost (outputs off by 1 at 1e9, 6e-4 at 1e4). And
  under a shared additive causal bias of -1e9 with one batch row left-padded, the padded
  rows, which see only -1e9 keys, went unshifted: the kernels' gradients there were off
  by the number of keys they see."""
  q, k, v = inputs(6)
  bias = jax.random.normal(jax.random.key(7), (1, 1, 12, 12)).at[..., 11].set(1e9)
  if hidden_by == "causal":
    case = dict(is_causal=True)
  elif hidden_by == "lengths":
    case = dict(key_value_seq_lengths=jnp.array([12, 9], jnp.int32))
  else:
    bias = jnp.where(jnp.tri(12, dtype=bool), 0.0, -1e9)[None, None]
    case = dict(mask=jnp.arange(12)[None, None, None, :] >= jnp.array([5, 0])[:, None, None, None])
  ours = both(q, k, v, implementation=implementation, bias=bias, **case)[0]
  if hidden_by == "padding":  # as jax.nn on each row's bias less its top over what it sees
    top = jnp.where(case["mask"], bias, -jnp.inf).max(axis=-1, keepdims=True)
    exact = bias - jnp.where(top > -1e30, top, 0.0)
    value, (dq, dk, dv, dbias) = both(q, k, v, bias=exact, **case)[1]
    theirs = value, (dq, dk, dv, dbias.sum(axis=0, keepdims=True))
  else:
    theirs = both(q, k, v, bias=bias, **case)[1]
  assert_close(ours, theirs)


def test_the_large_row_check_stays_one_branch_under_vmap():
  """The kernels' check for rows of large bias is a ``cond``; under ``vmap`` its
  predicate is one for the whole batch (a batched one would run both branches)."""
  q, k, v = (jnp.stack([x, -x]) for x in inputs(4))
  bias = jax.random.normal(jax.random.key(5), (2, 2, 1, 12, 12))
  loss = lambda q, k, v, b: jnp.sum(jattn.dot_product_attention(
      q, k, v, b, implementation="pallas_triton"))
  jaxpr = jax.make_jaxpr(jax.vmap(jax.grad(loss, argnums=(0, 3))))(q, k, v, bias)
  assert str(jaxpr).count(" cond[") == 2  # the forward's and the backward's


@pytest.mark.parametrize("case", [
    dict(mask="documents", is_causal=True),
    dict(mask="random", bias=(2, 4, 12, 12)),   # the bias covers the mask's shape
    dict(mask="random", bias=(2, 4, 12, 12), nonfinite=True),  # NaN, +inf where masked
    dict(mask="padding", lengths=(8, 12)),      # rows that see no key: zeros
    dict(mask="keys", rewritten=False),         # key padding: Hopper splits it as it is
    dict(mask="random", bias=(2, 4, 12, 12), int16=True, rewritten=False),
])
def test_a_mask_array_runs_as_an_additive_bias_where_hopper_takes_it(case, hopper_mask_choice):
  """Where the Hopper kernels would run it and not the call as it is, a mask array
  becomes a 16-bit additive bias (the bias where allowed, else -inf) beside a block
  mask of the index masks alone (they cannot gather the boolean array): forced here on
  the CPU, whose kernels run that call, the outputs and gradients (the bias's
  included) are jax.nn's, also with NaN or +inf in the bias where the mask refuses. A
  mask Hopper takes as it is (key padding: a part per key) or an integer bias stays."""
  taken = hopper_mask_choice
  case = dict(case)
  q_len, kv_len = case.pop("lengths", (12, 12))
  q, k, v = (x.astype(jnp.bfloat16) for x in inputs(9, q_len=q_len, kv_len=kv_len))
  kind = case.pop("mask")
  if kind == "documents":
    ids = jnp.array([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    mask = (ids[:, None, :, None] == ids[:, None, None, :])
  elif kind == "random":  # with the diagonal kept
    mask = jax.random.bernoulli(jax.random.key(3), 0.5, (2, 1, 12, 12)) | jnp.eye(12, dtype=bool)
  elif kind == "keys":
    mask = jnp.arange(kv_len)[None, None, None, :] < jnp.array([12, 7])[:, None, None, None]
  else:  # each batch row's keys from its own start; the first rows of one see none
    mask = jnp.arange(kv_len)[None, None, None, :] >= jnp.array([0, 10])[:, None, None, None]
    mask = mask & (jnp.arange(q_len)[None, None, :, None] >= jnp.array([0, 2])[:, None, None,
                                                                              None])
  rewritten = case.pop("rewritten", True)
  nonfinite, int16 = case.pop("nonfinite", False), case.pop("int16", False)
  if "bias" in case:
    bias = jax.random.normal(jax.random.key(4), case["bias"])
    if nonfinite:
      bias = jnp.where(mask, bias, jnp.where(jnp.arange(12) % 2, jnp.nan, jnp.inf))
    case["bias"] = jnp.round(bias * 3).astype(jnp.int16) if int16 else bias.astype(jnp.bfloat16)
  if kind == "padding":  # jax.nn averages the values on rows that see no key: zeros here
    seen = jnp.any(jnp.broadcast_to(mask, (2, 1, q_len, kv_len)), axis=-1)[:, 0]  # [b, q]
    ours = jattn.dot_product_attention(q, k, v, mask=mask).astype(jnp.float32)
    theirs = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    assert taken and taken[0] is not None
    assert_close(jnp.where(seen[..., None, None], ours, 0.0),
                 jnp.where(seen[..., None, None], theirs.astype(jnp.float32), 0.0), tol=2e-2)
    assert not jnp.any(jnp.where(seen[..., None, None], 0.0, ours))
    grads = jax.grad(lambda q, k, v: jnp.sum(jattn.dot_product_attention(
        q, k, v, mask=mask).astype(jnp.float32) ** 2), argnums=(0, 1, 2))(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads)
    return
  if int16:  # (an integer bias has no gradient)
    ours = jattn.dot_product_attention(q, k, v, mask=mask, **case)
    theirs = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla", **case)
    assert taken and taken[0] is None
    assert_close(ours, theirs, tol=2e-2)
    return
  ours, theirs = both(q, k, v, implementation=None, mask=mask, **case)
  assert taken and (taken[0] is not None) == rewritten
  if nonfinite:  # jax.nn's gradient of a bias where it is masked: NaN there, 0 ours
    ours = (ours[0], ours[1][:3] + (jnp.where(mask, ours[1][3], 0.0),))
    theirs = (theirs[0], theirs[1][:3] + (jnp.where(mask, theirs[1][3], 0.0),))
  assert_close(ours, theirs, tol=2e-2)


def test_unbatched_inputs_and_the_default_implementation():
  q, k, v = (x[0] for x in inputs(2))
  bias = jax.random.normal(jax.random.key(3), (4, 12, 12))  # [heads, q_len, kv_len]
  ours = jattn.dot_product_attention(q, k, v, bias, is_causal=True)
  theirs = jax.nn.dot_product_attention(q, k, v, bias, is_causal=True)
  assert ours.shape == q.shape
  assert_close(ours, theirs, tol=2e-3)  # (the kernels' float32 sums, where they run)
  ours = jattn.dot_product_attention(q, k, v, local_window_size=(2, 1))
  assert_close(ours, jax.nn.dot_product_attention(q, k, v, local_window_size=(2, 1)), tol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["bias", "mask", "bias causal"])
def test_the_default_gpu_path_with_one_element_bias_or_mask(case):
  """On a GPU with 16-bit inputs ``implementation=None`` picks our fastest kernels (Hopper
  where they run: a one-element bias or mask reads no index): against jax.nn's XLA path
  in float32 on the same values, outputs and gradients (the bias's too)."""
  q, k, v = (x.astype(jnp.bfloat16) for x in inputs(7, q_len=256, kv_len=256, d=64))
  options = dict(is_causal="causal" in case)
  if "bias" in case:
    options["bias"] = jnp.full((1, 1, 1, 1), 0.7, jnp.bfloat16)
  else:
    options["mask"] = jnp.ones((1, 1, 1, 1), bool)
  ours, theirs = both(q, k, v, implementation=None, **options)
  f32 = lambda t: jax.tree.map(lambda x: None if x is None else x.astype(jnp.float32), t,
                               is_leaf=lambda x: x is None)
  _, reference = both(*(x.astype(jnp.float32) for x in (q, k, v)), **{
      n: x.astype(jnp.float32) if n == "bias" else x for n, x in options.items()})
  del theirs
  ours = f32(ours)
  assert_close(ours[0], reference[0], tol=3e-2)  # the loss
  assert_close(ours[1][:3], reference[1][:3], tol=3e-2)  # q, k, v
  if "bias" in case:
    # Exactly 0 (a constant shift of every score), but every flash backward's row sums
    # delta = rowsum(o * do) take o rounded to 16 bits: the gradient is a sum of 2048
    # rows' roundings, bounded here by twice the root sum of squares of (do * one unit
    # in the last place of o) on float32 attention of the same values (~0.2-0.4).
    o = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                     bias=jnp.float32(0.7), is_causal=options["is_causal"])
    o16 = o.astype(jnp.bfloat16)
    ulp = (jnp.nextafter(o16, jnp.bfloat16(jnp.inf)) - o16).astype(jnp.float32)
    bound = 2 * jnp.sqrt(jnp.sum((jnp.cos(o16).astype(jnp.float32) * ulp) ** 2))
    assert abs(float(ours[1][3].reshape(()))) < float(bound)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["documents causal", "random mask and bias", "padding"])
def test_mask_arrays_on_the_default_gpu_path(case):
  """A boolean mask array on a GPU with 16-bit inputs (on Hopper: an additive bias read
  tile by tile, the mask's empty tiles skipped): against jax.nn's XLA path in float32
  on the same values, outputs and gradients (a bias's too); rows that see no key give
  zeros (jax.nn averages the values there)."""
  q, k, v = (x.astype(jnp.bfloat16) for x in inputs(12, q_len=384, kv_len=384, d=128))
  ids = jnp.stack([jnp.repeat(jnp.arange(3), 128), jnp.repeat(jnp.arange(4), 96)])
  options = {}
  if case == "documents causal":
    options = dict(mask=ids[:, None, :, None] == ids[:, None, None, :], is_causal=True)
  elif case == "random mask and bias":
    keep = jax.random.bernoulli(jax.random.key(13), 0.3, (2, 1, 384, 384))
    options = dict(mask=keep | jnp.eye(384, dtype=bool),
                   bias=jax.random.normal(jax.random.key(14), (2, 4, 384, 384), jnp.bfloat16))
  else:  # batch row 1 sees keys from 200 on, and its first 50 queries none
    keys = jnp.arange(384)[None, None, None, :] >= jnp.array([0, 200])[:, None, None, None]
    rows = jnp.arange(384)[None, None, :, None] >= jnp.array([0, 50])[:, None, None, None]
    options = dict(mask=keys & rows)
  seen = jnp.any(jnp.broadcast_to(options["mask"], (2, 1, 384, 384)), axis=-1)[:, 0]
  f32 = lambda x: x.astype(jnp.float32)
  ours = f32(jattn.dot_product_attention(q, k, v, **options))
  reference = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), implementation="xla", **{
      n: f32(x) if n == "bias" else x for n, x in options.items()})
  assert not jnp.any(jnp.where(seen[..., None, None], 0.0, ours))
  assert_close(jnp.where(seen[..., None, None], ours, 0.0),
               jnp.where(seen[..., None, None], reference, 0.0), tol=3e-2)
  if case != "padding":  # (jax.nn's gradients of its averaged rows differ by design)
    ours = jax.tree.map(f32, both(q, k, v, implementation=None, **options)[0])
    reference = both(f32(q), f32(k), f32(v), **{
        n: f32(x) if n == "bias" else x for n, x in options.items()})[1]
    assert_close(ours, reference, tol=3e-2)


@pytest.mark.gpu
def test_dense_bias_at_head_dim_128_on_the_gpu():
  """A dense 16-bit bias alone at head dim 128 on the kernels ``implementation=None``
  picks (Hopper: tiles of it): against jax.nn's XLA path in float32 on the same values,
  outputs and gradients, the bias's included."""
  q, k, v = (x.astype(jnp.bfloat16) for x in inputs(10, q_len=384, kv_len=320, d=128))
  bias = jax.random.normal(jax.random.key(11), (1, 4, 384, 320), jnp.bfloat16)
  ours = jax.tree.map(lambda x: x.astype(jnp.float32), both(q, k, v, implementation=None,
                                                           bias=bias)[0])
  reference = both(*(x.astype(jnp.float32) for x in (q, k, v)),
                   bias=bias.astype(jnp.float32))[1]
  assert_close(ours, reference, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 4, 1, 1), (2, 1, 256, 1), (2, 1, 1, 256)])
def test_hopper_kernels_with_rows_of_large_bias(shape):
  """The Hopper kernels on biases they can split, with rows of large values (5e4, -1e3,
  a -1e9 padding of keys): against jax.nn's XLA path in float32 on the same values less
  each row's maximum; the bias's gradient too where it is not exactly 0 (a bias constant
  along the keys changes no weight)."""
  q, k, v = (x.astype(jnp.bfloat16) for x in inputs(8, q_len=256, kv_len=256, d=64))
  bias = jax.random.normal(jax.random.key(9), shape)
  bias = bias.at[..., :1, :1, :1].add(5e4).at[..., -1:, -1:, -1:].add(-1e3)
  if shape[-1] > 1:
    bias = bias.at[1, ..., 200:].set(-1e9)
  bias = bias.astype(jnp.bfloat16)
  exact = bias.astype(jnp.float32)
  exact = exact - exact.max(axis=-1, keepdims=True)
  ours = both(q, k, v, implementation="pallas_mosaic", bias=bias)[0]
  reference = both(*(x.astype(jnp.float32) for x in (q, k, v)), bias=exact)[1]
  ours = jax.tree.map(lambda x: x.astype(jnp.float32), ours)
  assert_close(ours[0], reference[0], tol=3e-2)  # the loss
  assert_close(ours[1][:3], reference[1][:3], tol=3e-2)  # q, k, v
  if shape[-1] > 1:
    assert_close(ours[1][3], reference[1][3], tol=3e-2)


def test_bad_arguments_are_named():
  q, k, v = inputs(4)
  with pytest.raises(ValueError, match="implementation must be one of"):
    jattn.dot_product_attention(q, k, v, implementation="flash")
  with pytest.raises(TypeError, match="mask must be boolean"):
    jattn.dot_product_attention(q, k, v, mask=jnp.ones((12, 12)))
  with pytest.raises(TypeError, match="bias must be numbers .* boolean mask goes in mask"):
    jattn.dot_product_attention(q, k, v, bias=jnp.ones((12, 12), bool))
  with pytest.raises(ValueError, match=r"bias of shape \(1, 1, 12, 5\) does not broadcast"):
    jattn.dot_product_attention(q, k, v, bias=jnp.ones((12, 5)))
  with pytest.raises(ValueError, match="local_window_size must be an int >= 0"):
    jattn.dot_product_attention(q, k, v, local_window_size=(1, 2, 3))
  with pytest.raises(ValueError, match="must have rank 4"):
    jattn.dot_product_attention(q[0, 0], k, v)
  # Lengths are checked on every path, the masked ones (bias, causal) included.
  batch = q.shape[0]
  for bad, error, match in ((jnp.array([7] * (batch + 1)), ValueError, "key_value_seq_lengths"),
                            (jnp.full((batch,), 3.0), TypeError, "must be integers")):
    with pytest.raises(error, match=match):
      jattn.dot_product_attention(q, k, v, key_value_seq_lengths=bad, is_causal=True)


def test_cudnn_with_a_bias_is_jaxs_own_cudnn_call(monkeypatch):
  """flex has no cuDNN backend: ``implementation="cudnn"`` with a bias array hands the
  whole call to JAX's cuDNN path, every argument as given."""
  q, k, v = inputs(5)
  bias = jax.random.normal(jax.random.key(6), (1, 4, 12, 12))
  seen = {}

  def fake(*args, **kwargs):
    seen.update(args=args, kwargs=kwargs)
    return args[0]

  monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
  jattn.dot_product_attention(q, k, v, bias, is_causal=True, implementation="cudnn")
  assert seen["args"][3] is not None and seen["kwargs"]["implementation"] == "cudnn"
  assert seen["kwargs"]["is_causal"] is True


def test_a_mask_array_reaches_flex_classified_as_its_mask_function(monkeypatch):
  """With a mask array the flex call gets a block mask made from the array and the
  other masks by one reduction: tile for tile what evaluating the mask function
  gives (documents, causal, a window and lengths; tiles of every kind)."""
  import importlib
  module = importlib.import_module("jattn.dot_product")
  seen = {}
  monkeypatch.setattr(module, "flex_attention", lambda q, *a, **kw: seen.update(kw) or q)
  q, k, v = inputs(7, q_len=300, kv_len=290)
  docs = jnp.asarray([np.repeat([0, 1, 2], [100, 160, 40]), np.repeat([0, 1, 2], [200, 60, 40])])
  mask = docs[:, None, :, None] == docs[:, None, None, :290]
  jattn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=(130, 2),
                              query_seq_lengths=jnp.asarray([180, 250]),
                              key_value_seq_lengths=jnp.asarray([290, 100]))
  made = seen["block_mask"]
  evaluated = jattn.create_block_mask(made.mask_mod, 2, None, 300, 290,
                                      block=(made.block_q, made.block_kv))
  np.testing.assert_array_equal(made.kinds, evaluated.kinds)
  assert {0, 1, 2} <= set(np.unique(np.asarray(made.kinds)).tolist())
