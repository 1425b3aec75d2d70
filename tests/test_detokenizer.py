"""The engine's incremental detokenizer (pure logic, real tokenizers built here): fed an output a few tokens at a
time, its text is always the start of the whole output's decode (all of it at the end, for text a trained model
writes), bytes that form no character included, and its window of tokens stays short."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from worker.engine.detokenizer import IncrementalDetokenizer

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Ünïcödé wörds, 日本語のテキスト, emoji 🙂🚀 and more.",
          "def f(x):\n    return x ** 2  # code, with   spaces", "naïve café déjà vu — “quotes” ‘too’"] * 30
SPECIAL = ["<|pad|>", "<|end|>", "<|user|>"]


def _byte_level():
    raw = Tokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return raw


def _metaspace():  # SentencePiece's way (Llama 2, Mistral): spaces as ▁, byte fallback for unknown characters
    raw = Tokenizer(models.BPE(unk_token=None, byte_fallback=True))
    raw.normalizer = normalizers.Replace(" ", "▁")
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL + [f"<0x{b:02X}>" for b in range(256)], show_progress=False))
    return raw


def _wordpiece():
    raw = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.decoder = decoders.WordPiece()
    raw.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=SPECIAL + ["[UNK]"],
                                                              show_progress=False))
    return raw


@pytest.mark.parametrize("build", [_byte_level, _metaspace, _wordpiece])
def test_incremental_text_is_the_whole_decode(build):
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build(), pad_token="<|pad|>", eos_token="<|end|>")
    rng = random.Random(0)
    texts = [rng.choice(CORPUS)[rng.randrange(20):] for _ in range(20)]
    texts_ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]  # what a trained model writes
    outputs = texts_ids + [[rng.randrange(len(tokenizer)) for _ in range(200)] for _ in range(20)]  # random weights
    for out in outputs:
        detok, longest = IncrementalDetokenizer(tokenizer), 0
        at = 0
        while at < len(out):
            at = min(len(out), at + rng.choice([1, 1, 1, 2, 5]))
            piece_from = len(detok.text)
            piece = detok.update(out[:at])
            whole = tokenizer.decode(out[:at], skip_special_tokens=True)
            assert detok.text[piece_from:] == piece and whole.startswith(detok.text), (out[:at], detok.text, whole)
            longest = max(longest, len(detok._window))
        if out in texts_ids:  # valid UTF-8 throughout: all of it, from the tokens of one update and a few before
            assert detok.text == tokenizer.decode(out, skip_special_tokens=True) and longest <= 9
        else:  # runs of bytes that are no character wait longer (seen: 18 tokens), not for the whole output
            assert longest <= 40
