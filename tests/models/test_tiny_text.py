import json

import pytest
from transformers import AutoTokenizer, CLIPTokenizer, T5TokenizerFast

from diffrl.models.tiny_text import CLIP_BOS, CLIP_EOS, WORDS, clip_tokenizer, t5_tokenizer, text_encoder_ids

PROMPTS = ["a red circle left of a blue square", "A photo of 3 CATS, zebra! é", ""]


@pytest.fixture(scope="module")
def clip():
    return clip_tokenizer()


@pytest.fixture(scope="module")
def t5():
    return t5_tokenizer()


def test_clip_special_tokens_like_real_clip(clip):
    n = len(clip)
    assert (clip.bos_token, clip.eos_token, clip.pad_token, clip.unk_token) == (
        CLIP_BOS,
        CLIP_EOS,
        CLIP_EOS,
        CLIP_EOS,
    )
    # real CLIP: bos and eos are the last two ids (49406, 49407)
    assert (clip.bos_token_id, clip.eos_token_id) == (n - 2, n - 1)
    assert clip.model_max_length == 77
    assert text_encoder_ids(clip) == {
        "vocab_size": n,
        "eos_token_id": n - 1,
        "pad_token_id": n - 1,
        "bos_token_id": n - 2,
    }


def test_clip_words_are_single_tokens_and_lowercased(clip):
    for word in WORDS:
        ids = clip(word, add_special_tokens=False).input_ids
        assert clip.convert_ids_to_tokens(ids) == [word + "</w>"], word
    assert clip("RED Circle").input_ids == clip("red circle").input_ids
    # unknown words fall back to byte-level characters, never to unk
    ids = clip("zebra é", add_special_tokens=False).input_ids
    assert clip.unk_token_id not in ids and len(ids) > 2
    assert clip.decode(ids) == "zebra é"


def test_clip_padding_and_truncation_as_the_pipelines_call_it(clip):
    # SD3/FLUX: tokenizer(prompt, padding="max_length", max_length=77, truncation=True)
    enc = clip(PROMPTS, padding="max_length", max_length=clip.model_max_length, truncation=True)
    words = PROMPTS[0].split()
    ids = enc.input_ids[0]
    assert all(len(row) == 77 for row in enc.input_ids)
    assert ids[0] == clip.bos_token_id
    assert clip.convert_ids_to_tokens(ids[1 : 1 + len(words)]) == [w + "</w>" for w in words]
    assert ids[1 + len(words) :] == [clip.eos_token_id] * (76 - len(words))
    assert enc.input_ids[2][:2] == [clip.bos_token_id, clip.eos_token_id]
    long = clip(" ".join(["red"] * 100), padding="max_length", max_length=77, truncation=True).input_ids
    assert len(long) == 77 and long[0] == clip.bos_token_id and long[-1] == clip.eos_token_id


def test_t5_special_ids_and_words(t5):
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2)
    assert t5.bos_token_id is None
    for word in WORDS:
        assert t5.convert_ids_to_tokens(t5(word).input_ids) == ["▁" + word, "</s>"], word
    assert text_encoder_ids(t5) == {"vocab_size": len(t5), "eos_token_id": 1, "pad_token_id": 0}
    # characters outside the vocabulary are <unk>, ASCII falls back to characters
    assert t5.unk_token_id in t5("é").input_ids
    assert t5.decode(t5("zebra CATS!").input_ids, skip_special_tokens=True) == "zebra CATS!"


def test_t5_padding_and_truncation_as_the_pipelines_call_it(t5):
    # SD3 tokenizer_3 / FLUX tokenizer_2: padding="max_length", max_length=L, truncation=True
    enc = t5(PROMPTS, padding="max_length", max_length=12, truncation=True, add_special_tokens=True)
    n = len(PROMPTS[0].split())
    assert enc.input_ids[0][n:] == [1] + [0] * (11 - n)
    assert enc.attention_mask[0] == [1] * (n + 1) + [0] * (11 - n)
    assert enc.input_ids[2] == [1] + [0] * 11
    long = t5(" ".join(["red"] * 40), padding="max_length", max_length=12, truncation=True).input_ids
    assert len(long) == 12 and long[-1] == t5.eos_token_id


def test_round_trip_save_from_pretrained(tmp_path, clip, t5):
    clip.save_pretrained(tmp_path / "clip")
    t5.save_pretrained(tmp_path / "t5")
    for cls, tok, sub in (
        (CLIPTokenizer, clip, "clip"),
        (T5TokenizerFast, t5, "t5"),
        (AutoTokenizer, t5, "t5"),
    ):
        loaded = cls.from_pretrained(tmp_path / sub)
        assert type(loaded) is type(tok)
        assert loaded.model_max_length == tok.model_max_length
        kw = {"padding": "max_length", "max_length": 20, "truncation": True}
        assert loaded(PROMPTS, **kw).input_ids == tok(PROMPTS, **kw).input_ids
        assert loaded.all_special_ids == tok.all_special_ids
        assert loaded.get_vocab() == tok.get_vocab()
    config = json.loads((tmp_path / "clip" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "CLIPTokenizer"


def test_builders_are_deterministic_and_take_words():
    assert clip_tokenizer().get_vocab() == clip_tokenizer().get_vocab()
    assert t5_tokenizer().get_vocab() == t5_tokenizer().get_vocab()
    custom = clip_tokenizer(vocab_words=["zebra"])
    assert custom.convert_ids_to_tokens(custom("zebra", add_special_tokens=False).input_ids) == ["zebra</w>"]
    assert len(custom) < len(clip_tokenizer())
    with pytest.raises(ValueError, match="alphabetic"):
        clip_tokenizer(vocab_words=["red-ish"])
