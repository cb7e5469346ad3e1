"""Batched caches (runtime/batch.py): a batch equals its sequences run alone, or the recipe refuses.

mlx-lm's BatchGenerator drives the caches as its server does: ragged prompts (right-padded while
processed, then left-padded), sequences joining a running batch (extend) and leaving it (filter,
extract). fp16 must give every sequence the tokens it gets alone; a recipe whose tiers are a chain of
sink? >> recent? >> codes (kivi & co, runtime/batch_chain.py) the tokens, and logprobs within float
tolerance; every other built-in declares its refusal (compiler/batching.py), which explain prints."""

import types

import mlx.core as mx
import pytest
from mlx_lm import batch_generate
from mlx_lm.generate import BatchGenerator, generate_step

import veloxquant
from veloxquant.artifacts import CalibrationError
from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.compiler.batching import layer_layout, refusal
from veloxquant.errors import VeloxError
from veloxquant.recipe import builtin_names, load_recipe

from conftest import tiny_gemma3, tiny_llama

LENGTHS = [5, 17, 9, 30, 3, 12]
MAX_TOKENS = [10, 4, 12, 7, 9, 5]  # sequences leave the batch at different steps
LOGPROB_TOL = 2e-3  # float32: attention over a padded, masked row sums in another order


def _prompts():
    return [[1 + (i * 7 + j) % 400 for j in range(n)] for i, n in enumerate(LENGTHS)]


def _alone(model, recipe, prompt, n, sets=(), cache=None):
    cache = veloxquant.make_prompt_cache(model, recipe, sets) if cache is None else cache
    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=n)
    return [(int(t), lp) for t, lp in steps]


def _batched(model, recipe, prompts, max_tokens, join_after=3, sets=()):
    """The first half inserted at once; the second half joins after `join_after` steps."""
    gen = BatchGenerator(model, prefill_batch_size=2, completion_batch_size=8)
    half = len(prompts) // 2
    make = lambda ps: [veloxquant.make_prompt_cache(model, recipe, sets) for _ in ps]
    uids = gen.insert(prompts[:half], max_tokens[:half], caches=make(prompts[:half]))
    got, steps, caches = {}, 0, {}
    while True:
        responses = gen.next_generated()
        steps += 1
        if steps == join_after:
            uids += gen.insert(prompts[half:], max_tokens[half:], caches=make(prompts[half:]))
        elif not responses:
            break
        for r in responses:
            got.setdefault(r.uid, []).append((r.token, r.logprobs))
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
    gen.close()
    return [got[u] for u in uids], [caches[u] for u in uids]


@pytest.mark.parametrize("make_model", [tiny_llama, lambda: tiny_gemma3(window=8)], ids=["llama", "gemma3"])
def test_fp16_batch_equals_alone(make_model):
    model = make_model()
    prompts = _prompts()
    alone = [_alone(model, "fp16", p, n) for p, n in zip(prompts, MAX_TOKENS)]
    batched, caches = _batched(model, "fp16", prompts, MAX_TOKENS)
    for a, b, p, n, c in zip(alone, batched, prompts, MAX_TOKENS, caches):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(float(mx.abs(x - y).max()) for (_, x), (_, y) in zip(a, b)) < LOGPROB_TOL
        # a sequence extracted from the batch holds its own tokens only (never padding), at its positions
        held = len(p) + n  # the prompt and each token fed back (the last step ran ahead one token)
        assert c[0].offset == held and not c[0].rows
        window = model.args.sliding_window if hasattr(model.args, "sliding_window") else None
        assert [x.size() for x in c] == [min(held, window) if (window and x.plan.window) else held for x in c]


def test_an_extracted_cache_continues_as_one_run_alone():
    """A sequence leaves the batch with its cache (mlx-lm's server stores it for prefix reuse) and goes on."""
    model = tiny_llama()
    prompts = _prompts()[:3]
    batched, caches = _batched(model, "fp16", prompts, [6, 6, 6], join_after=1)
    tokens = prompts[1] + [t for t, _ in batched[1]]
    cache = veloxquant.make_prompt_cache(model, "fp16")
    model(mx.array([tokens]), cache=cache)  # the same tokens, alone
    for alone, out in zip(cache, caches[1]):
        assert out.offset == alone.offset and out.size() == alone.size()
        assert mx.allclose(alone.tiers[0].decoded(mx.float32)[0], out.tiers[0].decoded(mx.float32)[0], atol=2e-2)
    follow = [7, 8, 9]
    on_alone = model(mx.array([follow]), cache=cache)
    on_out = model(mx.array([follow]), cache=caches[1])
    assert float(mx.abs(on_alone - on_out).max()) < LOGPROB_TOL * 10


