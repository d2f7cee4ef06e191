import pytest

from hybridmoe import SamplingParams
from hybridmoe.engine.kv_blocks import BlockPool
from hybridmoe.engine.scheduler import Scheduler
from hybridmoe.engine.sequence import Sequence, SequenceStatus


def scheduler(num_slots, max_num_batched_tokens, num_blocks=64, block_size=4, prefix_caching=True):
    return Scheduler(num_slots, max_num_batched_tokens, BlockPool(num_blocks, block_size, prefix_caching))


def seq(name, prompt_len):
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100))


def run(batch, sched=None):
    """What the engine does after the model ran: advance caches (registering full blocks), add a token where
    one was sampled."""
    for s in batch:
        completes = s.completes
        s.seq.num_computed += s.num_tokens
        if sched is not None:
            sched.cache_computed(s.seq)
        if completes:
            s.seq.output_ids.append(0)


def plan(batch):
    return [(s.seq.request_id, s.num_tokens) for s in batch]


def test_admits_up_to_the_number_of_slots_and_a_finished_sequence_frees_its_slot_at_once():
    sched = scheduler(num_slots=2, max_num_batched_tokens=100)
    a, b, c = seq("a", 3), seq("b", 3), seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    run(batch := sched.schedule())
    assert plan(batch) == [("a", 3), ("b", 3)]
    assert (a.slot, b.slot, c.status) == (0, 1, SequenceStatus.WAITING)
    assert not sched.admits()  # c waits, but no slot is free: the next step runs the same sequences
    sched.finish(a)
    assert a.status is SequenceStatus.FINISHED and a.slot is None
    assert sched.admits()
    assert plan(sched.schedule()) == [("b", 1), ("c", 3)]
    assert c.slot == 0 and not sched.admits()


def test_an_aborted_waiting_sequence_is_never_scheduled():
    sched = scheduler(num_slots=1, max_num_batched_tokens=100)
    a, b = seq("a", 2), seq("b", 2)
    sched.add(a)
    sched.add(b)
    sched.finish(b)
    assert plan(sched.schedule()) == [("a", 2)]
    sched.finish(a)
    assert not sched.has_unfinished() and sched.free_slots == [0]


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding():
    sched = scheduler(num_slots=4, max_num_batched_tokens=8)
    a, b = seq("a", 2), seq("b", 2)
    sched.add(a)
    sched.add(b)
    run(sched.schedule())  # both prompts in one step; each now has one sampled token
    long = seq("long", 20)
    sched.add(long)
    steps = []
    while not long.output_ids:
        run(batch := sched.schedule())
        steps.append(plan(batch))
    # every step: one token per decoding stream, the other 6 of the budget on the long prompt
    assert steps == [[("a", 1), ("b", 1), ("long", 6)]] * 3 + [[("a", 1), ("b", 1), ("long", 2)]]
    assert long.num_computed == 20
    assert plan(sched.schedule()) == [("a", 1), ("b", 1), ("long", 1)]


def test_new_requests_join_between_steps_without_waiting_for_the_batch_to_drain():
    sched = scheduler(num_slots=4, max_num_batched_tokens=100)
    sched.add(seq("a", 4))
    run(sched.schedule())
    run(sched.schedule())
    sched.add(seq("b", 5))
    assert plan(sched.schedule()) == [("a", 1), ("b", 5)]


def finish_all(sched, seqs, max_steps=500):
    """Run steps until every seq has max_tokens outputs, finishing each as it gets there; the steps' plans."""
    plans = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return plans
        batch = sched.schedule()
        plans.append(plan(batch))
        run(batch, sched)
        for s in batch:
            if len(s.seq.output_ids) >= s.seq.params.max_tokens:
                sched.finish(s.seq)
    raise AssertionError(f"not finished after {max_steps} steps: {plans[-3:]}")


def test_a_prompt_starting_like_an_earlier_one_starts_after_its_cached_full_blocks():
    sched = scheduler(num_slots=2, max_num_batched_tokens=100, block_size=4)
    a = Sequence("a", list(range(1, 11)), SamplingParams(max_tokens=1))
    sched.add(a)
    finish_all(sched, [a])
    b = Sequence("b", list(range(1, 10)) + [99, 98], SamplingParams(max_tokens=1))
    sched.add(b)
    assert plan(sched.schedule()) == [("b", 3)]  # blocks [1-4] and [5-8] found: 8 tokens not computed
    assert b.num_cached_tokens == 8 and b.num_computed == 8
    assert (sched.pool.stats.queried_tokens, sched.pool.stats.hit_tokens) == (10 + 11, 8)


