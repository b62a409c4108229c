"""Memory checks shared by the kernel and loss tests: what autograd keeps alive between forward and backward."""

from __future__ import annotations


def saved_bytes(fn, own) -> int:
    """Bytes of the storages autograd saves for backward while ``fn()`` runs, besides those of the tensors in
    ``own`` (the inputs, which live anyway). torch is imported here: test_kernels_interpret.py sets up Triton's
    interpreter before anything imports torch."""
    import torch

    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    mine = {x.untyped_storage().data_ptr() for x in own}
    return sum(b for ptr, b in storages.items() if ptr not in mine)
