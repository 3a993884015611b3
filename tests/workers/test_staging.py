"""What a trainer rank holds of a step's rollout (diffrl.workers.staging): kept values resolve on
their own worker only, and the step's row numbers map onto the rows a rank holds."""

import pytest
import torch

from diffrl.train.batch import TrainingTargets
from diffrl.workers.staging import Kept, LocalStore, StagedRows


def test_kept_values_resolve_once_on_their_own_worker_in_order_with_handed_over_ones():
    store = LocalStore()
    marker = store.keep("rollout", "mine")
    assert marker == Kept("rollout")
    assert store.resolve(["a", marker, "b"]) == ["a", "mine", "b"]  # in process, others pass as they are
    with pytest.raises(RuntimeError, match=r"kept values \['rollout'\] are not on this worker"):
        store.resolve([marker])  # taken out by the first resolve: a second use is a bug


class _Rows:
    """Stands in for a Rollout: StagedRows only needs its length here."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def test_staged_rows_map_step_rows_to_the_held_ones_and_refuse_others():
    staged = StagedRows(_Rows(4), first=8)  # this rank holds rows 8..11 of the step
    assert staged.local(slice(8, 12)) == slice(0, 4)
    assert staged.local(torch.tensor([9, 11])).tolist() == [1, 3]
    with pytest.raises(RuntimeError, match=r"rows \[7, 8\] are not staged on this rank \(it holds 8:12\)"):
        staged.local(torch.tensor([7, 8]))
    with pytest.raises(RuntimeError, match="rows 10:14 are not staged"):
        staged.local(slice(10, 14))


def test_targets_are_cut_to_the_held_rows_and_means_must_cover_them_exactly():
    staged = StagedRows(_Rows(2), first=2)
    targets = TrainingTargets(advantages_B=torch.arange(6.0), batch_size=[6])
    staged.set_targets(targets, {"ref_means": [torch.ones(1, 3), torch.zeros(1, 3)]})
    assert staged.targets.advantages_B.tolist() == [2.0, 3.0]
    assert staged.targets.ref_means.tolist() == [[1.0] * 3, [0.0] * 3]
    with pytest.raises(RuntimeError, match="ref_means: 3 rows of means for 2 staged rows"):
        staged.set_targets(targets, {"ref_means": [torch.ones(3, 3)]})
