"""Generation benchmark (issue 39's last bar): the NNX decode loop of the docs model
against the same model in PyTorch, on the same GPU in the same run.

The model (docs/serving.md): ``jattn.nn.DecoderLM(32000, 1024, 16, 12,
max_positions=2304, dtype=bfloat16)`` (parameters float32 unless ``--param-dtype``;
``--kv-heads 4`` makes it grouped-query), a bfloat16 cache of 2304 tokens, batch 8, a
random 2048-token prompt per row, 256 greedy new tokens.

- jattn: ``jattn.nn.generate``'s two jitted calls, as ``greedy_generate`` makes them:
  ``prefill`` (caches the prompt, gives the first token) and ``decode_steps`` (the other
  255 tokens in one ``lax.fori_loop``); attention backend ``--backend`` (auto).
- torch: ``bench/torch_decoder.py``, the same architecture with the same weights (cast
  to the compute dtype), gpt-fast style: a static KV cache written in place, SDPA over
  it with a mask built from the position tensor, the decode step compiled with
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs; coordinate-descent tuning on)
  and called once per token from Python, the prefill compiled apart. One row per SDPA
  backend of the decode step (``--torch-sdpa``, default ``math,default``: gpt-fast's
  math backend, and torch's own choice); the prefill uses torch's own choice.

Measured per row: prefill ms (prompt in, first token out), decode ms (the 255 decode
steps) and decode tokens/s = batch * 255 / decode seconds (the loop's tokens; the first
of the 256 comes from the prefill), and the first call of each (compile included; for
torch, also CUDA-graph recording). Host wall clock between device syncs on both sides
(so dispatch and Python overhead count). Each round runs every row once, in alternating
order; medians over ``--reps`` rounds after ``--warmup`` untimed ones. Also prefill +
decode tokens/s = batch * 256 / (prefill + decode seconds), median over rounds.

Bar: jattn decode tokens/s / torch decode tokens/s >= 1.2, against the fastest torch row.

Check (before timing; ``--skip-check``): a float32 copy of the model (same seed, so the
same parameters; XLA attention, matmuls at full precision) against its float32 torch
twin on a short prompt: logits of the cached prompt and generated tokens agree (max
|diff| <= 1e-4 * max(1, max |logit|)) and the greedy tokens are equal. The timed runs'
tokens are also compared (bfloat16: agreement reported, not required).

    python bench/generate.py                       # the issue's model (GPU), MHA 16/16
    python bench/generate.py --kv-heads 4          # GQA 16/4 (label <gpu>_kv4)
    python bench/generate.py --smoke --no-compile  # CPU, tiny model, float32: both sides agree
    python bench/generate.py --check-only          # only the float32 check (CPU or GPU)

Writes ``generate_<label>.json`` and ``.md`` under ``--out`` (default bench/results;
with ``--smoke`` the temporary folder) after the first calls and after every round.
``--label`` defaults to the GPU's short name (``_kv<n>`` appended for GQA). ``--smoke``
runs 2 layers of width 64, batch 2, a 16-token prompt and 8 new tokens on the CPU (JAX's
XLA backend there, torch compiled unless ``--no-compile``) and exits 1 unless the check
passes and both sides give the same tokens (in float32, its default dtype).
"""

from __future__ import annotations

import os

# JAX preallocates 75% of the GPU by default; leave torch room (before importing jax).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import environment, write_results  # noqa: E402
from bench.decode import short_device_name  # noqa: E402
from bench.programs import one_line  # noqa: E402

BAR = 1.2  # jattn decode tokens/s / torch decode tokens/s


@dataclasses.dataclass(frozen=True)
class Shape:
  vocab: int
  width: int
  heads: int
  kv_heads: int
  layers: int
  batch: int
  prompt: int
  new_tokens: int

  @property
  def max_length(self) -> int:  # cache and position table: prompt + every new token
    return self.prompt + self.new_tokens

  @property
  def steps(self) -> int:  # decode steps: the prefill gives the first new token
    return self.new_tokens - 1


