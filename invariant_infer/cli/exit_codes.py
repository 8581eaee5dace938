"""The exit statuses of every ``invariant-infer`` command: one table for ``serve``, ``score`` and
``demo`` alike, shown at the end of each command's ``--help``."""

OK = 0
ROW_ERRORS = 1       # score: the job finished and some rows are error rows; demo: a row was not bitwise equal
REFUSED = 2          # bad arguments, a refused model or checkpoint, a job that cannot start or go on
VERIFY_MISMATCH = 3  # score --verify: a row re-scored alone gave another digest
RANK_FAILED = 4      # a tensor-parallel rank failed: serve stopped; score kept its rows (a re-run resumes)

MEANINGS = {
    OK: "success",
    ROW_ERRORS: "score finished with error rows; demo found a row that was not bitwise equal",
    REFUSED: "refused: bad arguments, a refused model or checkpoint, or a job that cannot go on",
    VERIFY_MISMATCH: "score --verify: a row re-scored alone gave another digest",
    RANK_FAILED: "a tensor-parallel rank failed (serve stops; score keeps its rows, a re-run resumes)",
}
