"""The command-line tools as a user runs them: the installed entry points in a
subprocess. Every mistake exits with status 2 and one line naming the option or file,
before the model loads where it can be known then, and leaves no output behind; the
working runs write what they say, grey and alpha images kept as such."""

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

from conftest import ON_GPU  # noqa: E402
from jattn.command_line import UsageError, atomic_folder, atomic_output  # noqa: E402
from jattn.interop.cli import convert_main  # noqa: E402
from jattn.interop.dat_torch import dat_torch  # noqa: E402
from jattn.nn import DATConfig  # noqa: E402

TINY = DATConfig(embed_dim=32, depth=(2,), num_heads=(2,), split_size=(4, 8), upscale=2)


def tool(name: str) -> str:
  """The installed entry point ``name`` (beside this Python, else on PATH)."""
  found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
  if found is None:
    pytest.fail(f"{name} is not installed: pip install -e . (the README's install) adds it")
  return found


def run(*argv, cwd=None, shell_prefix=None, without=()):
  """``argv`` with its first item an installed tool; ``shell_prefix``: sh commands first
  (``ulimit ...``); ``without``: modules the tool cannot import, as in an install that
  lacks them (the light one)."""
  env = {k: v for k, v in os.environ.items() if k != "JATTN_INTERPRET"}
  command = [tool(argv[0]), *argv[1:]]
  if shell_prefix:
    command = ["sh", "-c", f'{shell_prefix}; exec "$0" "$@"', *command]
  with tempfile.TemporaryDirectory() as site:
    if without:  # a sitecustomize, first on the path, that makes importing them fail
      with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(f"import sys\nsys.modules.update(dict.fromkeys({list(without)!r}))\n")
      env["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """A tiny DAT checkpoint, broken ones, and images of several kinds."""
  d = tmp_path_factory.mktemp("cli")
  torch.save(dat_torch(TINY, img_size=16, seed=7).state_dict(), d / "tiny.pth")
  data = (d / "tiny.pth").read_bytes()
  (d / "truncated.pth").write_bytes(data[: len(data) // 2])
  with zipfile.ZipFile(d / "tiny.pth") as src, zipfile.ZipFile(d / "corrupt.pth", "w") as dst:
    for item in src.infolist():  # a valid archive whose pickle is garbage
      body = src.read(item)
      dst.writestr(item, b"\x80\x02garbage" if item.filename.endswith("data.pkl") else body)
  torch.save({"model": torch.nn.Linear(2, 2)}, d / "pickled.pth")  # a module, not weights
  state = torch.load(d / "tiny.pth")
  torch.save({"encoder.weight": torch.ones(3, 3)}, d / "other.pth")
  (d / "notes.txt").write_text("not a checkpoint\n")
  torch.save({**state, "conv_first.weight": torch.tensor(1.0)}, d / "scalar.pth")
  os.mkfifo(d / "fifo.pth")  # reading it would block forever
  (d / "listed").mkdir()  # a converted folder whose config.json is not jattn-convert's
  (d / "listed/config.json").write_text("[1, 2]")
  (d / "listed/params.safetensors").write_bytes(b"")
  rng = np.random.default_rng(0)
  (d / "in").mkdir()
  Image.fromarray((rng.uniform(size=(20, 27, 3)) * 255).astype(np.uint8)).save(d / "in/rgb.png")
  (d / "clash").mkdir()  # both would be written to a.png
  for name in ("a.png", "a.jpg"):
    Image.fromarray((rng.uniform(size=(9, 9, 3)) * 255).astype(np.uint8)).save(d / "clash" / name)
  chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data
                              + struct.pack(">I", zlib.crc32(kind + data)))
  (d / "short.png").write_bytes(  # a valid header and checksums, too few pixels
      b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20, 20, 8, 2, 0, 0, 0))
      + chunk(b"IDAT", zlib.compress(b"\0" * 10)) + chunk(b"IEND", b""))
  (d / "huge.png").write_bytes(  # 12000 x 12000 1-bit: 18 KB that decode to 144 Mpixels
      b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 12000, 12000, 1, 0, 0, 0, 0))
      + chunk(b"IDAT", zlib.compress(bytes(12000 * 1501), 9)) + chunk(b"IEND", b""))
  shutil.copy(d / "tiny.pth", d / "model.png")  # a checkpoint under an image's name
  from safetensors.torch import save_file

  save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()},
            d / "bf16.safetensors")
  (d / "held").mkdir()  # a checkpoint named as jattn-convert's output, inside its out_dir
  shutil.copy(d / "bf16.safetensors", d / "held/params.safetensors")
  Image.fromarray((rng.uniform(size=(17, 19)) * 255).astype(np.uint8)).save(d / "in/grey.png")
  Image.fromarray((rng.uniform(size=(18, 16, 4)) * 255).astype(np.uint8), "RGBA").save(
      d / "in/rgba.png")
  return d


def _one_line_error(done, *needles):
  assert done.returncode == 2, done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1, done.stderr
  assert "Traceback" not in done.stderr and "weights_only=False" not in done.stderr
  for needle in needles:
    assert needle in lines[0], lines[0]


MISTAKES = {
    "missing checkpoint": (["--model", "{d}/nope.pth", "{d}/in/rgb.png", "{out}/o.png"],
                           ["nope.pth", "no such file"]),
    "text file as checkpoint": (["--model", "{d}/notes.txt", "{d}/in/rgb.png", "{out}/o.png"],
                                ["notes.txt", "is not a checkpoint"]),
    "truncated checkpoint": (["--model", "{d}/truncated.pth", "{d}/in/rgb.png", "{out}/o.png"],
                             ["truncated.pth", "truncated or corrupt"]),
    "corrupt checkpoint": (["--model", "{d}/corrupt.pth", "{d}/in/rgb.png", "{out}/o.png"],
                           ["corrupt.pth", "truncated or corrupt"]),
    "pickled objects": (["--model", "{d}/pickled.pth", "{d}/in/rgb.png", "{out}/o.png"],
                        ["pickled.pth", "Python objects besides tensors"]),
    "another model": (["--model", "{d}/other.pth", "{d}/in/rgb.png", "{out}/o.png"],
                      ["other.pth", "not a DAT checkpoint", "encoder.weight"]),
    "text file as image": (["--model", "{d}/tiny.pth", "{d}/notes.txt", "{out}/o.png"],
                           ["notes.txt", "not an image"]),
    "missing image": (["--model", "{d}/tiny.pth", "{d}/nope.png", "{out}/o.png"],
                      ["nope.png", "no such file"]),
    "tile 0": (["--model", "{d}/tiny.pth", "--tile", "0", "{d}/in/rgb.png", "{out}/o.png"],
               ["--tile", ">= 1"]),
    "tile below 8": (["--model", "{d}/tiny.pth", "--tile", "4", "--overlap", "2",
                      "{d}/in/rgb.png", "{out}/o.png"], ["--tile must be at least 8"]),
    "negative overlap": (["--model", "{d}/tiny.pth", "--overlap", "-4", "{d}/in/rgb.png",
                          "{out}/o.png"], ["--overlap", ">= 0"]),
    "overlap over tile": (["--model", "{d}/tiny.pth", "--tile", "16", "--overlap", "16",
                           "{d}/in/rgb.png", "{out}/o.png"], ["--overlap (16) must be smaller"]),
    "unknown output format": (["--model", "{d}/tiny.pth", "{d}/in/rgb.png", "{out}/o.xyz"],
                              ["o.xyz", "unknown image suffix '.xyz'"]),
    "alpha into jpeg": (["--model", "{d}/tiny.pth", "{d}/in/rgba.png", "{out}/o.jpg"],
                        ["o.jpg", "stores no alpha channel"]),
    "bad precision": (["--model", "{d}/tiny.pth", "--precision", "fp8", "{d}/in/rgb.png",
                       "{out}/o.png"], ["--precision", "invalid choice: 'fp8'"]),
    "image without its pixels": (["--model", "{d}/tiny.pth", "{d}/short.png", "{out}/o.png"],
                                 ["short.png", "not an image that can be read"]),
    "pipe as checkpoint": (["--model", "{d}/fifo.pth", "{d}/in/rgb.png", "{out}/o.png"],
                           ["fifo.pth", "not a regular file"]),
    "foreign converted folder": (["--model", "{d}/listed", "{d}/in/rgb.png", "{out}/o.png"],
                                 ["listed", "config.json is not what jattn-convert writes"]),
    "two inputs one output": (["--model", "{d}/tiny.pth", "{d}/clash", "{out}"],
                              ["'a.jpg' and 'a.png' would both be written to 'a.png'"]),
    "output is the input": (["--model", "{d}/tiny.pth", "{d}/in/rgb.png", "{d}/in/rgb.png"],
                            ["rgb.png", "is the input"]),
    "output under a file": (["--model", "{d}/tiny.pth", "{d}/in", "{d}/notes.txt/out"],
                            ["notes.txt", "is not a folder"]),
    "image beyond the pixel limit": (["--model", "{d}/tiny.pth", "{d}/huge.png", "{out}/o.png"],
                                     ["huge.png", "12000x12000 = 144,000,000 pixels, more than "
                                      "the limit of 16,777,216 (--max-pixels raises it)"]),
    "image beyond --max-pixels": (["--model", "{d}/tiny.pth", "--max-pixels", "539",
                                   "{d}/in/rgb.png", "{out}/o.png"],
                                  ["rgb.png", "27x20 = 540 pixels, more than the limit of 539"]),
    "output is the model": (["--model", "{d}/model.png", "{d}/in/rgb.png", "{d}/model.png"],
                            ["model.png", "is a file of --model"]),
}


@pytest.mark.parametrize("argv,needles", MISTAKES.values(), ids=MISTAKES)
def test_upscale_mistakes_exit_2_with_one_line_and_write_nothing(files, tmp_path, argv, needles):
  out = tmp_path / "out"
  done = run("jattn-upscale", *(a.format(d=files, out=out) for a in argv))
  _one_line_error(done, *needles)
  assert not out.exists()


@pytest.mark.parametrize("argv,needles", [
    (["check", "--dtypes", "float64"], ["--dtypes: 'float64' is not one of"]),
    (["check", "--reps", "0"], ["--reps", ">= 1"]),
    (["check", "--backends", "cudnn"], ["--backends: cudnn is not usable here"]),
    (["check", "--ops", "flash"], ["--ops: 'flash' is not one of"]),
    (["convert", "dat", "{d}/notes.txt", "{out}"], ["notes.txt", "is not a checkpoint"]),
    (["convert", "dat", "{d}/other.pth", "{out}"], ["other.pth", "not a DAT checkpoint"]),
    (["convert", "dat", "{d}/scalar.pth", "{out}"],
     ["scalar.pth", "'conv_first.weight' has shape (), expected 4"]),
    (["convert", "dat", "{d}/tiny.pth", "{out}", "--img-range", "nan"],
     ["--img-range", "finite number > 0"]),
    (["convert", "dat", "{d}/tiny.pth", "{out}", "--num-heads", "2"],
     ["--num-heads applies to retnet checkpoints, not dat"]),
    (["convert", "dat", "{d}/tiny.pth", "{d}/notes.txt/sub"], ["notes.txt", "is not a folder"]),
    (["check", "--ops", ""], ["--ops", "expected a comma-separated list"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    (["convert", "dat", "{d}/held/params.safetensors", "{d}/held"],
     ["writing '{d}/held/params.safetensors' would replace the checkpoint being converted"]),
    (["convert", "dat", "{d}/tiny.pth", "{d}/in"],
     ["out_dir '{d}/in' is not empty", "or --overwrite"]),
], ids=["dtype", "reps", "backend", "op", "convert-text", "convert-other-model",
        "convert-malformed", "convert-img-range", "convert-other-option", "convert-out-dir",
        "empty-ops", "command", "convert-onto-its-input", "convert-into-files"])
def test_jattn_mistakes_exit_2_with_one_line(files, tmp_path, argv, needles):
  if "cudnn" in argv and ON_GPU:
    pytest.skip("cudnn is usable on this machine")
  out = tmp_path / "out"
  held = (files / "held/params.safetensors").read_bytes()
  done = run("jattn", *(a.format(d=files, out=out) for a in argv))
  _one_line_error(done, *(n.format(d=files) for n in needles))
  assert not out.exists()
  assert (files / "held/params.safetensors").read_bytes() == held
  assert sorted(os.listdir(files / "in")) == ["grey.png", "rgb.png", "rgba.png"]


def test_verbose_shows_the_traceback(files, tmp_path):
  done = run("jattn-upscale", "--verbose", "--model", str(files / "notes.txt"),
             str(files / "in/rgb.png"), str(tmp_path / "o.png"))
  assert done.returncode == 2 and "Traceback" in done.stderr
  assert done.stderr.strip().splitlines()[-1].startswith("jattn-upscale: error: ")


def test_help_shows_every_default():
  done = run("jattn-upscale", "--help")
  assert done.returncode == 0
  text = " ".join(done.stdout.split())  # argparse wraps lines
  for default in ("(default: 256)", "(default: 16)", "(default: fp32)"):
    assert default in text
  assert "``" not in text and "(default: None)" not in text
  assert "upscale" in run("jattn", "--help").stdout


def test_without_an_extra_the_tool_says_which_to_install(files, tmp_path):
  done = run("jattn-upscale", "--model", str(files / "tiny.pth"), str(files / "in/rgb.png"),
             str(tmp_path / "o.png"), without=("PIL",))
  _one_line_error(done, "this needs PIL, which jattn's 'image' extra installs")


def test_convert_then_upscale_keeps_grey_and_alpha(files, tmp_path):
  conv = tmp_path / "conv"  # relative names, as typed
  # A bfloat16 .safetensors checkpoint, converted by an install without torch,
  # safetensors or pillow (the light one): jattn-convert needs none of them.
  done = run("jattn-convert", "dat", str(files / "bf16.safetensors"), "conv", cwd=tmp_path,
             without=("torch", "safetensors", "PIL"))
  assert done.returncode == 0, done.stderr
  assert sorted(os.listdir(conv)) == ["config.json", "params.safetensors"]
  out = tmp_path / "out"
  done = run("jattn", "upscale", "--model", "conv", "--tile", "16", "--overlap", "4",
             str(files / "in"), "out", cwd=tmp_path)
  assert done.returncode == 0, done.stderr
  assert sorted(os.listdir(out)) == ["grey.png", "rgb.png", "rgba.png"]
  expected = {"rgb.png": ("RGB", (54, 40)), "grey.png": ("L", (38, 34)),
              "rgba.png": ("RGBA", (32, 36))}
  for name, (mode, size) in expected.items():
    with Image.open(out / name) as img:
      assert (img.mode, img.size) == (mode, size), name
  with Image.open(out / "rgba.png") as img, Image.open(files / "in/rgba.png") as src:
    # the alpha channel is the input's, upscaled
    alpha = np.asarray(img)[:, :, 3].astype(np.float32)
    small = np.asarray(src)[:, :, 3].astype(np.float32)
    assert abs(alpha.mean() - small.mean()) < 8


def test_overwrite_replaces_the_converted_files_and_keeps_the_rest(files, tmp_path, capsys):
  out = tmp_path / "conv"
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  (out / "config.json").write_text("an old one")
  assert convert_main(["dat", str(files / "tiny.pth"), str(out), "--overwrite"]) == 0, \
      capsys.readouterr().err
  assert sorted(os.listdir(out)) == ["config.json", "notes.txt", "params.safetensors"]
  assert json.loads((out / "config.json").read_text())["model"] == "DAT"
  assert (out / "notes.txt").read_text() == "mine"


def test_a_write_that_fails_says_so_in_one_line_and_leaves_nothing(files, tmp_path):
  """A full disk, as a file-size limit below the converted weights' size."""
  done = run("jattn-convert", "dat", str(files / "tiny.pth"), str(tmp_path / "conv"),
             shell_prefix="ulimit -f 100")  # at most 100 blocks of 512 or 1024 bytes
  _one_line_error(done, "cannot write", "conv", "File too large")
  assert os.listdir(tmp_path) == []


def test_upscale_a_file_from_a_pth_checkpoint(files, tmp_path):
  done = run("jattn-upscale", "--model", str(files / "tiny.pth"), "--precision", "bf16",
             "--max-pixels", "540", str(files / "in/rgb.png"), str(tmp_path / "new/x2.webp"))
  assert done.returncode == 0, done.stderr
  with Image.open(tmp_path / "new/x2.webp") as img:
    assert img.size == (54, 40)
  assert os.listdir(tmp_path / "new") == ["x2.webp"]  # no temporary file left


def test_jattn_check_runs_the_ops_asked_for_and_the_model_rows():
  done = run("jattn", "check", "--ops", "retention_step,LlamaForCausalLM", "--backends", "xla",
             "--reps", "1")
  assert done.returncode == 0, done.stderr
  assert "4/4 checks within tolerance" in done.stdout  # one op, three model families
  models = [line.split()[1] for line in done.stdout.splitlines()
            if line.startswith("LlamaForCausalLM ") and line.endswith("ok")]
  assert models == ["llama", "qwen2", "mistral"]
  assert "FAIL" not in done.stdout and "flash_attention" not in done.stdout


def test_outputs_appear_only_when_complete(tmp_path):
  target = tmp_path / "a" / "b" / "out.png"
  with pytest.raises(RuntimeError):
    with atomic_output(str(target)) as tmp:
      open(tmp, "w").write("half")
      raise RuntimeError("failed while writing")
  assert not (tmp_path / "a").exists()  # nor the folders made for it
  with atomic_output(str(target)) as tmp:
    open(tmp, "w").write("whole")
  assert target.read_text() == "whole" and os.listdir(target.parent) == ["out.png"]
  umask = os.umask(0o022)
  os.umask(umask)
  assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # the umask's, not mkstemp's 0600
  folder = tmp_path / "conv"
  with pytest.raises(RuntimeError):
    with atomic_folder(str(folder)) as tmp:
      open(os.path.join(tmp, "params"), "w").write("half")
      raise RuntimeError
  assert os.listdir(tmp_path) == ["a"]
  (folder / "config").mkdir(parents=True)  # in the way of one of the files
  with pytest.raises(UsageError, match="holds a folder named 'config'"):
    with atomic_folder(str(folder)) as tmp:
      for name in ("params", "config"):
        open(os.path.join(tmp, name), "w").write("whole")
  assert os.listdir(folder) == ["config"] and sorted(os.listdir(tmp_path)) == ["a", "conv"]
