"""Numbers and verdicts: metrics, tolerances, and the pass/fail decision of one point."""