FULL = Shape(vocab=32000, width=1024, heads=16, kv_heads=16, layers=12, batch=8, prompt=2048,
             new_tokens=256)
SMOKE = Shape(vocab=256, width=64, heads=4, kv_heads=4, layers=2, batch=2, prompt=16,
              new_tokens=8)
DTYPES = {"bfloat16": (jnp.bfloat16, "bfloat16"), "float32": (jnp.float32, "float32")}


def torch_dtype(name):
  import torch
  return getattr(torch, name)


# ---------------------------------------------------------------- jattn

def build_jax_model(shape: Shape, dtype, param_dtype, backend: str, seed: int = 0):
  from flax import nnx
  from jattn.nn import DecoderLM

  return DecoderLM(shape.vocab, shape.width, shape.heads, shape.layers,
                   num_kv_heads=shape.kv_heads, max_positions=shape.max_length,
                   backend=backend, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(seed))


def reset_cache(model) -> None:
  """Every row's cached length back to 0 (the old keys are never attended again)."""
  for block in model.blocks:
    lengths = block.attn.cache.lengths
    lengths[...] = jax.block_until_ready(jnp.zeros_like(lengths[...]))


def jax_generate(model, prompt, steps: int):
  """greedy_generate's two calls, timed: tokens ``[batch, 1 + steps]`` (numpy), prefill
  seconds, decode seconds."""
  from jattn.nn.generate import decode_steps, prefill

  reset_cache(model)
  start = time.perf_counter()
  first = jax.block_until_ready(prefill(model, prompt))
  middle = time.perf_counter()
  rest = jax.block_until_ready(decode_steps(model, first, steps))
  end = time.perf_counter()
  return np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], 1), middle - start, \
      end - middle


# ---------------------------------------------------------------- torch

def torch_sync(device: str):
  import torch
  return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def torch_runners(model_jax, prompt, shape: Shape, args, device: str) -> dict:
  """name -> a callable running one generation on the torch twin (tokens, prefill s,
  decode s), one per SDPA backend of the decode step; they share the model and caches."""
  import torch
  from bench import torch_decoder as td

  twin = td.from_nnx(model_jax, dtype=torch_dtype(args.dtype), device=device)
  twin.setup_caches(shape.batch, shape.max_length, mark_static=args.compile and device == "cuda")
  if args.compile:
    td.configure_inductor(coordinate_descent=not args.no_coordinate_descent)
  prefill_fn = td.compiled(td.prefill, args.compile)
  tokens = torch.from_numpy(np.array(prompt)).long().to(device)
  sync = torch_sync(device)

  def runner(step_fn):
    def run():
      with torch.no_grad():
        out, prefill_s, decode_s = td.generate(prefill_fn, step_fn, twin, tokens, shape.steps,
                                               sync)
      return out.cpu().numpy(), prefill_s, decode_s
    return run

  return {f"torch_{name}": runner(td.compiled(td.STEPS[name], args.compile,
                                              mode="reduce-overhead"))
          for name in args.torch_sdpa}


# ---------------------------------------------------------------- the check

