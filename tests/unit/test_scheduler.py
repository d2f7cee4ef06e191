from hybridmoe import SamplingParams
from hybridmoe.engine.scheduler import Scheduler
from hybridmoe.engine.sequence import Sequence, SequenceStatus


def seq(name, prompt_len):
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100))


def run(batch):
    """What the engine does after the model ran: advance caches, add a token where one was sampled."""
    for s in batch:
        completes = s.completes
        s.seq.num_computed += s.num_tokens
        if completes:
            s.seq.output_ids.append(0)


def plan(batch):
    return [(s.seq.request_id, s.num_tokens) for s in batch]


def test_admits_up_to_the_number_of_slots_and_a_finished_sequence_frees_its_slot_at_once():
    sched = Scheduler(num_slots=2, max_num_batched_tokens=100)
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
    sched = Scheduler(num_slots=1, max_num_batched_tokens=100)
    a, b = seq("a", 2), seq("b", 2)
    sched.add(a)
    sched.add(b)
    sched.finish(b)
    assert plan(sched.schedule()) == [("a", 2)]
    sched.finish(a)
    assert not sched.has_unfinished() and sched.free_slots == [0]


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding():
    sched = Scheduler(num_slots=4, max_num_batched_tokens=8)
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
    sched = Scheduler(num_slots=4, max_num_batched_tokens=100)
    sched.add(seq("a", 4))
    run(sched.schedule())
    run(sched.schedule())
    sched.add(seq("b", 5))
    assert plan(sched.schedule()) == [("a", 1), ("b", 5)]
