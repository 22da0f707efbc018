"""SentencePiece-style tokenization (llama.cpp's llm_tokenizer_spm_session).

Start from single characters and keep merging the adjacent pair whose concatenation is the vocabulary
entry with the highest score (ties: leftmost); pieces that are not tokens fall back to <0xXX> bytes.
"""

from __future__ import annotations

import heapq

from tandem.tokenizer.vocab import Vocab


class SPMTokenizer:
    """Tokenizes text that has already had its spaces escaped to U+2581."""

    def __init__(self, vocab: Vocab) -> None:
        self.token_to_id = vocab.token_to_id
        self.scores = vocab.scores
        self.unk_id = vocab.ids["unk"]
        self._byte_ids: dict[int, int] = {}
        for b in range(256):
            tid = vocab.token_to_id.get(f"<0x{b:02X}>")
            if tid is None and b < 0x80:
                tid = vocab.token_to_id.get(chr(b))  # llama.cpp's byte_to_token fallback
            if tid is not None:
                self._byte_ids[b] = tid

    def byte_token(self, b: int) -> int:
        """The token for one raw byte. llama.cpp aborts when there is none; we use <unk>."""
        tid = self._byte_ids.get(b, self.unk_id)
        if tid is None:
            raise KeyError(f"vocabulary has no token for byte 0x{b:02X} and no <unk>")
        return tid

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` (no special-token handling, no space prefix)."""
        n = len(text)
        if n == 0:
            return []
        get = self.token_to_id.get
        scores = self.scores
        # Symbol i always starts at character i; `size[i] == 0` once it was merged into its left neighbour.
        size = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []

        def try_add(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            tid = get(text[left : left + size[left] + size[right]])
            if tid is not None:
                # max-heap on score, then the leftmost pair (llm_bigram_spm::comparator)
                heapq.heappush(heap, (-scores[tid], left, size[left] + size[right], right))

        for i in range(1, n):
            try_add(i - 1, i)
        while heap:
            _, left, total, right = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != total:
                continue  # one side was merged since this pair was queued
            size[left] = total
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])

        out: list[int] = []
        i = 0
        while i != -1:
            piece = text[i : i + size[i]]
            tid = get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.byte_token(b) for b in piece.encode("utf-8", errors="surrogatepass"))
            i = nxt[i]
        return out
