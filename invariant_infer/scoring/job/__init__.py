"""The ``invariant-infer score`` job: ``run`` (reading the request file, resume, digests, verify),
``backends`` (one process, tensor-parallel ranks, or Ray) and ``ray`` (Ray Data workers)."""
