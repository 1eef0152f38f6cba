"""Generation with a Llama-shaped model (issue 40): ``jattn.nn.LlamaForCausalLM.generate``
against transformers' ``generate`` on the same weights, same GPU, same run.

The model (random weights, bf16): 16 layers, width 2048, 32 query / 8 KV heads (head dim
64), SwiGLU width 8192, vocabulary 32000, untied head (Llama 3.2 1B's shape with
Llama 2's vocabulary). Batch 8 of 2048-token random prompts, 256 new tokens, greedy,
no end-of-sequence token (every row makes all 256).

Rows (median wall clock of whole ``generate`` calls, after each one's first call):
- ``jattn``: ``model.generate(ids, 256)`` (prefill + one jitted while loop).
- ``hf_default``: ``generate(ids, max_new_tokens=256, do_sample=False)``: the dynamic
  cache, SDPA attention.
- ``hf_static_compiled``: the static cache (``cache_implementation="static"``), its
  decode steps compiled by ``torch.compile(mode="reduce-overhead", fullgraph=True)``
  (CUDA graphs): through ``compile_config`` where transformers has ``CompileConfig``
  (it compiles the static cache's steps itself there), else by replacing
  ``model.forward``, the older documented recipe.
Prefill: the same call with ``max_new_tokens=1``. Tokens/s: ``batch * 256 /`` the whole
call (prefill included), and the decode alone: ``batch * 255 / (call - prefill)``.

    python bench/llm_generate.py --out bench/results --label h100
    python bench/llm_generate.py --smoke   # CPU, tiny model, float32, eager torch
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")  # room for torch

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import environment, write_results  # noqa: E402
from bench.generate import git_commit, torch_info  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
  layers: int = 16
  width: int = 2048
  heads: int = 32
  kv_heads: int = 8
  mlp: int = 8192
  vocab: int = 32000
  batch: int = 8
  prompt: int = 2048
  new_tokens: int = 256


SMOKE = Shape(layers=2, width=64, heads=4, kv_heads=2, mlp=128, vocab=128, batch=2, prompt=16,
              new_tokens=8)
BARS = {"hf_static_compiled": 1.3, "hf_default": 2.0}


def hf_model(shape: Shape, dtype, device):
  import torch
  import transformers

  config = transformers.LlamaConfig(
      vocab_size=shape.vocab, hidden_size=shape.width, intermediate_size=shape.mlp,
      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
      num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.prompt + shape.new_tokens,
      rope_theta=500000.0, tie_word_embeddings=False)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
  model.generation_config.eos_token_id = None  # every row makes all its tokens
  model.generation_config.pad_token_id = 0
  return model


def prompt_ids(shape: Shape) -> np.ndarray:
  """The benchmark's prompts: ``[batch, prompt]`` random token ids."""
  return np.random.default_rng(1).integers(3, shape.vocab, (shape.batch, shape.prompt))


def check_equivalence(shape: Shape, device: str) -> dict:
  """The float32 models (transformers' and jattn's from its weights, TF32 off, JAX's
  matmuls at full precision) on a short prompt: the logits' largest difference against
  1e-4 of the largest logit, and 16 greedy tokens (the bf16 rows' tokens drift apart
  where two logits nearly tie, so equality is judged here)."""
  import torch

  from jattn.nn import LlamaForCausalLM

  batch, n, new = min(shape.batch, 2), min(shape.prompt, 32), min(shape.new_tokens, 16)
  hf = hf_model(shape, torch.float32, device)
  ids = np.random.default_rng(2).integers(3, shape.vocab, (batch, n))
  tids = torch.from_numpy(ids).to(device)
  tf32 = torch.backends.cuda.matmul.allow_tf32
  torch.backends.cuda.matmul.allow_tf32 = False
  try:
    with torch.no_grad():
      full = torch.from_numpy(prompt_ids(shape)).to(device)
      first = hf(full).logits[:, -1].argmax(-1).cpu().numpy()  # float32's first new tokens
      ref = hf(tids).logits.float().cpu().numpy()
      ref_tokens = hf.generate(tids, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)[:, n:].cpu().numpy()
    with jax.default_matmul_precision("highest"):
      ours = LlamaForCausalLM.from_torch(hf, backend="auto")
      logits = np.asarray(ours(jnp.asarray(ids)))
      tokens = np.asarray(ours.generate(jnp.asarray(ids), new))
  finally:
    torch.backends.cuda.matmul.allow_tf32 = tf32
  diff, scale = float(np.abs(logits - ref).max()), float(np.abs(ref).max())
  same = bool((tokens == ref_tokens).all())
  return dict(float32_first_tokens=first.tolist(),
              batch=batch, prompt=n, new_tokens=new, max_abs_logit=scale, max_abs_diff=diff,
              tolerance=1e-4 * max(1.0, scale), tokens_equal=same,
              passed=diff <= 1e-4 * max(1.0, scale) and same)


