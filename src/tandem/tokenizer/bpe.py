"""BPE (llama.cpp's llm_tokenizer_bpe_session): split into words with the pre-tokenizer, map each
word's bytes to GPT-2 characters (byte-level BPE; Gemma 4 keeps raw UTF-8), then apply merges lowest
rank first (ties: leftmost)."""

from __future__ import annotations

import heapq

from tandem.tokenizer.pretokenize import byte_encode, regex_split
from tandem.tokenizer.vocab import Vocab

_CACHE_LIMIT = 200_000


class BPETokenizer:
    """Tokenizes raw text (no special-token handling) with the model's merges."""

    def __init__(self, vocab: Vocab) -> None:
        assert vocab.spec is not None
        self.token_to_id = vocab.token_to_id
        self.ranks = vocab.bpe_ranks
        self.regexes = vocab.spec.regexes
        self.ignore_merges = vocab.spec.ignore_merges
        self.byte_encode = vocab.spec.byte_encode
        self.gemma4 = vocab.spec.gemma4
        self._cache: dict[str, tuple[int, ...]] = {}

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`."""
        out: list[int] = []
        cache = self._cache
        for word in regex_split(text, self.regexes):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                ids = cache[word] = tuple(self._word(byte_encode(word) if self.byte_encode else word))
            out.extend(ids)
        return out

    def _word(self, word: str) -> list[int]:
        get = self.token_to_id.get
        if self.ignore_merges and (tid := get(word)) is not None:
            return [tid]
        if self.gemma4 and not word.strip("\n") and (tid := get(word)) is not None:
            return [tid]  # llama.cpp PR 21343: a run of newlines that is a token is not merged up
        n = len(word)
        if n == 0:
            return []
        ranks = self.ranks
        sym = list(word)  # current text of each symbol; "" once merged into its left neighbour
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[int, int, str, int]] = []

        def add(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            rank = ranks.get((sym[left], sym[right]))
            if rank is not None:
                heapq.heappush(heap, (rank, left, sym[left] + sym[right], right))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, merged, right = heapq.heappop(heap)
            if not sym[left] or not sym[right] or sym[left] + sym[right] != merged:
                continue  # outdated pair
            sym[left] = merged
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])

        out: list[int] = []
        i = 0
        while i != -1:
            tid = get(sym[i])
            if tid is not None:
                out.append(tid)
            elif self.byte_encode:
                # llama.cpp looks up each UTF-8 byte of the symbol as a one-byte token; only ASCII can hit
                for b in sym[i].encode("utf-8"):
                    if b < 0x80 and (bt := get(chr(b))) is not None:
                        out.append(bt)
            else:
                for b in sym[i].encode("utf-8", errors="surrogatepass"):
                    if (bt := get(f"<0x{b:02X}>")) is not None:
                        out.append(bt)
            i = nxt[i]
        return out
