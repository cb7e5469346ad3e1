"""`veloxquant leaderboard`, `recommend` and `report`: argument parsing and the commands."""
import shlex
import sys
from pathlib import Path

PROTOCOL_NAMES = ("cpu", "standard")  # board/protocol.py's PROTOCOLS (kept light: no MLX for --help)


def add_leaderboard_args(p) -> None:
    p.add_argument("--model", help="mlx-lm model folder or alias such as 'gemma3' (default: SmolLM2-135M-Instruct)")
    p.add_argument("--corpus", default="austen", help="'austen', 'austen:emma' or a text file (default: austen)")
    p.add_argument("--protocol", default="cpu", choices=PROTOCOL_NAMES,
                   help="cpu: 2 windows of 1024+128 tokens, one 1k passkey prompt (about a minute a row on 2 "
                   "CPU cores with SmolLM2); standard: eval's defaults (4 windows of 1536+256, passkey 1k/2k)")
    p.add_argument("--out", metavar="JSON", help="the leaderboard file, resumed if it exists "
                   "(default: results/leaderboard-MODEL-PROTOCOL.json)")
    p.add_argument("--only", metavar="NAMES", help="comma-separated built-ins to measure (default: all)")
    p.add_argument("--limit", type=int, help="measure at most this many new rows, then stop")
    p.add_argument("--no-progress", action="store_true", help="no per-row progress lines on stderr")


def cmd_leaderboard(args) -> int:
    from ..data import load_text
    from ..models import load_model
    from .leaderboard import default_path, run
    name = args.model or "SmolLM2-135M-Instruct"
    name = Path(name).name if Path(name).exists() else name
    out = Path(args.out) if args.out else default_path(name, args.protocol)
    text = load_text(args.corpus)
    model, tokenizer = load_model(args.model)
    command = " ".join(["veloxquant", *map(shlex.quote, sys.argv[1:])]) if "leaderboard" in sys.argv[1:2] else ""
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else []
    board = run(model, tokenizer, name, text, args.corpus, args.protocol, out, only, args.limit,
                command or f"veloxquant leaderboard --protocol {args.protocol}", progress=not args.no_progress)
    state = "partial" if board["partial"] else "complete"
    print(f"wrote {out}: {len(board['rows'])} rows ({state})", file=sys.stderr)
    return 0
