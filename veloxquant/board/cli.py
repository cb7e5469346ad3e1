"""`veloxquant leaderboard`, `recommend` and `report`: argument parsing and the commands."""

import shlex
import sys
from pathlib import Path

PROTOCOL_NAMES = ("cpu", "standard", "gpu")  # board/protocol.py's PROTOCOLS (kept light: no MLX for --help)


def add_leaderboard_args(p) -> None:
    p.add_argument("--model", help="mlx-lm model folder or alias such as 'gemma3' (default: SmolLM2-135M-Instruct)")
    p.add_argument("--corpus", default="austen", help="'austen', 'austen:emma' or a text file (default: austen)")
    p.add_argument(
        "--protocol",
        default="cpu",
        choices=PROTOCOL_NAMES,
        help="cpu: 1 window of 640+128 tokens, one 512-token passkey prompt (a minute or two a row on "
        "a share of 2 CPU cores with SmolLM2); standard: eval's defaults (4 windows of 1536+256, "
        "passkey 1k/2k); gpu: the GPU tables' 4k protocol (4 windows of 3840+256, passkey 4k/8k)",
    )
    p.add_argument(
        "--out",
        metavar="JSON",
        help="the leaderboard file, resumed if it exists (default: results/leaderboard-MODEL-PROTOCOL.json)",
    )
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
    board = run(
        model,
        tokenizer,
        name,
        text,
        args.corpus,
        args.protocol,
        out,
        only,
        args.limit,
        command or f"veloxquant leaderboard --protocol {args.protocol}",
        progress=not args.no_progress,
    )
    state = "partial" if board["partial"] else "complete"
    print(f"wrote {out}: {len(board['rows'])} rows ({state})", file=sys.stderr)
    return 0


def add_report_args(p) -> None:
    p.add_argument("results", nargs="+", metavar="RESULTS.json", help="leaderboard or `eval --json` files")
    p.add_argument("-o", "--output", metavar="report.html", help="write the self-contained HTML page here")
    p.add_argument(
        "--choosing",
        metavar="OUT.md",
        help="write the recipe-choosing tables (docs/choosing.md) from leaderboard files",
    )


def cmd_report(args) -> int:
    from ..errors import VeloxError
    from . import choosing, html

    if not args.output and not args.choosing:
        raise VeloxError("report: give -o report.html, --choosing OUT.md or both")
    if args.output:
        Path(args.output).write_text(html.render(html.load(args.results), args.results))
        print(f"wrote {args.output}", file=sys.stderr)
    if args.choosing:
        Path(args.choosing).write_text(choosing.render(choosing.load(args.results)))
        print(f"wrote {args.choosing}", file=sys.stderr)
    return 0


def add_recommend_args(p) -> None:
    p.add_argument("--model", help="mlx-lm model folder or alias whose shape to use (default: SmolLM2-135M)")
    p.add_argument(
        "--shape",
        metavar="LxHxD",
        help="a uniform shape instead of a model: layers x kv heads x head_dim, e.g. 32x8x128 for Llama-3-8B",
    )
    p.add_argument("--context", type=int, required=True, help="tokens the cache must hold")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--memory", help="KV-cache memory to fit in, e.g. 1GB, 512MiB")
    g.add_argument("--ratio", type=float, help="fraction of the fp16 cache's bytes to fit in, e.g. 0.25")
    p.add_argument("--max-dppl", type=float, metavar="P", help="only recipes measured at ≤ P %% perplexity increase")
    p.add_argument(
        "--board", action="append", metavar="JSON", help="leaderboard files (default: results/leaderboard-*.json)"
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="run the recommended recipe on the model over --context tokens of --corpus and compare the bytes "
        "its caches hold with the prediction (exit 1 if more than 2%% off)",
    )
    p.add_argument("--corpus", default="austen", help="text for --check (default: austen)")


def cmd_recommend(args) -> int:
    from ..compiler import SMOLLM2_135M, ModelShape
    from ..data import load_text
    from ..errors import VeloxError
    from ..models import load_model
    from . import choosing
    from .recommend import check, parse_shape, parse_size, recommend, render, render_check

    if args.check and args.shape:
        raise VeloxError("--check runs the recipe on a model: give --model (or neither), not --shape")
    paths = args.board or sorted(str(p) for p in Path("results").glob("leaderboard-*.json"))
    if not paths:
        raise VeloxError("no leaderboard files: run `veloxquant leaderboard` or pass --board JSON")
    if args.shape:
        shape = parse_shape(args.shape)
    elif args.model:
        shape = ModelShape.from_model(load_model(args.model, lazy=True)[0], Path(args.model).name)
    else:
        shape = SMOLLM2_135M
    name = Path(args.model).name if args.model else (None if args.shape else "SmolLM2-135M-Instruct")
    answer = recommend(
        choosing.load(paths),
        shape,
        args.context,
        parse_size(args.memory) if args.memory else None,
        args.ratio,
        args.max_dppl,
        name,
    )
    print(render(answer, args.model), end="")
    if not answer["choice"]:
        return 1
    if args.check:
        model, tokenizer = load_model(args.model)
        got = check(model, tokenizer, load_text(args.corpus), answer)
        print(render_check(got, answer), end="")
        return 0 if got["within"] else 1
    return 0
