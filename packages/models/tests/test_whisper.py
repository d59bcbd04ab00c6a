"""Whisper against transformers' WhisperForConditionalGeneration: logits, generation, checkpoints both ways."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.models.hf import load_whisper_pretrained, save_whisper_pretrained
from ponente.models.whisper import WHISPER_PRESETS, WhisperConfig, greedy_transcribe, sinusoids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SOT, EOT = 100, 101


def _hf_model(mels: int, *, suppress: list[int] | None = None, begin: list[int] | None = None, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.WhisperConfig(
        vocab_size=120,
        num_mel_bins=mels,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=48,
        max_source_positions=50,
        max_target_positions=40,
        decoder_start_token_id=SOT,
        eos_token_id=EOT,
        pad_token_id=EOT,
        bos_token_id=EOT,
        suppress_tokens=suppress or [],
        begin_suppress_tokens=begin or [],
    )
    model = transformers.WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases (fresh ones are 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _ponente(hf_model) -> object:
    cfg = WhisperConfig.from_hf_config(hf_model.config.to_dict())
    template = jax.eval_shape(lambda: cfg.build(key=jax.random.key(0)))
    return template.from_hf_state_dict({k: v.detach().numpy() for k, v in hf_model.state_dict().items()})


def _features(mels: int, batch: int = 2, frames: int = 100, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, mels, frames)).astype(np.float32)


def _named_features(x: np.ndarray) -> hax.NamedArray:
    return hax.named(jnp.asarray(x), ("batch", "mel", "frame"))


@pytest.mark.parametrize("mels", [80, 128])
def test_logits_match_transformers(mels: int) -> None:
    hf = _hf_model(mels)
    model = _ponente(hf)
    feats = _features(mels)
    tokens = np.array([[SOT, 5, 6, 7, 8, 9], [SOT, 10, 11, 12, 13, 14]])
    with torch.no_grad():
        ref = hf(input_features=torch.tensor(feats), decoder_input_ids=torch.tensor(tokens)).logits.numpy()
    ours = model(_named_features(feats), hax.named(jnp.asarray(tokens), ("batch", "position")))
    ours = np.asarray(ours.rearrange(("batch", "position", "vocab")).array)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("mels", [80, 128])
def test_greedy_transcription_with_the_cache_equals_transformers_generate(mels: int) -> None:
    hf = _hf_model(mels, suppress=[7, 8], begin=[EOT, 3], seed=1)
    model = _ponente(hf)
    feats = _features(mels, batch=3, seed=2)
    prompt = [SOT, 4, 5]
    ours = greedy_transcribe(model, _named_features(feats), prompt, max_new_tokens=12)
    with torch.no_grad():
        ref = hf.generate(
            input_features=torch.tensor(feats),
            decoder_input_ids=torch.tensor([prompt] * 3),
            max_new_tokens=12,
            do_sample=False,
        ).numpy()
    new = ours[:, len(prompt) :]
    ref_new = ref[:, -new.shape[1] :] if ref.shape[1] >= new.shape[1] else ref
    assert ours[:, : len(prompt)].tolist() == [prompt] * 3
    assert new.shape == ref_new.shape
    assert new.tolist() == ref_new.tolist()
    assert not np.isin(new, [7, 8]).any()


def test_cached_decoding_equals_teacher_forcing() -> None:
    hf = _hf_model(80, seed=3)
    model = _ponente(hf)
    feats = _named_features(_features(80, batch=2, seed=4))
    tokens = hax.named(jnp.asarray([[SOT, 3, 4, 5, 6, 7], [SOT, 9, 8, 7, 6, 5]]), ("batch", "position"))
    full = model(feats, tokens)
    state = model.init_decode_state(model.encode(feats), 16)
    first, state = model.decode_step(tokens["position", 0:2], state)
    steps = [first]
    for i in range(2, 6):
        logits, state = model.decode_step(tokens["position", i : i + 1], state)
        steps.append(logits)
    cached = hax.concatenate("position", steps)
    np.testing.assert_allclose(cached.rearrange(full.axes).array, full.array, rtol=0, atol=1e-5)


def test_checkpoints_round_trip_through_transformers(tmp_path) -> None:
    hf = _hf_model(80, suppress=[2], begin=[EOT], seed=5)
    hf.save_pretrained(tmp_path / "hf")
    model = load_whisper_pretrained(tmp_path / "hf")
    assert model.config.suppress_tokens == (2,)
    save_whisper_pretrained(model, tmp_path / "ours")
    back = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    feats = _features(80, batch=1)
    tokens = torch.tensor([[SOT, 3, 4]])
    with torch.no_grad():
        a = hf(input_features=torch.tensor(feats), decoder_input_ids=tokens).logits.numpy()
        b = back(input_features=torch.tensor(feats), decoder_input_ids=tokens).logits.numpy()
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    assert back.config.num_mel_bins == 80
    assert back.config.decoder_ffn_dim == 48


def test_sinusoids_match_the_checkpoint_and_presets() -> None:
    hf = _hf_model(80)
    stored = hf.model.encoder.embed_positions.weight.detach().numpy()
    np.testing.assert_allclose(sinusoids(50, 32), stored, atol=1e-5)  # transformers computes them in float32
    tiny = WhisperConfig.preset("tiny")
    assert (tiny.d_model, tiny.encoder_layers, tiny.encoder_attention_heads, tiny.vocab_size) == (384, 4, 6, 51865)
    v3 = WhisperConfig.preset("large-v3")
    assert (v3.num_mel_bins, v3.vocab_size, v3.d_model, v3.decoder_layers) == (128, 51866, 1280, 32)
    assert WhisperConfig.preset("large-v3-turbo").decoder_layers == 4
    assert WhisperConfig.preset("base.en").eos_token_id == 50256
    assert len(WHISPER_PRESETS) == 12
    with pytest.raises(ValueError, match="tiniest"):
        WhisperConfig.preset("tiniest")


def test_bad_inputs_name_the_setting() -> None:
    model = _ponente(_hf_model(80))
    with pytest.raises(ValueError, match="num_mel_bins"):
        model.encode(_named_features(_features(128)))
    with pytest.raises(ValueError, match="max_source_positions"):
        model.encode(_named_features(_features(80, frames=400)))
    with pytest.raises(ValueError, match="max_target_positions"):
        greedy_transcribe(model, _named_features(_features(80)), [SOT], max_new_tokens=100)
    with pytest.raises(ValueError, match="d_model"):
        WhisperConfig(d_model=30, encoder_attention_heads=4)


def _safetensors(folder) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


def test_load_pretrained_and_save_pretrained_dispatch_on_the_model_type(tmp_path) -> None:
    from ponente.models.hf import load_pretrained, save_pretrained
    from ponente.models.whisper import WhisperModel

    hf = _hf_model(80, seed=6)
    hf.save_pretrained(tmp_path / "hf")  # float32
    model = load_pretrained(tmp_path / "hf")
    assert isinstance(model, WhisperModel)
    feats = _features(80, batch=2, seed=7)
    tokens = np.array([[SOT, 3, 4, 5], [SOT, 9, 8, 7]])
    with torch.no_grad():
        ref = hf(input_features=torch.tensor(feats), decoder_input_ids=torch.tensor(tokens)).logits.numpy()
    ours = model(_named_features(feats), hax.named(jnp.asarray(tokens), ("batch", "position")))
    np.testing.assert_allclose(ours.rearrange(("batch", "position", "vocab")).array, ref, rtol=0, atol=1e-5)
    save_pretrained(model, tmp_path / "ours")
    back = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        again = back(input_features=torch.tensor(feats), decoder_input_ids=torch.tensor(tokens)).logits.numpy()
    np.testing.assert_array_equal(again, ref)
    with pytest.raises(ValueError, match="vocabulary is not padded"):
        load_pretrained(tmp_path / "hf", pad_vocab_to_multiple=64)
    with pytest.raises(ValueError, match="not fields of WhisperConfig"):
        load_pretrained(tmp_path / "hf", config_overrides={"no_such_field": 1})


def test_hugging_face_round_trip_is_bitwise(tmp_path) -> None:
    hf = _hf_model(80, seed=8)
    hf.save_pretrained(tmp_path / "hf")
    original = _safetensors(tmp_path / "hf")
    # transformers' float32 sinusoids are not sinusoids(): the stored table must be kept, not recomputed
    stored = original["model.encoder.embed_positions.weight"]
    assert not np.array_equal(stored, sinusoids(*stored.shape))
    model = load_whisper_pretrained(tmp_path / "hf")
    save_whisper_pretrained(model, tmp_path / "ours")
    written = _safetensors(tmp_path / "ours")
    assert set(written) == set(original)
    for name, value in original.items():
        assert written[name].dtype == value.dtype, name
        np.testing.assert_array_equal(written[name].view(np.uint8), value.view(np.uint8), err_msg=name)
    feats = _named_features(_features(80, batch=1, seed=9))
    tokens = hax.named(jnp.asarray([[SOT, 3, 4]]), ("batch", "position"))
    again = load_whisper_pretrained(tmp_path / "ours")
    np.testing.assert_array_equal(again(feats, tokens).array, model(feats, tokens).array)


def test_a_new_model_starts_from_the_sinusoids_and_they_get_no_gradient() -> None:
    cfg = WhisperConfig.preset("tiny").scaled(d_model=16, layers=1, heads=2, max_source_positions=8, vocab_size=32)
    model = cfg.build(key=jax.random.key(0))
    np.testing.assert_array_equal(model.model.encoder.embed_positions.weight.array, sinusoids(8, 16))
    feats = _named_features(_features(80, batch=1, frames=16))
    tokens = hax.named(jnp.asarray([[1, 2, 3]]), ("batch", "position"))
    grads = eqx.filter_grad(lambda m: m(feats, tokens).array.sum())(model)
    assert not np.asarray(grads.model.encoder.embed_positions.weight.array).any()
    assert np.asarray(grads.model.encoder.conv1.weight.array).any()
