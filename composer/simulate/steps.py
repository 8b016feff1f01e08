"""An engine in time, as vLLM's scheduler runs it: ``kvc simulate --fleet``'s engine model.

vLLM (v1) runs an engine in steps. Each step it schedules, within a token
budget (``max_num_batched_tokens``): first the requests running, in the order
they were admitted (a decode: one token; a prompt not done yet: its next
chunk), then the waiting ones in arrival order while the budget lasts, fewer
than ``max_num_seqs`` run and the KV cache has blocks for them
(``num_gpu_blocks``, one pool for every KV cache group: a full-attention group
holds a block per ``block_size`` tokens of a request, a sliding window's or an
attention chunk's only the last ones, a mamba group one; a waiting request
that does not fit holds the queue, as in vLLM's FCFS policy). What a request
finds cached (vLLM's prefix cache, a node's load) is not computed; a node's
load is done in the step that first schedules the request (a synchronous
load, before the forward; a prompt wholly cached still computes its last
token, as vLLM does). A request whose prompt is
done in a step samples its first token there: its TTFT is that step's end (and
the time its request took to reach the engine, ``request_s``); each later step
gives it one token. A running request needing a block when none is free
preempts the last admitted one, which is computed again later, as vLLM does.

A step takes ``step_s`` + ``prefill_token_s`` per prompt token computed +
``load_token_s`` per token loaded + ``decode_seq_s`` per request decoding
(:class:`CostModel`, fitted by :mod:`composer.simulate.calibrate`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from composer.simulate.cost import CostModel
from composer.simulate.tiers import SimKVGroup


class Job:
    """One request on an engine, from its arrival in the queue to its last token."""

    __slots__ = (
        "index",
        "arrival",
        "prompt",
        "cached",
        "loaded",
        "output",
        "computed",
        "kv",
        "produced",
        "blocks",
        "ttft",
        "started",
        "reserved",
    )

    def __init__(
        self,
        index: int,
        arrival: float,
        prompt: int,
        cached: int,
        loaded: int,
        output: int,
        started: Any = None,
    ) -> None:
        self.index, self.arrival, self.started = index, arrival, started
        self.prompt, self.output = prompt, max(1, output)
        # A prompt wholly cached still computes its last token (vLLM's rule).
        self.cached = min(cached, prompt - 1) if prompt > 0 else 0
        #: Of the cached tokens, those a node loads (vLLM's own hits cost nothing).
        self.loaded = min(loaded, self.cached)
        #: Prompt tokens done (cached ones included once admitted), tokens with KV
        #: written, output tokens sampled, KV blocks held.
        self.computed = self.kv = self.produced = self.blocks = 0
        self.ttft = -1.0
        #: The prefill the router reserved for it (the fleet's routers' load terms).
        self.reserved = prompt - cached


class StepEngine:
    """One engine's queue, its running requests and its KV cache, step by step.

    :meth:`start_step` schedules a step (returns how long it takes, or None when
    there is nothing to run); :meth:`end_step` applies it (returns the requests
    that got their first token and those that finished)."""

    def __init__(self, cost: CostModel, block_size: int, groups: Sequence[SimKVGroup] = ()) -> None:
        self.cost, self.block_size = cost, max(1, block_size)
        kinds = [g.kind for g in groups]
        #: Full-attention groups; each window group's window (tokens); mamba groups.
        self.full = kinds.count("attention") if groups else 1
        self.windows = [g.window for g in groups if g.window]
        self.mamba = kinds.count("mamba")
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        # (vLLM keeps one block of its pool aside: the null block.)
        self.free = max(0, cost.num_gpu_blocks - 1)
        self.limited = bool(cost.num_gpu_blocks)
        #: The step under way: (job, tokens) per request scheduled; empty when idle.
        self.step: list[tuple[Job, int]] = []
        self.preemptions = 0

    @property
    def busy(self) -> bool:
        return bool(self.step)

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def _holding(self, kv: int, tokens: int) -> int:
        """Blocks a request with ``kv`` tokens' KV holds, in every group, once it writes
        ``tokens`` more: a window group first frees the blocks before its window (vLLM
        does so as it schedules the step), then takes blocks for all the new tokens."""
        size = self.block_size
        end = -(-(kv + tokens) // size)
        windows = sum(end - max(0, kv - w) // size for w in self.windows)
        return self.full * end + windows + self.mamba

    def _blocks_for(self, job: Job, tokens: int) -> int:
        """More blocks ``job`` needs to write ``tokens`` more tokens' KV (its blocks
        before a window given back first)."""
        if self.windows and job.blocks:
            kept = self._holding(job.kv, 0)
            if kept < job.blocks:
                self.free += job.blocks - kept
                job.blocks = kept
        return max(0, self._holding(job.kv, tokens) - job.blocks)

    def _take(self, job: Job, need: int) -> None:
        job.blocks += need
        self.free -= need

    def _release(self, job: Job) -> None:
        self.free += job.blocks
        job.blocks = 0

    def start_step(self) -> float | None:
        cost = self.cost
        budget = cost.max_num_batched_tokens
        step: list[tuple[Job, int]] = []
        prefill = decodes = 0
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            job = running[i]
            tokens = min(job.prompt - job.computed, budget) if job.computed < job.prompt else 1
            need = self._blocks_for(job, tokens)
            while self.limited and need > self.free and running[-1] is not job:
                self._preempt(running.pop())
                preempted = True
            if self.limited and need > self.free and i > 0:
                self._preempt(running.pop(i))  # itself, the last: it waits again
                preempted = True
                break
            # (Alone, it runs whatever it needs: vLLM's cache holds one request of the
            # longest length it serves, which a trace's request may exceed here.)
            self._take(job, need)
            job.kv += tokens
            if job.computed < job.prompt:
                job.computed += tokens
                prefill += tokens
            else:
                decodes += 1
            budget -= tokens
            step.append((job, tokens))
            i += 1
        loaded = 0
        if not preempted:
            loaded, prefill = self._admit(step, budget, prefill)
        self.step = step
        if not step:
            return None
        return (
            cost.step_s
            + cost.prefill_token_s * prefill
            + cost.load_token_s * loaded
            + cost.decode_seq_s * decodes
        )

    def _admit(self, step: list[tuple[Job, int]], budget: int, prefill: int) -> tuple[int, int]:
        """Waiting requests, in order, while the budget, ``max_num_seqs`` and the free
        blocks allow (one that does not fit holds the rest); returns the tokens their
        nodes load and the prompt tokens the step computes."""
        loaded = 0
        while self.waiting and budget > 0 and len(self.running) < self.cost.max_num_seqs:
            job = self.waiting[0]
            tokens = min(job.prompt - job.cached, budget)
            need = self._blocks_for(job, job.cached + tokens)
            if self.limited and need > self.free and (self.running or step):
                break
            # (An engine with nothing else admits it whatever it needs: vLLM refuses a
            # request longer than its KV cache at its arrival, which a trace cannot be.)
            self.waiting.popleft()
            self._take(job, need)
            job.kv = job.computed = job.cached + tokens
            loaded += job.loaded
            prefill += tokens
            budget -= tokens
            self.running.append(job)
            step.append((job, tokens))
        return loaded, prefill

    def _preempt(self, job: Job) -> None:
        """vLLM frees a preempted request's blocks and computes it again later."""
        self._release(job)
        job.computed = job.kv = 0  # (the tokens it sent stay sent)
        self.waiting.appendleft(job)
        self.preemptions += 1

    def end_step(self) -> tuple[list[Job], list[Job]]:
        """The step ended: the requests whose first token it sampled, and those done."""
        first: list[Job] = []
        done: list[Job] = []
        for job, _ in self.step:
            if job.computed < job.prompt:
                continue  # a chunk of its prompt
            if job.produced == 0:
                first.append(job)
            job.produced += 1
            if job.produced >= job.output:
                done.append(job)
        if done:
            gone = set(map(id, done))
            self.running = [j for j in self.running if id(j) not in gone]
            for job in done:
                self._release(job)
        self.step = []
        return first, done
