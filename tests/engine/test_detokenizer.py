"""`IncrementalDetokenizer`: streamed pieces add up to the full decode (and to transformers'),
never show half a UTF-8 character, and stop strings cut the text without ever streaming part of
one."""

from __future__ import annotations

import json
import pathlib
import random

import pytest
from helpers.hf_models import EOS_ID, SPECIAL_TOKENS, corpus

from aserve.engine.detokenizer import IncrementalDetokenizer
from aserve.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world. The quick brown fox jumps over the lazy dog.",
    "Emoji 😀🎉👍🏽 and ❤️ hearts 🚀🦜",
    "中文文本测试：你好，世界！今天天气很好。",
    "日本語のテキスト and 한국어 문장 mixed with English",
    "Ünïcödé äccents: café, naïve, résumé 𝔘𝔫𝔦",
    "  spaces\t\ttabs\n\nnewlines  ",
    "special <|im_end|> inside <|im_start|>text<|endoftext|>",
]
PROMPT = "<|im_start|>user\nSay something 😀<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A SentencePiece-style tokenizer (Metaspace, byte fallback, a decoder that strips one
    leading space) trained on ASCII only, so other characters come out of `<0xNN>` tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    backend.train_from_iterator([t for t in corpus() if t.isascii()], trainer=trainer)
    data = json.loads(backend.to_str())  # byte tokens as plain vocab entries, as in Llama's
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in byte_tokens]
    out = tmp_path_factory.mktemp("sp")
    (out / "tokenizer.json").write_text(json.dumps(data))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def random_chunks(ids: list[int], rng: random.Random, max_chunk: int) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> tuple[list[str], str | None]:
    """Feed `chunks` as an engine would, the last one with finished=True; return the streamed
    pieces and the stop string that ended the output (None if none did)."""
    pieces = []
    for i, chunk in enumerate(chunks):
        finished = i == len(chunks) - 1
        stop_str = detok.update(chunk, finished=finished)
        finished = finished or stop_str is not None
        pieces.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop_str is not None:
            return pieces, stop_str
    return pieces, None


def make(tok: Tokenizer, prompt: str = PROMPT, **kwargs) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, tok.encode(prompt), **kwargs)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("max_chunk", [1, 3, 8])
def test_streamed_text_equals_full_decode_and_transformers(tok, hf, skip_special_tokens,
                                                           max_chunk):
    rng = random.Random(max_chunk)
    for text in TEXTS:
        ids = tok.encode(text) + [EOS_ID]
        chunks = [[i] for i in ids] if max_chunk == 1 else random_chunks(ids, rng, max_chunk)
        detok = make(tok, skip_special_tokens=skip_special_tokens)
        pieces, stop_str = stream(detok, chunks)
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert stop_str is None
        assert "".join(pieces) == detok.output_text == full
        assert full == hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert not any("\ufffd" in piece for piece in pieces)
        assert detok.num_output_tokens == len(ids) and detok.output_token_ids == ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids_stream_to_full_decode(tok, hf, skip_special_tokens):
    """Arbitrary ids, specials included, can leave invalid UTF-8 behind: the held-back bytes come
    out when the request finishes, and a replacement character only streams if the full decode
    has one at that point."""
    rng = random.Random(1)
    for trial in range(400):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        chunks = random_chunks(ids, rng, 1 + trial % 5)
        detok = make(tok, prompt=rng.choice(["", "x", PROMPT]),
                     skip_special_tokens=skip_special_tokens)
        pieces, _ = stream(detok, chunks)
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == detok.output_text == full, ids
        assert full == hf.decode(ids, skip_special_tokens=skip_special_tokens)
        streamed = ""
        for piece in pieces:
            streamed += piece
            assert full.startswith(streamed)  # never a replacement the full text lacks


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deferred_text_is_the_streamed_text_decoded_once_at_the_end(tok, sp_dir,
                                                                     skip_special_tokens):
    sp = Tokenizer.from_dir(sp_dir)
    rng = random.Random(7)
    for trial in range(300):
        t = (tok, sp)[trial % 2]
        ids = [rng.randrange(t.vocab_size) for _ in range(rng.randint(1, 40))]
        prompt = t.encode(rng.choice(["", "x", "Say é", PROMPT]))
        chunks = random_chunks(ids, rng, 1 + trial % 4)
        streamed = IncrementalDetokenizer(t, prompt, skip_special_tokens=skip_special_tokens)
        deferred = IncrementalDetokenizer(t, prompt, skip_special_tokens=skip_special_tokens,
                                          defer=True)
        decodes = []
        decode = t.decode
        t.decode = lambda *a, _calls=decodes, _decode=decode, **k: (_calls.append(1)
                                                                    or _decode(*a, **k))
        try:
            for i, chunk in enumerate(chunks):
                assert deferred.update(chunk, finished=i == len(chunks) - 1) is None
                if i < len(chunks) - 1:
                    assert deferred.output_text == "" and not decodes
        finally:
            del t.decode
        stream(streamed, chunks)
        assert deferred.output_text == streamed.output_text, (ids, prompt)
        assert len(decodes) <= 2  # the window and its new prefix, once
        assert deferred.output_token_ids == ids


