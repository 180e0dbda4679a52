"""The DAG runner and its entry points."""
