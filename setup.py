"""Only the optional C parts: the call-site walk (``rankwise.identity._frames``) and the
fast constructor of per-call records (``rankwise._slots``); every other setting is in
pyproject.toml. ``optional``: without a compiler the install goes on and the Python code
serves (same results: the Python walk, ~2 us more per collective; the classes' own
``__init__``, ~1 us more per device collective)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("rankwise.identity._frames", ["src/rankwise/identity/_frames.c"], optional=True),
    Extension("rankwise._slots", ["src/rankwise/_slots.c"], optional=True),
])
