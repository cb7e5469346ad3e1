import json

import mlx.core as mx
import pytest

import veloxquant as vq
from veloxquant.errors import CacheFileError
from veloxquant.runtime import checksums
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache

from conftest import feed

TOKENS = mx.random.randint(0, 500, (1, 160), key=mx.random.key(3))


@pytest.fixture
def saved(llama_model, tmp_path):
    caches = vq.make_prompt_cache(llama_model, "kivi", ["window=32"])
    feed(llama_model, TOKENS[:, :150], caches, 50)
    path = tmp_path / "kivi.safetensors"
    size = save_prompt_cache(str(path), caches, {"note": "test"})
    return caches, path, size


def test_round_trip_continues_identically(llama_model, saved):
    caches, path, size = saved
    loaded, meta = load_prompt_cache(str(path), expect_fingerprint=caches[0].fingerprint)
    assert meta == {"note": "test"} and size == path.stat().st_size
    assert [c.offset for c in loaded] == [c.offset for c in caches]
    a = llama_model(TOKENS[:, 150:], cache=caches)
    b = llama_model(TOKENS[:, 150:], cache=loaded)
    assert float(mx.abs(a - b).max()) == 0.0


def test_file_is_smaller_than_fp16(llama_model, saved, tmp_path):
    caches, path, size = saved
    full = vq.make_prompt_cache(llama_model, "fp16")
    feed(llama_model, TOKENS[:, :150], full, 50)
    assert size < 0.5 * save_prompt_cache(str(tmp_path / "fp16.safetensors"), full)


def test_refuses_a_cache_made_by_another_recipe(llama_model, saved):
    caches, path, _ = saved
    other = vq.make_prompt_cache(llama_model, "kivi", ["window=32", "bits=4"])[0].fingerprint
    with pytest.raises(CacheFileError, match="made by recipe 'kivi'"):
        load_prompt_cache(str(path), expect_fingerprint=other)


def test_refuses_corrupt_files(saved, tmp_path):
    _, path, _ = saved
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    with pytest.raises(CacheFileError, match="not a readable"):
        load_prompt_cache(str(garbage))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CacheFileError):
        load_prompt_cache(str(truncated))


def test_refuses_tampered_plan_and_arrays(saved, tmp_path):
    caches, path, _ = saved
    arrays, meta = mx.load(str(path), return_metadata=True)
    plan = json.loads(meta["plan"])
    plan["layers"][0]["tiers"][1]["keys"][0]["bits"] = 4
    bad = tmp_path / "tampered.safetensors"
    mx.save_safetensors(str(bad), arrays, {**meta, "plan": json.dumps(plan)})
    with pytest.raises(CacheFileError, match="metadata fails its checksum"):
        load_prompt_cache(str(bad))
    # Re-signed (checksums recomputed), the plan's own fingerprint still refuses it.
    mx.save_safetensors(str(bad), arrays, checksums.sign(arrays, {**meta, "plan": json.dumps(plan)}))
    with pytest.raises(CacheFileError, match="fingerprint"):
        load_prompt_cache(str(bad))
    key = next(k for k in arrays if k.startswith("0.1.k.codes"))
    short = {**arrays, key: arrays[key][:, :, :5]}
    mx.save_safetensors(str(bad), short, meta)
    with pytest.raises(CacheFileError, match=f"array {key} is uint32"):
        load_prompt_cache(str(bad))
    mx.save_safetensors(str(bad), short, checksums.sign(short, meta))
    with pytest.raises(CacheFileError, match="layer 0 tier 1"):
        load_prompt_cache(str(bad))


def test_a_flipped_bit_in_raw_fp16_data_is_refused(saved, tmp_path):
    _, path, _ = saved
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x04  # the last array's data: fp16 window values, any bit pattern is a number
    bad = tmp_path / "flipped.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="fails its checksum"):
        load_prompt_cache(str(bad))
