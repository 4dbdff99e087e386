"""Datastore: retrieval drafting (REST, He et al. 2024) from a token corpus of the target's own
earlier answers, read by the lookup drafter (propose/lookup.py) beside prompt lookup.

A datastore is a directory:
    datastore.json   the manifest: format, target, tokenizer fingerprint, sources, counts, digest
    tokens.npy       int32: the corpus, each segment (an assistant turn with its role header)
                     preceded by SEP (-1); SEP never matches a token, so no n-gram or continuation
                     crosses a segment boundary
    index-K.npy      int32: every corpus position sorted by the K tokens that start there (a suffix
                     array cut at depth K), made at the first load and kept beside them,
                     memory-mapped afterwards; a rebuild of the datastore deletes it. Every load
                     checks the tokens against the manifest's digest first (a sha256 pass over
                     the corpus), so tokens changed under a kept index are refused
data/datastore.py builds one from chat records (`taps lookup build`).

Drafting: for n = max_ngram down to min_ngram, the positions that follow the context's last n
tokens are one contiguous range of the index (two binary searches); the longest n that occurs
(followed by something: not only at segments' ends) is used. Within that range positions are
sorted by what follows them, so the continuations (up to `depth` tokens) form a trie whose node
counts are run lengths: a node's count is how many occurrences continue with its path. Up to
`max_matches` occurrences, evenly spaced over the range, are read (the spacing keeps the
proportions), and the nodes with the highest counts are kept, parents before children (a child never counts more than its parent): REST's most frequent
continuations. Each node carries its share of the occurrences (count / occurrences read), which
the lookup drafter turns into a node score.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from taps.core.jsonl import read_json, write_json_atomic

FORMAT = 1
MANIFEST, TOKENS = "datastore.json", "tokens.npy"
SEP = -1  # segment separator: never a token id
# default K: the longest n-gram the index answers. 16, not 8: a store of one task's answers (an online
# store of JSON extractions, docs/learn.md) drafts better from the longest shared context (acceptance
# 6.30 with 3-grams, 6.65 with 8, 6.86 with 16 and with 32), and the family's store is level (GSM8K
# 3.11 / 3.08, MT-Bench 1.97 / 1.97 with 3 and 16)
INDEX_DEPTH = 16


class DatastoreError(ValueError):
    """A datastore directory that cannot be read or built; the message names the file."""


def is_datastore(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def _digest(tokens: np.ndarray) -> str:
    return "sha256:" + hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:32]


def _save_npy(path: Path, array: np.ndarray) -> None:
    """np.save through a temporary file and a rename (a killed writer leaves no half file)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            np.save(handle, array, allow_pickle=False)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would keep the datastore from other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def join_segments(segments) -> np.ndarray:
    """The corpus array: each segment (a list of token ids) preceded by SEP, one SEP at the end."""
    parts = []
    for segment in segments:
        parts.append([SEP])
        parts.append(segment)
    parts.append([SEP])
    return np.fromiter((t for part in parts for t in part), dtype=np.int32)


def build_index(tokens: np.ndarray, depth: int) -> np.ndarray:
    """Every non-SEP position of `tokens`, sorted by the `depth` tokens starting there (SEP-padded;
    SEP sorts before every token), ties by position."""
    padded = np.concatenate([tokens, np.full(depth, SEP, dtype=np.int32)])
    positions = np.flatnonzero(tokens != SEP).astype(np.int32)
    keys = [padded[positions + k] for k in range(depth - 1, -1, -1)]  # lexsort: the last key is primary
    return positions[np.lexsort([positions] + keys)]


