from conftest import reference

from router.detokenizer import IncrementalDetokenizer, StopSequenceMatcher


def test_streamed_text_equals_full_decode_with_multibyte_characters():
    ref = reference("llama")
    tok = ref.tokenizer
    text = " visitors from Zürich and São Paulo read 日本語の本 🙂 together"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test needs a character split across tokens"
    detok = IncrementalDetokenizer(tok, tok("The library")["input_ids"])
    pieces = [detok.add([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)


def test_stop_matcher_holds_back_possible_prefixes_and_cuts_at_the_stop():
    m = StopSequenceMatcher(["END", "xyz"])
    assert m.feed("hello E") == ("hello ", None)
    assert m.feed("N") == ("", None)
    assert m.feed("D and more") == ("", "END")


def test_stop_matcher_releases_text_that_turned_out_not_to_stop():
    m = StopSequenceMatcher(["STOP"])
    assert m.feed("a ST") == ("a ", None)
    assert m.feed("ART") == ("START", None)
    assert m.feed(" x S") == (" x ", None)
    assert m.flush() == "S"


def test_no_stops_passes_text_through():
    assert StopSequenceMatcher([]).feed("abc") == ("abc", None)
