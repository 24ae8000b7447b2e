"""The report: artifacts/report.md and its plots, from the committed metrics."""