def test_a_prompt_cached_whole_still_computes_its_last_block_and_prefix_caching_off_finds_nothing():
    for caching, cached in ((True, 4), (False, 0)):
        sched = scheduler(num_slots=2, max_num_batched_tokens=100, block_size=4, prefix_caching=caching)
        first = Sequence("a", list(range(1, 9)), SamplingParams(max_tokens=1))
        sched.add(first)
        finish_all(sched, [first])
        again = Sequence("b", list(range(1, 9)), SamplingParams(max_tokens=1))
        sched.add(again)
        # 8 tokens, two full blocks cached: the second is computed again (a sequence samples after its last token)
        assert plan(sched.schedule()) == [("b", 8 - cached)]
        assert again.num_cached_tokens == cached


def test_a_sequence_the_pool_cannot_hold_is_preempted_and_resumes_where_it_stood():
    # 6 usable blocks of 4 tokens: two sequences of 8-token prompts and 12 new tokens each cannot both fit
    sched = scheduler(num_slots=2, max_num_batched_tokens=100, num_blocks=7, block_size=4)
    a = Sequence("a", list(range(1, 9)), SamplingParams(max_tokens=12))
    b = Sequence("b", list(range(101, 109)), SamplingParams(max_tokens=12))
    sched.add(a)
    sched.add(b)
    plans = finish_all(sched, [a, b])
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert len(a.output_ids) == len(b.output_ids) == 12
    # b comes back with its prompt and the tokens it had: computed again after the full blocks still cached
    back = next(i for i, p in enumerate(plans) if i and ("b", 1) in plans[i - 1] and ("b", 1) not in p)
    assert any(name == "b" and n > 1 for p in plans[back:] for name, n in p)
    assert sched.pool.num_free == sched.pool.usable_blocks
    assert all(r == 0 for r in sched.pool.refs)


@pytest.mark.parametrize("host_blocks", [0, 5])
def test_every_block_is_back_in_the_pool_after_mixed_requests_and_aborts(host_blocks):
    import random

    rng = random.Random(0)
    sched = Scheduler(4, 16, BlockPool(12, 4, host_blocks=host_blocks))
    shared = [7] * 12  # prompts that share a prefix hit the cache
    live = []
    for step in range(400):
        if rng.random() < 0.3:
            prompt = (shared[:rng.randrange(13)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))])
            seq = Sequence(f"s{step}", prompt, SamplingParams(max_tokens=rng.randrange(1, 10)))
            sched.add(seq)
            live.append(seq)
        if live and rng.random() < 0.05:
            sched.finish(live.pop(rng.randrange(len(live))))  # an abort, waiting or running
        batch = sched.schedule()
        run(batch, sched)
        for s in batch:
            if len(s.seq.output_ids) >= s.seq.params.max_tokens:
                sched.finish(s.seq)
                live.remove(s.seq)
        assert sched.pool.num_free + len({b for s in sched.running for b in s.blocks.table}) == \
            sched.pool.usable_blocks
    for seq in list(live):
        sched.finish(seq)
    assert not sched.has_unfinished()
    assert sched.pool.num_free == sched.pool.usable_blocks and all(r == 0 for r in sched.pool.refs)
    assert sched.pool.stats.hit_tokens > 0 and sched.num_preemptions > 0
    pool = sched.pool
    assert len(pool.on_host) + len(pool.host_free) == host_blocks  # every host block listed once
    assert len(set(pool.on_host.values()) | set(pool.host_free)) == host_blocks
    if host_blocks:
        assert any(c.direction == "in" for c in pool.copies) and any(c.direction == "out" for c in pool.copies)


