import itertools

import pytest

from rl_data.readers import read_prompts
from rl_data.sampler import GroupSampler, GroupStream


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


# ----------------------------------------------------------------------------- GroupStream


def _ids_of(records):
    return [r.fields["id"] for r in records]


def _prompt_file(tmp_path, ids, bad=()):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(('{"prompt": ""}' if i in bad else f'{{"prompt": "p{i}", "id": {i}}}') + "\n"
                            for i in ids))
    return path


def test_group_stream_repeats_each_record_n_times_epoch_after_epoch(tmp_path):
    stream = GroupStream(read_prompts(_prompt_file(tmp_path, range(3), bad={1}), on_error="skip"), n=2)
    batches = stream.batches(3)
    assert _ids_of(next(batches)) == [0, 0, 2, 2, 0, 0]  # row 1 skipped; a new epoch follows
    assert _ids_of(next(batches)) == [2, 2, 0, 0, 2, 2]
    assert stream.epoch == 2 and stream.reader.skipped == 1  # the third epoch is under way


@pytest.mark.parametrize("stop", [1, 3, 4, 9, 12])
def test_group_stream_resume_over_a_file_with_bad_rows(tmp_path, stop):
    path = _prompt_file(tmp_path, range(6), bad={2})
    expected = _ids_of(itertools.islice(GroupStream(read_prompts(path, on_error="skip"), n=2), 30))
    first = GroupStream(read_prompts(path, on_error="skip"), n=2)
    head = _ids_of(itertools.islice(iter(first), stop))
    resumed = GroupStream(read_prompts(path, on_error="skip"), n=2)
    resumed.load_state_dict(first.state_dict())
    assert head + _ids_of(itertools.islice(iter(resumed), 30 - stop)) == expected


def test_group_stream_state_checks():
    rows = [{"prompt": "a", "id": 0}]
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(rows)
    state = GroupStream(read_prompts(ds), n=2).state_dict()
    with pytest.raises(ValueError, match="n=2 but this stream has n=3"):
        GroupStream(read_prompts(ds), n=3).load_state_dict(state)
    with pytest.raises(ValueError, match=r"shard=\[0, 1\] but this stream has shard=\[1, 2\]"):
        GroupStream(read_prompts(ds, rank=1, world_size=2), n=2).load_state_dict(state)
    with pytest.raises(ValueError, match="repeat 2 is not a position"):
        GroupStream(read_prompts(ds), n=2).load_state_dict({**state, "repeat": 2})
    empty = GroupStream(read_prompts(ds, rank=1, world_size=2), n=2)  # one row: rank 1 has none
    with pytest.raises(ValueError, match="no usable record in epoch 0"):
        next(iter(empty))


def _shuffled_stream(rank, world_size, n=2):
    """A 2-shard iterable dataset shuffled with a seed (shard order and a buffer), this rank's part."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": f"p{i}", "id": i} for i in range(11)])
    ids = ds.to_iterable_dataset(num_shards=2).shuffle(seed=3, buffer_size=4)
    return GroupStream(read_prompts(ids, rank=rank, world_size=world_size), n=n)


def test_group_stream_ranks_see_disjoint_records_that_cover_the_epoch():
    first_epochs = []
    for rank in range(2):
        stream = _shuffled_stream(rank, 2)
        size = len(list(stream.reader))  # this rank's shard
        first_epochs.append(_groups(_ids_of(itertools.islice(iter(stream), 2 * size)), 2))
        assert stream.state_dict()["position"] == size  # the epoch is done, the next not begun
    assert not set(first_epochs[0]) & set(first_epochs[1])
    assert sorted(first_epochs[0] + first_epochs[1]) == list(range(11))


def _with_epochs(stream, count):
    """(epoch, id) of the next `count` records (the epoch is counted before each yield)."""
    return [(stream.epoch, r.fields["id"]) for r in itertools.islice(iter(stream), count)]


@pytest.mark.parametrize("stop", [3, 10, 13, 25])
def test_group_stream_resumed_over_a_shuffled_iterable_dataset_continues_without_repeats(stop):
    expected = _with_epochs(_shuffled_stream(1, 2), 40)
    first = _shuffled_stream(1, 2)
    head = _with_epochs(first, stop)  # mid-group (3, 13, 25) and at an epoch end (10 or 12)
    resumed = _shuffled_stream(1, 2)
    resumed.load_state_dict(first.state_dict())
    assert head + _with_epochs(resumed, 40 - stop) == expected
    by_epoch = {}
    for epoch, i in expected:
        by_epoch.setdefault(epoch, []).append(i)
    complete = [ids for epoch, ids in sorted(by_epoch.items()) if epoch < max(by_epoch)]
    assert len(complete) >= 2
    for ids in complete:
        groups = _groups(ids, 2)
        assert len(set(groups)) == len(groups)  # no record twice within an epoch
    assert complete[0] != complete[1]  # set_epoch reshuffled the next epoch


def test_next_prompts_cross_into_the_next_epoch_and_resume():
    sampler = GroupSampler(5, 3, seed=1)
    first, second = sampler.epoch_prompts(0), sampler.epoch_prompts(1)
    assert sampler.next_prompts(4) == first[:4]
    state = sampler.state_dict()
    assert sampler.next_prompts(3) == [first[4], *second[:2]]  # the epoch's last prompt, then the next epoch's
    again = GroupSampler(5, 3, seed=1)
    again.load_state_dict(state)
    assert again.next_prompts(3) == [first[4], *second[:2]]
