"""The `serve` subcommand's arguments (light: mlx_lm.server loads when the command runs)."""


def add_serve_args(p) -> None:
    p.add_argument("recipe", help="recipe file or built-in name")
    p.add_argument("--model", help="mlx-lm model folder (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a recipe parameter (repeatable)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--max-tokens", type=int, help="default completion length (mlx_lm.server's --max-tokens)")
    p.add_argument("--temp", type=float, help="default sampling temperature (mlx_lm.server's --temp)")
    p.add_argument("--prefill-step-size", type=int, help="prompt tokens per prefill step")
    p.add_argument("--prompt-cache-size", type=int, help="prefix caches kept for reuse (LRU)")
    p.add_argument("--chat-template", help="a chat template to use instead of the tokenizer's")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def cmd_serve(args) -> int:
    from .server import serve

    return serve(args)
