"""What a doctor check returns: one finding says what is wrong, shows the evidence, and
gives the fix, so a user can act on it without knowing how the check works."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["Finding", "Severity"]


class Severity(IntEnum):
    """How bad a finding is. ``INFO`` is context (shown with ``-v``); ``WARNING`` and
    ``ERROR`` are problems (exit code 1): a warning slows or endangers a job, an error
    makes it fail."""

    INFO = 0
    WARNING = 1
    ERROR = 2


@dataclass(frozen=True)
class Finding:
    """One observation of one check."""

    check: str
    severity: Severity
    what: str
    evidence: str = ""
    fix: str = ""

    @property
    def problem(self) -> bool:
        return self.severity >= Severity.WARNING

    def as_dict(self) -> dict[str, str]:
        return {"check": self.check, "severity": self.severity.name.lower(), "what": self.what,
                "evidence": self.evidence, "fix": self.fix}