def check_equivalence(shape: Shape, device: str, seed: int = 0) -> dict:
  """The float32 model and its float32 torch twin on a short prompt (module docstring)."""
  import torch
  from flax import nnx
  from bench import torch_decoder as td
  from jattn.nn.generate import greedy_generate

  batch, n, new = min(shape.batch, 2), min(shape.prompt, 16), min(shape.new_tokens, 8)
  model = build_jax_model(shape, jnp.float32, jnp.float32, "xla", seed)
  twin = td.from_nnx(model, torch.float32, device)
  prompt = jax.random.randint(jax.random.PRNGKey(2), (batch, n), 0, shape.vocab, jnp.int32)
  tf32 = torch.backends.cuda.matmul.allow_tf32
  torch.backends.cuda.matmul.allow_tf32 = False
  try:
    with jax.default_matmul_precision("highest"):
      model.init_cache(batch, n + new, jnp.float32)
      tokens_jax = np.asarray(greedy_generate(model, prompt, new))
      sequence = jnp.concatenate([prompt, jnp.asarray(tokens_jax[:, :-1])], axis=1)
      model.init_cache(batch, n + new, jnp.float32)
      logits_jax = np.asarray(nnx.jit(lambda m, t: m(t, decode=True))(model, sequence))
    with torch.no_grad():
      twin.setup_caches(batch, n + new)
      seq = torch.from_numpy(np.array(sequence)).long().to(device)
      logits_torch = twin(seq, torch.arange(seq.shape[1], device=device)).cpu().numpy()
      twin.setup_caches(batch, n + new)
      tokens_torch = td.generate(td.prefill, td.decode_step, twin, seq[:, :n], new - 1,
                                 torch_sync(device))[0].cpu().numpy()
  finally:
    torch.backends.cuda.matmul.allow_tf32 = tf32
  diff, scale = float(np.abs(logits_jax - logits_torch).max()), float(np.abs(logits_jax).max())
  tolerance = 1e-4 * max(1.0, scale)
  same = bool((tokens_jax == tokens_torch).all())
  return {"batch": batch, "prompt": n, "new_tokens": new, "max_abs_logit": scale,
          "max_abs_diff": diff, "tolerance": tolerance, "tokens_equal": same,
          "pass": diff <= tolerance and same}


def agreement(reference, tokens) -> dict:
  """How far two greedy generations agree: equal fraction, first differing step per row."""
  equal = reference == tokens
  first = [int(np.argmin(row)) if not row.all() else None for row in equal]
  return {"equal_fraction": float(equal.mean()), "first_difference": first}


# ---------------------------------------------------------------- timing

def summarize(samples: dict, shape: Shape) -> dict:
  """Medians (ms) and decode tokens/s of one row's samples (seconds)."""
  out = dict(samples)
  if samples.get("decode_s"):
    decode = statistics.median(samples["decode_s"])
    whole = statistics.median(p + d for p, d in zip(samples["prefill_s"], samples["decode_s"]))
    out.update(prefill_ms=statistics.median(samples["prefill_s"]) * 1e3, decode_ms=decode * 1e3,
               tokens_per_s=shape.batch * shape.steps / decode,
               generate_tokens_per_s=shape.batch * shape.new_tokens / whole)
  return out


def judge(rows: dict) -> dict:
  """Each torch row's ratio and the bar against the fastest torch row."""
  ours = rows.get("jattn", {}).get("tokens_per_s")
  torch_rows = {k: r["tokens_per_s"] for k, r in rows.items()
                if k.startswith("torch") and r.get("tokens_per_s")}
  ratios = {k: ours / v for k, v in torch_rows.items()} if ours else {}
  if not ratios:
    return {"threshold": BAR, "ratios": ratios, "pass": None}
  best = max(torch_rows, key=torch_rows.get)
  return {"threshold": BAR, "ratios": ratios, "against": best, "ratio": ratios[best],
          "pass": ratios[best] >= BAR}


def run_rounds(runners: dict, args, shape: Shape, save) -> tuple[dict, dict]:
  """First calls, warm-up, then ``args.reps`` timed rounds (order alternating); returns
  the rows (samples and medians) and each row's last tokens. ``save(rows, tokens)``
  after the first calls and after every round."""
  rows, tokens = {}, {}
  for name, run in list(runners.items()):
    try:
      tokens[name], prefill_s, decode_s = run()
    except Exception as e:  # e.g. an SDPA backend that does not take this call
      rows[name] = {"error": one_line(e)}
      runners.pop(name)
      print(f"{name}: ERROR {rows[name]['error']}", flush=True)
      continue
    rows[name] = {"first_prefill_s": prefill_s, "first_decode_s": decode_s, "prefill_s": [],
                  "decode_s": []}
    print(f"{name}: first call: prefill {prefill_s:.1f} s, decode {decode_s:.1f} s "
          "(compile included)", flush=True)
  save(rows, tokens)
  for _ in range(args.warmup):
    for run in runners.values():
      run()
  for r in range(args.reps):
    order = list(runners) if r % 2 == 0 else list(reversed(runners))
    for name in order:
      tokens[name], prefill_s, decode_s = runners[name]()
      rows[name]["prefill_s"].append(prefill_s)
      rows[name]["decode_s"].append(decode_s)
    rows = {k: summarize(v, shape) for k, v in rows.items()}
    save(rows, tokens)
  return rows, tokens


