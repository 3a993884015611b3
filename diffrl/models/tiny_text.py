"""Tiny tokenizers built offline, for the tiny random pipelines of every family.

Real checkpoints ship tokenizers with tens of thousands of tokens; the tiny pipelines need the
same *classes* (so the pipelines' own `encode_prompt` runs unchanged and `from_pretrained` reloads
them) with a vocabulary small enough for a few-kB embedding table. Both builders start from one
shared word list, `WORDS` (the shapes world's vocabulary plus common prompt words), so prompts like
"a red circle left of a blue square" tokenize into whole words, and anything else still
tokenizes (CLIP: byte-level characters; T5: characters, else `<unk>`).

- `clip_tokenizer()` -> `transformers.CLIPTokenizer` (the class SD3's and FLUX's model_index.json
  name): CLIP's own normalizer (lower-casing), pre-tokenizer and byte-level BPE with "</w>"
  word ends. Layout as in the real CLIP vocabulary: the 256 byte symbols, the same 256 with
  "</w>", the merged tokens, then `<|startoftext|>` (bos) and `<|endoftext|>` (eos, also pad
  and unk) as the last two ids. Merges are learned here, deterministically, by plain BPE on
  `WORDS`, so every listed word becomes one token. `model_max_length` 77.
- `t5_tokenizer()` -> `transformers.T5TokenizerFast` (SD3's tokenizer_3, FLUX's tokenizer_2; Wan
  loads the same class through AutoTokenizer): a Unigram model with T5's special ids (pad 0,
  eos 1, unk 2), "▁word" pieces for `WORDS` and single characters as the fallback; eos appended.

Use `save_pretrained(dir)` (or hand the tokenizer to a pipeline and save the pipeline); the
classes reload the directory with `from_pretrained` to the same ids. `text_encoder_ids(tokenizer)`
gives the ids a matching transformers text-encoder config needs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import pairwise

from tokenizers import pre_tokenizers
from transformers import CLIPTokenizer, T5TokenizerFast

_WORDS_TEXT = """
    a an the of and or with without on in at to by from for is are this that there
    one two three four five six seven eight nine ten zero no many some several few
    red green blue yellow orange purple pink brown black white gray grey cyan magenta gold silver
    circle circles square squares triangle triangles rectangle rectangles star stars ellipse
    hexagon pentagon diamond heart cross ring dot dots line lines shape shapes object objects
    small large big tiny huge medium little long short tall wide thin thick bright dark
    left right above below top bottom next beside under over near inside outside behind front
    middle center corner between around
    photo picture image painting drawing render illustration sign text saying word words written
    letter letters number background foreground scene style high quality detailed simple plain
    cat dog bird car tree house person man woman child flower apple table chair book cup
    """
#: Words the tiny tokenizers know as whole tokens: the shapes world (colours, shapes, sizes,
#: counts, spatial relations) and words common in prompt sets (GenEval-, OCR-style prompts).
WORDS: tuple[str, ...] = tuple(_WORDS_TEXT.split())

CLIP_BOS = "<|startoftext|>"
CLIP_EOS = "<|endoftext|>"


def _learn_bpe_merges(words: Sequence[str]) -> list[tuple[str, str]]:
    """Plain BPE on `words` (each counted once), until every word is a single symbol.

    Symbols are characters, the last one of a word carrying CLIP's "</w>" suffix. Each round
    merges the most frequent adjacent pair (ties: the lexicographically smallest), so the result is
    deterministic, and applying the merges in rank order (what the BPE model does at encode time)
    reproduces the training segmentation: every word of `words` encodes to one token.
    """
    segs = {w: [*w[:-1], w[-1] + "</w>"] for w in dict.fromkeys(words) if w}
    merges: list[tuple[str, str]] = []
    while True:
        pairs = Counter(p for seg in segs.values() for p in pairwise(seg))
        if not pairs:
            return merges
        best_count = max(pairs.values())
        pair = min(p for p, c in pairs.items() if c == best_count)
        merges.append(pair)
        for w, seg in segs.items():
            out, i = [], 0
            while i < len(seg):
                if i + 1 < len(seg) and (seg[i], seg[i + 1]) == pair:
                    out.append(seg[i] + seg[i + 1])
                    i += 2
                else:
                    out.append(seg[i])
                    i += 1
            segs[w] = out


def clip_tokenizer(
    vocab_words: Sequence[str] = WORDS, model_max_length: int = 77, pad_token: str = CLIP_EOS
) -> CLIPTokenizer:
    """A small CLIP byte-level BPE tokenizer whose whole-word tokens are `vocab_words` (lower-cased).

    `pad_token`: `<|endoftext|>` as CLIP-L's tokenizer (SD3 `tokenizer`, FLUX `tokenizer`); SD3's
    CLIP-G tokenizer (`tokenizer_2`) pads with "!", which is also in this vocabulary.
    """
    words = [w.lower() for w in vocab_words]
    if any(not w.isalpha() for w in words):
        bad = [w for w in words if not w.isalpha()]
        raise ValueError(
            f"vocab_words must be alphabetic words (CLIP's pre-tokenizer splits at anything else); got {bad}"
        )
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges = _learn_bpe_merges(words)
    tokens += ["".join(m) for m in merges]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    vocab[CLIP_BOS] = len(vocab)
    vocab[CLIP_EOS] = len(vocab)
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=CLIP_EOS,
        bos_token=CLIP_BOS,
        eos_token=CLIP_EOS,
        pad_token=pad_token,
        model_max_length=model_max_length,
    )


def t5_tokenizer(vocab_words: Sequence[str] = WORDS, model_max_length: int = 512) -> T5TokenizerFast:
    """A small T5 Unigram tokenizer: pad 0, eos 1, unk 2, "▁word" pieces, characters as fallback.

    Case-sensitive like T5 (no normaliser); no sentinel `<extra_id_*>` tokens (RL never uses them).
    """
    chars = [chr(c) for c in range(33, 127)]  # printable ASCII except space
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    # Whole words score far above any split into characters, so Viterbi picks them.
    pieces += [(f"▁{w}", -4.0) for w in dict.fromkeys(vocab_words)]
    pieces += [(f"▁{c}", -9.0) for c in chars]
    pieces += [(c, -10.0) for c in chars]
    seen: set[str] = set()
    unique = [(p, s) for p, s in pieces if not (p in seen or seen.add(p))]
    return T5TokenizerFast(
        vocab=unique,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=0,
        model_max_length=model_max_length,
    )


def text_encoder_ids(tokenizer) -> dict[str, int]:
    """`vocab_size` and special-token ids for a transformers text-encoder config matching `tokenizer`.

    CLIP's text model pools at the eos position found from `eos_token_id`, so its config must carry
    the tokenizer's ids; T5 configs take `pad_token_id` / `eos_token_id` / `decoder_start_token_id`.
    """
    ids = {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if tokenizer.bos_token_id is not None:
        ids["bos_token_id"] = tokenizer.bos_token_id
    return ids


__all__ = ["CLIP_BOS", "CLIP_EOS", "WORDS", "clip_tokenizer", "t5_tokenizer", "text_encoder_ids"]
