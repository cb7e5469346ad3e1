"""Left-padded batches (runtime/batch_left.py: what mlx-vlm's BatchGenerator builds through `to_batch`),
without mlx-vlm: a tiny random Llama (float32) fed a batch of a 48-token and a 16-token prompt, the short one
behind 32 columns of padding, in 16-column blocks, against each prompt alone through mlx-lm's generate_step
with 16-token prefill steps. The padding is two whole blocks, so each row's own blocks are its alone blocks:
(16, 16, 15) and (15), then its last prompt token alone. Chains (kivi, kivi_sink) and eviction (h2o,
snapkv) then give every row the tokens it gets alone, logprobs within float tolerance."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import veloxquant as vq
from veloxquant.errors import VeloxError

from conftest import tiny_llama

PROMPTS = [[1 + (7 * j) % 400 for j in range(48)], [3 + (11 * j) % 400 for j in range(16)]]
PAD = 32
STEPS = 6
TOL = 2e-3  # float32: attention over a padded, masked row sums in another order


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(autouse=True)
def _unhook():
    yield
    vq.uninstall()


def _alone(model, recipe, sets, prompt):
    caches = vq.make_prompt_cache(model, recipe, sets)
    steps = generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=STEPS, prefill_step_size=16)
    return [(int(t), lp) for t, lp in steps]


def _batched(model, recipe, sets):
    caches = [c.to_batch([0, PAD]) for c in vq.make_prompt_cache(model, recipe, sets)]
    ids = mx.array([PROMPTS[0], [0] * PAD + PROMPTS[1]])
    for start, end in ((0, 16), (16, 32), (32, 47)):
        model(ids[:, start:end], cache=caches)
    y, out = ids[:, 47:], []
    for _ in range(STEPS):
        logits = model(y, cache=caches)[:, -1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = mx.argmax(logprobs, axis=-1)[:, None]
        out.append((y[:, 0].tolist(), logprobs))
    return out, caches


@pytest.mark.parametrize(
    "recipe,sets",
    [
        ("fp16", []),
        ("kivi", ["window=8", "group=8"]),
        ("kivi_sink", ["window=8", "group=8"]),
        ("h2o", ["budget=12"]),
        ("snapkv", ["budget=12", "window=4"]),
    ],
)
def test_a_left_padded_batch_equals_alone(model, recipe, sets):
    batched, caches = _batched(model, recipe, sets)
    for row, prompt in enumerate(PROMPTS):
        alone = _alone(model, recipe, sets, prompt)
        assert [t for t, _ in alone] == [tokens[row] for tokens, _ in batched]
        assert max(float(mx.abs(lp - b[row]).max()) for (_, lp), (_, b) in zip(alone, batched)) < TOL
    assert all(c.lead is None for c in caches)  # the padding is fed: offsets are each row's own positions
    assert caches[0].offset.tolist() == [len(p) + STEPS - 1 for p in PROMPTS]  # the last token is not fed


def test_left_padding_on_a_batch_that_holds_tokens_is_refused(model):
    caches = [c.to_batch([0, 2]) for c in vq.make_prompt_cache(model, "kivi")]
    model(mx.array([[5, 6, 7], [0, 0, 7]]), cache=caches)
    with pytest.raises(VeloxError, match="left padding can only be added to an empty batch cache"):
        caches[0].prepare(left_padding=[1, 0])