# ---------------------------------------------------------------- output

def torch_info(device: str) -> dict:
  import torch
  info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
          "torch_device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
  if device == "cuda":  # on the CPU inductor never makes CUDA graphs
    try:
      from torch._dynamo.utils import counters
      info["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # not in this torch
      pass
  return info


def git_commit():
  """The checkout's short commit, ``+changes`` where tracked files differ from it (the
  device's copy of a working tree, say); None outside a git checkout."""
  git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True,
                                     cwd=os.path.dirname(os.path.abspath(__file__)),
                                     check=True).stdout.strip()
  try:
    commit = git("rev-parse", "--short", "HEAD")
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
  except Exception:  # not a git checkout
    return None


ROW_NOTES = {
    "jattn": "jattn.nn.generate: prefill + decode_steps (one lax.fori_loop)",
    "torch_math": "SDPA math backend in the decode step (gpt-fast), compiled + CUDA graphs",
    "torch_default": "SDPA, torch's own backend choice, compiled + CUDA graphs",
    "torch_efficient": "SDPA memory-efficient backend, compiled + CUDA graphs",
    "torch_cudnn": "SDPA cuDNN backend, compiled + CUDA graphs",
}


def _fmt(value, spec):
  return "" if value is None else format(value, spec)


def table(rows: dict, bar: dict, torch_mode: str) -> str:
  lines = ["| row | prefill ms | decode ms | decode tokens/s | jattn / row | prefill + decode "
           "tokens/s | first prefill s | first decode s | what |",
           "|---|---|---|---|---|---|---|---|---|"]
  for name, r in rows.items():
    what = ROW_NOTES.get(name, "")
    what = what.replace("compiled + CUDA graphs", torch_mode)
    if "error" in r:
      lines.append(f"| {name} | | | | | | | | ERROR {r['error']} |")
      continue
    lines.append(f"| {name} | {_fmt(r.get('prefill_ms'), '.2f')} | {_fmt(r.get('decode_ms'), '.2f')}"
                 f" | {_fmt(r.get('tokens_per_s'), '.0f')} | "
                 f"{_fmt(bar['ratios'].get(name), '.2f')} | "
                 f"{_fmt(r.get('generate_tokens_per_s'), '.0f')} | {r['first_prefill_s']:.1f} | "
                 f"{r['first_decode_s']:.1f} | {what} |")
  return "\n".join(lines) + "\n"


