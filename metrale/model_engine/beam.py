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
as there. It runs where the logits are: the requests of one beam width form a `BeamGroup` whose
search state stays there as `[R, k]` tensors for the request's whole life (rows added at
admission, dropped when a request ends), and whose token history is host arrays (`[R, k, L]`
generated tokens, the finished hypotheses'), advanced by vectorised gathers. Per step the host
builds its facts (rows, forced tokens, bans, length divisors) from the group's arrays, with
per-beam Python only for requests in their forced prefix or using `no_repeat_ngram_size` /
`min_tokens`, sends them in one asynchronous copy and reads the device back once for every
request together (the picks that steer the block tables), then once more only on a step
where requests finish (their scores), so a GPU step is not host-bound by the search. The
per-request Python left is the block bookkeeping of `_rebuild` (k beams each).

Sharing: a *physical* sequence (`SequenceState`) holds the KV of a beam's tokens but the
last, which it feeds in the next decoder forward. Beams with the same history share one
physical sequence (the K copies of the prompt at step 0); a beam that continues its parent
takes the parent's sequence over, a second continuation forks it: a new `SequenceState`
whose block table references the same blocks (`BlockPool.incref`). Before a forward writes
into a shared partial last block, that block is copied (copy-on-write; the step's copies
run as one batch before the forward); only a sequence just started or forked (`Phys.check`)
can hold a shared last block, so only those are looked at. A beam whose score is
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

import numpy as np
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
from metrale.model_engine.beam_state import NEG, BeamGroup, BeamState, Phys, beam_bans
from metrale.model_engine.traits import SequenceState

logger = logging.getLogger(__name__)


class BeamSearchDriver:
    """Runs beam-search requests to completion over one backend, batching every running
    request's beams into one decoder forward per `step`."""

    def __init__(self, backend: BeamBackend, eos_token_ids: Sequence[int]) -> None:
        if not eos_token_ids:
            raise ValueError("beam search needs at least one EOS token id")
        self.backend = backend
        self.eos = tuple(int(t) for t in eos_token_ids)
        self._waiting: list[BeamRequest] = []
        self._running: dict[str, BeamState] = {}
        #: Beam width -> its requests, in admission order.
        self._groups: dict[int, BeamGroup] = {}
        #: Blocks copied before a write into a shared partial block; forks made.
        self.cow_copies = 0
        self.forks = 0
        self.forwards = 0
        self._eos_tensors: dict[torch.device, torch.Tensor] = {}
        self._masks: dict[tuple[torch.device, int, int], torch.Tensor] = {}

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
        self._leave([state])
        return True

    def live_sequences(self) -> list[SequenceState]:
        """The physical sequences the running requests hold (each once)."""
        return [p.seq for st in self._running.values() for p in st.uniq]

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

    def _leave(self, states: list[BeamState]) -> None:
        """Take finished or aborted requests out of their groups."""
        by_group: dict[int, set[int]] = {}
        for st in states:
            if st.group is not None:
                by_group.setdefault(st.k, set()).add(st.row)
        for k, rows in by_group.items():
            group = self._groups[k]
            group.remove(rows)
            if not group.states:
                del self._groups[k]
        for st in states:
            st.group = None

    def _step(self) -> list[BeamOutput]:
        backend = self.backend
        if self._waiting:  # every waiting request starts (encoder-decoder: one encoder batch)
            starting, self._waiting = self._waiting, []
            new: list[BeamState] = []
            for req, seq in zip(starting, backend.beam_start_batch(starting), strict=True):
                st = BeamState(req, self.eos, Phys(seq, req.prompt[-1]))
                self._running[req.request_id] = st
                new.append(st)
            by_k: dict[int, list[BeamState]] = {}
            for st in new:
                by_k.setdefault(st.k, []).append(st)
            for k, sts in by_k.items():
                group = self._groups.get(k)
                if group is None:
                    group = self._groups[k] = BeamGroup(k, sts[0].keep)
                group.add(sts)
        if not self._running:
            return []
        states = list(self._running.values())
        physicals: list[Phys] = []
        for st in states:
            st.base = len(physicals)
            physicals += st.uniq
        copies: tuple[list[int], list[int]] = ([], [])
        for p in physicals:
            if p.check:
                p.check = False
                self._copy_on_write(p.seq, copies)
        backend.kv_cache.copy_blocks(*copies)  # every copy of the step in one batch
        logits = backend.decode_batch([p.pending for p in physicals], [p.seq for p in physicals])
        self.forwards += 1
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        # Groups in the order of their first request (the order the bookkeeping concatenates).
        order: dict[int, BeamGroup] = {}
        for st in states:
            if st.k not in order:
                order[st.k] = self._groups[st.k]
        groups = list(order.values())
        packed = [self._search_group(g, logprobs) for g in groups]
        flat = torch.cat(packed) if len(packed) > 1 else packed[0]
        host = flat.to("cpu").numpy()  # the step's one device read
        vocab = logprobs.shape[1]
        ended: list[BeamState] = []
        offset = 0
        for g in groups:
            size = len(g.states) * (g.keep + 3 * g.k + 1)
            done = self._apply(g, host[offset : offset + size], vocab)
            offset += size
            for st, d in zip(g.states, done.tolist(), strict=True):
                st.steps += 1
                if d:
                    ended.append(st)
        if not ended:
            return []
        # The ended requests' finished scores, read before their rows leave their groups.
        ended.sort(key=lambda s: s.base)  # the order they ran in
        by_k: dict[int, list[BeamState]] = {}
        for st in ended:
            by_k.setdefault(st.k, []).append(st)
        picks, at, pos = [], 0, {}
        for k, sts in by_k.items():
            g = self._groups[k]
            idx = torch.tensor([st.row for st in sts], dtype=torch.int64)
            picks.append(g.fin_scores.index_select(0, idx.to(g.dev, non_blocking=True)))
            for st in sts:
                pos[st.req.request_id] = at
                at += k
        scores = (
            torch.cat([t.reshape(-1) for t in picks]) if len(picks) > 1 else picks[0].reshape(-1)
        )
        fin = scores.to("cpu").numpy()  # a step where requests end reads their scores
        finished = []
        for st in ended:
            at = pos[st.req.request_id]
            finished.append(self._output(st, fin[at : at + st.req.params.n].tolist()))
            del self._running[st.req.request_id]
            self._release(st)
        self._leave(ended)
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

    def _search_group(self, g: BeamGroup, logprobs: torch.Tensor) -> torch.Tensor:
        """The device half of a step for the requests of one beam width `k`: transformers'
        `_beam_search` bookkeeping on `[R, ...]` tensors, no host read. The host facts are
        built from the group's arrays (per-beam Python only for requests whose processors
        ban tokens, or that are in their forced prefix) and go up in one asynchronous copy.
        Returns, flattened, per request: the top `keep` flat indices, the `k` running picks
        among them, the `k` finished picks, the `k` alive flags and the done flag."""
        dev, vocab = logprobs.device, logprobs.shape[1]
        g.to(dev)
        states = g.states
        r_count, k, keep = len(states), g.k, g.keep
        gl = g.gen_len
        base = np.fromiter((st.base for st in states), dtype=np.int64, count=r_count)
        dead = g.slot_idx < 0
        rows = np.where(dead, 0, g.slot_idx + base[:, None])
        forced = gl < g.forced_len
        at_limit = gl + 1 >= g.max_new
        zero: list[int] = []  # (request, beam, token) triples set to 0 (the forced token)
        ban: list[int] = []  # (request, beam, token) triples set to -inf
        for r in np.flatnonzero(forced | g.bans).tolist():
            st, n = states[r], int(gl[r])
            for j in range(k):
                if dead[r, j]:
                    continue
                if n < st.forced:
                    zero += (r, j, st.req.forced[n])
                else:
                    for t in beam_bans(st, g.gen[r, j, :n].tolist()):
                        ban += (r, j, t)
        # transformers' stopping rule, after its cur_len += 1.
        cur = (gl + 1).astype(np.float64)
        best = np.where(g.never, g.max_new, gl + 1).astype(np.float64)
        div_host = np.stack((np.power(cur, g.lp), np.power(best, g.lp)), axis=1)
        # Host facts go up in one asynchronous copy (no device sync): the int64 facts, then
        # the float32 divisors `[R, 2]` bit-cast into R int64 words.
        ints = np.concatenate(
            (rows.reshape(-1), dead.reshape(-1), forced, at_limit, g.early,
             div_host.astype(np.float32).view(np.int64).reshape(-1),
             np.asarray(zero, dtype=np.int64), np.asarray(ban, dtype=np.int64)),
            dtype=np.int64,
        )  # fmt: skip
        staged = torch.from_numpy(ints)
        if dev.type == "cuda":  # pinned: the copy is truly asynchronous (pageable may stage)
            staged = staged.pin_memory()
        up = staged.to(dev, non_blocking=True)
        n = r_count * k
        row_idx, dead_t = up[:n], up[n : 2 * n].view(r_count, k).bool()
        flags = up[2 * n : 2 * n + 3 * r_count].view(3, r_count).bool()
        forced_t, limit_t, early_t = flags[0], flags[1], flags[2]
        at = 2 * n + 3 * r_count
        div = up[at : at + r_count].view(torch.float32).view(r_count, 2)
        triples = up[at + r_count :]
        # (zero first, then ban; each a [count, 3] block of (request, beam, token))
        z = triples[: len(zero)].view(-1, 3).t() if zero else None
        b = triples[len(zero) :].view(-1, 3).t() if ban else None

        # The requests' processors: forced prefix, bans, dead beams.
        proc = logprobs.index_select(0, row_idx).view(r_count, k, vocab)
        if forced.any():
            proc.masked_fill_(forced_t[:, None, None], float("-inf"))
        if z is not None:
            proc[z[0], z[1], z[2]] = 0.0
        if b is not None:
            proc[b[0], b[1], b[2]] = float("-inf")
        if dead.any():
            proc.masked_fill_(dead_t[:, :, None], float("-inf"))

        scores = proc + g.running[:, :, None]
        topk_scores, topk_idx = torch.topk(scores.view(r_count, k * vocab), k=keep, dim=1)
        # (a broadcast compare: `torch.isin` sorts, and its CUDA unique reads the device)
        tok = topk_idx % vocab
        if len(self.eos) == 1:
            hits = limit_t[:, None] | (tok == self.eos[0])
        else:
            hits = limit_t[:, None] | (tok[..., None] == self._eos_on(dev)).any(-1)

        # The K best unfinished continuations run on.
        # (`bool * NEG` is float32, as `bool.to(float32) * NEG`: one launch fewer)
        run_scores = topk_scores + hits * NEG
        next_idx = torch.topk(run_scores, k=k, dim=1)[1]
        new_running = run_scores.gather(1, next_idx)

        # Finished continuations among the first K enter the finished set.
        fin_scores, fin_done, heuristic = g.fin_scores, g.fin_done, g.heuristic
        did = hits & self._first_k(dev, keep, k)
        fin = topk_scores / div[:, :1]
        full = fin_done.all(dim=1) & early_t
        fin = fin + full[:, None] * NEG
        fin = fin + (~heuristic)[:, None] * NEG
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
        g.running, g.fin_scores, g.fin_done, g.heuristic = (
            new_running,
            fin_scores,
            fin_done,
            heuristic,
        )
        alive = new_running != float("-inf")
        packed = torch.cat((topk_idx, next_idx, pick, alive.long(), done.long()[:, None]), dim=1)
        return packed.reshape(-1)

    def _first_k(self, dev: torch.device, keep: int, k: int) -> torch.Tensor:
        """`[1, keep]` bool: the first `k` of the top `keep` (made once per shape)."""
        t = self._masks.get((dev, keep, k))
        if t is None:
            t = self._masks[(dev, keep, k)] = (torch.arange(keep, device=dev) < k)[None, :]
        return t

    def _eos_on(self, dev: torch.device) -> torch.Tensor:
        t = self._eos_tensors.get(dev)
        if t is None:
            t = self._eos_tensors[dev] = torch.tensor(self.eos, dtype=torch.int64, device=dev)
        return t

    def _apply(self, g: BeamGroup, flat: np.ndarray, vocab: int) -> np.ndarray:
        """The host half of a step for one group, from the values `_search_group` packed: the
        finished hypotheses' and the beams' tokens (vectorised over the group), then each
        request's beams' sequences; returns the requests' done flags."""
        r_count, k, keep = len(g.states), g.k, g.keep
        block = flat.reshape(r_count, keep + 3 * k + 1)
        top, nxt = block[:, :keep], block[:, keep : keep + k]
        picked, alive = block[:, keep + k : keep + 2 * k], block[:, keep + 2 * k : keep + 3 * k]
        parents, tokens = top // vocab, top % vocab
        r_idx = np.arange(r_count)[:, None]
        gl = g.gen_len
        # Every candidate's tokens: its parent's then its token; the finished set picks among
        # its old members (index < k) and the candidates.
        cand = g.gen[r_idx, parents]
        cand[r_idx, g.first_keep, gl[:, None]] = tokens
        g.fin_tok = np.concatenate((g.fin_tok, cand), axis=1)[r_idx, picked]
        # The running beams are candidates too: their tokens are the picked candidates'.
        g.gen = cand[r_idx, nxt]
        g.gen_len = gl + 1
        run_parents, run_tokens = parents[r_idx, nxt], tokens[r_idx, nxt]
        # One host list for the requests' block bookkeeping: old slots | parents | tokens | alive.
        rows = np.concatenate((g.slot_idx, run_parents, run_tokens, alive), axis=1).tolist()
        rebuild = self._rebuild
        g.slot_idx = np.array(
            [
                rebuild(st, row[:k], row[k : 2 * k], row[2 * k : 3 * k], row[3 * k :])
                for st, row in zip(g.states, rows, strict=True)
            ],
            dtype=np.int64,
        ).reshape(r_count, k)
        return block[:, -1]

    def _rebuild(
        self, st: BeamState, old_slots: list[int], parents: list[int], tokens: list[int],
        alive: list[int],
    ) -> list[int]:  # fmt: skip
        """The request's beams' physical sequences after a step (`old_slots`: each old beam's
        index among the request's sequences, -1 dead): a beam continuing a parent's sequence
        takes it over, a second continuation forks it, a parent no beam continues is freed.
        Returns each new beam's index among the request's new sequences (-1: dead)."""
        old = st.uniq
        taken = [False] * len(old)  # parent sequences already continued by a child
        children: dict[tuple[int, int], int] = {}  # (parent sequence, token) -> new index
        uniq: list[Phys] = []
        slots: list[int] = []
        for pi, tok, live in zip(parents, tokens, alive):
            u = old_slots[pi]
            if u < 0 or not live:
                slots.append(-1)
                continue
            at = children.get((u, tok))
            if at is None:
                at = children[(u, tok)] = len(uniq)
                parent = old[u]
                if not taken[u]:
                    taken[u] = True
                    parent.pending = tok
                    uniq.append(parent)
                else:
                    uniq.append(Phys(self.backend.beam_fork(parent.seq), tok))
                    parent.check = True  # its last block is now shared
                    self.forks += 1
            slots.append(at)
        for u, t in enumerate(taken):  # parents no child continued are freed
            if not t:
                self.backend.free_sequence(old[u].seq)
        st.uniq = uniq
        return slots

    def _release(self, st: BeamState) -> None:
        for p in st.uniq:
            self.backend.free_sequence(p.seq)
        st.uniq = []

    def _output(self, st: BeamState, scores: list[float]) -> BeamOutput:
        """The request's best `n` hypotheses; `scores` are their finished scores."""
        g, nf = st.group, st.forced
        assert g is not None
        hyps = []
        for i in range(st.req.params.n):
            row = g.fin_tok[st.row, i]
            toks = row[row >= 0].tolist()
            reason = "stop" if toks and toks[-1] in self.eos else "length"
            hyps.append(BeamHypothesis(toks[nf:], float(scores[i]), reason))
        return BeamOutput(st.req.request_id, hyps, list(st.req.source or st.req.prompt), st.steps)
