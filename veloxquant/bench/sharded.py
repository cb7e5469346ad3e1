"""A random-init tiny Llama sharded over ranks (mlx.launch, ring backend on loopback) against unsharded.

    veloxquant bench sharded --ranks 2 [--json OUT] [RECIPE ...]

Launches `--ranks` processes (veloxquant/bench/sharded_rank.py), then loads rank 0's saved cache in this
one-process world (refused) and prints a table: max |logit diff| sharded vs unsharded, save/load
continuation diff, and what loading another rank's file said.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import VeloxError
from ..runtime.persist import load_prompt_cache
from .registry import bench


def launcher() -> str:
    here = Path(sys.executable).parent / "mlx.launch"
    found = str(here) if here.exists() else shutil.which("mlx.launch")
    if not found:
        raise VeloxError("mlx.launch not found (it comes with mlx: pip install mlx)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks: int, out: Path, where: Path, recipes, timeout: float = 120) -> dict:
    cmd = [
        launcher(),
        "--backend",
        "ring",
        "-n",
        str(ranks),
        "--starting-port",
        str(free_port()),
        "--env",
        f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}",
        sys.executable,
        "-m",
        "veloxquant.bench.sharded_rank",
        str(out),
        str(where),
        *recipes,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode or not out.exists():
        raise VeloxError(f"{' '.join(cmd)} failed (exit {done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(out.read_text())


def refused_here(where: Path, recipe: str) -> str:
    """Loading rank 0's file in this process (world size 1): the error it gives."""
    try:
        load_prompt_cache(str(where / f"{recipe.split('[')[0]}.rank0.safetensors"))
        return "loaded (not refused)"
    except VeloxError as e:
        return str(e)


@bench("sharded", "a tiny Llama sharded over ranks with mlx.launch: recipes' logits against unsharded, save/load")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="veloxquant bench sharded", description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="*")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--json", help="write the measured rows here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        got = launch(args.ranks, Path(tmp) / "out.json", Path(tmp), args.recipes)
        got["wall_s"] = time.perf_counter() - started
        for row in got["rows"]:
            if "other_rank" in row:
                row["world_1"] = refused_here(Path(tmp), row["recipe"])
    print(
        f"{got['world']} ranks, Llama {got['shape']}, prompt {got['prompt']} + decode {got['decode']} "
        f"(wall {got['wall_s']:.1f} s)\n"
    )
    print("| recipe | max abs logit diff vs unsharded | head budgets equal | save/load continuation diff | s |")
    print("|---|---|---|---|---|")
    for r in got["rows"]:
        print(
            f"| {r['recipe']} | {r['max_diff']:.3g} | {r.get('budgets_equal', '–')} | "
            f"{r.get('reload_diff', '–')} | {r['seconds']:.2f} |"
        )
    for r in got["rows"][1:2]:
        print(f"\nanother rank's file: {r['other_rank']}\nin a 1-process world: {r['world_1']}")
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
