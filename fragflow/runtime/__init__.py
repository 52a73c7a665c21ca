"""The runtime: executors for placed graphs, and the run monitor they report to."""
