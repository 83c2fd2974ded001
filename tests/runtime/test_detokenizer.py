"""IncrementalDetokenizer against the default model's byte-level BPE tokenizer (and a tiny
SentencePiece-style one): streamed deltas, split UTF-8 characters, stop strings, context."""

from __future__ import annotations

import random

import pytest

from radixlang.model_files import load_model_files
from radixlang.runtime.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    return load_model_files("smollm2-135m-instruct").load_tokenizer()


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(det: IncrementalDetokenizer, ids, check_stop: bool = True) -> list[str]:
    """Push ids until the request stops; return the deltas, flush's included if it did not."""
    deltas = []
    for i in ids:
        deltas.append(det.push(i, check_stop))
        if det.stopped:
            return deltas
    deltas.append(det.flush())
    return deltas


class CountingTokenizer:
    """Records how many ids each decode call was given."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


TEXTS = [
    "Hello, world! How are you today?",
    "def f(x):\n    return x * 2  # doubles\n\n\nprint(f(3))",
    "Punctuation... (brackets) [more] {and} 'quotes' \"double\" -- dashes; colons: ok?!",
    "🙂🎉 emoji 🙂 in 🎉 text 👍🏽 and a family 👨‍👩‍👧",
    "你好世界，今天天气很好。",
    "café naïve résumé Ünïcödé ñ",
    "  leading and trailing spaces  \t tab\n",
    "mixed 中文 English 日本語 🙂 done",
]


# ---- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_join_to_decode(tok, text):
    ids = enc(tok, text)
    det = IncrementalDetokenizer(tok)
    deltas = stream(det, ids)
    assert tok.decode(ids) == text
    assert "".join(deltas) == det.text == text
    assert det.matched_stop is None and not det.stopped and det.finished
    # The text has no U+FFFD, so no delta may carry half a character.
    assert all(REPLACEMENT not in d for d in deltas)


def test_split_emoji_is_held_until_complete(tok):
    ids = enc(tok, "🙂🎉")
    assert len(ids) == 5  # both emoji span several tokens
    det = IncrementalDetokenizer(tok)
    deltas = [det.push(i) for i in ids]
    assert deltas == ["", "🙂", "", "", "🎉"]
    assert det.flush() == ""


def test_text_before_an_incomplete_character_goes_out_at_once(tok):
    # 5549 is b" \xc3" (a space and the first byte of "é"), 119 is b"\xa9" (its second byte).
    det = IncrementalDetokenizer(tok)
    assert det.push(5549) == " "
    assert det.text == " "
    assert det.push(119) == "é"
    assert det.flush() == "" and det.text == " é" == tok.decode([5549, 119])


def test_bytes_that_never_complete_come_out_as_decode_renders_them(tok):
    first_byte = enc(tok, "你")[0]  # b"\xe4\xbd": an incomplete character on its own
    ids = [*enc(tok, "ok "), first_byte]
    det = IncrementalDetokenizer(tok)
    assert [det.push(i) for i in ids] == ["ok", " ", ""]
    assert det.flush() == REPLACEMENT
    assert det.text == tok.decode(ids) == "ok " + REPLACEMENT


def test_invalid_bytes_keep_the_window_short(tok):
    # A lone continuation byte is invalid, not incomplete: a model emitting many of them must
    # not make every decode longer; the text still equals decode's rendering.
    continuation = enc(tok, "你")[1]
    ids = [*enc(tok, "start"), *[continuation] * 40, *enc(tok, " end")]
    counting = CountingTokenizer(tok)
    det = IncrementalDetokenizer(counting)
    deltas = stream(det, ids)
    assert "".join(deltas) == det.text == tok.decode(ids) == "start" + REPLACEMENT * 40 + " end"
    # Released after 8 pending ids; the window then holds them as context plus 9 new ones.
    assert max(counting.lengths) <= 18


def test_decode_window_stays_short_on_long_outputs(tok):
    ids = enc(tok, " ".join(TEXTS) * 8)
    assert len(ids) > 500
    counting = CountingTokenizer(tok)
    det = IncrementalDetokenizer(counting, prompt_ids=enc(tok, "Some prompt text here"))
    assert "".join(stream(det, ids)) == tok.decode(ids)
    # O(1) per token: at most two short decodes per push, never the whole output.
    assert max(counting.lengths) <= 8
    assert len(counting.lengths) <= 2 * len(ids) + 3


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_match_decode_and_single_stop_cuts_at_first_occurrence(tok, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(TEXTS) for _ in range(3))
    ids = enc(tok, text)
    # Random stop: a slice of the text (so it occurs) or a string that does not.
    start = rng.randrange(len(text) - 4)
    stop = text[start : start + rng.randint(1, 4)] if rng.random() < 0.7 else "\x00never"
    det = IncrementalDetokenizer(tok, stop=[stop])
    deltas = stream(det, ids)
    assert "".join(deltas) == det.text
    cut = text.find(stop)
    if cut >= 0:
        assert det.matched_stop == stop and det.text == text[:cut]
    else:
        assert det.matched_stop is None and det.text == text
    assert stop not in "".join(deltas)


# ---- stop strings --------------------------------------------------------------------------
def test_stop_inside_one_token(tok):
    ids = enc(tok, "Hello world ###END### more")  # "Hello", " world", " ###", "END", ...
    det = IncrementalDetokenizer(tok, stop=["END"])
    deltas = stream(det, ids)
    assert det.stopped and det.matched_stop == "END"
    assert deltas == ["Hello", " world", " ###", ""]
    assert det.text == "Hello world ###"
    assert det.flush() == ""


def test_stop_spanning_two_tokens_is_held_then_cut(tok):
    ids = enc(tok, "abc</stop>def")  # "abc", "</", "stop", ">", "def"
    det = IncrementalDetokenizer(tok, stop=["stop>"])
    assert [det.push(i) for i in ids[:3]] == ["abc", "</", ""]  # "stop" may start the stop
    assert det.text == "abc</stop"  # decoded, but held back
    assert det.push(ids[3]) == ""
    assert det.matched_stop == "stop>" and det.text == "abc</"


def test_stop_spanning_three_tokens_starting_and_ending_mid_token(tok):
    ids = enc(tok, "abc</stop>def")
    det = IncrementalDetokenizer(tok, stop=["c</s"])
    # "c" ends "abc" and may start the stop: only "ab" goes out.
    assert [det.push(i) for i in ids[:3]] == ["ab", "", ""]
    assert det.stopped and det.matched_stop == "c</s" and det.text == "ab"
    with pytest.raises(RuntimeError, match="stop string matched"):
        det.push(ids[3])


def test_stop_at_the_very_start(tok):
    det = IncrementalDetokenizer(tok, stop=["Hello"])
    assert det.push(enc(tok, "Hello")[0]) == ""
    assert det.stopped and det.matched_stop == "Hello" and det.text == ""
    assert det.flush() == ""


def test_earliest_starting_stop_wins(tok):
    ids = enc(tok, "The answer is 42.")  # "The", " answer", " is", ...
    # Both complete with " is"; "answer is" starts first. "answer" was held back as its start.
    det = IncrementalDetokenizer(tok, stop=["is", "answer is"])
    assert stream(det, ids) == ["The", " ", ""]
    assert det.matched_stop == "answer is" and det.text == "The "


def test_stop_completed_first_wins_over_a_longer_one_still_pending(tok):
    ids = enc(tok, "The answer is 42.")
    det = IncrementalDetokenizer(tok, stop=["is 42.", "42"])
    assert "".join(stream(det, ids)) == "The answer is "
    assert det.matched_stop == "42" and det.text == "The answer is "


def test_tie_at_the_same_start_takes_the_shortest(tok):
    ids = enc(tok, "abcdef")
    det = IncrementalDetokenizer(tok, stop=["abc", "ab"])
    assert det.push(ids[0]) == ""
    assert det.matched_stop == "ab" and det.text == ""


def test_never_completed_stop_prefix_is_held_then_released_by_flush(tok):
    ids = enc(tok, "Hello world ###")  # "Hello", " world", " ###"
    det = IncrementalDetokenizer(tok, stop=["###END!"])
    assert [det.push(i) for i in ids] == ["Hello", " world", " "]
    assert det.text == "Hello world ###"  # "###" decoded but not streamed
    assert det.flush() == "###"
    assert det.matched_stop is None and det.text == "Hello world ###"
    with pytest.raises(RuntimeError, match="flush"):
        det.push(ids[0])
    assert det.flush() == ""


def test_broken_stop_prefix_is_released_with_the_next_token(tok):
    ids = enc(tok, "Hello world ###END### more")
    det = IncrementalDetokenizer(tok, stop=["###STOP"])
    deltas = stream(det, ids)
    assert deltas == ["Hello", " world", " ", "###END", "", "### more", ""]
    assert det.text == "Hello world ###END### more" and det.matched_stop is None


def test_check_stop_false_ignores_stops(tok):
    ids = enc(tok, "Hello world ###END### more")
    det = IncrementalDetokenizer(tok, stop=["END", "world"])
    deltas = stream(det, ids, check_stop=False)
    assert "".join(deltas) == det.text == "Hello world ###END### more"
    assert det.matched_stop is None and not det.stopped


def test_stop_ending_after_min_new_tokens_is_cut_even_if_it_began_before(tok):
    ids = enc(tok, "Hello world ###END### more")
    det = IncrementalDetokenizer(tok, stop=["world", " ###END"])
    # The first three tokens are unchecked (min_new_tokens = 3): " world" does not stop, but
    # " ###" is held back as it may start " ###END".
    assert [det.push(i, check_stop=False) for i in ids[:3]] == ["Hello", " world", ""]
    assert det.push(ids[3]) == ""
    assert det.matched_stop == " ###END" and det.text == "Hello world"


def test_stop_found_in_text_released_by_flush(tok):
    # "!" waits behind the incomplete character; the stop is still found when flush releases it.
    ids = [*enc(tok, "Hi!"), enc(tok, "你")[0]]
    det = IncrementalDetokenizer(tok, stop=["!" + REPLACEMENT])
    assert [det.push(i) for i in ids] == ["Hi", "", ""]
    assert det.flush() == ""
    assert det.matched_stop == "!" + REPLACEMENT and det.text == "Hi"


def test_bad_stop_arguments(tok):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, stop=["ok", ""])
    with pytest.raises(TypeError):
        IncrementalDetokenizer(tok, stop="oops")


# ---- special tokens and prompt context -----------------------------------------------------
def test_special_tokens_skipped_or_kept(tok):
    ids = [*enc(tok, "x"), tok.eos_token_id, *enc(tok, "y")]
    skipped = IncrementalDetokenizer(tok)
    assert "".join(stream(skipped, ids)) == skipped.text == "xy" == tok.decode(ids, True)
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == kept.text == "x<|im_end|>y"
    assert kept.text == tok.decode(ids, skip_special_tokens=False)


def test_stop_on_a_kept_special_token(tok):
    ids = [*enc(tok, "x"), tok.eos_token_id, *enc(tok, "y")]
    det = IncrementalDetokenizer(tok, stop=[tok.eos_token], skip_special_tokens=False)
    assert stream(det, ids) == ["x", ""]
    assert det.matched_stop == "<|im_end|>" and det.text == "x"


@pytest.mark.parametrize("skip", [True, False])
def test_prompt_context_does_not_leak(tok, skip):
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say something"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = enc(tok, prompt)
    output = "Sure thing! 🙂 你好"
    ids = enc(tok, output)
    det = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=skip)
    deltas = stream(det, ids)
    assert "".join(deltas) == det.text == output == tok.decode(ids)
    assert deltas[0] == "Sure"


def test_prompt_ending_inside_a_character_is_not_used_as_context(tok):
    first, rest = enc(tok, "你")  # the prompt ends with the first half of the character
    det = IncrementalDetokenizer(tok, prompt_ids=[*enc(tok, "Hi "), first])
    assert "".join(stream(det, [rest, *enc(tok, "ok")])) == det.text
    assert det.text == tok.decode([rest, *enc(tok, "ok")]) == REPLACEMENT + "ok"


@pytest.fixture(scope="module")
def sp_tok():
    """A Llama-style (SentencePiece) decoder: "▁" is a space, the first one is stripped, and
    bytes come as <0xNN> tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "!", "Hi", "<0xF0>", "<0x9F>"]
    pieces += ["<0x99>", "<0x82>"]
    inner = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    inner.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_sentencepiece_leading_space_kept_by_context(sp_tok):
    hi, hello, world, bang = 6, 3, 4, 5
    assert sp_tok.decode([hello, world]) == "Hello world"  # the first space is stripped
    det = IncrementalDetokenizer(sp_tok, prompt_ids=[1, hi])
    assert stream(det, [hello, world, bang]) == [" Hello", " world", "!", ""]
    whole, prompt = sp_tok.decode([1, hi, hello, world, bang]), sp_tok.decode([1, hi])
    assert det.text == whole[len(prompt) :] == " Hello world!"
    # Without a prompt the output starts a sequence, as decode(output) renders it.
    det = IncrementalDetokenizer(sp_tok)
    assert "".join(stream(det, [hello, world])) == det.text == "Hello world"


