"""The earlier regex automaton (benchmarks/regex_automaton.py, bench_grammar_engines' peer) on
a small hand-made vocabulary, checked against a brute-force oracle built on Python's ``re``: a
token is allowed exactly when the text so far plus its text can still be completed into a full
match."""

from __future__ import annotations

import random
import re

import interegular
import pytest
import torch
from bench_module import load

from radixlang.constrain import DTYPE_REGEXES, ConstraintError, dtype_regex, token_vocabulary

automaton = load("regex_automaton")
RegexConstraint = automaton.RegexConstraint
RegexGuide = automaton.RegexGuide
get_regex_guide = automaton.get_regex_guide

EOS = 0
TOKENS = [
    "<eos>",  # 0: special
    "0",
    "1",
    "2",
    "12",
    "-",
    "+",
    "-1",
    "a",
    "b",
    "ab",
    "ba",
    "abab",
    "x",
    "yes",
    "no",
    "y",
    "es",
    "n",
    "o",
    " ",
    '"',
    '"a',
    'a"',
    '"ab"',
    "\n",
    ".",
    "1.",
    ".5",
    "5",
    "True",
    "False",
    "Tr",
    "ue",
    "\ufffd",  # a lone byte of a multi-byte character, as a byte-level BPE decodes it alone
    "",  # decodes to nothing
    "<pad>",  # 36: special
]
SPECIAL = {0, 36}
USABLE = [i for i, s in enumerate(TOKENS) if i not in SPECIAL and s and "\ufffd" not in s]


