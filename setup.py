"""Only the optional C parts: the call-site walk (``rankwise.identity._frames``) and the
fast constructor of per-call records (``rankwise.utils._slots``); every other setting is in pyproject.toml. ``optional``: without a compiler the install goes on
and the pure-Python walk serves (same results, ~2 us more per collective)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("rankwise.identity._frames", ["src/rankwise/identity/_frames.c"], optional=True),
    Extension("rankwise.utils._slots", ["src/rankwise/utils/_slots.c"], optional=True),
])