def test_sentencepiece_byte_fallback_run_is_held(sp_tok):
    hello, emoji_bytes = 3, [7, 8, 9, 10]
    assert sp_tok.decode([hello, 7, 8]) == "Hello" + REPLACEMENT * 2  # one per byte
    det = IncrementalDetokenizer(sp_tok)
    assert [det.push(i) for i in [hello, *emoji_bytes]] == ["Hello", "", "", "", "🙂"]
    assert det.flush() == "" and det.text == "Hello🙂"


def test_stop_completed_while_unchecked_does_not_match_later(tok):
    ids = enc(tok, "abc</stop>def")  # "abc", "</", "stop", ">", "def"
    det = IncrementalDetokenizer(tok, stop=["c</stop>", "</"])
    # "</" completes while unchecked; it stays in the held-back "c</" ...
    assert [det.push(i, check_stop=False) for i in ids[:2]] == ["ab", ""]
    # ... and is not matched by the checked tokens that follow; "c</stop>" is.
    assert det.push(ids[2]) == ""
    assert det.push(ids[3]) == ""
    assert det.matched_stop == "c</stop>" and det.text == "ab"


@pytest.mark.parametrize(("prompt_len", "context_len"), [(0, 0), (3, 3), (5, 5), (12, 5)])
def test_context_is_the_prompt_tail(tok, prompt_len, context_len):
    prompt_ids = enc(tok, "one two three four five six seven eight nine ten eleven twelve")
    counting = CountingTokenizer(tok)
    det = IncrementalDetokenizer(counting, prompt_ids=prompt_ids[:prompt_len])
    assert det.push(enc(tok, " yes")[0]) == " yes"
    # The push decodes the context with the new id, then the new id alone as the next context.
    assert counting.lengths[-2:] == [context_len + 1, 1]