def test_batch_bytes_count_the_rows():
    model = tiny_llama()
    caches = [veloxquant.make_prompt_cache(model, "fp16") for _ in range(3)]
    for c, n in zip(caches, (4, 9, 6)):
        model(mx.array([list(range(1, n + 1))]), cache=c)
    merged = caches[0][0].merge([c[0] for c in caches])
    assert merged.offset.tolist() == [4, 9, 6] and merged.rows.left.tolist() == [5, 0, 3]
    assert merged.nbytes == 3 * 9 * 3 * 64 * 2 * 2  # rows x longest x kv heads x head dim x fp16 x (K, V)
    merged.filter([0, 2])  # the longest leaves: columns that are padding in every row are let go
    assert merged.rows.left.tolist() == [5, 3] and merged.tiers[0].start == 3


def _refusals(shape):
    """Each built-in's declared refusal on `shape` (recipes this shape refuses at compile time left out)."""
    out = {}
    for name in builtin_names():
        try:
            out[name] = refusal(compile_recipe(load_recipe(name), shape))
        except VeloxError:
            continue  # e.g. xquant on sliding layers: a located compile error of its own
    return out


CHAINS = [
    "cachegen",
    "composite",
    "gear",
    "kitty",
    "kivi",
    "kivi_sink",
    "polarquant",
    "qjl",
    "rabitq",
    "streaming_llm",
    "ratekivi",
    "ratequant",
    "spectralquant",
    "turboquant_mse",
    "turboquant_prod",
    "turboquant_rvq",
    "vecinfer",
]

EVICTIONS = [
    "h2o",
    "keydiff",
    "knorm",
    "observed_attention",
    "pyramidkv",
    "snapkv",
    "tova",
]  # one per-head eviction tier (tests/test_batch_eviction.py)


def test_every_builtin_batches_or_declares_why():
    model = tiny_llama()
    llama, gemma = (_refusals(ModelShape.from_model(m)) for m in (model, tiny_gemma3()))
    assert sorted(n for n, why in llama.items() if why is None) == sorted(["fp16"] + CHAINS + EVICTIONS)
    assert sorted(n for n, why in gemma.items() if why is None) == sorted(["fp16"] + CHAINS + EVICTIONS)  # sliding
    for reasons in (llama, gemma):
        assert all("does not batch: layer" in why for why in reasons.values() if why), reasons
    plan = compile_recipe(load_recipe("kivi_sink"), ModelShape.from_model(model))
    assert {layer_layout(layer) for layer in plan.layers} == {"chain"}


CHAIN_LENGTHS = [5, 70, 40, 3]  # the window (8) and the code groups (32 or 64 tokens) fill at different steps
CHAIN_TOKENS = [10, 4, 7, 5]
# The same tokens in the same code groups, but a batched matmul rounds its float32 sums in another order
# (fp16's logprobs move ~2e-4): at 2 bits a key or value on a level's edge then takes the next code.
CHAIN_TOL = 5e-2


@pytest.mark.parametrize(
    "recipe,make_model",
    [(r, tiny_llama) for r in CHAINS]
    + [(r, lambda: tiny_gemma3(window=24)) for r in ("kivi", "kivi_sink", "turboquant_rvq", "streaming_llm")],
    ids=CHAINS + ["kivi-gemma3", "kivi_sink-gemma3", "turboquant_rvq-gemma3", "streaming_llm-gemma3"],
)
def test_a_chain_batch_equals_alone(recipe, make_model):
    """Each sequence's sinks, window spills, code groups and (Gemma 3's sliding layers) expiry are its own
    in a batch: tokens as alone, logprobs within float tolerance, and the cache it leaves with holds
    what the alone cache holds, tier by tier."""
    _check_chain(recipe, make_model)


@pytest.mark.parametrize("route", ["", "decode"], ids=["default", "decode"])
@pytest.mark.parametrize("recipe", ["kivi", "kivi_sink"])
def test_a_chain_batch_attends_codes_through_the_kernel_route(recipe, route, monkeypatch):
    """Where a kernel reads an affine tier (CUDA's fused kernel; on the CPU and Metal MLX's own quantized
    matmuls, `qmm`, a batch's default: table.MLX_ATTEND_ROWS_BACKENDS), a batch's decode step attends
    every row's codes in one call, each row's span an input (runtime/chain_attention.py), instead of
    decoding the tier; VELOXQUANT_AFFINE_ROUTE=decode decodes it. Either way: tokens and logprobs as alone."""
    from veloxquant.runtime import fused

    monkeypatch.setenv("VELOXQUANT_AFFINE_ROUTE", route)
    answered = []
    rows_answer = fused.rows_answer
    monkeypatch.setattr(fused, "rows_answer", lambda *a: answered.append(rows_answer(*a)) or answered[-1])
    _check_chain(recipe, tiny_llama)
    took = sum(a is not None for a in answered)
    assert answered and (took > 0 if route == "" else took == 0)


