"""Compare a re-run of a benchmark with its stored results, row by row.

    python bench/compare.py --stem recheck bench/results/window.json new/window.json \
        bench/results/dilated.json new/dilated.json

Takes (stored, new) pairs of result files written by the benches (rows with ``impl``,
``shape``, ``dtype``, ``mode``, optional ``causal``, and ``ms``). For every row present
in both, ``speed = stored ms / new ms`` (> 1: the re-run is faster). Machines drift
between sessions, so each line also gives the median speed of the peers (the impls not
named ``jattn*``) at the same shape, dtype and mode: a jattn change well beyond that
drift is the code's, not the machine's. Writes ``<stem>.json`` and ``<stem>.md`` under
--out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import write_results  # noqa: E402


def _key(row):
  return (row["impl"], tuple(row["shape"]), row["dtype"], row.get("causal"), row["mode"])


def compare(stored: dict, new: dict, source: str) -> list[dict]:
  """One line per jattn row timed in both runs, with the peers' median drift."""
  old = {_key(r): r["ms"] for r in stored["rows"] if r.get("ms")}
  now = {_key(r): r["ms"] for r in new["rows"] if r.get("ms")}
  speed = {k: old[k] / now[k] for k in old.keys() & now.keys()}
  lines = []
  for key in sorted(speed, key=lambda k: (k[1:], k[0])):
    impl, shape, dtype, causal, mode = key
    if not impl.startswith("jattn"):
      continue
    peers = [s for k, s in speed.items() if k[1:] == key[1:] and not k[0].startswith("jattn")]
    lines.append({"bench": source, "impl": impl, "shape": list(shape), "dtype": dtype,
                  "causal": causal, "mode": mode, "stored_ms": old[key], "new_ms": now[key],
                  "speed": speed[key], "peer_drift": statistics.median(peers) if peers else None})
  return lines


def markdown(lines, title):
  head = ("| bench | impl | shape | dtype | causal | mode | stored ms | new ms | speed | "
          "peers' drift |\n|---|---|---|---|---|---|---|---|---|---|\n")
  body = "".join(
      f"| {l['bench']} | {l['impl']} | {','.join(map(str, l['shape']))} | {l['dtype']} | "
      f"{'' if l['causal'] is None else ('yes' if l['causal'] else 'no')} | {l['mode']} | "
      f"{l['stored_ms']:.3f} | {l['new_ms']:.3f} | {l['speed']:.2f}x | "
      f"{'' if l['peer_drift'] is None else format(l['peer_drift'], '.2f') + 'x'} |\n"
      for l in lines)
  speeds = sorted(l["speed"] for l in lines)
  summary = (f"\n{len(lines)} jattn rows; speed (stored ms / new ms, > 1: faster now) median "
             f"{statistics.median(speeds):.3f}x, range {speeds[0]:.2f}x-{speeds[-1]:.2f}x; "
             f"{sum(s < 0.97 for s in speeds)} rows more than 3% slower.\n" if speeds else "")
  return f"# {title}\n\n{head}{body}{summary}"


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("files", nargs="+", metavar="JSON", help="stored, new, stored, new, ...")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--stem", default="recheck")
  parser.add_argument("--title", default="Re-run against the stored results")
  args = parser.parse_args()
  if len(args.files) % 2:
    parser.error("give the files in (stored, new) pairs")
  lines, envs = [], []
  for stored_path, new_path in zip(args.files[::2], args.files[1::2]):
    with open(stored_path) as f:
      stored = json.load(f)
    with open(new_path) as f:
      new = json.load(f)
    name = os.path.splitext(os.path.basename(stored_path))[0]
    lines += compare(stored, new, name)
    envs.append({"bench": name, "stored": stored.get("env"), "new": new.get("env")})
  md = markdown(lines, args.title)
  write_results(args.out, args.stem, {"runs": envs, "rows": lines}, md)
  print(md)


if __name__ == "__main__":
  main()