def markdown(result) -> str:
  env, shape, cfg, bar = result["env"], result["shape"], result["config"], result["bar"]
  torch_mode = ("eager" if not cfg["compile"] else "compiled + CUDA graphs"
                if env["torch_device"] != "cpu" else "compiled (no CUDA graphs on the CPU)")
  out = [f"# Generation (issue 39), {env['device']} (jax {env['jax']}, torch {env['torch']}, "
         f"{env['time']})", "",
         f"DecoderLM: vocab {shape['vocab']}, width {shape['width']}, {shape['layers']} layers, "
         f"{shape['heads']} heads / {shape['kv_heads']} KV heads; batch {shape['batch']}, "
         f"prompt {shape['prompt']}, {shape['new_tokens']} new tokens (the prefill's + "
         f"{shape['new_tokens'] - 1} decode steps), cache {shape['prompt'] + shape['new_tokens']}. "
         f"Compute {cfg['dtype']}, jattn parameters {cfg['param_dtype']} (torch weights "
         f"{cfg['dtype']}); jattn backend {cfg['backend']}; torch "
         f"{torch_mode}.",
         "", f"torch device {env['torch_device']} (CUDA {env['torch_cuda']}), Python "
         f"{env['python']}, jattn commit {env['jattn_commit']}.", "",
         f"Medians of {result['rounds']} rounds ({result['timing']}).", "",
         table(result["rows"], bar, torch_mode)]
  if bar["pass"] is None:
    out += ["Bar: no data.", ""]
  else:
    out += [f"**Bar: jattn decode tokens/s / {bar['against']} = {bar['ratio']:.2f} "
            f"(>= {bar['threshold']}: {'PASS' if bar['pass'] else 'FAIL'})**", ""]
  check = result.get("check")
  if check:
    out += [f"Check (float32, batch {check['batch']}, prompt {check['prompt']}, "
            f"{check['new_tokens']} tokens): max |logit diff| {check['max_abs_diff']:.2e} "
            f"(tolerance {check['tolerance']:.1e}), greedy tokens equal: "
            f"{check['tokens_equal']}: {'PASS' if check['pass'] else 'FAIL'}.", ""]
  for name, a in result["agreement"].items():
    out.append(f"- tokens of {name} equal to jattn's: {a['equal_fraction']:.1%} "
               f"(first difference per row: {a['first_difference']})")
  if env.get("cudagraph_skips"):
    out.append(f"- WARNING: inductor skipped CUDA graphs {env['cudagraph_skips']} time(s)")
  return "\n".join(out) + "\n"


# ---------------------------------------------------------------- main

def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="CPU, tiny float32 model")
  parser.add_argument("--check-only", action="store_true",
                      help="only the float32 equivalence check (CPU or GPU)")
  parser.add_argument("--skip-check", action="store_true")
  parser.add_argument("--kv-heads", type=int, default=None, help="default: the query heads")
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--prompt", type=int, default=None)
  parser.add_argument("--new-tokens", type=int, default=None)
  parser.add_argument("--dtype", choices=DTYPES, default=None,
                      help="compute (and cache, torch weight) dtype; default bfloat16, "
                           "float32 with --smoke")
  parser.add_argument("--param-dtype", choices=DTYPES, default="float32",
                      help="jattn parameter dtype (the docs model: float32)")
  parser.add_argument("--backend", default="auto", help="jattn attention backend")
  parser.add_argument("--torch-sdpa", default="math,default",
                      help="SDPA backends of the torch decode step, one row each "
                           "(math, default, efficient, cudnn)")
  parser.add_argument("--no-compile", dest="compile", action="store_false",
                      help="torch eager (no torch.compile, no CUDA graphs)")
  parser.add_argument("--no-coordinate-descent", action="store_true",
                      help="inductor without gpt-fast's coordinate-descent tuning")
  parser.add_argument("--reps", type=int, default=None, help="timed rounds (default 10)")
  parser.add_argument("--warmup", type=int, default=1, help="untimed rounds after the first")
  parser.add_argument("--label", default=None, help="output stem generate_<label>")
  parser.add_argument("--out", default=None, help="output folder (default bench/results)")
  args = parser.parse_args(argv)
  from bench.torch_decoder import STEPS
  args.torch_sdpa = [s for s in args.torch_sdpa.split(",") if s]
  bad = [s for s in args.torch_sdpa if s not in STEPS]
  if bad or not args.torch_sdpa:
    parser.error(f"--torch-sdpa: choose from {', '.join(STEPS)}")
  args.dtype = args.dtype or ("float32" if args.smoke else "bfloat16")
  args.reps = args.reps or (2 if args.smoke else 10)
  return args


