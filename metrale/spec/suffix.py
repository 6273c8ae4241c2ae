"""Suffix lookup: prompt lookup over the sequence's own tokens first, then a shared
cross-request index of the same tenant's token sequences.

Owner: spec. Pure Python. The shared index holds "documents": the committed tokens of a
tenant's running sequences (fed incrementally by `observe`) and finished ones (completed by
`on_finished`). Per tenant and per n in [min, max], a hash table maps an n-gram to
(document, position after it), the latest fed occurrence winning; a lookup takes the longest
suffix of the requesting sequence found there and copies what followed it.

Invariants:
- Tenant isolation: a document belongs to one tenant, tables are per tenant, and a hit is
  used only when its document's tenant is the request's tenant; so a request of tenant T is
  only ever proposed tokens of T's sequences or its own. `tenant=None` neither feeds nor
  reads the shared index.
- Bounded memory: the tokens stored over all tenants never exceed `suffix_cache_max_tokens`
  after a call returns; whole least-recently-used documents are evicted (a hit or a feed
  makes a document the most recent) and every table entry pointing into an evicted document
  is removed with it. A stream longer than the budget continues in a fresh document.
- Every shared hit is re-checked against the stored tokens of a live document: a hash
  collision or a stale entry costs a miss, never a wrong draft.
- A draft copies stored tokens only: `doc[e : e + m]` with `e + m <= len(doc)`.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

from metrale.spec import ngram
from metrale.spec.ngram import NgramProposer, SequenceIndex, same_tokens
from metrale.spec.proposer import DraftRequest

_POS_BITS = 40
_POS_MASK = (1 << _POS_BITS) - 1


class _Document:
    """A run of one tenant's tokens, with prefix hashes for (re)computing its n-gram keys."""

    __slots__ = ("alive", "doc_id", "prefix", "tenant", "tokens")

    def __init__(self, doc_id: int, tenant: str) -> None:
        self.doc_id = doc_id
        self.tenant = tenant
        self.tokens = array("q")
        self.prefix = array("q", [0])
        self.alive = True


class _Feed:
    """A running sequence's link to the document its tokens go to."""

    __slots__ = ("doc", "fed", "last", "tenant")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.doc: _Document | None = None
        #: Tokens of the sequence offered so far (stored, or skipped by a new document).
        self.fed = 0
        #: The last offered token: a later call whose tokens disagree starts over.
        self.last = -1


