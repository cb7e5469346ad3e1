"""mlx-vlm's own batching with veloxquant caches: mlx_vlm.batch_generate (its BatchGenerator, which its server
runs too) builds each batch from the language model's make_cache(), so
`model.language_model.make_cache = lambda: veloxquant.make_prompt_cache(model, recipe)` hands it our caches;
it left-pads the prompts and asks each cache for `to_batch(left_padding)` (runtime/batch_left.py).

Two prompts of different lengths, each with its own generated image, batched, against each run alone through
mlx_vlm.generate with the recipe's caches: the logits every step are recorded by a logits processor (both
paths call it with the row's logits). fp16 on a float16 model equals alone and mlx-vlm's own batch cache
exactly, with a chunked prefill whose left padding spans more than a chunk. Lossy recipes are compared with
the prompt prefilled in one block: a chunked prefill puts a left-padded row's block boundaries elsewhere than
alone, and kivi's fp16 window and h2o's cuts follow block boundaries (measured with 32-token chunks on the
float32 model: kivi 0.17, h2o 0.24 in the logits of the padded row, the unpadded row within 4e-5). h2o and
snapkv keep each row's image tokens on top of the budget, as alone (runtime/eviction/protected.py); without
that the batch was measured 0.49 off alone. Gemma 3 (sliding windows) below, through the BatchGenerator."""

import mlx.core as mx
import pytest

mlx_vlm = pytest.importorskip("mlx_vlm")

from mlx_vlm.generate.ar import BatchGenerator, _split_prompt_kwargs_per_row, generate_step  # noqa: E402
from mlx_vlm.utils import StoppingCriteria  # noqa: E402
from vlm_folder import image, qwen2_5_vl_folder, words  # noqa: E402

import veloxquant as vq  # noqa: E402
from veloxquant.errors import VeloxError  # noqa: E402
from veloxquant.runtime import batch_left  # noqa: E402

from test_vlm import gemma3, llava, model_of  # noqa: E402

MAX_TOKENS = 8
LOSSY_TOL = 2e-4  # float32 model: attention over a padded row sums in another order (measured <= 6.6e-5)


class Recorder:
    """A logits processor that keeps the logits it is shown; batch_generate clones one per row."""

    def __init__(self, rows=None):
        self.seen, self.rows = [], rows

    def clone(self):
        row = Recorder()
        self.rows.append(row)
        return row

    def __call__(self, tokens, logits):
        self.seen.append(logits.astype(mx.float32))
        return logits

    def logits(self):
        return mx.concatenate(self.seen)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    images = [image(root / "a.png", 1), image(root / "b.png", 2)]
    built = {}

    def load(dtype):
        if dtype not in built:
            model, processor = mlx_vlm.load(str(qwen2_5_vl_folder(root / str(dtype), dtype)))
            built[dtype] = model, processor
        return built[dtype]

    return load, images


@pytest.fixture(autouse=True)
def _unhook():
    yield
    vq.uninstall()


PROMPTS = [words(120, 0), words(70, 1)]  # 50 columns of left padding in the second row


def batched(model, processor, images, make, step):
    lm = model.language_model
    if make is None:
        vars(lm).pop("make_cache", None)
    else:
        lm.make_cache = make
    rows = []
    try:
        out = mlx_vlm.batch_generate(
            model,
            processor,
            images=images,
            prompts=PROMPTS,
            max_tokens=MAX_TOKENS,
            logits_processors=[Recorder(rows)],
            prefill_step_size=step,
        )
    finally:
        vars(lm).pop("make_cache", None)
    return out.texts, [r.logits() for r in rows]


def alone(model, processor, images, i, caches, step):
    record = Recorder()
    prompt = mlx_vlm.apply_chat_template(processor, model.config, PROMPTS[i], num_images=1)
    out = mlx_vlm.generate(
        model,
        processor,
        prompt,
        image=[images[i]],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logits_processors=[record],
        prompt_cache=caches,
        prefill_step_size=step,
    )
    return out.text, record.logits()


def test_fp16_batch_equals_alone_and_mlx_vlms_own_batch(folder):
    load, images = folder
    model, processor = load(mx.float16)
    own_texts, own = batched(model, processor, images, None, 32)
    texts, got = batched(model, processor, images, lambda: vq.make_prompt_cache(model, "fp16"), 32)
    assert texts == own_texts
    for i in range(2):
        text, logits = alone(model, processor, images, i, vq.make_prompt_cache(model, "fp16"), 32)
        assert texts[i] == text
        assert float(mx.abs(got[i] - logits).max()) == 0.0
        assert float(mx.abs(got[i] - own[i]).max()) == 0.0


