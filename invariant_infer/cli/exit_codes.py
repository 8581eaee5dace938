"""The exit statuses of every ``invariant-infer`` command: one table for ``serve``, ``score``, ``demo``
and ``check`` alike, shown at the end of each command's ``--help``."""

OK = 0
ROW_ERRORS = 1         # score: the job finished and some rows are error rows; demo: a row was not bitwise equal
REFUSED = 2            # bad arguments, a refused model or checkpoint, a job that cannot start or go on
VERIFY_MISMATCH = 3    # score --verify: a row re-scored alone gave another digest
RANK_FAILED = 4        # a tensor-parallel rank failed: serve stopped; score kept its rows (a re-run resumes)
NOT_INVARIANT = 5      # check, and serve's check before traffic: a row depended on its batch, or an op strayed
UNSUPPORTED_MODEL = 6  # the checkpoint's architecture or model type is not one these commands run

MEANINGS = {
    OK: "success",
    ROW_ERRORS: "score finished with error rows; demo found a row that was not bitwise equal",
    REFUSED: "refused: bad arguments, a refused model or checkpoint, or a job that cannot go on",
    VERIFY_MISMATCH: "score --verify: a row re-scored alone gave another digest",
    RANK_FAILED: "a tensor-parallel rank failed (serve stops; score keeps its rows, a re-run resumes)",
    NOT_INVARIANT: "check (and serve's check before traffic) failed: a row depended on its batch, or an op ran "
                   "outside the invariant kernels",
    UNSUPPORTED_MODEL: "unsupported model: the checkpoint's architecture or model type is not one that runs here "
                       "(causal LMs and image-text-to-text models of the supported families; serve also takes "
                       "pooled checkpoints)",
}


def architecture_refusal(command: str, path: str) -> int | None:
    """Check ``path``'s architecture before any weight loads (``checkpoints.loading.check_architecture``):
    the exit status, with the message on stderr, when it is refused; None when it runs."""
    import sys

    from ..checkpoints.loading import check_architecture
    from ..errors import CheckpointLoadError, UnsupportedModelError
    try:
        check_architecture(path, "serve" if command == "serve" else "model")
    except UnsupportedModelError as exc:
        print(f"invariant-infer {command}: {path}: {exc}", file=sys.stderr)
        return UNSUPPORTED_MODEL
    except CheckpointLoadError as exc:
        print(f"invariant-infer {command}: {exc}", file=sys.stderr)
        return REFUSED
    return None
