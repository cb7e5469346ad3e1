"""`veloxquant run RECIPE --vlm --model M --image FILE` (run_vlm.py) on a random-init tiny Qwen2.5-VL saved
to a folder and a generated PNG: nothing downloaded."""

import json

import mlx.core as mx
import pytest

pytest.importorskip("mlx_vlm")

from vlm_folder import image, qwen2_5_vl_folder, words  # noqa: E402

from veloxquant.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_vlm")
    return str(qwen2_5_vl_folder(root / "model", mx.float16)), image(root / "a.png", 1)


def _run(capsys, *argv):
    code = main(["run", *argv])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def test_run_reports_bytes_and_image_tokens(folder, capsys):
    model, png = folder
    common = ["--vlm", "--model", model, "--image", png, "--prompt", words(60), "--max-tokens", "4", "--json"]
    code, (fp16,), _ = _run(capsys, "fp16", *common)
    assert code == 0 and fp16["image_tokens"] == 4 and fp16["image_tokens_kept_by_eviction"] is None
    assert fp16["generated_tokens"] == 4 and fp16["tokens"] == fp16["prompt_tokens"] + 4
    code, (h2o,), _ = _run(capsys, "h2o", "--set", "budget=8", *common)
    assert code == 0 and h2o["image_tokens_kept_by_eviction"] == 4
    assert h2o["tokens_held_per_layer"] == {"min": 12, "max": 12}  # the budget and the image's 4 tokens
    assert h2o["cache_bytes"] < h2o["fp16_bytes"] == fp16["fp16_bytes"]
    code, (gone,), _ = _run(capsys, "h2o", "--set", "budget=8", "--image-tokens", "evict", *common)
    assert gone["image_tokens_kept_by_eviction"] is None and gone["tokens_held_per_layer"]["max"] == 8


def test_text_report(folder, capsys):
    model, png = folder
    code = main(["run", "kivi", "--vlm", "--model", model, "--image", png, "--prompt", words(30), "--max-tokens", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "cache bytes" in out and "image tokens             4 in the prompt" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--image", "x.png"], "--image: the model must be an mlx-vlm model; add --vlm"),
        (["--vlm"], "--vlm needs --model"),
        (["--vlm", "--model", "m", "--batch", "2"], "--vlm: --batch not supported"),
        (["--vlm", "--model", "m", "--image", "/no/such.png"], "/no/such.png"),
    ],
)
def test_bad_use_is_refused_before_loading(argv, message, capsys):
    code, _, err = _run(capsys, "fp16", *argv)
    assert code == 2 and message in err
