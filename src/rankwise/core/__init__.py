"""What runs a call between ranks: the communicator and its parts, groups, work.

``communicator`` composes one part per job (``sending``, ``waiting``, ``mismatches``,
``departures``, ``activity``); ``router`` matches arriving frames to posted receives;
``group`` numbers a group's calls and picks its engine; ``work``/``future`` are the
handles of asynchronous calls. Below the API, above the transports and the wire.
"""
