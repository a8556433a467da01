"""Bytes between ranks: frame headers, buffers and dtypes, reduce ops, objects, auth.

``frames`` is the header format and its hostile-input decoder; ``buffers`` turns
tensors and arrays into flat typed memory and reduces it (``reduce_op``: the ops);
``serialize`` is the safe object codec; ``auth`` the HMAC handshake; ``hugepages``
the large transfer buffers. The bottom layer: it imports nothing of rankwise but errors.
"""
