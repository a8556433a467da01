"""The live job page of ``rankwise run`` (issue 38); docs/live.md.

- ``publisher``: each rank puts a small snapshot of itself in the job's store (a thread,
  every 0.5 s, from what the call log keeps; stacks only when asked).
- ``collector``: the launcher on node 0 reads them back, once for all page requests.
- ``server`` / ``page``: the HTTP server (standard library, GET only, token required)
  and the one HTML page it serves; ``serve.start_page`` starts both for the launcher.
"""