class SuffixProposer(NgramProposer):
    """Own prompt lookup, then the tenant's shared suffix index (same window and backoff as
    `NgramProposer`; a shared hit counts as a hit)."""

    name = "suffix"

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int = 2,
        prompt_lookup_max: int = 5,
        suffix_cache_max_tokens: int = 262_144,
    ) -> None:
        super().__init__(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
        if suffix_cache_max_tokens < 1:
            raise ValueError(f"suffix_cache_max_tokens must be >= 1, got {suffix_cache_max_tokens}")
        self.max_tokens = suffix_cache_max_tokens
        self._doc_cap = min(suffix_cache_max_tokens, _POS_MASK)
        #: Live documents, least recently used first.
        self._docs: OrderedDict[int, _Document] = OrderedDict()
        #: tenant -> one table per n (index n - min_n): key -> doc_id << _POS_BITS | end.
        self._tables: dict[str, list[dict[int, int]]] = {}
        self._tenant_docs: dict[str, int] = {}
        self._feeds: dict[str, _Feed] = {}
        self._next_doc = 0
        self._stored = 0
        self._evicted = 0
        self._shared_hits = 0

    # ------------------------------------------------------------------ lookup

    def _fallback(self, req: DraftRequest, index: SequenceIndex, limit: int) -> list[int]:
        tenant = req.tenant
        if tenant is None:
            return []
        tables = self._tables.get(tenant)
        if tables is None:
            return []
        tokens = req.tokens
        length = index.length
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            packed = tables[n - self.min_n].get(ngram.window_hash(index.prefix, length - n, length))
            if packed is None:
                continue
            doc = self._docs.get(packed >> _POS_BITS)
            e = packed & _POS_MASK
            if doc is None or doc.tenant != tenant or not n <= e < len(doc.tokens):
                continue
            if not same_tokens(doc.tokens, e - n, tokens, length - n, n):
                continue  # a hash collision
            self._docs.move_to_end(doc.doc_id)
            self._shared_hits += 1
            return doc.tokens[e : e + limit].tolist()
        return []

    # ------------------------------------------------------------------ feeding

    def observe(self, seq_id: str, tokens: Sequence[int], tenant: str | None) -> None:
        if tenant is None:
            self._feeds.pop(seq_id, None)  # what it fed under a tenant stays, finished
            return
        self._feed(seq_id, tokens, tenant)

    def on_finished(self, seq_id: str, tokens: Sequence[int], tenant: str | None) -> None:
        super().on_finished(seq_id, tokens, tenant)
        if tenant is not None:
            self._feed(seq_id, tokens, tenant)
        self._feeds.pop(seq_id, None)

    def _feed(self, seq_id: str, tokens: Sequence[int], tenant: str) -> None:
        feed = self._feeds.get(seq_id)
        if feed is None or feed.tenant != tenant:
            feed = self._feeds[seq_id] = _Feed(tenant)
        total = len(tokens)
        if feed.fed and (total < feed.fed or tokens[feed.fed - 1] != feed.last):
            # Not an extension of what was fed: the old document stays as it is (its tokens
            # were this tenant's), the sequence starts a new one.
            feed.doc, feed.fed = None, 0
        stop = feed.fed
        while stop < total and tokens[stop] >= 0:  # stop at a placeholder
            stop += 1
        doc = feed.doc
        if stop == feed.fed:
            if doc is not None and doc.alive:
                self._docs.move_to_end(doc.doc_id)
            return
        pos = feed.fed
        while pos < stop:
            if doc is None or not doc.alive or len(doc.tokens) >= self._doc_cap:
                doc = self._new_document(tenant)
            else:
                self._docs.move_to_end(doc.doc_id)
            take = min(stop - pos, self._doc_cap - len(doc.tokens))
            self._append(doc, tokens, pos, pos + take)
            pos += take
            self._evict_over_budget(keep=doc)
        feed.doc = doc
        feed.fed = stop
        feed.last = int(tokens[stop - 1])

    def _new_document(self, tenant: str) -> _Document:
        doc = _Document(self._next_doc, tenant)
        self._next_doc += 1
        self._docs[doc.doc_id] = doc
        if tenant not in self._tables:
            self._tables[tenant] = [{} for _ in range(self.max_n - self.min_n + 1)]
            self._tenant_docs[tenant] = 0
        self._tenant_docs[tenant] += 1
        return doc

    def _append(self, doc: _Document, tokens: Sequence[int], start: int, stop: int) -> None:
        old = len(doc.tokens)
        doc.tokens.extend(int(tokens[i]) for i in range(start, stop))
        ngram.extend_prefix_hashes(doc.prefix, tokens, start, stop)
        new = len(doc.tokens)
        self._stored += new - old
        base = doc.doc_id << _POS_BITS
        tables = self._tables[doc.tenant]
        for j, n in enumerate(range(self.min_n, self.max_n + 1)):
            table = tables[j]
            # An n-gram ending at e is worth indexing once a token follows it (e < new).
            for e in range(max(n, old), new):
                table[ngram.window_hash(doc.prefix, e - n, e)] = base | e

    def _evict_over_budget(self, keep: _Document) -> None:
        while self._stored > self.max_tokens:
            victim = next(iter(self._docs.values()))
            if victim is keep:  # cannot happen: keep is the most recent and fits alone
                break
            self._evict(victim)

    def _evict(self, doc: _Document) -> None:
        del self._docs[doc.doc_id]
        doc.alive = False
        self._stored -= len(doc.tokens)
        self._evicted += 1
        base = doc.doc_id << _POS_BITS
        tables = self._tables[doc.tenant]
        for j, n in enumerate(range(self.min_n, self.max_n + 1)):
            table = tables[j]
            for e in range(n, len(doc.tokens)):
                key = ngram.window_hash(doc.prefix, e - n, e)
                if table.get(key) == base | e:
                    del table[key]
        self._tenant_docs[doc.tenant] -= 1
        if not self._tenant_docs[doc.tenant]:
            del self._tenant_docs[doc.tenant]
            del self._tables[doc.tenant]
        doc.tokens = array("q")  # a feed may still point at it; its memory goes now
        doc.prefix = array("q", [0])

    def stats(self) -> dict[str, int]:
        return {
            **super().stats(),
            "documents": len(self._docs),
            "stored_tokens": self._stored,
            "evicted_documents": self._evicted,
            "shared_hits": self._shared_hits,
        }