def static_compile(hf) -> dict:
  """The ``generate`` keywords that compile the static cache's decode steps with CUDA
  graphs (transformers with ``CompileConfig``), or ``{}`` after replacing
  ``hf.forward`` by its compiled self (older transformers)."""
  import torch
  import transformers

  if hasattr(transformers, "CompileConfig"):
    return dict(compile_config=transformers.CompileConfig(fullgraph=True,
                                                          mode="reduce-overhead"))
  hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
  return {}


def timed(call, reps: int, sync):
  """``(first-call seconds, median seconds of reps calls, last result)``."""
  start = time.perf_counter()
  out = call()
  sync(out)
  first = time.perf_counter() - start
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    out = call()
    sync(out)
    times.append(time.perf_counter() - start)
  return first, statistics.median(times), out


def run_rows(shape: Shape, args):
  import torch

  device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
  tdtype = torch.float32 if args.smoke else torch.bfloat16
  hf = hf_model(shape, tdtype, device)
  from jattn.nn import LlamaForCausalLM

  ours = LlamaForCausalLM.from_torch(hf, backend=args.backend)
  ids = prompt_ids(shape)
  jids, tids = jnp.asarray(ids), torch.from_numpy(ids).to(device)
  jsync = jax.block_until_ready
  tsync = lambda _: torch.cuda.synchronize() if device == "cuda" else None
  rows, tokens = {}, {}
  with torch.no_grad():  # the bf16 logits' error beside the gaps greedy decides on
    ref = hf(tids[:2, :64]).logits.float().cpu().numpy()
  got = np.asarray(ours(jids[:2, :64]))
  top2 = np.sort(ref, axis=-1)[..., -2:]
  bf16 = dict(max_abs_diff=float(np.abs(got - ref).max()), max_abs_logit=float(np.abs(ref).max()),
              median_top2_gap=float(np.median(top2[..., 1] - top2[..., 0])),
              argmax_equal=float((got.argmax(-1) == ref.argmax(-1)).mean()))
  print("bf16 logits:", bf16, flush=True)

  def hf_call(n, **kw):  # (generate runs without gradients by itself)
    return lambda: hf.generate(tids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               **kw)

  calls = {"jattn": lambda n: (lambda: ours.generate(jids, n)),
           "hf_default": lambda n: hf_call(n)}
  if not args.smoke:
    calls["hf_static_compiled"] = lambda n: hf_call(n, cache_implementation="static",
                                                    **static_compile(hf))
  for name, make in calls.items():
    try:
      first_prefill, prefill, _ = timed(make(1), args.reps, jsync if name == "jattn" else tsync)
      first, whole, out = timed(make(shape.new_tokens), args.reps,
                                jsync if name == "jattn" else tsync)
    except Exception as e:  # a peer that fails here is reported, not fatal
      rows[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
      print(name, rows[name], flush=True)
      continue
    out = np.asarray(out if name == "jattn" else out[:, shape.prompt:].cpu())
    tokens[name] = out
    new = shape.batch * shape.new_tokens
    rows[name] = dict(prefill_ms=1e3 * prefill, generate_ms=1e3 * whole,
                      tokens_per_s=new / whole,
                      decode_tokens_per_s=shape.batch * (shape.new_tokens - 1) / (whole - prefill),
                      first_prefill_s=first_prefill, first_generate_s=first)
    print(name, {k: round(v, 3) for k, v in rows[name].items()}, flush=True)
  agree = {name: float((tokens[name] == tokens["jattn"]).mean()) for name in tokens
           if name != "jattn" and "jattn" in tokens}
  return rows, agree, bf16, torch_info(device), tokens


def markdown(result) -> str:
  s, env, rows = result["shape"], result["environment"], result["rows"]
  lines = [f"# LLM generation (issue 40), {env['device']} (jax {env['jax']}, torch "
           f"{env.get('torch')}, transformers {result['transformers']}, {env['time']})", "",
           f"Code: commit {result['commit']}.", "",
           f"LlamaForCausalLM with random weights, {result['dtype']}: {s['layers']} layers, "
           f"width {s['width']}, {s['heads']} query / {s['kv_heads']} KV heads, SwiGLU "
           f"{s['mlp']}, vocabulary {s['vocab']}; batch {s['batch']}, {s['prompt']}-token "
           f"prompts, {s['new_tokens']} new tokens, greedy. jattn backend {result['backend']}.",
           "", f"Medians of {result['reps']} calls after the first.", "",
           "| row | prefill ms | generate ms | tokens/s | decode tokens/s | jattn tokens/s / row "
           "| first prefill s | first generate s |", "|---|---|---|---|---|---|---|---|"]
  for name, r in rows.items():
    if "error" in r:
      lines.append(f"| {name} | {r['error']} |  |  |  |  |  |  |")
      continue
    ratio = "" if name == "jattn" else f"{rows['jattn']['tokens_per_s'] / r['tokens_per_s']:.2f}"
    lines.append(f"| {name} | {r['prefill_ms']:.1f} | {r['generate_ms']:.1f} | "
                 f"{r['tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.0f} | {ratio} | "
                 f"{r['first_prefill_s']:.1f} | {r['first_generate_s']:.1f} |")
  lines.append("")
  for name, bar in result["bars"].items():
    lines.append(f"**Bar: jattn tokens/s / {name} = {bar['ratio']:.2f} (>= {bar['threshold']}: "
                 f"{'PASS' if bar['pass'] else 'FAIL'})**")
  c, b = result["check"], result["bf16_logits"]
  lines += ["", f"Check (float32, TF32 off, batch {c['batch']}, prompt {c['prompt']}, "
            f"{c['new_tokens']} greedy tokens, against transformers): max |logit diff| "
            f"{c['max_abs_diff']:.2e} (tolerance {c['tolerance']:.1e}), tokens equal: "
            f"{c['tokens_equal']}: {'PASS' if c['passed'] else 'FAIL'}.",
            "", f"bf16 logits of 2 x 64 prompt tokens against transformers': max |diff| "
            f"{b['max_abs_diff']:.3f} of logits up to {b['max_abs_logit']:.3f}, while the "
            f"median gap between a position's two largest logits is "
            f"{b['median_top2_gap']:.4f}; argmax equal at {b['argmax_equal']:.1%} of "
            "positions. Generated bf16 tokens equal to jattn's: "
            + ", ".join(f"{k} {v:.1%}" for k, v in result["agree"].items())
            + " (a greedy path that parts once stays apart). Each row's first new token "
            "against the float32 model's greedy pick on the same full prompts: "
            + ", ".join(f"{k} {v:.0%}" for k, v in b["first_token_equal_to_float32"].items())
            + ".",
            "", "Tokens/s: new tokens / the whole generate call (prefill included); decode "
            "tokens/s: (new tokens - the prefill's) / (call - prefill call)."]
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--smoke", action="store_true", help="CPU, tiny float32 model")
  parser.add_argument("--reps", type=int, default=None, help="timed calls (default 3)")
  parser.add_argument("--backend", default="auto")
  parser.add_argument("--label", default=None, help="output stem llm_generate_<label>")
  parser.add_argument("--out", default=None, help="output folder (default bench/results)")
  args = parser.parse_args(argv)
  args.reps = args.reps or (1 if args.smoke else 3)
  shape = SMOKE if args.smoke else Shape()
  import transformers

  import torch

  check = check_equivalence(shape, "cuda" if torch.cuda.is_available() and not args.smoke
                            else "cpu")
  print("check:", check, flush=True)
  rows, agree, bf16, tinfo, tokens = run_rows(shape, args)
  first = np.asarray(check["float32_first_tokens"])
  bf16["first_token_equal_to_float32"] = {name: float((t[:, 0] == first).mean())
                                          for name, t in tokens.items()}
  bars = {name: dict(threshold=t, ratio=rows["jattn"]["tokens_per_s"] / rows[name]["tokens_per_s"])
          for name, t in BARS.items()
          if "tokens_per_s" in rows.get(name, {}) and "tokens_per_s" in rows["jattn"]}
  for bar in bars.values():
    bar["pass"] = bar["ratio"] >= bar["threshold"]
  result = dict(shape=dataclasses.asdict(shape), dtype="float32" if args.smoke else "bfloat16",
                backend=args.backend, reps=args.reps, rows=rows, agree=agree, bars=bars,
                check=check, bf16_logits=bf16,
                commit=git_commit(), transformers=transformers.__version__,
                environment={**environment(), **tinfo})
  text = markdown(result)
  print(text)
  if not args.smoke or args.out:
    stem = "llm_generate" + (f"_{args.label}" if args.label else "")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    write_results(out, stem, result, text)
    print(f"wrote {out}/{stem}.json and .md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
