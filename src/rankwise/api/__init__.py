"""The torch.distributed functions rankwise exports (``import rankwise as dist``).

Each function validates its arguments locally, before any I/O (bad input is an
``InvalidArgument``, never a hang), describes the call (op, buffers, root, reduce op,
call site), and hands it to the group's engine; ``world`` holds the process's groups and
``init`` makes and tears down the job. Only the facade ``rankwise/__init__.py`` and the
layers above (nn, torch, diagnosis) import from here.
"""
