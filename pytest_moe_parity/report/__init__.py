"""What a run tells its user: failure text, the summary table and the JSON reports."""
