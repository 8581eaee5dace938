"""Helpers shared by the test files, one module per concern: ``models`` (checkpoints, families,
batchings), ``controls`` (negative controls), ``tokenizer``, ``scoring_rows``, ``lm_eval_tasks``,
``servers`` (server processes) and ``kernel_compile``."""
