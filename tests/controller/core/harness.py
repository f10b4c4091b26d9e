"""A scheduler harness without a model: a fake executor that answers steps as a model would
(each token a function of the tokens before it), request and config builders, the pool
invariants checked after every step, and a loop that drives a scheduler until it drains."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from common.wire.step_types import (
    RequestStepOutput,
    SamplingParams,
    StepInput,
    StepOutput,
)
from controller.core.request import Request, RequestStatus
from controller.core.scheduler import RequestUpdate, Scheduler, SchedulerConfig

BS = 16


EOS = 2


def model_token(tokens: list[int]) -> int:
    """The fake model: the next token is a deterministic function of the whole sequence."""
    return 1000 + hash((len(tokens), *tokens[-4:])) % 1000


def expected_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(model_token(tokens))
    return tokens[len(prompt) :]


@dataclass
class _Held:
    """What the fake executor holds for one request."""

    tokens: list[int]  # prompt + outputs it knows
    num_prompt: int  # prompt length
    computed: int  # tokens with KV written
    table: list[int]  # block table
    mask: bytes | None = None  # allowed tokens of this step's sample (structured output)
    prefix_keys: list[int] = field(default_factory=list)  # KV "content" of every position


class FakeExecutor:
    """Plays the executor: keeps request state from the step diffs, 'writes KV' into blocks,
    checks that every position it reads holds the right content (so prefix hits and block
    reuse are verified), and samples `model_token` (or a scripted token) on prefill completion.
    """

    def __init__(self, block_size: int = BS, script: dict[str, list[int]] | None = None) -> None:
        self.block_size = block_size
        self.script = script or {}  # request id -> tokens to emit, by output index
        self.held: dict[str, _Held] = {}
        self.kv: dict[int, dict[int, int]] = {}  # block id -> slot -> content key
        self.fail: set[str] = set()  # request ids to answer with an error
        self.last_step_id = 0  # step ids must follow each other
        self.ignore_masks = False  # sample as if no allowed-token mask came (a broken executor)
        self.masks_seen = 0  # allowed-token masks received with a sample

    def _key(self, held: _Held, pos: int) -> int:
        while len(held.prefix_keys) <= pos:
            prev = held.prefix_keys[-1] if held.prefix_keys else 0
            held.prefix_keys.append(hash((prev, held.tokens[len(held.prefix_keys)])))
        return held.prefix_keys[pos]

    def run(self, step: StepInput) -> StepOutput:
        assert step.num_requests > 0, "an empty step is not meant to be sent"
        assert step.step_id == self.last_step_id + 1
        self.last_step_id = step.step_id
        for rid in step.finished_request_ids:
            assert rid in self.held, f"finished id {rid} unknown to the executor"
            del self.held[rid]
        work = []
        for new in step.new_requests:
            assert new.request_id not in self.held
            held = _Held(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                len(new.prompt_token_ids),
                new.num_computed_tokens,
                list(new.block_ids),
            )
            self.held[new.request_id] = held
            held.mask = new.allowed_token_mask
            work.append((new.request_id, held, new.num_scheduled_tokens))
        for cached in step.cached_requests:
            held = self.held[cached.request_id]
            assert held.computed == cached.num_computed_tokens
            held.table.extend(cached.new_block_ids)
            held.mask = cached.allowed_token_mask
            work.append((cached.request_id, held, cached.num_scheduled_tokens))
        bs = self.block_size
        for _, held, n in work:  # write every scheduled token's KV first ...
            assert n > 0 and held.computed + n <= len(held.tokens)
            assert len(held.table) * bs >= held.computed + n
            for pos in range(held.computed, held.computed + n):
                assert held.table[pos // bs] != 0
                self.kv.setdefault(held.table[pos // bs], {})[pos % bs] = self._key(held, pos)
            held.computed += n
        outputs = []
        for rid, held, _ in work:  # ... then "attend" and sample
            out = RequestStepOutput(rid)
            if rid in self.fail:
                out.error = "device says no"
            elif held.computed == len(held.tokens):
                for pos in range(held.computed):
                    got = self.kv[held.table[pos // bs]].get(pos % bs)
                    assert got == self._key(held, pos), f"{rid}: bad KV at position {pos}"
                index = len(held.tokens) - held.num_prompt
                script = self.script.get(rid)
                token = (
                    script[index] if script and index < len(script) else model_token(held.tokens)
                )
                if held.mask is not None:
                    self.masks_seen += 1
                    if not self.ignore_masks:
                        token = allowed_token(held.mask, token)
                held.tokens.append(token)
                out.sampled_token_id = token
            outputs.append(out)
        return StepOutput(step.step_id, outputs)


def allowed_token(mask: bytes, preferred: int) -> int:
    """The token a masked sample takes: `preferred` if the mask allows it, else the lowest
    allowed one (packed little-endian words: bit t of the whole mask is token t)."""
    bits = int.from_bytes(mask, "little")
    if bits >> preferred & 1:
        return preferred
    assert bits, "the mask allows no token"
    return (bits & -bits).bit_length() - 1


def make_config(**kw) -> SchedulerConfig:
    kw.setdefault("num_blocks", 64)
    return SchedulerConfig(**kw)


def make_request(rid: str, prompt: list[int] | int, max_tokens: int = 4, **kw) -> Request:
    if isinstance(prompt, int):
        prompt = [hash((rid, i)) % 900 + 10 for i in range(prompt)]
    return Request(rid, prompt, SamplingParams(), max_tokens=max_tokens, **kw)


def check_invariants(sched: Scheduler, step: StepInput | None = None) -> None:
    """Budget, request count, ref counts, free queue and hash map all consistent."""
    cfg, pool = sched.config, sched.kv.pool
    if step is not None:
        assert step.num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert step.num_requests <= cfg.max_num_seqs
        assert sched.stats().num_scheduled_tokens == step.num_scheduled_tokens
        if not cfg.chunked_prefill:
            for new in step.new_requests:
                total = len(new.prompt_token_ids) + len(new.output_token_ids)
                assert new.num_computed_tokens + new.num_scheduled_tokens == total
    refs: dict[int, int] = {}
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        ids = sched.kv.get_block_ids(req.request_id)
        assert len(ids) * sched.kv.block_size >= req.num_computed_tokens
        for block_id in ids:
            refs[block_id] = refs.get(block_id, 0) + 1
    for req in sched.requests.values():
        if req.status is not RequestStatus.RUNNING:
            assert sched.kv.get_block_ids(req.request_id) == []
    for block in pool.blocks[1:]:
        assert block.ref_count == refs.get(block.block_id, 0), block
    free_ids = pool.free_queue.block_ids()
    assert sorted(free_ids) == [b.block_id for b in pool.blocks[1:] if b.ref_count == 0]
    assert 0 not in free_ids
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    assert sched.num_running + sched.num_waiting == len(sched.requests)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)  # every token streamed
    reason: str | None = None  # finish reason
    updates: list[RequestUpdate] = field(default_factory=list)


def run_step(sched: Scheduler, ex: FakeExecutor, results: dict[str, Result]) -> StepInput:
    step = sched.schedule()
    check_invariants(sched, step)
    if step.num_requests == 0:  # not sent, as the engine does: it must carry nothing
        assert not step.finished_request_ids and step.step_id == ex.last_step_id + 1
        return step
    for update in sched.update_from_output(step, ex.run(step)):
        res = results.setdefault(update.request_id, Result())
        assert res.reason is None, "update after finish"
        res.tokens += update.new_token_ids
        res.updates.append(update)
        if update.finished:
            res.reason = update.finish_reason
    check_invariants(sched)
    return step


def drive(
    sched: Scheduler,
    ex: FakeExecutor,
    results: dict[str, Result] | None = None,
    max_steps: int = 2000,
) -> dict[str, Result]:
    """Run until every request finished (adding to `results`); then check no block is held."""
    results = {} if results is None else results
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        run_step(sched, ex, results)
    else:
        raise AssertionError("scheduler did not drain")
    assert sched.kv.num_used_blocks == 0 and sched.stats().kv_usage == 0.0
    # The executor holds nothing but requests the next step will tell it to drop.
    assert set(ex.held) == set(sched._finished_ids)
    return results


def random_workload(
    sched: Scheduler, seed: int, *, count: int, share_every: int, max_extra: int, max_tokens: int
) -> dict[str, tuple[list[int], int]]:
    """`count` requests added to `sched` (ids r0, r1, ...): every `share_every`-th starts with
    the same 40 tokens (prefix-cache hits), then 1 to `max_extra` - 1 random tokens, and asks for
    1 to `max_tokens` - 1 tokens. Returns each id's (prompt, max_tokens)."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 900) for _ in range(40)]
    made = {}
    for i in range(count):
        prompt = (shared if i % share_every == 0 else []) + [
            rng.randrange(10, 900) for _ in range(rng.randrange(1, max_extra))
        ]
        req = make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, max_tokens))
        sched.add_request(req)
        made[req.request_id] = (prompt, req.max_tokens)
    return made