def test_stop_strings_are_never_deferred(tok):
    detok = make(tok, stop=["lo"], defer=True)
    assert not detok.defer
    assert detok.update(tok.encode("Hello", add_special_tokens=False)) == "lo"


def test_split_emoji_is_held_back_until_complete(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # the byte-level BPE splits it over several tokens
    detok = make(tok)
    for token_id in ids[:-1]:
        assert detok.update([token_id]) is None
        assert detok.output_text == "" and detok.get_next_output_text(False, True) == ""
    detok.update(ids[-1:])
    assert detok.get_next_output_text(False, True) == "😀"


def test_incomplete_utf8_is_flushed_when_finished(tok):
    ids = tok.encode("😀")[:-1]
    detok = make(tok)
    detok.update(ids)
    assert detok.get_next_output_text(False, True) == ""
    detok.update([], finished=True)
    assert detok.get_next_output_text(True, True) == tok.decode(ids) == "\ufffd"


def test_prompt_ending_inside_a_character_is_not_completed_by_output(tok):
    emoji = tok.encode("😀")
    detok = IncrementalDetokenizer(tok, tok.encode("a") + emoji[:1])
    detok.update(emoji[1:], finished=True)
    assert detok.output_text == tok.decode(emoji[1:])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_output(tok, include):
    text = TEXTS[0]
    detok = make(tok, stop=["fox"], include_stop_str_in_output=include)
    pieces, stop_str = stream(detok, [[i] for i in tok.encode(text)])
    cut = text.index("fox") + (len("fox") if include else 0)
    assert stop_str == "fox"
    assert detok.output_text == "".join(pieces) == text[:cut]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["lo wor", "😀🎉", "ji 😀", "你好，世"])
def test_stop_string_split_across_tokens(tok, stop, include):
    text = next(t for t in TEXTS + ["Hello world"] if stop in t)
    ids = tok.encode(text)
    assert all(stop not in tok.decode([i]) for i in ids)  # no single token holds it
    for max_chunk in (1, 2, 5):
        detok = make(tok, stop=[stop, "never appears"], include_stop_str_in_output=include)
        pieces, stop_str = stream(detok, random_chunks(ids, random.Random(max_chunk), max_chunk))
        cut = text.index(stop) + (len(stop) if include else 0)
        assert stop_str == stop
        assert "".join(pieces) == detok.output_text == text[:cut]


def test_stop_string_is_never_streamed_partially(tok):
    text, stop = TEXTS[0], "brown fox"
    detok = make(tok, stop=[stop])
    streamed = ""
    for token_id in tok.encode(text):
        stop_str = detok.update([token_id])
        streamed += detok.get_next_output_text(finished=stop_str is not None, delta=True)
        if stop_str is None:  # a streamed tail is never the start of the stop string
            assert not any(streamed.endswith(stop[:k]) for k in range(1, len(stop)))
            assert len(streamed) <= max(len(detok.output_text) - (len(stop) - 1), 0)
        else:
            break
    assert streamed == text[:text.index(stop)]


def test_earliest_completed_stop_string_wins(tok):
    text = TEXTS[0]
    detok = make(tok, stop=["brown fox", "quick"])
    detok.update(tok.encode(text))  # all at once: both appear in the same update
    assert detok.stop_str == "quick"
    assert detok.output_text == text[:text.index("quick")]


def test_update_after_stop_changes_nothing(tok):
    detok = make(tok, stop=["world"])
    assert detok.update(tok.encode("Hello world and more")) == "world"
    assert detok.update(tok.encode(" further text"), finished=True) is None
    assert detok.output_text == "Hello "
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello "


def test_stop_string_matching_output_start_gives_empty_text(tok):
    detok = make(tok, stop=["Hel"])
    assert detok.update(tok.encode("Hello")) == "Hel"
    assert detok.output_text == "" and detok.get_next_output_text(True, True) == ""


