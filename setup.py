"""Only the optional C part (``rankwise._native``: the call-site walk and the fast
constructor of per-call records); every other setting is in pyproject.toml. ``optional``:
without a compiler the install goes on and the Python code serves (same results: the
Python walk, ~2 us more per collective; the classes' own ``__init__``, ~1 us more per
device collective)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("rankwise._native", ["src/rankwise/_native.c"], optional=True),
])
