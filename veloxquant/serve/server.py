"""`veloxquant serve`: mlx-lm's OpenAI-compatible server (mlx_lm.server) running a recipe's caches.

mlx-lm's server builds each sequence's cache with mlx_lm.models.cache.make_prompt_cache(model), which defers
to `model.make_cache()`: once the model is loaded, the provider below compiles the recipe for it and points
that method at the recipe's caches. Everything else (HTTP, chat templates, streaming, LRUPromptCache prefix
reuse, continuous batching) is mlx-lm's own. The server batches when the recipe's plan declares it can
(compiler/batching.py: fp16 today); any other recipe is served one sequence at a time, and the log and the
status endpoint give the reason.
"""

import argparse
import json
import logging

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, _run_http_server

from ..compiler.batching import refusal as batch_refusal
from ..models import load_model
from ..models.default import default_model_path
from ..recipe import load_recipe
from ..run import cache_report
from ..runtime import hook, plan_for
from ..runtime.make import prompt_caches

STATUS_PATH = "/v1/veloxquant/status"
# Request fields that would ask for another recipe: refused (the recipe is fixed when the server starts).
RECIPE_FIELDS = ("recipe", "sets", "veloxquant")

log = logging.getLogger("veloxquant.serve")


def server_args(model: str, **overrides) -> argparse.Namespace:
    """mlx_lm.server's command-line namespace with its defaults (mlx-lm 0.32.2), `overrides` applied."""
    args = {
        "model": model,
        "adapter_path": None,
        "host": "127.0.0.1",
        "port": 8080,
        "allowed_origins": "*",
        "draft_model": None,
        "num_draft_tokens": 3,
        "trust_remote_code": False,
        "log_level": "INFO",
        "chat_template": "",
        "use_default_chat_template": False,
        "temp": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "max_tokens": 512,
        "chat_template_args": {},
        "decode_concurrency": 32,
        "prompt_concurrency": 8,
        "prefill_step_size": 2048,
        "prompt_cache_size": 10,
        "prompt_cache_bytes": None,
        "kv_bits": None,
        "kv_group_size": 64,
        "quantized_kv_start": DEFAULT_QUANTIZED_KV_START,
        "pipeline": False,
    }
    args.update({k: v for k, v in overrides.items() if v is not None})
    return argparse.Namespace(**args)


class RecipeModelProvider(ModelProvider):
    """mlx-lm's model provider, serving one model whose caches are `recipe`'s."""

    def __init__(self, cli_args, recipe, sets=()):
        super().__init__(cli_args)
        self.recipe, self.sets = recipe, list(sets)
        self.plan = None
        self.serial_reason = None
        self.context = None  # the model's max_position_embeddings, where its config gives one
        self.last_sequence = None  # cache_report of the last finished sequence (set in the generation thread)

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path not in ("default_model", self.cli_args.model):
            raise ValueError(
                f"this server serves {self.cli_args.model} under recipe '{self.plan_name}'; "
                f"ask for model 'default_model' (or that path), not {model_path!r}"
            )
        return super().load("default_model", None, "default_model")

    @property
    def plan_name(self) -> str:
        return self.plan.recipe if self.plan else getattr(self.recipe, "name", str(self.recipe))

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        # Every load goes through here (ModelProvider.load), so is_batchable, the one switch that sends the
        # server down its BatchGenerator path, is always the recipe caches' answer.
        super()._load(model_path, adapter_path, draft_model_path)
        model, tokenizer = self.model, self.tokenizer
        # Compiled before make_cache is replaced: the model's shape (sliding windows) is read off its own.
        plan = self.plan = plan_for(model, self.recipe, self.sets)
        hook.install(model)
        model.make_cache = lambda: prompt_caches(model, plan, tokenizer)
        caches = model.make_cache()
        # mlx-lm's own load-time test (ModelProvider._load), now over the recipe's caches, and the plan's
        # declared capability (compiler/batching.py): a refused recipe never reaches merge().
        unmergeable = [c for c in caches if not hasattr(c, "merge")]
        self.serial_reason = batch_refusal(plan) or (
            f"{type(unmergeable[0]).__name__} has no merge(), so mlx-lm serves requests one at a time"
            if unmergeable
            else None
        )
        self.is_batchable = self.serial_reason is None
        self.context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        log.info(
            "veloxquant: model %s, recipe '%s', fingerprint %s, %d layers",
            model_path,
            plan.recipe,
            plan.fingerprint,
            len(plan.layers),
        )
        if self.serial_reason:
            log.info("veloxquant: serving one sequence at a time: %s", self.serial_reason)

    def status(self) -> dict:
        return {
            "recipe": self.plan_name,
            "fingerprint": self.plan.fingerprint if self.plan else None,
            "model": self.cli_args.model,
            "batched": bool(self.is_batchable),
            "serving": "batched" if self.is_batchable else f"one sequence at a time: {self.serial_reason}",
            "context": self.context,
            "last_sequence": self.last_sequence,
        }