def _check_chain(recipe, make_model):
    model = make_model()
    sets = ["window=8"] if "window" in load_recipe(recipe).params else []
    prompts = [[1 + (i * 7 + j) % 400 for j in range(n)] for i, n in enumerate(CHAIN_LENGTHS)]
    try:
        alone_caches = [veloxquant.make_prompt_cache(model, recipe, sets) for _ in prompts]
        alone = [_alone(model, recipe, p, n, sets, c) for p, n, c in zip(prompts, CHAIN_TOKENS, alone_caches)]
    except CalibrationError:
        pytest.skip(f"{recipe} needs a calibration artifact for this model (its batch is untested here)")
    batched, caches = _batched(model, recipe, prompts, CHAIN_TOKENS, sets=sets)
    for a, b in zip(alone, batched):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(float(mx.abs(x - y).max()) for (_, x), (_, y) in zip(a, b)) < CHAIN_TOL
    for c, cache in zip(caches, alone_caches):  # what each tier holds, as alone
        assert [x.meta_state for x in c] == [x.meta_state for x in cache]
    if caches[0][0].tiers[-1].drops:  # streaming_llm: some rows let tokens go
        assert any(c[0].size() < c[0].offset for c in caches)
    else:
        assert sum(c[0].tiers[-1].count for c in caches) > 0  # some rows hold codes


@pytest.mark.parametrize("recipe", ["adakv", "xquant", "kvquant", "age_tiered"])
def test_a_refused_recipe_has_no_merge(recipe):
    """mlx-lm's batchability test (hasattr merge: its server's, at load) sees a refused recipe as serial, so
    mlx_lm.server serves it one sequence at a time; merge asked for directly, or batch_generate, says why
    (a VeloxError, not mlx-lm's "does not yet support batching")."""
    model = tiny_llama()
    tokenizer = types.SimpleNamespace(eos_token_ids=[], decode=lambda ids: "")
    caches = [veloxquant.make_prompt_cache(model, recipe) for _ in range(2)]
    assert not hasattr(caches[0][0], "merge")
    with pytest.raises(VeloxError, match=f"recipe '{recipe}' does not batch: layer 0: .*one sequence at a time"):
        caches[0][0].merge([c[0] for c in caches])
    with pytest.raises(VeloxError, match=f"recipe '{recipe}' does not batch: layer 0: .*one sequence at a time"):
        batch_generate(model, tokenizer, _prompts()[:2], prompt_caches=caches, max_tokens=2)


def test_batch_generate_with_fp16_caches():
    model = tiny_llama()
    tokenizer = types.SimpleNamespace(eos_token_ids=[], decode=lambda ids: " ".join(map(str, ids)))
    prompts = _prompts()[:4]
    caches = [veloxquant.make_prompt_cache(model, "fp16") for _ in prompts]
    out = batch_generate(model, tokenizer, prompts, prompt_caches=caches, max_tokens=5, return_token_ids=True)
    assert out.token_ids == [[t for t, _ in _alone(model, "fp16", p, 5)] for p in prompts]


def test_run_batch_reports_each_sequence_and_the_whole():
    from veloxquant.recipe import load_recipe as load
    from veloxquant.run_batch import format_batch, generate_batch, ragged_prompts

    model = tiny_llama()
    tokenizer = types.SimpleNamespace(eos_token_ids=[])
    args = types.SimpleNamespace(batch=3, sets=[], no_hook=False, max_tokens=4)
    tokens = list(range(1, 61))
    assert [len(p) for p in ragged_prompts(tokens, 3)] == [60, 50, 40]
    r = generate_batch(model, tokenizer, tokens, load("fp16"), args)
    assert r["mode"] == "batched" and r["reason"] is None
    assert [s["prompt_tokens"] for s in r["sequences"]] == [60, 50, 40]
    assert all(s["generated_tokens"] == 4 and s["ratio"] == 1.0 for s in r["sequences"])  # no padding held
    assert r["cache_bytes"] == sum(s["cache_bytes"] for s in r["sequences"]) and r["decode_tok_s"] > 0
    assert "3 sequences, batched" in format_batch(r)


def test_bench_serve_prints_its_table(capsys):
    from veloxquant.bench.serve import main

    assert (
        main(
            [
                "--recipes",
                "fp16,age_tiered",
                "--context",
                "40",
                "--decode",
                "3",
                "--concurrency",
                "1,3",
                "--layers",
                "2",
                "--budget-mib",
                "1",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    rows = [
        line.split(" | ")
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| fp16") or line.startswith("| age_tiered")
    ]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("| fp16", "1", "batched"),
        ("| fp16", "3", "batched"),
        ("| age_tiered", "1", "one at a time"),
        ("| age_tiered", "3", "one at a time"),
    ]
    # fp16 holds exactly its tokens: 43 x 2 layers x 2 kv heads x 64 x 2 bytes x (K, V), padding never kept
    assert all(float(r[4]) == round(43 * 2 * 2 * 64 * 2 * 2 / 1024) for r in rows[:2])
