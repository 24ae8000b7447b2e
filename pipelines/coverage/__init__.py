"""Model coverage over the transformers zoo: each architecture checked (check.py), the runs
(run.py: one process each, resumable), the table of results (table.py)."""