def test_special_token_text_as_stop_string_when_not_skipped(tok):
    ids = tok.encode("answer<|im_end|>trailing")
    detok = make(tok, skip_special_tokens=False, stop=[SPECIAL_TOKENS[2]])
    pieces, stop_str = stream(detok, [[i] for i in ids])
    assert stop_str == "<|im_end|>" and "".join(pieces) == "answer"


def test_non_delta_output_holds_back_stop_buffer_until_finished(tok):
    detok = make(tok, stop=["xyz12"])
    detok.update(tok.encode("Hello world"))
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello w"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello world"
    detok = make(tok, stop=["xyz12"], include_stop_str_in_output=True)
    detok.update(tok.encode("Hello world"))
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello world"


def test_random_stop_strings_cut_at_first_occurrence(tok):
    rng = random.Random(2)
    for trial in range(200):
        text = "".join(rng.sample(TEXTS[:5], 2))
        ids = tok.encode(text)
        start = rng.randrange(len(text) - 4)
        stop = text[start:start + rng.randint(1, 4)]
        include = trial % 2 == 1
        detok = make(tok, stop=[stop], include_stop_str_in_output=include)
        pieces, stop_str = stream(detok, random_chunks(ids, rng, 4))
        first = text.index(stop)
        expected = text[:first + len(stop)] if include else text[:first]
        assert stop_str == stop
        assert "".join(pieces) == detok.output_text == expected


def test_decoding_window_stays_small(tok, monkeypatch):
    """Each step decodes a few tokens, not the whole output: per-token cost is O(new tokens)."""
    ids = tok.encode(" ".join(TEXTS) * 20)
    sizes = []
    original = tok.decode
    monkeypatch.setattr(tok, "decode", lambda i, **kw: (sizes.append(len(i)), original(i, **kw))[1])
    detok = make(tok)
    for token_id in ids:
        detok.update([token_id])
    detok.update([], finished=True)
    assert detok.output_text == original(ids)
    assert len(ids) > 1000 and max(sizes) <= 8


def test_byte_fallback_text_streams_exactly(sp_dir):
    """Characters split over `<0xNN>` tokens never stream half-done, and the pieces add up to
    the full decode, transformers' included."""
    transformers = pytest.importorskip("transformers")
    sp, ref = Tokenizer.from_dir(sp_dir), transformers.AutoTokenizer.from_pretrained(sp_dir)
    assert len(sp.byte_token_ids) == 256
    rng = random.Random(3)
    for text in TEXTS:
        ids = sp.encode(text, add_special_tokens=False)
        assert ids == ref(text, add_special_tokens=False)["input_ids"]
        for max_chunk in (1, 3):
            detok = IncrementalDetokenizer(sp, [])
            pieces, _ = stream(detok, random_chunks(ids, rng, max_chunk))
            assert "".join(pieces) == detok.output_text == sp.decode(ids)
            assert sp.decode(ids) == ref.decode(ids, skip_special_tokens=True)
            assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_fallback_random_ids_stream_to_full_decode(sp_dir, skip_special_tokens):
    """A run of byte tokens decodes as a whole (one U+FFFD per byte when invalid), so text is
    held while the ids end in one; a skipped special token does not end the run."""
    sp = Tokenizer.from_dir(sp_dir)
    rng = random.Random(4)
    for _ in range(400):
        ids = [rng.randrange(sp.vocab_size) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(sp, [], skip_special_tokens=skip_special_tokens)
        pieces, _ = stream(detok, random_chunks(ids, rng, 3))
        assert "".join(pieces) == sp.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_sentencepiece_first_output_token_keeps_its_space_after_a_prompt(sp_dir):
    sp = Tokenizer.from_dir(sp_dir)
    prompt, ids = sp.encode("Say:"), sp.encode("Hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(sp, prompt)
    detok.update(ids, finished=True)
    assert sp.decode(ids) == "Hello world"  # decoded alone, the space is stripped
    assert detok.output_text == " Hello world" == sp.decode(prompt + ids)[len("Say:"):]


def test_output_bytes_do_not_join_the_prompts_byte_run(sp_dir):
    sp = Tokenizer.from_dir(sp_dir)
    prompt = sp.encode("Say é")
    assert prompt[-1] in sp.byte_token_ids
    ids = [sp.token_to_id("<0x80>"), sp.token_to_id("e")]
    detok = IncrementalDetokenizer(sp, prompt)
    detok.update(ids, finished=True)
    assert detok.output_text == sp.decode(ids) == "\ufffde"
