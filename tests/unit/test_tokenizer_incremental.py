import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from hybridmoe.engine.detokenizer import Detokenizer
from hybridmoe.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    # Trained on ASCII only, so every CJK character / emoji is split over several byte tokens.
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["the end of the story. The END is near, said the fox."] * 4,
                            trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=["<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Tokenizer(bpe, {"eos_token": "<eos>"}, None)


def stream(tok, text, stop=(), prompt="Once"):
    """Feed text's tokens one by one; return the deltas, the final text and whether a stop hit."""
    ids = tok.encode(text)
    detok = Detokenizer(tok, tok.encode(prompt), list(stop))
    deltas = []
    for i, t in enumerate(ids):
        delta, stopped = detok.add(t, final=i == len(ids) - 1)
        deltas.append(delta)
        if stopped:
            break
    return deltas, detok.text, stopped


@pytest.fixture
def text():
    return " the fox said 你好 🦊, the end."


def test_multibyte_characters_are_never_split(tok, text):
    deltas, final, stopped = stream(tok, text)
    assert not stopped and final == text == "".join(deltas)
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens end mid-character and release nothing yet


def test_text_stops_before_a_stop_string_and_deltas_add_up(tok, text):
    deltas, final, stopped = stream(tok, text, stop=["said 你"])
    assert stopped and final == " the fox " == "".join(deltas)


def test_the_beginning_of_a_possible_stop_string_is_held_back_until_it_fails(tok):
    deltas, final, stopped = stream(tok, " the end of the story", stop=["the END"])
    assert not stopped and "".join(deltas) == final == " the end of the story"
    # tokens are " the", " end", " of", " the", " story"; "the" could start "the END"
    assert deltas == [" ", "the end", " of", " ", "the story"]


def test_earliest_of_several_stop_strings_wins(tok):
    _, final, stopped = stream(tok, " the end of the story. The END", stop=["story", "of"])
    assert stopped and final == " the end "
