"""``rankwise.settings``: every ``RANKWISE_*`` variable declared once, validated, and README's
table equal to the declarations."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from rankwise import settings
from rankwise.errors import InvalidArgument

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"RANKWISE_[A-Z0-9_]*[A-Z0-9]")
#: names that look like variables but are not: ``doctor.probes.PortState.RANKWISE_STORE``
NOT_VARIABLES = {"RANKWISE_STORE"}
BEGIN = "<!-- config table: rankwise.settings.table(); tests/test_settings.py checks it -->"
END = "<!-- end of config table -->"


def _names_in_src() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in sorted((ROOT / "src").rglob("*")):
        if path.suffix in (".py", ".c") and path.is_file():
            for name in NAME.findall(path.read_text()):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return {n: p for n, p in found.items() if n not in NOT_VARIABLES}


def _readme_table() -> str:
    text = (ROOT / "README.md").read_text()
    assert BEGIN in text and END in text, "README.md has no generated table of variables"
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def test_every_variable_named_in_src_is_declared() -> None:
    missing = {n: p for n, p in _names_in_src().items() if n not in settings.VARIABLES}
    assert not missing, f"named in src but not declared in rankwise/settings.py: {missing}"


def test_every_declared_variable_is_used_in_src() -> None:
    used = _names_in_src()
    unused = [n for n in settings.VARIABLES if n not in used]
    assert not unused, f"declared in rankwise/settings.py but read nowhere: {unused}"


def test_readme_table_is_the_generated_one() -> None:
    assert _readme_table() == settings.table(), (
        "README.md's table of variables differs from rankwise.settings.table(); paste "
        "`python -c 'from rankwise.settings import table; print(table())'` between the markers")
    rows = re.findall(r"^\| `(RANKWISE_[A-Z0-9_]+)`", _readme_table(), re.MULTILINE)
    assert sorted(rows) == sorted(settings.VARIABLES)


@pytest.mark.parametrize(("name", "value", "says"), [
    ("RANKWISE_ENGINE", "infiniband", "one of auto, tcp"),
    ("RANKWISE_DEADLOCK", "maybe", "1/0, true/false"),
    ("RANKWISE_WARN_AFTER", "0", "a number > 0"),
    ("RANKWISE_WARN_AFTER", "soon", "a number > 0"),
    ("RANKWISE_HEARTBEAT_TIMEOUT", "-1", "a number >= 0"),
    ("RANKWISE_HEARTBEAT_TIMEOUT", "nan", "a number >= 0"),
    ("RANKWISE_PARKED_TOTAL", "1.5", "an integer > 0"),
    ("RANKWISE_SOCKBUF", "-4", "an integer > 0"),
])
def test_a_bad_value_names_the_variable_and_what_it_takes(name: str, value: str, says: str,
                                                          monkeypatch: Any) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgument, match=f"{name}={value!r} is not {says}"):
        settings.check_all()


def test_values_parse_and_unset_or_empty_means_the_default(monkeypatch: Any) -> None:
    env = {"RANKWISE_DEADLOCK": " OFF ", "RANKWISE_ENGINE": "Shm", "RANKWISE_TIMEOUT": "2.5",
           "RANKWISE_SOCKBUF": "65536", "RANKWISE_TOKEN": " spaced ", "RANKWISE_CHECK": " "}
    assert settings.flag("RANKWISE_DEADLOCK", env) is False
    assert settings.choice("RANKWISE_ENGINE", env) == "shm"
    assert settings.number("RANKWISE_TIMEOUT", env=env) == 2.5
    assert settings.integer("RANKWISE_SOCKBUF", env=env) == 65536
    assert settings.text("RANKWISE_TOKEN", env) == " spaced "  # a secret is taken as written
    assert settings.choice("RANKWISE_CHECK", env) == "async"
    assert settings.flag("RANKWISE_DIAGNOSIS", {}) is True
    assert settings.integer("RANKWISE_SHM_SLOT_BYTES", 123, {}) == 123  # a computed default
    assert settings.text("RANKWISE_DUMP", {}) is None


def test_init_refuses_a_bad_value_before_any_io(monkeypatch: Any) -> None:
    import rankwise as dist

    monkeypatch.setenv("RANKWISE_WARN_AFTER", "soon")
    # nothing listens there: reaching it would be a different error
    with pytest.raises(InvalidArgument, match="RANKWISE_WARN_AFTER='soon'"):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:9", rank=1, world_size=2,
                                timeout=5)


def test_the_torch_switch_takes_what_settings_declares() -> None:
    """``rankwise_autoload`` reads RANKWISE_TORCH_CHECKS itself (at ``import torch``, which
    must not import rankwise): its values and default are the declared ones."""
    import rankwise_autoload

    var = settings.VARIABLES[rankwise_autoload.ENV]
    assert var.choices == rankwise_autoload.MODES
    assert rankwise_autoload.mode({}) == var.default
