"""mlx-vlm's server with a recipe: its continuous-batching engine (mlx_vlm.server.generation.ResponseGenerator,
what `mlx_vlm.server` answers requests with) loads the model through `load_model_resources`; wrapped to point
the language model's make_cache at veloxquant (docs/serving.md), its BatchGenerator batches our caches
(runtime/batch_left.py). Two requests with images: each gets the tokens and logprobs it gets
alone through mlx_vlm.stream_generate with the recipe's caches, sent at once or the second joining the first's
running batch."""

import threading

import mlx.core as mx
import pytest

mlx_vlm = pytest.importorskip("mlx_vlm")
generation = pytest.importorskip("mlx_vlm.server.generation")

from vlm_folder import image, qwen2_5_vl_folder, words  # noqa: E402

import veloxquant as vq  # noqa: E402

PROMPTS = [words(120, 0), words(70, 1)]
MAX_TOKENS = [40, 6]  # the first still runs when the second joins


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_server")
    return str(qwen2_5_vl_folder(root / "model", mx.float16)), [image(root / "a.png", 1), image(root / "b.png", 2)]


@pytest.fixture(autouse=True)
def _unhook():
    yield
    vq.uninstall()


def serve(monkeypatch, path, images, recipe, sets, stagger):
    """The two requests at once (one prompt batch, to_batch), or the second sent once the first has its first
    token (a running batch of one, merged, extended by the second, filtered when the first ends)."""
    made = []
    load = generation.load_model_resources

    def with_recipe(model_path, adapter_path):
        model, processor, config = load(model_path, adapter_path)
        model.language_model.make_cache = lambda: made.append(1) or vq.make_prompt_cache(model, recipe, sets)
        return model, processor, config

    monkeypatch.setattr(generation, "load_model_resources", with_recipe)
    server = generation.ResponseGenerator(path)
    model, processor, _ = server.wait_until_ready(120)
    got, started = {}, threading.Event()

    def ask(i):
        prompt = mlx_vlm.apply_chat_template(processor, model.config, PROMPTS[i], num_images=1)
        args = generation.GenerationArguments(max_tokens=MAX_TOKENS[i], temperature=0.0, logprobs=True)
        _, tokens = server.generate(prompt, images=[images[i]], args=args)
        got[i] = []
        for t in tokens:
            got[i].append((t.token, float(t.logprobs)))
            started.set()

    try:
        first = threading.Thread(target=ask, args=(0,))
        first.start()
        if stagger:
            assert started.wait(120)
        second = threading.Thread(target=ask, args=(1,))
        second.start()
        first.join(120)
        second.join(120)
    finally:
        server.stop_and_join()
    return [got[0], got[1]], len(made)


def alone(path, images, recipe, sets):
    model, processor = mlx_vlm.load(path)
    out = []
    for i in range(2):
        prompt = mlx_vlm.apply_chat_template(processor, model.config, PROMPTS[i], num_images=1)
        caches = vq.make_prompt_cache(model, recipe, sets)
        steps = mlx_vlm.stream_generate(
            model, processor, prompt, image=[images[i]], max_tokens=MAX_TOKENS[i], temperature=0.0, prompt_cache=caches
        )
        out.append([(r.token, float(r.logprobs[r.token])) for r in steps][: MAX_TOKENS[i]])  # then a closing one
    return out


@pytest.mark.parametrize("stagger", [False, True], ids=["at_once", "joining"])
@pytest.mark.parametrize("recipe,sets", [("fp16", []), ("kivi", ["window=16", "group=16"]), ("h2o", ["budget=32"])])
def test_requests_get_what_each_gets_alone(folder, monkeypatch, recipe, sets, stagger):
    path, images = folder
    served, made = serve(monkeypatch, path, images, recipe, sets, stagger)
    assert made == 2 if stagger else made >= 1  # the server's batches were built from veloxquant's caches
    for a, b in zip(alone(path, images, recipe, sets), served):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-2  # float16 logprobs