def test_evicted_cached_blocks_go_to_the_host_tier_and_come_back_as_copies():
    from hybridmoe.engine.kv_blocks import BlockCopy

    sched = scheduler(num_slots=1, max_num_batched_tokens=100, num_blocks=4, block_size=4)  # 3 usable blocks
    sched.pool = pool = BlockPool(4, 4, host_blocks=4)
    a = Sequence("a", list(range(1, 10)), SamplingParams(max_tokens=1))  # 9 tokens: 2 full blocks, 3 blocks
    sched.add(a)
    finish_all(sched, [a])
    kept = dict(pool.cached)
    assert len(kept) == 2 and not pool.copies
    b = Sequence("b", list(range(50, 59)), SamplingParams(max_tokens=1))  # needs every block: a's are evicted
    sched.add(b)
    finish_all(sched, [b])
    assert [c.direction for c in pool.copies] == ["out", "out"]
    assert {c.device_block for c in pool.copies} == set(kept.values()) and set(pool.on_host) == set(kept)
    pool.copies.clear()
    again = Sequence("c", list(range(1, 10)) + [77], SamplingParams(max_tokens=1))
    sched.add(again)
    assert plan(sched.schedule()) == [("c", 2)]  # a's two full blocks, copied back in
    assert again.num_cached_tokens == 8
    ins = [c for c in pool.copies if c.direction == "in"]
    assert [c.host_block for c in ins] == [pool.on_host[d] for d in kept]
    assert again.blocks.table[:2] == [c.device_block for c in ins]
    # the copies out (b's blocks evicted for the copies in) come before the copies in that reuse their blocks
    for i, c in enumerate(pool.copies):
        if c.direction == "in":
            later_outs = [o for o in pool.copies[i + 1:] if o.direction == "out" and o.device_block == c.device_block]
            assert not later_outs
    assert BlockCopy("in", 1, 0).direction == "in"


@pytest.mark.parametrize("num_blocks, host_blocks, prompt_len", [(5, 3, 13), (9, 7, 29), (17, 15, 61)])
def test_a_prefix_comes_back_whole_from_a_full_host_tier(num_blocks, host_blocks, prompt_len):
    """Copying a conversation's blocks back evicts another's into the full host tier: that must not drop the
    blocks of the same conversation still waiting to be copied in."""
    sched = scheduler(num_slots=1, max_num_batched_tokens=100, num_blocks=num_blocks, block_size=4)
    sched.pool = pool = BlockPool(num_blocks, 4, host_blocks=host_blocks)
    first = list(range(1, prompt_len + 1))  # full blocks as many as the host tier holds, and one partial block
    for name, prompt in (("a", first), ("b", list(range(500, 500 + prompt_len)))):  # b evicts a's to the host
        s = Sequence(name, prompt, SamplingParams(max_tokens=1))
        sched.add(s)
        finish_all(sched, [s])
    assert len(pool.on_host) == host_blocks and not pool.cached.keys() & pool.on_host.keys()
    again = Sequence("c", first + [77], SamplingParams(max_tokens=1))
    sched.add(again)
    sched.schedule()
    assert again.num_cached_tokens == 4 * host_blocks  # every one of a's blocks copied back in
    assert [c.direction for c in pool.copies].count("in") == host_blocks