def shape_for(args) -> Shape:
  base = SMOKE if args.smoke else FULL
  given = {"kv_heads": args.kv_heads, "batch": args.batch, "prompt": args.prompt,
           "new_tokens": args.new_tokens}
  shape = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
  if shape.heads % shape.kv_heads or shape.new_tokens < 2:
    sys.exit(f"generate.py: need kv_heads dividing {shape.heads} and new_tokens >= 2 ({shape})")
  return shape


def devices(args) -> str:
  """The torch device; exits where the run cannot happen."""
  import torch
  if args.smoke:
    os.environ.pop("JATTN_INTERPRET", None)  # jattn's XLA backend on the CPU, not interpret
    jax.config.update("jax_platforms", "cpu")
    return "cpu"
  jax_gpu = jax.devices()[0].platform == "gpu"
  if args.check_only:
    return "cuda" if jax_gpu and torch.cuda.is_available() else "cpu"
  if not (jax_gpu and torch.cuda.is_available()):
    sys.exit("generate.py: needs a GPU for JAX and torch; --smoke runs on the CPU")
  return "cuda"


def main(argv=None):
  args = parse_args(argv)
  shape = shape_for(args)
  device = devices(args)
  if args.check_only:
    check = check_equivalence(shape, device)
    print(check)
    sys.exit(0 if check["pass"] else 1)
  env = environment() | torch_info(device) | {"jattn_commit": git_commit()}
  label = args.label or ("smoke" if args.smoke else short_device_name(env["device"])
                         + (f"_kv{shape.kv_heads}" if shape.kv_heads != shape.heads else ""))
  out_dir = args.out or (os.path.join(tempfile.gettempdir(), "jattn_generate_smoke")
                         if args.smoke else os.path.join(os.path.dirname(__file__), "results"))
  check = None if args.skip_check else check_equivalence(shape, device)
  if check:
    print(f"check: {check}", flush=True)

  dtype, _ = DTYPES[args.dtype]
  model = build_jax_model(shape, dtype, DTYPES[args.param_dtype][0], args.backend)
  model.init_cache(shape.batch, shape.max_length, dtype)
  prompt = jax.random.randint(jax.random.PRNGKey(1), (shape.batch, shape.prompt), 0,
                              shape.vocab, jnp.int32)
  runners = {"jattn": lambda: jax_generate(model, prompt, shape.steps)}
  runners |= torch_runners(model, prompt, shape, args, device)

  result = {"env": env, "label": label, "args": vars(args), "shape": dataclasses.asdict(shape),
            "config": {"dtype": args.dtype, "param_dtype": args.param_dtype,
                       "backend": args.backend, "compile": args.compile,
                       "coordinate_descent": args.compile and not args.no_coordinate_descent,
                       "torch_sdpa": args.torch_sdpa},
            "timing": (f"after the first calls and {args.warmup} warm-up round(s); host wall "
                       "clock between device syncs; rows in alternating order"),
            "check": check}

  def save(rows, tokens):
    result["env"] |= torch_info(device)  # the CUDA-graph skips so far
    result.update(rows=rows, rounds=max([len(r.get("decode_s", [])) for r in rows.values()],
                                        default=0),
                  bar=judge(rows), agreement={k: agreement(tokens["jattn"], t)
                                              for k, t in tokens.items()
                                              if k != "jattn" and "jattn" in tokens})
    write_results(out_dir, f"generate_{label}", result, markdown(result))

  run_rounds(runners, args, shape, save)
  print(markdown(result))
  print(f"wrote {os.path.join(out_dir, f'generate_{label}')}.json and .md")
  if args.smoke:  # bfloat16 (--dtype) may round the two sides apart: then only reported
    same = all(a["equal_fraction"] == 1.0 for a in result["agreement"].values())
    ok = (same or args.dtype != "float32") and (check is None or check["pass"])
    print(f"smoke: {'OK' if ok else 'FAILED'} (tokens equal: {same}, check: "
          f"{None if check is None else check['pass']})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
