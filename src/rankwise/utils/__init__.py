"""Utilities; ``rankwise.utils.data`` (needs torch) is imported explicitly, never from here."""
