import itertools

import pytest

from rl_data.sampler import GroupSampler


def _groups(indices, n):
    """Split into runs of n, asserting each run is one prompt repeated."""
    runs = [indices[i : i + n] for i in range(0, len(indices), n)]
    assert all(len(set(run)) == 1 and len(run) == n for run in runs)
    return [run[0] for run in runs]


def test_each_prompt_repeated_n_times_consecutively_once_per_epoch():
    sampler = GroupSampler(10, 4, seed=3)
    epoch0 = list(sampler)
    assert len(epoch0) == len(sampler) == 40
    assert sorted(_groups(epoch0, 4)) == list(range(10))
    assert sampler.epoch == 1 and sampler.position == 0


def test_no_shuffle_keeps_order():
    assert _groups(list(GroupSampler(5, 2, shuffle=False)), 2) == [0, 1, 2, 3, 4]


def test_epoch_reshuffle_is_deterministic():
    a, b = GroupSampler(50, 2, seed=7), GroupSampler(50, 2, seed=7)
    assert a.epoch_prompts(0) == b.epoch_prompts(0)
    assert a.epoch_prompts(1) == b.epoch_prompts(1)
    assert a.epoch_prompts(0) != a.epoch_prompts(1)
    assert GroupSampler(50, 2, seed=8).epoch_prompts(0) != a.epoch_prompts(0)
    # iterating matches epoch_prompts for consecutive epochs
    assert _groups(list(a), 2) == b.epoch_prompts(0)
    assert _groups(list(a), 2) == b.epoch_prompts(1)


@pytest.mark.parametrize(("num_prompts", "world"), [(12, 3), (10, 3), (7, 4), (2, 4)])
def test_shards_are_whole_groups_disjoint_and_covering(num_prompts, world):
    shards = [GroupSampler(num_prompts, 3, seed=1, rank=r, world_size=world) for r in range(world)]
    per_rank = [_groups(list(s), 3) for s in shards]
    assert len({len(p) for p in per_rank}) == 1  # same step count on every rank
    flat = [i for p in per_rank for i in p]
    assert set(flat) == set(range(num_prompts))  # covering
    padded = len(flat) - num_prompts
    assert padded == (-num_prompts) % world  # only the wrap-around padding repeats
    order = GroupSampler(num_prompts, 3, seed=1).epoch_prompts(0)
    assert sorted(flat) == sorted(order + (order * world)[:padded])


def test_drop_last_shards_disjoint():
    shards = [GroupSampler(10, 2, rank=r, world_size=3, drop_last=True) for r in range(3)]
    per_rank = [set(_groups(list(s), 2)) for s in shards]
    assert [len(p) for p in per_rank] == [3, 3, 3]
    assert not (per_rank[0] & per_rank[1] or per_rank[0] & per_rank[2] or per_rank[1] & per_rank[2])


def test_gathered_rank_batches_reconstruct_whole_groups():
    world, n = 2, 4
    shards = [GroupSampler(8, n, seed=5, rank=r, world_size=world) for r in range(world)]
    for step in zip(*(s.batches(2) for s in shards), strict=True):
        gathered = [i for batch in step for i in batch]  # all_gather order: rank 0, rank 1
        assert len(_groups(gathered, n)) == 4


def _stream(sampler, count):
    """The next `count` indices, crossing epoch boundaries."""
    epochs = itertools.chain.from_iterable(iter(sampler) for _ in range(4))
    return list(itertools.islice(epochs, count))


@pytest.mark.parametrize("stop", [0, 5, 7, 8, 39, 40, 41])
def test_resume_mid_epoch_continues_exactly(stop):
    expected = _stream(GroupSampler(10, 4, seed=9), 80)  # two epochs, uninterrupted
    first = GroupSampler(10, 4, seed=9)
    head = _stream(first, stop)  # stop mid-group (5, 7), at a group edge (8), at epoch end (40)
    resumed = GroupSampler(10, 4, seed=9)
    resumed.load_state_dict(first.state_dict())
    assert head + _stream(resumed, 80 - stop) == expected
    assert expected[:40] != expected[40:]  # the second epoch really is reshuffled


def test_resume_with_batches_and_rank():
    full = GroupSampler(9, 2, seed=4, rank=1, world_size=2)
    expected = list(full.batches(2))
    first = GroupSampler(9, 2, seed=4, rank=1, world_size=2)
    it = first.batches(2)
    done = [next(it)]
    resumed = GroupSampler(9, 2, seed=4, rank=1, world_size=2)
    resumed.load_state_dict(first.state_dict())
    assert done + list(resumed.batches(2)) == expected
    assert [len(b) for b in expected] == [4, 4, 2]  # 5 prompts per rank, last batch short


def test_exhausted_epoch_state_is_next_epoch_start():
    sampler = GroupSampler(3, 2, seed=0)
    it = iter(sampler)
    for _ in range(6):
        next(it)
    assert (sampler.state_dict()["epoch"], sampler.state_dict()["position"]) == (1, 0)


def test_load_state_dict_rejects_other_settings():
    state = GroupSampler(10, 4, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this sampler has seed=2"):
        GroupSampler(10, 4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="n=4"):
        GroupSampler(10, 8, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="position 99"):
        GroupSampler(10, 4, seed=1).load_state_dict({**state, "position": 99})


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        GroupSampler(4, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="n must be"):
        GroupSampler(4, 0)
    with pytest.raises(ValueError, match="leaves none"):
        GroupSampler(2, 2, world_size=4, drop_last=True)
    with pytest.raises(ValueError, match="prompts_per_batch"):
        next(GroupSampler(4, 2).batches(0))