@pytest.mark.parametrize(
    "recipe,sets", [("kivi", ["window=16", "group=16"]), ("h2o", ["budget=32"]), ("snapkv", ["budget=32", "window=8"])]
)
def test_lossy_batch_equals_alone(folder, recipe, sets, monkeypatch):
    load, images = folder
    model, processor = load(mx.float32)
    make = lambda: vq.make_prompt_cache(model, recipe, sets)
    batches, to_batch = [], batch_left.to_batch
    monkeypatch.setattr(batch_left, "to_batch", lambda *a: batches.append(to_batch(*a)) or batches[-1])
    texts, got = batched(model, processor, images, make, 4096)
    for i in range(2):
        text, logits = alone(model, processor, images, i, make(), 4096)
        assert texts[i] == text
        assert float(mx.abs(got[i] - logits).max()) < LOSSY_TOL
    assert len(batches) == len(model.language_model.layers)
    for c in batches if recipe != "kivi" else ():  # every head of both rows still holds its row's 4 image tokens
        tier = c.tiers[0]
        assert c.protected.held_rows().tolist() == [4, 4] and tier.count < c.rows.seen.max()  # some were cut
        assert (mx.sum(c.protected.mask(tier.positions), axis=-1) == 4).all().item()


# Gemma 3 (sliding-window layers, a bidirectional mask over the image's tokens) and LLaVA: mlx-vlm's
# BatchGenerator driven as batch_generate drives it (prompts padded, embedded as one batch, unpadded on
# insert), from test_vlm's tiny models and generated image (no processor: the ids are built by hand). fp16
# equals alone exactly; on Gemma 3 mlx-vlm's own batch (BatchRotatingKVCache) was measured 0.012 off alone
# by the 8th token.
class _Processor:
    class tokenizer:
        stopping_criteria = StoppingCriteria([-1], object())  # no stop token: every row runs MAX_TOKENS


def _two_rows(make):
    """test_vlm's model, its prompt and the same prompt with half the text after the image, and its pixels."""
    model, ids, image_id, pixels, _ = model_of(make)
    head = ids.index(image_id) + ids.count(image_id)  # up to the image's last token
    return model, [ids, ids[:head] + ids[head:][: len(ids) // 2]], pixels.astype(mx.float16)


def direct_batched(model, rows, pixels, make, step):
    lm = model.language_model
    if make is not None:
        lm.make_cache = make
    width = max(map(len, rows))
    ids = mx.array([[0] * (width - len(r)) + r for r in rows])
    mask = mx.array([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    embedded = model.get_input_embeddings(ids, mx.concatenate([pixels] * len(rows)), mask=mask).to_dict()
    kwargs = _split_prompt_kwargs_per_row({k: v for k, v in embedded.items() if v is not None}, len(rows))
    record = Recorder([])
    gen = BatchGenerator(lm, _Processor, max_tokens=MAX_TOKENS, prefill_step_size=step)
    try:
        gen.insert(
            ids,
            MAX_TOKENS,
            prompt_kwargs=kwargs,
            attention_mask=mask,
            logits_processors=[[record.clone()] for _ in rows],
        )
        while gen.has_work:
            gen.next()
    finally:
        gen.close()
        vars(lm).pop("make_cache", None)
    return [r.logits() for r in record.rows]


def direct_alone(model, row, pixels, caches, step):
    record = Recorder()
    ones = mx.ones((1, len(row)), mx.int32)
    steps = generate_step(
        mx.array([row]),
        model,
        pixels,
        ones,
        prompt_cache=caches,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logits_processors=[record],
        prefill_step_size=step,
    )
    list(zip(steps, range(MAX_TOKENS)))
    return record.logits()


@pytest.mark.parametrize(
    "recipe,sets,step,tol",
    [
        ("fp16", [], 32, 0.0),  # 192 columns of left padding, six chunks; windows of 32
        ("kivi", ["window=16", "group=16"], 4096, 5e-2),  # float16 model: measured 3.9e-3
        ("h2o", ["budget=32"], 4096, 5e-2),  # measured 0.0
        ("snapkv", ["budget=32", "window=8"], 4096, 5e-2),  # measured 2.2e-2
    ],
)
def test_gemma3_batch_equals_alone(recipe, sets, step, tol):
    model, rows, pixels = _two_rows(gemma3)
    make_caches = lambda: vq.make_prompt_cache(model, recipe, sets)
    got = direct_batched(model, rows, pixels, make_caches, step)
    for row, batched in zip(rows, got):
        alone = direct_alone(model, row, pixels, make_caches(), step)
        assert mx.array_equal(mx.argmax(batched, axis=-1), mx.argmax(alone, axis=-1))
        assert float(mx.abs(batched - alone).max()) <= tol


def test_llava_fp16_batch_equals_mlx_vlms_own_batch():
    """mlx-vlm's own batch of this LLaVA was measured 2.97 off alone in the logits of the unpadded row, whose
    batched input embeddings are 0.85 off alone's (the padded row equals alone): the recipe's batch equals
    mlx-vlm's own exactly."""
    model, rows, pixels = _two_rows(llava)
    own = direct_batched(model, rows, pixels, None, 32)
    got = direct_batched(model, rows, pixels, lambda: vq.make_prompt_cache(model, "fp16"), 32)
    assert all(float(mx.abs(a - b).max()) == 0.0 for a, b in zip(got, own))


def test_a_recipe_that_does_not_batch_is_refused_with_its_reason(folder):
    load, images = folder
    model, processor = load(mx.float16)
    with pytest.raises(VeloxError, match="recipe 'adakv' does not batch: layer 0: "):
        batched(model, processor, images, lambda: vq.make_prompt_cache(model, "adakv"), 32)
