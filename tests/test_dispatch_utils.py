"""The operator counter used by the host-sync and launch-count tests sees what it must see."""

import torch

from tests.dispatch_utils import BOOL_MASK_INDEX, count_dispatched_ops, kernel_ops, sync_ops


def test_counter_sees_host_reads_and_boolean_indexing_forward_and_backward():
    x = torch.arange(6.0, requires_grad=True)

    def step():
        y = x[x > 2]  # boolean-mask indexing (a nonzero inside the kernel)
        y.sum().backward()
        return float(y.detach().max()) + len(torch.nonzero(x.detach()))  # a host read, a nonzero

    counts = count_dispatched_ops(step)
    assert sync_ops(counts) == {"aten._local_scalar_dense": 1, "aten.nonzero": 1, BOOL_MASK_INDEX: 2}
    assert counts["aten.index_put"] == 1  # the backward pass of the boolean indexing is counted too
    assert sync_ops(count_dispatched_ops(lambda: x.detach()[torch.tensor([0, 2])] * 2)) == {}


def test_kernel_ops_leave_out_views():
    x = torch.randn(2, 3)
    counts = count_dispatched_ops(lambda: (x.t().reshape(6)[1:] + 1).view(1, 5))
    assert counts["aten.t"] == 1 and counts["aten.view"] >= 1
    assert kernel_ops(counts) == {"aten.clone": 1, "aten.add": 1}  # the copy that reshape needs, and the add
