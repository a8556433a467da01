"""What a call is, at the bottom of the call path: its call site, fingerprint, words.

``callsite`` finds the user's file:line; ``calls`` holds the fingerprint ranks compare,
barrier names and the one way every layer describes a call ("all_reduce(float32 x 4,
op=SUM) at train.py:42"). It imports only the wire and errors, so the communicator,
the engines, checks and diagnosis all import it at the top, with no loop.
"""