class FakeTokenizer:
    """The slice of a Hugging Face tokenizer the vocabulary reads."""

    def __init__(self, tokens: list[str], special: set[int], pieces: list[str] | None = None):
        self.tokens = tokens
        self.all_special_ids = sorted(special)
        self.pieces = pieces

    def __len__(self) -> int:
        return len(self.tokens)

    def decode(self, ids, **kwargs) -> str:
        return "".join(self.tokens[i] for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [(self.pieces or self.tokens)[i] for i in ids]


@pytest.fixture(scope="module")
def tok():
    return FakeTokenizer(TOKENS, SPECIAL)


def guide(tok, regex: str, vocab_size: int | None = None) -> RegexGuide:
    return RegexGuide(regex, tok, [EOS], vocab_size or len(TOKENS))


# ---- the oracle --------------------------------------------------------------------------------
def fsm_oracle(regex: str):
    """Brute force over every token (no trie, no pruning): run the token's text through the
    automaton from the state after ``text``; allowed iff it ends where a match is still
    reachable. EOS iff ``text`` itself matches (per Python's ``re``)."""
    fsm = interegular.parse_pattern(regex).to_fsm()
    live = set(fsm.finals)
    changed = True
    while changed:
        changed = False
        for s, row in fsm.map.items():
            if s not in live and any(d in live for d in row.values()):
                live.add(s)
                changed = True

    def run(text: str) -> int | None:
        state = fsm.initial
        for c in text:
            key = fsm.alphabet[c]
            state = fsm.map.get(state, {}).get(key) if key is not None else None
            if state is None or state not in live:
                return None
        return state

    def mask(text: str) -> set[int]:
        want = {i for i in USABLE if run(text + TOKENS[i]) is not None}
        if re.fullmatch(regex, text):
            want.add(EOS)
        return want

    return mask


def allowed(c: RegexConstraint) -> set[int]:
    return set(torch.nonzero(c.allowed_mask()).flatten().tolist())


REGEXES = [
    r"[-+]?[0-9]+",
    r"(ab)+",
    r"a(b|x)a?",
    r"(yes|no)",
    r'"[^"\n]*"',
    r"[0-9]*\.?[0-9]+",
    r"(True|False)",
    r"a{2,3}b?",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_masks_equal_brute_force_along_random_walks(tok, regex):
    g = guide(tok, regex)
    oracle = fsm_oracle(regex)
    rng = random.Random(0)
    for _ in range(6):
        c = g.new_constraint()
        text = ""
        for _step in range(8):
            mask = c.allowed_mask()
            assert mask.dtype == torch.bool and mask.shape == (len(TOKENS),)
            want = oracle(text)
            assert allowed(c) == want, f"after {text!r}"
            continuing = sorted(want - {EOS})
            # A complete match that could go on may end where the model leaves it.
            assert c.may_end() == (EOS in want and bool(continuing))
            for t in range(len(TOKENS)):
                assert c.ends_on(t) == (EOS in want and t not in want), (text, TOKENS[t])
            assert c.is_finished() == (not continuing and EOS in want)
            if c.is_finished():
                assert re.fullmatch(regex, text)
                break
            token = rng.choice(sorted(want))
            c.advance(token)
            if token == EOS:
                assert c.is_finished() and re.fullmatch(regex, text)
                break
            text += TOKENS[token]


def test_multi_character_tokens_cross_states(tok):
    g = guide(tok, r"[-+]?[0-9]+")
    c = g.new_constraint()
    assert TOKENS.index("-1") in allowed(c)  # sign and digit in one token
    c.advance(TOKENS.index("-1"))
    assert EOS in allowed(c) and TOKENS.index("12") in allowed(c)
    assert TOKENS.index("-") not in allowed(c)
    c.advance(TOKENS.index("12"))
    assert not c.is_finished()

    c = guide(tok, r"(ab)+").new_constraint()
    assert {TOKENS.index("ab"), TOKENS.index("abab"), TOKENS.index("a")} <= allowed(c)
    assert TOKENS.index("ba") not in allowed(c) and EOS not in allowed(c)
    c.advance(TOKENS.index("a"))
    assert allowed(c) == {TOKENS.index("b"), TOKENS.index("ba")}  # "ba" ends one ab, opens one
    c.advance(TOKENS.index("ba"))
    assert EOS not in allowed(c)
    c.advance(TOKENS.index("b"))
    assert EOS in allowed(c)


def test_eos_only_in_accepting_states(tok):
    c = guide(tok, r"[0-9]+").new_constraint()
    assert EOS not in allowed(c)
    c.advance(TOKENS.index("1"))
    assert EOS in allowed(c) and not c.is_finished()
    c.advance(EOS)
    assert c.is_finished()
    with pytest.raises(ConstraintError, match="finished"):
        c.advance(TOKENS.index("1"))

    c = guide(tok, r"[0-9]+").new_constraint()
    with pytest.raises(ConstraintError, match="EOS"):
        c.advance(EOS)


def test_dead_end_allows_only_eos(tok):
    c = guide(tok, r"(yes|no)").new_constraint()
    assert allowed(c) == {TOKENS.index(s) for s in ("yes", "no", "y", "n")}
    c.advance(TOKENS.index("y"))
    assert allowed(c) == {TOKENS.index("es")}
    c.advance(TOKENS.index("es"))
    assert allowed(c) == {EOS}
    assert c.is_finished()  # the engine ends here without sampling the EOS


def test_disallowed_token_raises(tok):
    c = guide(tok, r"[0-9]+").new_constraint()
    with pytest.raises(ConstraintError, match="cannot continue"):
        c.advance(TOKENS.index("a"))
    with pytest.raises(ConstraintError, match="outside"):
        c.advance(10_000)
    assert c.state == c.guide.initial_state  # a refused token leaves the state alone


def test_unusable_tokens_are_never_allowed(tok):
    c = guide(tok, r'"[^"\n]*"').new_constraint()
    c.advance(TOKENS.index('"'))
    got = allowed(c)
    for bad in (TOKENS.index("\ufffd"), TOKENS.index(""), 36):
        assert bad not in got
    assert TOKENS.index("\n") not in got and TOKENS.index("x") in got


def test_mask_is_as_wide_as_the_logits(tok):
    g = guide(tok, r"[0-9]+", vocab_size=len(TOKENS) + 24)
    mask = g.new_constraint().allowed_mask()
    assert mask.shape == (len(TOKENS) + 24,) and not mask[len(TOKENS) :].any()


def test_sentencepiece_word_start_keeps_its_space():
    # A SentencePiece decoder drops the space of "▁ab" when it decodes the token alone.
    tokens = ["<eos>", "ab", "ab", "x"]
    pieces = ["<eos>", "\u2581ab", "ab", "x"]
    tok = FakeTokenizer(tokens, {0}, pieces)
    assert token_vocabulary(tok, 4).text == [None, " ab", "ab", "x"]
    c = RegexGuide(r" ab", tok, [0], 4).new_constraint()
    assert allowed(c) == {1}


def test_bad_regexes_raise_constraint_error(tok):
    with pytest.raises(ConstraintError, match="invalid regex"):
        guide(tok, "(ab")
    with pytest.raises(ConstraintError, match="interegular"):
        guide(tok, r"^ab$")
    with pytest.raises(ConstraintError, match="interegular"):
        guide(tok, r"(a)\1")
    with pytest.raises(ConstraintError, match="lookaround"):
        guide(tok, r"a(?=b)")
    with pytest.raises(ConstraintError, match="no token"):
        guide(tok, r"z+")  # no token has a "z"
    with pytest.raises(ConstraintError, match="must be a str"):
        guide(tok, 5)  # type: ignore[arg-type]
    assert issubclass(ConstraintError, ValueError)


def test_guides_are_cached_per_regex_and_tokenizer(tok):
    a = get_regex_guide(r"[0-9]+", tok, [EOS], len(TOKENS))
    assert get_regex_guide(r"[0-9]+", tok, [EOS], len(TOKENS)) is a
    assert get_regex_guide(r"[0-9]*", tok, [EOS], len(TOKENS)) is not a
    other = FakeTokenizer(TOKENS, SPECIAL)
    assert get_regex_guide(r"[0-9]+", other, [EOS], len(TOKENS)) is not a
    assert token_vocabulary(tok, len(TOKENS)) is a.vocab


# ---- dtypes: the automaton reads them as re does --------------------------------------------
SAMPLES = ["0", "12", "-3", "+7", "3.5", ".5", "-0.25", "5.", "1e3", "", "-", "True", "False",
           "true", '"hi"', '""', '"a\nb"', '"a"b"', "x", " 1"]  # fmt: skip


@pytest.mark.parametrize("name", ["int", "float", "bool", "str"])
def test_dtype_regexes_agree_with_re(name):
    regex = dtype_regex(name)
    types = {"int": int, "float": float, "bool": bool, "str": str}
    assert regex == DTYPE_REGEXES[name] == dtype_regex(types[name])
    fsm = interegular.parse_pattern(regex).to_fsm()
    for s in SAMPLES:
        assert fsm.accepts(s) == bool(re.fullmatch(regex, s)), (name, s)
    assert any(re.fullmatch(regex, s) for s in SAMPLES)


# ---- the default model's tokenizer -------------------------------------------------------------
@pytest.mark.slow
def test_default_tokenizer_masks_are_right():
    from radixlang.model_files import DEFAULT_MODEL, load_model_files

    tokenizer = load_model_files(DEFAULT_MODEL).load_tokenizer()
    vocab = token_vocabulary(tokenizer, 49152)
    eos = [tokenizer.eos_token_id]
    # Every state's mask (41 states: three phrases then three digits) has allowed tokens. How
    # fast they are is bench_grammar_engines' figure, not a test's (a time says how busy the
    # machine is).
    for regex in (r"[-+]?[0-9]+", r"(the quick brown fox|jumps over|lazy dog)[0-9]{3}"):
        g = RegexGuide(regex, tokenizer, eos, 49152)
        for state in g.states:
            assert g.state_mask(state).mask.any()
    g = RegexGuide(r'"[^"\n]*"', tokenizer, eos, 49152)
    c = g.new_constraint()
    first = allowed(c)
    assert first and all(vocab.text[t].startswith('"') for t in first)
    c.advance(tokenizer.encode('"')[0])
    inside = allowed(c)
    assert len(inside) > 40_000  # nearly every token may sit inside a string
    assert all("\n" not in vocab.text[t] for t in inside)
    assert all(vocab.text[t].count('"') <= 1 for t in inside)
