"""Tools for tests and demos: random-init checkpoints of every family (``random_checkpoints``)
and the batch drift of a model, stock against invariant (``drift``)."""
