"""The `disagg` command line: `main.py` (serve, generate, bench, make-model) and the servers' shared flags."""