class ReportingPromptCache(LRUPromptCache):
    """mlx-lm's prefix cache; each finished sequence's caches are measured as they are stored.

    insert_cache runs in the generation thread between steps, where reading the caches' bytes is safe."""

    def __init__(self, provider: RecipeModelProvider, max_size: int, max_bytes: int = 1 << 63):
        super().__init__(max_size, max_bytes)
        self.provider = provider
        self.stored = {"sequences": 0, "bytes": 0}  # replaced whole: the status handler reads it from its thread

    def fetch_nearest_cache(self, model, tokens):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is None or rest:
            return cache, rest
        # An exact hit leaves nothing to prefill, and mlx-lm 0.32.2's stream_generate refuses an empty prompt
        # (the connection drops). Step back one token where the caches rewind exactly; else start afresh.
        if can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 1) == 1:
            return cache, tokens[-1:]
        return None, tokens

    def insert_cache(self, model, tokens, prompt_cache, **kwargs):
        report = cache_report(prompt_cache)
        report = {k: report[k] for k in ("tokens", "cache_bytes", "fp16_bytes", "ratio")}
        log.info(
            "veloxquant: sequence of %d tokens holds %s bytes (fp16: %s, ratio %.3f)",
            report["tokens"],
            f"{report['cache_bytes']:,}",
            f"{report['fp16_bytes']:,}",
            report["ratio"] or 0.0,
        )
        super().insert_cache(model, tokens, prompt_cache, **kwargs)
        self.provider.last_sequence = report
        self.stored = {"sequences": len(self), "bytes": self.nbytes}


class RecipeResponseGenerator(ResponseGenerator):
    def _tokenize(self, tokenizer, request, args):
        out = super()._tokenize(tokenizer, request, args)
        limit = self.model_provider.context
        if limit is not None and len(out[0]) > limit:
            raise ValueError(f"the prompt has {len(out[0]):,} tokens, more than the model's context of {limit:,}")
        return out


class RecipeHandler(APIHandler):
    """mlx-lm's request handler plus GET /v1/veloxquant/status; requests cannot name another recipe."""

    def do_GET(self):
        if self.path != STATUS_PATH:
            return super().do_GET()
        generator = self.response_generator
        body = {**generator.model_provider.status(), "prompt_cache": generator.prompt_cache.stored}
        self._set_completion_headers(200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        asked = [f for f in RECIPE_FIELDS if f in self.body]
        if asked:
            raise ValueError(
                f"request field {asked[0]!r}: the recipe is fixed when the server starts "
                "(veloxquant serve RECIPE --set NAME=VALUE); a request cannot change it"
            )


def check_recipe(recipe_ref, sets, model_path: str):
    """Load and compile the recipe for the model (its weights left lazy): errors before the server starts."""
    recipe = load_recipe(recipe_ref)
    model, _ = load_model(model_path, lazy=True)
    plan_for(model, recipe, sets)  # the --set values are checked as the plan applies them
    return recipe


def serve(args) -> int:
    model_path = str(args.model or default_model_path())
    recipe = check_recipe(args.recipe, args.sets, model_path)
    cli_args = server_args(
        model_path,
        host=args.host,
        port=args.port,
        max_tokens=args.max_tokens,
        temp=args.temp,
        prefill_step_size=args.prefill_step_size,
        prompt_cache_size=args.prompt_cache_size,
        chat_template=args.chat_template,
        log_level=args.log_level,
    )
    logging.basicConfig(
        level=getattr(logging, cli_args.log_level.upper(), logging.INFO),
        format="%(asctime)s - %(levelname)s - %(message)s",
    )
    provider = RecipeModelProvider(cli_args, recipe, args.sets)
    prompt_cache = ReportingPromptCache(provider, cli_args.prompt_cache_size)
    generator = RecipeResponseGenerator(provider, prompt_cache)
    _run_http_server(cli_args.host, cli_args.port, generator, handler_class=RecipeHandler)
    return 0
