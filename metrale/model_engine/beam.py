"""Beam search over a paged-KV model: `BeamSearchDriver` (the request and result types,
`BeamParams`, `BeamRequest`, `BeamOutput`, and the model side, `BeamBackend`, live in
`beam_backend.py` and are re-exported here).

Owner: model-engine (below the engine, so a model's `generate_beam_batch` can use it). One
driver serves encoder-decoder translation (`EncoderDecoderModel`) and
decoder-only beam search (`TransformerModel` through `DecoderOnlyBeamBackend`); both reach the
model only through `BeamBackend`.

The search is transformers' `generate(num_beams=K)` step for step, per request: log-softmax
of the float32 logits, the request's processors (forced prefix, `min_tokens`,
`no_repeat_ngram_size`), the top `2K` continuations of the `K * vocab` accumulated scores, the
`K` best unfinished ones run on, finished ones (EOS or the length limit) among the first `K`
enter the request's `K` best finished hypotheses with `score / length ** length_penalty`, and
`early_stopping` (True, False, "never") decides when the request is done, with the same
heuristic. The bookkeeping runs as the same float32 torch operations on transformers'
batched shapes (`[requests, ...]`, the requests of one beam width together), so ties break
as there. It runs where the logits are: per step the host sends its facts (rows, forced
tokens, bans, length divisors) in two asynchronous copies and reads the device back once for
every request together (the picks that steer the block tables), then once more only on a
step where requests finish (their scores), so a GPU step is not host-bound by the search.

Sharing: a *physical* sequence (`SequenceState`) holds the KV of a beam's tokens but the
last, which it feeds in the next decoder forward. Beams with the same history share one
physical sequence (the K copies of the prompt at step 0); a beam that continues its parent
takes the parent's sequence over, a second continuation forks it: a new `SequenceState`
whose block table references the same blocks (`BlockPool.incref`). Before a forward writes
into a shared partial last block, that block is copied (copy-on-write; the step's copies
run as one batch before the forward). A beam whose score is
`-inf` can never be chosen again and holds no sequence. Every request's rows run in one
decoder forward per step.

Decoder-only prompts go through the model's prefix cache (`DecoderOnlyBeamBackend`): a
prompt's full blocks are looked up, the rest prefilled, and the result indexed, so a repeated
prompt prefills only its tail; the cache's own references keep its blocks from being written
(a beam writing into a shared block copies it first).

Invariants:
- A request holds pool blocks only through the physical sequences of its live beams; when it
  finishes, is aborted, or a step raises, every one of them is freed (a raising step frees
  every request's and drops the waiting ones, then re-raises), so an idle driver holds no
  block.
- Outputs are the request's best `n` finished hypotheses, best first, each with its score
  (transformers' `sequences_scores`) and tokens generated after the forced prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from metrale.errors import InvalidRequestError
from metrale.model_engine.beam_backend import (  # noqa: F401  (re-exported: the driver's API)
    BeamBackend,
    BeamHypothesis,
    BeamOutput,
    BeamParams,
    BeamRequest,
    DecoderOnlyBeamBackend,
    fork_state,
)
from metrale.model_engine.traits import SequenceState

logger = logging.getLogger(__name__)

NEG = -1.0e9


class _Phys:
    """A physical sequence and the token it feeds next."""

    __slots__ = ("pending", "seq")

    def __init__(self, seq: SequenceState, pending: int) -> None:
        self.seq = seq
        self.pending = pending


@dataclass
class _Slot:
    phys: _Phys | None  # None: the beam's score is -inf
    gen: list[int]  # generated tokens, the forced prefix included


class _State:
    def __init__(self, req: BeamRequest, eos: tuple[int, ...], phys: _Phys) -> None:
        p = req.params
        self.req = req
        self.k = p.num_beams
        self.eos = eos
        self.max_new = p.max_tokens + len(req.forced)
        self.min_new = p.min_tokens + len(req.forced)
        self.keep = max(2, 1 + len(eos)) * self.k
        self.slots = [_Slot(phys, []) for _ in range(self.k)]
        # The search state lives where the logits are (moved there at the first step).
        self.running = torch.zeros(self.k, dtype=torch.float32)
        self.running[1:] = NEG
        self.fin_scores = torch.full((self.k,), NEG, dtype=torch.float32)
        self.fin_done = torch.zeros(self.k, dtype=torch.bool)
        self.fin_tokens: list[list[int]] = [[] for _ in range(self.k)]
        #: transformers' "a better hypothesis is still possible" flag (a bool scalar tensor).
        self.heuristic = torch.ones((), dtype=torch.bool)
        self.steps = 0

    def to(self, dev: torch.device) -> None:
        if self.running.device != dev:
            self.running, self.fin_scores = self.running.to(dev), self.fin_scores.to(dev)
            self.fin_done, self.heuristic = self.fin_done.to(dev), self.heuristic.to(dev)

    def physicals(self) -> list[_Phys]:
        seen: dict[int, _Phys] = {}
        for s in self.slots:
            if s.phys is not None:
                seen.setdefault(id(s.phys), s.phys)
        return list(seen.values())


class BeamSearchDriver:
    """Runs beam-search requests to completion over one backend, batching every running
    request's beams into one decoder forward per `step`."""

    def __init__(self, backend: BeamBackend, eos_token_ids: Sequence[int]) -> None:
        if not eos_token_ids:
            raise ValueError("beam search needs at least one EOS token id")
        self.backend = backend
        self.eos = tuple(int(t) for t in eos_token_ids)
        self._waiting: list[BeamRequest] = []
        self._running: dict[str, _State] = {}
        #: Blocks copied before a write into a shared partial block; forks made.
        self.cow_copies = 0
        self.forks = 0
        self.forwards = 0
        self._eos_tensors: dict[torch.device, torch.Tensor] = {}

    # ---------------------------------------------------------------- requests

    def add_request(self, req: BeamRequest) -> None:
        if not req.prompt:
            raise InvalidRequestError(
                "a beam-search prompt needs at least one token", param="prompt"
            )
        keep = max(2, 1 + len(self.eos)) * req.params.num_beams
        if req.params.num_beams * self.backend.vocab_size() < keep:
            raise InvalidRequestError(
                f"num_beams {req.params.num_beams} needs a vocabulary of at least {keep // req.params.num_beams} tokens",
                param="num_beams",
            )
        if req.request_id in self._running or any(
            r.request_id == req.request_id for r in self._waiting
        ):
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        self._waiting.append(req)

    def abort_request(self, request_id: str) -> bool:
        for i, r in enumerate(self._waiting):
            if r.request_id == request_id:
                del self._waiting[i]
                return True
        state = self._running.pop(request_id, None)
        if state is None:
            return False
        self._release(state)
        return True

    def live_sequences(self) -> list[SequenceState]:
        """The physical sequences the running requests hold (each once)."""
        return [p.seq for st in self._running.values() for p in st.physicals()]

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def run(self, reqs: Sequence[BeamRequest]) -> list[BeamOutput]:
        """Every request to completion; outputs in the order given."""
        for r in reqs:
            self.add_request(r)
        done: dict[str, BeamOutput] = {}
        try:
            while self.has_unfinished():
                for out in self.step():
                    done[out.request_id] = out
        except BaseException:
            for r in reqs:
                self.abort_request(r.request_id)
            raise
        return [done[r.request_id] for r in reqs]

    # ---------------------------------------------------------------- stepping

    def step(self) -> list[BeamOutput]:
        """Admit waiting requests, run one decoder forward over every running beam, advance
        each request; returns the requests that finished."""
        try:
            return self._step()
        except BaseException:
            for rid in list(self._running):
                self.abort_request(rid)
            self._waiting.clear()
            raise

    def _step(self) -> list[BeamOutput]:
        backend = self.backend
        if self._waiting:  # every waiting request starts (encoder-decoder: one encoder batch)
            starting, self._waiting = self._waiting, []
            for req, seq in zip(starting, backend.beam_start_batch(starting), strict=True):
                self._running[req.request_id] = _State(req, self.eos, _Phys(seq, req.prompt[-1]))
        if not self._running:
            return []
        states = list(self._running.values())
        physicals = [p for st in states for p in st.physicals()]
        copies: tuple[list[int], list[int]] = ([], [])
        for p in physicals:
            self._copy_on_write(p.seq, copies)
        backend.kv_cache.copy_blocks(*copies)  # every copy of the step in one batch
        logits = backend.decode_batch([p.pending for p in physicals], [p.seq for p in physicals])
        self.forwards += 1
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        row_of = {id(p): i for i, p in enumerate(physicals)}
        ended = []
        for st, done in zip(states, self._advance_all(states, logprobs, row_of), strict=True):
            st.steps += 1
            if done:
                del self._running[st.req.request_id]
                self._release(st)
                ended.append(st)
        if not ended:
            return []
        scores = torch.cat([st.fin_scores[: st.req.params.n] for st in ended]).tolist()
        finished, offset = [], 0
        for st in ended:
            finished.append(self._output(st, scores[offset : offset + st.req.params.n]))
            offset += st.req.params.n
        return finished

    def _copy_on_write(self, seq: SequenceState, copies: tuple[list[int], list[int]]) -> None:
        """Give `seq` a private copy of its shared partial last block: the block is allocated
        and swapped in now, its contents copied with the step's others (`copies`: sources,
        destinations) before the forward. A source keeps another holder's reference, so it
        stays allocated (and unwritten) until the copy has run."""
        backend = self.backend
        if seq.seq_len % backend.block_size == 0 or not seq.block_table:
            return  # the next token opens a fresh block
        last = seq.block_table[-1]
        if backend.block_pool.ref_count(last) > 1:
            private = backend.block_pool.allocate(1)[0]
            copies[0].append(last)
            copies[1].append(private)
            backend.block_pool.decref([last])
            seq.block_table[-1] = private
            self.cow_copies += 1

    def _bans(self, st: _State, slot: _Slot) -> list[int]:
        """Tokens the slot's processors set to -inf (`no_repeat_ngram_size`, `min_tokens`);
        a slot still in its forced prefix is handled by the caller."""
        p = st.req.params
        banned: set[int] = set()
        n = p.no_repeat_ngram_size
        if n:
            tokens = st.req.prompt + slot.gen
            if len(tokens) + 1 >= n:
                prefix = tuple(tokens[len(tokens) - n + 1 :]) if n > 1 else ()
                banned = {
                    tokens[i + n - 1]
                    for i in range(len(tokens) - n + 1)
                    if tuple(tokens[i : i + n - 1]) == prefix
                }
        if len(slot.gen) < st.min_new:
            banned.update(st.eos)
        return sorted(banned)

    def _advance_all(
        self, states: list[_State], logprobs: torch.Tensor, row_of: dict[int, int]
    ) -> list[bool]:
        """One beam step of every running request; returns which are done. Requests of one
        beam width advance together as `[requests, ...]` tensors (transformers' batched
        shapes); the step reads the device back once, for all of them."""
        groups: dict[int, list[_State]] = {}
        for st in states:
            groups.setdefault(st.k, []).append(st)
        packed = [self._search_group(g, logprobs, row_of) for g in groups.values()]
        host = torch.cat(packed).tolist() if len(packed) > 1 else packed[0].tolist()
        vocab = logprobs.shape[1]
        done: dict[int, bool] = {}
        offset = 0
        for group in groups.values():
            for st in group:
                width = st.keep + 3 * st.k + 1
                done[id(st)] = self._apply(st, host[offset : offset + width], vocab)
                offset += width
        return [done[id(st)] for st in states]

    def _search_group(
        self, group: list[_State], logprobs: torch.Tensor, row_of: dict[int, int]
    ) -> torch.Tensor:
        """The device half of a step for requests of one beam width `k`: transformers'
        `_beam_search` bookkeeping on `[R, ...]` tensors, no host read. Returns, flattened,
        per request: the top `keep` flat indices, the `k` running picks among them, the `k`
        finished picks, the `k` alive flags and the done flag."""
        dev, vocab = logprobs.device, logprobs.shape[1]
        r_count, k, keep = len(group), group[0].k, group[0].keep
        rows: list[int] = []
        dead: list[int] = []
        forced: list[int] = []
        zero: list[int] = []  # (request, beam, token) triples set to 0 (the forced token)
        ban: list[int] = []  # (request, beam, token) triples set to -inf
        at_limit: list[int] = []
        early_true: list[int] = []
        divisors: list[float] = []
        for r, st in enumerate(group):
            st.to(dev)
            p = st.req.params
            gen_len = len(st.slots[0].gen)  # every beam has generated the same count
            is_forced = gen_len < len(st.req.forced)
            forced.append(int(is_forced))
            for j, slot in enumerate(st.slots):
                if slot.phys is None:  # score -inf: a row of -inf
                    rows.append(0)
                    dead.append(1)
                    continue
                rows.append(row_of[id(slot.phys)])
                dead.append(0)
                if is_forced:
                    zero += (r, j, st.req.forced[gen_len])
                else:
                    for t in self._bans(st, slot):
                        ban += (r, j, t)
            at_limit.append(int(gen_len + 1 >= st.max_new))
            early_true.append(int(p.early_stopping is True))
            # transformers' stopping rule, after its cur_len += 1.
            best_len = (
                st.max_new
                if p.early_stopping == "never" and p.length_penalty > 0.0
                else gen_len + 1
            )
            divisors.append((gen_len + 1) ** p.length_penalty)
            divisors.append(best_len**p.length_penalty)
        # Host facts go up in two asynchronous copies (no device sync).
        ints = [*rows, *dead, *forced, *at_limit, *early_true, *zero, *ban]
        up = torch.tensor(ints, dtype=torch.int64).to(dev, non_blocking=True)
        div = torch.tensor(divisors, dtype=torch.float32).to(dev, non_blocking=True).view(-1, 2)
        n = r_count * k
        row_idx, dead_t = up[:n], up[n : 2 * n].view(r_count, k).bool()
        flags = up[2 * n : 2 * n + 3 * r_count].view(3, r_count).bool()
        forced_t, limit_t, early_t = flags[0], flags[1], flags[2]
        triples = up[2 * n + 3 * r_count :]
        # (zero first, then ban; each a [count, 3] block of (request, beam, token))
        z = triples[: len(zero)].view(-1, 3).t() if zero else None
        b = triples[len(zero) :].view(-1, 3).t() if ban else None

        # The requests' processors: forced prefix, bans, dead beams.
        proc = logprobs.index_select(0, row_idx).view(r_count, k, vocab)
        if any(forced):
            proc.masked_fill_(forced_t[:, None, None], float("-inf"))
        if z is not None:
            proc[z[0], z[1], z[2]] = 0.0
        if b is not None:
            proc[b[0], b[1], b[2]] = float("-inf")
        if any(dead):
            proc.masked_fill_(dead_t[:, :, None], float("-inf"))

        running = torch.stack([st.running for st in group])
        scores = proc + running[:, :, None]
        topk_scores, topk_idx = torch.topk(scores.view(r_count, k * vocab), k=keep, dim=1)
        # (a broadcast compare: `torch.isin` sorts, and its CUDA unique reads the device)
        hits = limit_t[:, None] | ((topk_idx % vocab)[..., None] == self._eos_on(dev)).any(-1)

        # The K best unfinished continuations run on.
        run_scores = topk_scores + hits.to(torch.float32) * NEG
        next_idx = torch.topk(run_scores, k=k, dim=1)[1]
        new_running = run_scores.gather(1, next_idx)

        # Finished continuations among the first K enter the finished set.
        fin_scores = torch.stack([st.fin_scores for st in group])
        fin_done = torch.stack([st.fin_done for st in group])
        heuristic = torch.stack([st.heuristic for st in group])
        did = hits & (torch.arange(keep, device=dev) < k)[None, :]
        fin = topk_scores / div[:, :1]
        full = fin_done.all(dim=1) & early_t
        fin = fin + full.to(torch.float32)[:, None] * NEG
        fin = fin + (~heuristic).to(torch.float32)[:, None] * NEG
        fin = fin + (~did) * NEG
        merged_scores = torch.cat((fin_scores, fin), dim=1)
        merged_done = torch.cat((fin_done, did), dim=1)
        pick = torch.topk(merged_scores, k=k, dim=1)[1]
        fin_scores = merged_scores.gather(1, pick)
        fin_done = merged_done.gather(1, pick)

        # transformers' stopping rules.
        best_possible = new_running[:, :1] / div[:, 1:]
        worst = torch.where(fin_done, fin_scores.min(dim=1, keepdim=True).values, NEG)
        heuristic = heuristic & (best_possible > worst).any(dim=1)
        done = ~heuristic | (fin_done.all(dim=1) & early_t) | hits.all(dim=1)
        for r, st in enumerate(group):
            st.running, st.fin_scores = new_running[r], fin_scores[r]
            st.fin_done, st.heuristic = fin_done[r], heuristic[r]
        alive = new_running != float("-inf")
        packed = torch.cat((topk_idx, next_idx, pick, alive.long(), done.long()[:, None]), dim=1)
        return packed.reshape(-1)

    def _eos_on(self, dev: torch.device) -> torch.Tensor:
        t = self._eos_tensors.get(dev)
        if t is None:
            t = self._eos_tensors[dev] = torch.tensor(self.eos, dtype=torch.int64, device=dev)
        return t

    def _apply(self, st: _State, row: list[int], vocab: int) -> bool:
        """The host half of a step: the request's finished tokens and its beams' sequences,
        from the values `_search_group` packed; returns whether the request is done."""
        k, keep = st.k, st.keep
        top, nxt = row[:keep], row[keep : keep + k]
        picked, alive = row[keep + k : keep + 2 * k], row[keep + 2 * k : keep + 3 * k]
        parents = [i // vocab for i in top]
        tokens = [i % vocab for i in top]
        old_tokens = st.fin_tokens
        st.fin_tokens = [
            old_tokens[i] if i < k else [*st.slots[parents[i - k]].gen, tokens[i - k]]
            for i in picked
        ]
        self._rebuild(st, [parents[i] for i in nxt], [tokens[i] for i in nxt], alive)
        return bool(row[-1])

    def _rebuild(self, st: _State, parents: list[int], tokens: list[int], alive: list[int]) -> None:
        backend = self.backend
        old = st.slots
        children: dict[tuple[int, int], _Phys] = {}
        taken: set[int] = set()  # parent physicals already continued by a child
        new_slots = []
        for j, (pi, tok) in enumerate(zip(parents, tokens)):
            parent = old[pi]
            gen = [*parent.gen, tok]
            if parent.phys is None or not alive[j]:
                new_slots.append(_Slot(None, gen))
                continue
            key = (id(parent.phys), tok)
            phys = children.get(key)
            if phys is None:
                if id(parent.phys) not in taken:
                    taken.add(id(parent.phys))
                    phys = _Phys(parent.phys.seq, tok)
                else:
                    seq = backend.beam_fork(parent.phys.seq)
                    self.forks += 1
                    phys = _Phys(seq, tok)
                children[key] = phys
            new_slots.append(_Slot(phys, gen))
        # Parents no child continued are freed.
        for p in {id(s.phys): s.phys for s in old if s.phys is not None}.values():
            if id(p) not in taken:
                backend.free_sequence(p.seq)
        st.slots = new_slots

    def _release(self, st: _State) -> None:
        for p in st.physicals():
            self.backend.free_sequence(p.seq)
        st.slots = [_Slot(None, s.gen) for s in st.slots]

    def _output(self, st: _State, scores: list[float]) -> BeamOutput:
        """The request's best `n` hypotheses; `scores` are their finished scores."""
        nf = len(st.req.forced)
        hyps = []
        for i in range(st.req.params.n):
            toks = st.fin_tokens[i]
            reason = "stop" if toks and toks[-1] in self.eos else "length"
            hyps.append(BeamHypothesis(list(toks[nf:]), float(scores[i]), reason))
        return BeamOutput(st.req.request_id, hyps, list(st.req.source or st.req.prompt), st.steps)