def test_the_host_tier_drops_its_least_recently_used_block_when_full():
    pool = BlockPool(3, 4, host_blocks=1)  # 2 usable device blocks, 1 host block
    seq = SequenceBlocksFor(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    pool.release(seq.table)
    pool.allocate(2)  # evicts both, the later block first (released last): the earlier one replaces it on the host
    assert list(pool.on_host) == [seq.digests[0]] and pool.on_host[seq.digests[0]] == 0
    assert [c.direction for c in pool.copies] == ["out", "out"]


def SequenceBlocksFor(pool, tokens):
    """Two full blocks of tokens computed and registered in pool (a finished sequence's blocks)."""
    from hybridmoe.engine.kv_blocks import SequenceBlocks, TokenDigests

    seq = SequenceBlocks(pool.allocate(len(tokens) // pool.block_size))
    pool.register(seq, TokenDigests.of(tokens, pool.block_size), len(tokens))
    return seq


def test_each_block_of_a_sequence_is_hashed_once_however_long_it_waits(monkeypatch):
    """A waiting prompt is looked up at every step it stays out, and its blocks registered as they fill: each
    block's digest is computed once, and equals the chain of block_digest over its tokens."""
    import hybridmoe.engine.kv_blocks as kv_blocks

    calls = []
    digest = kv_blocks.block_digest
    monkeypatch.setattr(kv_blocks, "block_digest", lambda parent, tokens: calls.append((parent, tuple(tokens)))
                        or digest(parent, tokens))
    # one slot: b (12 tokens, 3 blocks) waits while a runs its 10 new tokens
    sched = scheduler(num_slots=1, max_num_batched_tokens=100, block_size=4)
    a = Sequence("a", list(range(1, 9)), SamplingParams(max_tokens=10))
    b = Sequence("b", list(range(50, 62)), SamplingParams(max_tokens=1))
    sched.add(a)
    sched.add(b)
    finish_all(sched, [a, b])
    assert len(calls) == len(set(calls))  # no block hashed twice
    want, parent = [], b""
    for i in range(3):
        parent = digest(parent, b.token_ids(4 * i, 4 * i + 4))
        want.append(parent)
    assert [b.block_digests[i] for i in range(3)] == want


def recurrent_scheduler(num_slots, max_num_batched_tokens, num_blocks=64, block_size=4, num_snapshots=8, interval=0,
                        host_blocks=0):
    """A scheduler for a model with a recurrent state per sequence: its pool keeps state snapshots."""
    from hybridmoe.engine.state_snapshots import StateSnapshots

    pool = BlockPool(num_blocks, block_size, host_blocks=host_blocks,
                     snapshots=StateSnapshots(num_snapshots, interval))
    return Scheduler(num_slots, max_num_batched_tokens, pool)


def digest_at(tokens, boundary, block_size=4):
    """The digest of the block that ends at `boundary` tokens."""
    from hybridmoe.engine.kv_blocks import TokenDigests

    return TokenDigests.of(tokens, block_size)[boundary // block_size - 1]


def assert_snapshots_accounted(pool):
    """Every snapshot row is free or holds the state at a block the prefix cache still has, each row once."""
    snaps = pool.snapshots
    rows = list(snaps.rows().values()) + snaps.free_rows
    assert sorted(rows) == list(range(snaps.num_snapshots))
    assert all(pool.is_cached(d) for d in snaps.entries)


def test_a_recurrent_models_prefix_is_reused_up_to_its_last_block_with_a_state_snapshot():
    sched = recurrent_scheduler(num_slots=2, max_num_batched_tokens=100)
    a = Sequence("a", list(range(1, 11)), SamplingParams(max_tokens=1))
    sched.add(a)
    (step,) = sched.schedule()
    # the prompt's last full block ends at 8: the step keeps the state there, 8 of its 10 tokens in
    assert step.restore is None and [n for n, _ in step.saves] == [8]
    saved = step.saves[0][1]
    run([step], sched)
    sched.finish(a)
    b = Sequence("b", list(range(1, 10)) + [99, 98], SamplingParams(max_tokens=1))
    sched.add(b)
    (step,) = sched.schedule()
    assert plan([step]) == [("b", 3)] and b.num_cached_tokens == 8 and step.restore == saved
    run([step], sched)
    sched.finish(b)
    # blocks [1-4] are cached too, but no snapshot holds the state after them: computed from position 0
    c = Sequence("c", list(range(1, 6)) + [55, 56], SamplingParams(max_tokens=1))
    sched.add(c)
    (step,) = sched.schedule()
    assert plan([step]) == [("c", 7)] and c.num_cached_tokens == 0 and step.restore is None
    assert digest_at(c.prompt_ids, 4) in sched.pool.cached


def test_a_sequence_keeps_one_snapshot_past_its_prompt_and_every_intervals_block():
    sched = recurrent_scheduler(num_slots=1, max_num_batched_tokens=100, interval=3)
    a = Sequence("a", list(range(1, 7)), SamplingParams(max_tokens=30))  # prompt end at 4
    sched.add(a)
    saves = []
    while not a.output_ids or len(a.output_ids) < 30:
        batch = sched.schedule()
        saves += [(batch[0].seq.num_computed + n) for n, _ in batch[0].saves]
        run(batch, sched)
    tokens = a.prompt_ids + a.output_ids
    # the prompt's end, every 3rd block's end, and each block end after the prompt (the latest replaces the one
    # before, an interval's stays)
    assert saves == [4, 8, 12, 16, 20, 24, 28, 32]
    kept = {digest_at(tokens, b) for b in (4, 12, 24)}
    assert set(sched.pool.snapshots.entries) == kept | {digest_at(tokens, 32)}
    assert a.latest_snapshot == digest_at(tokens, 32)
    sched.finish(a)
    assert_snapshots_accounted(sched.pool)


def test_a_preempted_sequence_resumes_from_the_snapshot_of_its_own_prefix():
    # 9 usable blocks of 4 tokens: two sequences of 8-token prompts and 12 new tokens each (5 blocks) cannot both
    # fit, and the blocks a takes from b's after its preemption leave b's first ones cached
    sched = recurrent_scheduler(num_slots=2, max_num_batched_tokens=100, num_blocks=10, block_size=4)
    a, b = (Sequence(name, list(range(first, first + 8)), SamplingParams(max_tokens=12))
            for name, first in (("a", 1), ("b", 101)))
    for s in (a, b):
        sched.add(s)
    resumed = []
    while sched.has_unfinished():
        batch = sched.schedule()
        resumed += [(s.seq.request_id, s.seq.num_computed) for s in batch if s.restore is not None]
        run(batch, sched)
        for s in batch:
            if len(s.seq.output_ids) >= s.seq.params.max_tokens:
                sched.finish(s.seq)
    assert b.num_preemptions >= 1 and len(b.output_ids) == 12
    # b comes back at a block boundary past its prompt end (its latest snapshot), not at position 0
    assert any(name == "b" and n > 8 and n % 4 == 0 for name, n in resumed)
    assert sched.pool.num_free == sched.pool.usable_blocks
    assert_snapshots_accounted(sched.pool)


def test_a_snapshot_leaves_with_its_block_and_a_full_snapshot_pool_drops_its_least_recently_used():
    sched = recurrent_scheduler(num_slots=1, max_num_batched_tokens=100, num_blocks=4, num_snapshots=2)  # 3 blocks
    prompts = [list(range(10 * k + 1, 10 * k + 10)) for k in range(3)]  # 9 tokens: 2 full blocks, 3 blocks each
    for k, prompt in enumerate(prompts[:2]):
        s = Sequence(f"p{k}", prompt, SamplingParams(max_tokens=1))
        sched.add(s)
        finish_all(sched, [s])
    pool, snaps = sched.pool, sched.pool.snapshots
    # the second prompt took every block: the first's cached blocks, and so its snapshot, are gone
    assert set(snaps.entries) == {digest_at(prompts[1], 8)} and snaps.stats.evicted == 0
    assert_snapshots_accounted(pool)
    big = recurrent_scheduler(num_slots=1, max_num_batched_tokens=100, num_snapshots=2)
    for k, prompt in enumerate(prompts):
        s = Sequence(f"p{k}", prompt, SamplingParams(max_tokens=1))
        big.add(s)
        finish_all(big, [s])
    snaps = big.pool.snapshots
    assert set(snaps.entries) == {digest_at(prompts[1], 8), digest_at(prompts[2], 8)} and snaps.stats.evicted == 1
    assert digest_at(prompts[0], 8) in big.pool.cached  # the block stays, but no prefix ends there now
    again = Sequence("again", prompts[0] + [7], SamplingParams(max_tokens=1))
    big.add(again)
    big.schedule()
    assert again.num_cached_tokens == 0


def test_a_snapshot_whose_step_never_ran_is_dropped_before_the_next_step():
    """A step that fails leaves its sequences' blocks unregistered: the rows it was to save into hold no state, and
    must not serve the same tokens later."""
    sched = recurrent_scheduler(num_slots=1, max_num_batched_tokens=100)
    a = Sequence("a", list(range(1, 11)), SamplingParams(max_tokens=1))
    sched.add(a)
    (step,) = sched.schedule()
    assert step.saves and len(sched.pool.snapshots) == 1
    sched.finish(a)  # the step raised: the engine ends the request without its blocks registered
    sched.schedule()
    assert len(sched.pool.snapshots) == 0 and sched.pool.snapshots.free_rows
    assert_snapshots_accounted(sched.pool)


@pytest.mark.parametrize("host_blocks", [0, 5])
def test_every_block_and_snapshot_is_accounted_for_after_mixed_requests_and_aborts(host_blocks):
    import random

    rng = random.Random(1)
    sched = recurrent_scheduler(4, 16, num_blocks=12, num_snapshots=3, interval=2, host_blocks=host_blocks)
    shared = [7] * 12
    live = []
    for step in range(400):
        if rng.random() < 0.3:
            prompt = shared[:rng.randrange(13)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
            seq = Sequence(f"s{step}", prompt, SamplingParams(max_tokens=rng.randrange(1, 10)))
            sched.add(seq)
            live.append(seq)
        if live and rng.random() < 0.05:
            sched.finish(live.pop(rng.randrange(len(live))))
        batch = sched.schedule()
        for s in batch:  # each step restores and saves distinct rows, a sequence's saves in order
            assert [n for n, _ in s.saves] == sorted({n for n, _ in s.saves})
            assert all(0 < n <= s.num_tokens for n, _ in s.saves)
        rows = [i for s in batch for _, i in s.saves]
        assert len(rows) == len(set(rows)) and not set(rows) & {s.restore for s in batch}
        run(batch, sched)
        for s in batch:
            if len(s.seq.output_ids) >= s.seq.params.max_tokens:
                sched.finish(s.seq)
                live.remove(s.seq)
        assert_snapshots_accounted(sched.pool)
    for seq in live:
        sched.finish(seq)
    pool = sched.pool
    assert pool.num_free == pool.usable_blocks and all(r == 0 for r in pool.refs)
    assert pool.stats.hit_tokens > 0 and pool.snapshots.stats.restored > 0 and sched.num_preemptions > 0