def write_datastore(out: str | Path, segments, meta: dict, depth: int = INDEX_DEPTH) -> dict:
    """Write a datastore directory from token segments; `meta` joins the manifest (target,
    tokenizer fingerprint, sources). Returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = join_segments(segments)
    _save_npy(out / TOKENS, tokens)
    segments_n = int((tokens == SEP).sum()) - 1
    manifest = {"format": FORMAT, **meta, "segments": segments_n, "tokens": int(len(tokens) - segments_n - 1),
                "max_token": int(tokens.max(initial=SEP)), "digest": _digest(tokens), "index_depth": depth}
    for stale in out.glob("index-*.npy"):
        stale.unlink()
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


@dataclass(frozen=True)
class DatastoreNode:
    parent: int  # index of the parent in the returned list; -1: a child of the root
    token: int
    share: float  # occurrences continuing with this node's path / occurrences read


class Datastore:
    """A loaded datastore: the corpus and its index (both memory-mapped when read from files)."""

    def __init__(self, tokens: np.ndarray, index: np.ndarray, depth: int, manifest: dict | None = None,
                 path: Path | None = None):
        self.tokens = tokens  # ends in SEP: reading past a segment's end stops there
        self.index, self.depth = index, depth
        self.manifest, self.path = manifest or {}, path
        self.load_seconds = 0.0

    @classmethod
    def of_segments(cls, segments, depth: int = INDEX_DEPTH) -> "Datastore":
        """An in-memory datastore (tests, the hit-rate bench)."""
        tokens = join_segments(segments)
        return cls(tokens, build_index(tokens, depth), depth)

    @classmethod
    def load(cls, path: str | Path) -> "Datastore":
        """Read a datastore directory; the index is built and saved beside the tokens on first use."""
        t0 = time.perf_counter()
        path = Path(path)
        manifest = read_json(path / MANIFEST, "a datastore manifest", DatastoreError)
        if manifest.get("format") != FORMAT:
            raise DatastoreError(f"{path / MANIFEST}: datastore format {manifest.get('format')!r}, this TAPS reads "
                                 f"format {FORMAT}; rebuild it with `taps lookup build`")
        try:
            depth = int(manifest["index_depth"])
            tokens = np.load(path / TOKENS, mmap_mode="r", allow_pickle=False)
        except (KeyError, TypeError, ValueError) as err:
            raise DatastoreError(f"{path}: not a readable datastore ({err}); rebuild it with `taps lookup build`") \
                from None
        if tokens.dtype != np.int32 or tokens.ndim != 1:
            raise DatastoreError(f"{path / TOKENS}: expected a 1-D int32 array, got {tokens.dtype} {tokens.shape}")
        if _digest(tokens) != manifest.get("digest"):  # every load: tokens changed under a kept index mislead it
            raise DatastoreError(f"{path / TOKENS}: its content does not match the manifest's digest; "
                                 "rebuild the datastore with `taps lookup build`")
        index_file = path / f"index-{depth}.npy"
        index = None
        if index_file.is_file():
            index = np.load(index_file, mmap_mode="r", allow_pickle=False)
            if index.dtype != np.int32 or len(index) != manifest.get("tokens"):
                index = None
        if index is None:  # first load (or a stale index): sort once, keep the result
            index = build_index(np.asarray(tokens), depth)
            try:
                _save_npy(index_file, index)
            except OSError:
                pass  # a read-only datastore: the index lives in memory for this process
        store = cls(tokens, index, depth, manifest, path)
        store.load_seconds = time.perf_counter() - t0
        return store

    @property
    def size(self) -> int:
        return len(self.index)

    # ---- matching ------------------------------------------------------------------------------
    def _range(self, gram: list[int]) -> tuple[int, int]:
        """The index range of the positions where `gram` (len <= depth) starts."""
        n, tokens, index = len(gram), np.asarray(self.tokens), np.asarray(self.index)  # plain views of a memmap

        def key(i: int) -> list[int]:
            p = int(index[i])
            return tokens[p:p + n].tolist()

        lo = bisect_left(range(len(index)), gram, key=key)
        hi = bisect_right(range(lo, len(index)), gram, key=key) + lo
        return lo, hi

    def match(self, context: list[int], max_ngram: int, min_ngram: int) -> tuple[int, int, int]:
        """(n, lo, hi) of the longest suffix of `context` (n = max_ngram..min_ngram, at most the
        index depth) that occurs in the corpus; (0, 0, 0) when none does.

        A binary search over n (about 4 index searches for 16 sizes, not up to 16): wherever the
        suffix of n tokens occurs, the suffix of n - 1 occurs one position later, so the sizes
        that occur are exactly min_ngram..longest."""
        lo_n, hi_n, best = min_ngram, min(max_ngram, self.depth, len(context)), (0, 0, 0)
        while lo_n <= hi_n:
            n = (lo_n + hi_n) // 2
            lo, hi = self._range(list(context[-n:]))
            if hi > lo:
                best, lo_n = (n, lo, hi), n + 1
            else:
                hi_n = n - 1
        return best

    def continuations(self, n: int, lo: int, hi: int, depth: int, max_matches: int) -> np.ndarray:
        """[m, depth] continuations of up to `max_matches` occurrences evenly spaced over the range,
        SEP after a segment's end, rows in index order (so sorted by their first depth tokens if
        depth <= index depth - n)."""
        count = hi - lo
        rows = np.arange(lo, hi) if count <= max_matches else lo + (np.arange(max_matches) * count) // max_matches
        starts = np.asarray(self.index[rows], dtype=np.int64) + n
        window = self.tokens[np.minimum(starts[:, None] + np.arange(depth), len(self.tokens) - 1)]
        ended = np.cumsum(window == SEP, axis=1) > 0
        window[ended] = SEP
        return window

    def draft(self, context: list[int], budget: int, depth: int, max_ngram: int, min_ngram: int = 1,
              max_matches: int = 512) -> list[DatastoreNode]:
        """Up to `budget` trie nodes of the most frequent continuations of the context's longest
        suffix that occurs with a continuation, highest count first, parents before children."""
        if budget <= 0 or depth <= 0:
            return []
        n, lo, hi = self.match(context, max_ngram, min_ngram)  # n = 0: no suffix occurs
        shortest = max(min_ngram, 1)
        while n >= shortest:
            nodes = trie_nodes(self.continuations(n, lo, hi, depth, max_matches), budget)
            if nodes:
                return nodes
            n -= 1  # every occurrence ends its segment: a shorter suffix (which occurs too)
            if n >= shortest:  # (not past the loop's end: no index search for a length never read)
                lo, hi = self._range(list(context[-n:]))
        return []


def trie_nodes(rows: np.ndarray, budget: int) -> list[DatastoreNode]:
    """The `budget` most frequent nodes of the trie of `rows` ([m, depth], SEP-padded), by count
    then depth (so a parent always precedes its children), with their shares of m."""
    m, depth = rows.shape
    if m == 0:
        return []
    rows = rows[np.lexsort(rows.T[::-1])]
    new = np.zeros(m, dtype=bool)
    new[0] = True
    cand_depth, cand_count, cand_token, cand_parent, cand_group = [], [], [], [], []
    previous = None
    for d in range(depth):
        column = rows[:, d]
        new = new | np.concatenate([[True], column[1:] != column[:-1]])
        group = np.cumsum(new) - 1
        starts = np.flatnonzero(new)
        counts = np.diff(np.append(starts, m))
        tokens = column[starts]
        valid = tokens != SEP
        if not valid.any():
            break
        parents = previous[starts] if previous is not None else np.full(len(starts), -1)
        cand_depth.append(np.full(int(valid.sum()), d))
        cand_count.append(counts[valid])
        cand_token.append(tokens[valid])
        cand_parent.append(parents[valid])
        cand_group.append(group[starts][valid])
        previous = group
    if not cand_depth:  # every row ends its segment at once: no continuation to draft
        return []
    depth_ = np.concatenate(cand_depth)
    count = np.concatenate(cand_count)
    order = np.lexsort((depth_, -count))[:budget]
    token, parent, group = (np.concatenate(c) for c in (cand_token, cand_parent, cand_group))
    where: dict[tuple[int, int], int] = {}  # (depth, group) -> index in the result
    out: list[DatastoreNode] = []
    for i in order.tolist():
        d = int(depth_[i])
        up = -1 if d == 0 else where[(d - 1, int(parent[i]))]
        where[(d, int(group[i]))] = len(out)
        out.append(DatastoreNode(up, int(token[i]), float(count[i]) / m))
    return out
