"""``rankwise bench``: the benchmark subcommand (``run``), its per-rank worker (``worker``)
and its tables and plots (``report``)."""
